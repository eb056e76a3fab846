"""How a fit shares the cores between torch's threads and numpy's BLAS.

The engine's arithmetic runs in torch's thread pool; what numpy computes
during a fit is bookkeeping of O(n) or O(d) values (weighted means, dot
products of weights and targets). A BLAS call large enough to be threaded
wakes the BLAS library's worker threads, which then spin for a while
waiting for more work, on the cores that torch's threads need next: the
passes over X that follow run several times slower until they give up
(``docs/tuning.md``, "numpy's BLAS during a fit"). During a fit numpy's
BLAS therefore runs on the calling thread. A BLAS library that torch
itself loaded is left alone: it does the engine's products.

A worker pool's ranks share the cores too: :func:`threads_per_worker` gives
each its share of the cores this process may use, and
:func:`warn_if_oversubscribed` says when the ranks outnumber them. Other
processes may hold cores too: a one-process fit runs on the cores free
when it starts (:func:`threads_for_free_cores`).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import time
import warnings
from collections.abc import Iterator

import torch
from threadpoolctl import ThreadpoolController


@functools.cache
def _numpy_blas() -> ThreadpoolController:
    """The BLAS libraries loaded in this process, except torch's own (inspected once)."""
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    every_blas = ThreadpoolController().select(user_api="blas")
    others = [
        library.filepath
        for library in every_blas.lib_controllers
        if not os.path.realpath(library.filepath).startswith(torch_dir + os.sep)
    ]
    return every_blas.select(filepath=others)


@contextlib.contextmanager
def numpy_blas_single_threaded() -> Iterator[None]:
    """Within the block, numpy's BLAS runs on the calling thread; restored after."""
    with _numpy_blas().limit(limits=1):
        yield


def thread_budget() -> tuple[int, int]:
    """This machine's usable cores, and how many of them this process may use.

    Inside a joblib/loky worker (``GridSearchCV(n_jobs>1)``) joblib gave this
    process ``cores // n_jobs`` threads through ``OMP_NUM_THREADS``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if type(multiprocessing.current_process()).__name__ != "LokyProcess":
        return cores, cores
    try:
        share = int(os.environ.get("OMP_NUM_THREADS", cores))
    except ValueError:
        share = cores
    return cores, min(max(share, 1), cores)


# Size a one-process fit's torch threads to the cores free when it starts
# (:func:`threads_for_free_cores`); False keeps torch's own count (benchmarks
# compare both).
SIZE_TO_FREE_CORES = True


# others_running's readings and the seconds between them.
_READINGS = 3
_READING_INTERVAL = 1e-3


def others_running() -> int | None:
    """Runnable tasks besides this one, now, where the kernel says so (Linux), else None.

    The least of a few readings, a millisecond apart, of ``/proc/stat``'s
    ``procs_running`` less this process's own runnable threads, so that a
    task waking for a moment (or torch's threads, which spin a while after
    each operation) does not count. None
    where this process may not run on every CPU the count covers (a
    container pinned to some of a host's cores): the count says nothing
    about those cores then.
    """
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != os.cpu_count():
        return None
    readings = []
    for reading in range(_READINGS):
        if reading:
            time.sleep(_READING_INTERVAL)
        try:
            with open("/proc/stat", "rb") as stat:
                running = next(
                    (int(line.split()[1]) for line in stat if line.startswith(b"procs_running")),
                    None,
                )
            own = _own_running_threads()
        except (OSError, ValueError, IndexError):
            return None
        if running is None:
            return None
        readings.append(max(running - own, 0))
    return min(readings)


def _own_running_threads() -> int:
    """This process's threads that are runnable now (this one included).

    torch's idle threads spin for a while after each operation: they are
    this process's own, not another's.
    """
    running = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat", "rb") as stat:
            # The state follows the command's closing parenthesis.
            running += stat.read().rsplit(b")", 1)[1].split()[0] == b"R"
    return max(running, 1)


@contextlib.contextmanager
def threads_for_free_cores() -> Iterator[int]:
    """Within: torch runs on at most the cores that other processes leave free.

    torch's threads wait for one another at every operation, spinning; a
    thread whose core another process holds makes the others wait for the
    scheduler, so a fit on more threads than free cores ran several times
    slower than on one thread (``docs/tuning.md``, "A busy machine"). At
    least one thread, never more than torch had or the thread budget
    (:func:`thread_budget`) allows; torch's count is restored after.
    """
    before = torch.get_num_threads()
    cores, budget = thread_budget()
    threads = min(before, budget)
    others = others_running() if SIZE_TO_FREE_CORES else None
    if others is not None:
        threads = max(1, min(threads, cores - others))
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads != before:
            torch.set_num_threads(before)


def ranks_yield(n_ranks: int) -> bool:
    """Whether ``n_ranks`` ranks on this machine yield their cores around collectives, now.

    The yield (:class:`~sklearn_casgd._engine.comm.TorchCommunicator`) lets
    gloo's transport thread run where the ranks' own threads fill the cores;
    beside other busy processes it hands one of them a whole scheduler slice
    at every blocking collective (``docs/tuning.md``, "A busy machine"). More
    runnable tasks than the other ranks means other processes are running.
    Unknown (not Linux, pinned CPUs): the yields stay.
    """
    others = others_running()
    return others is None or others <= n_ranks - 1


def threads_per_worker(n_workers: int) -> int:
    """Ranks x threads <= this process's cores: more threads than cores slowed ranks 4-17x."""
    return max(1, thread_budget()[1] // n_workers)


# The oversubscription messages this process has shown: each is shown once.
# Python's own once-per-location memory does not hold inside GridSearchCV,
# whose fits change the warning filters (which resets that memory).
_SHOWN: set[str] = set()


def warn_if_oversubscribed(n_workers: int) -> None:
    """Warn when the worker processes of a fit outnumber the cores this process may use.

    Once per process and message (so once per joblib worker of a search).
    """
    cores, budget = thread_budget()
    if n_workers <= budget:
        return
    if budget == cores:
        message = (
            f"n_devices={n_workers} runs {n_workers} worker processes on {cores} CPU cores: "
            "they oversubscribe the cores and a fit runs slower than on fewer ranks. Use "
            f"n_devices <= {cores}."
        )
    else:
        parallel = cores // budget
        message = (
            f"n_devices={n_workers} runs {n_workers} worker processes in each of about "
            f"{parallel} parallel jobs (this joblib worker was given {budget} of {cores} CPU "
            f"cores, as GridSearchCV(n_jobs={parallel}) does): {n_workers * parallel} "
            f"processes on {cores} cores oversubscribe them. Use n_jobs=1 with "
            f"n_devices={n_workers}, or n_devices=1 with n_jobs>1."
        )
    if message in _SHOWN:
        return
    _SHOWN.add(message)
    warnings.warn(message, UserWarning, stacklevel=6)  # the estimator's fit
