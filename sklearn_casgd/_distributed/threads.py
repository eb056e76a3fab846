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
:func:`warn_if_oversubscribed` says when the ranks outnumber them.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
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


def threads_per_worker(n_workers: int) -> int:
    """Ranks x threads <= this process's cores: more threads than cores slowed ranks 4-17x."""
    return max(1, thread_budget()[1] // n_workers)


def warn_if_oversubscribed(n_workers: int) -> None:
    """Warn when the worker processes of a fit outnumber the cores this process may use."""
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
    warnings.warn(message, UserWarning, stacklevel=6)  # the estimator's fit
