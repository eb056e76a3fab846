"""Where the ranks live: one process, a worker pool, or a ``torchrun`` world.

Above the engine: a backend hands each rank its column block and calls
:func:`.._engine.fit.fit_block` there. ``launch`` owns the pool of worker
processes, ``worker`` is their main loop, ``rundir`` the private directory a
fit's inputs travel through, ``netns`` the workers' private network,
``world`` a user's own process group, ``threads`` the thread budgets.
"""
