"""The s-step SGD engine: planning, the step recurrence, epochs, the full pass.

A fit enters through :func:`.fit_plan.plan_fit` (the whole data's decisions,
once) and :func:`.fit.fit_block` (one rank's column block). Inside:
``precision``, ``stepsize`` and ``step_plan`` (what a step is), ``state``
(what the steps work on), ``batch`` and ``exchange`` (an outer iteration's
rows, reduced as a Gram or all-gathered), ``recurrence`` (the s-step
recurrence and the plain step), ``snapshot`` and ``curvature`` (the full
pass, SVRG's control variate, Newton), ``epochs``, ``solver_state`` and
``solver`` (an epoch's walk, the loop's state, the loops and stopping), ``cost``
and ``planner`` (the choice of s and of the solver), ``execution`` (how the
epochs run on this device) and ``comm`` (the collectives the engine calls).
It imports :mod:`.._glm`, :mod:`.._data.storage` and :mod:`.._accel`, never the
process management above it.
"""
