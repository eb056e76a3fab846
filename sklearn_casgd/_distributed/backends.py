"""Where the ranks of a fit live: one interface, one class per place.

An estimator asks :func:`backend_for` for the backend its ``n_devices``
names and talks to it through :class:`Backend` only: the number of ranks
(for the plan), whether rank 0's seed must be shared, and ``fit``. A new
place to fit (another launcher, a cluster scheduler) is a new class here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from .._data.storage import as_storage
from .._engine.fit import BlockResult, FitPlan, fit_local
from .launch import WorkerPool, pool_for
from .threads import warn_if_oversubscribed
from .world import fit_world, job_world_size


class Backend(ABC):
    """The ranks a fit runs on."""

    #: Number of ranks (column blocks).
    world_size: int
    #: The ranks were started by someone else and draw ``random_state=None`` seeds
    #: of their own: rank 0's must be broadcast.
    shares_seed: bool = False
    #: The ranks are processes of this machine: their collectives are priced, not
    #: timed (:data:`~sklearn_casgd._engine.cost.POOL_TRANSPORT`).
    one_machine: bool = False

    @abstractmethod
    def fit(
        self, plan: FitPlan, X: np.ndarray, target: np.ndarray, sample_weight: np.ndarray
    ) -> BlockResult:
        """Run ``plan`` on X (dense or CSR) and return rank 0's result with the full weights."""


class InProcess(Backend):
    """``n_devices=1``: the calling process holds every column."""

    world_size = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fit(self, plan, X, target, sample_weight) -> BlockResult:
        preconditioning = plan.stored_preconditioning(0, X.shape[1])
        X_storage = as_storage(X, self.device, plan.policy.x_storage, *preconditioning)
        return fit_local(plan, X_storage, target, sample_weight)


class OnWorkerPool(Backend):
    """``n_devices=k``: k worker processes of a :class:`~sklearn_casgd.WorkerPool`."""

    one_machine = True

    def __init__(self, pool: WorkerPool, timeout: float) -> None:
        self.pool = pool
        self.timeout = timeout
        self.world_size = pool.n_workers

    def fit(self, plan, X, target, sample_weight) -> BlockResult:
        return self.pool._run_fit(plan, X, target, sample_weight, self.timeout)


class JobWorld(Backend):
    """``n_devices="world"``: every rank of the job this process belongs to.

    ``columns`` (this rank's ``[start, stop)`` and the number of columns):
    each rank's X is its own column block, not all of X.
    """

    shares_seed = True

    def __init__(self, timeout: float, columns: tuple[tuple[int, int], int] | None = None) -> None:
        self.timeout = timeout
        self.columns = columns
        self.world_size = job_world_size()

    def fit(self, plan, X, target, sample_weight) -> BlockResult:
        return fit_world(plan, X, target, sample_weight, self.timeout, self.columns)


def backend_for(
    n_devices: int | str,
    device: torch.device,
    timeout: float,
    columns: tuple[tuple[int, int], int] | None = None,
) -> Backend:
    """The backend of an estimator's ``n_devices`` on ``device``; ``columns``: see JobWorld."""
    if n_devices == "world":
        return JobWorld(timeout, columns)
    if n_devices == 1:
        return InProcess(device)
    if device.type == "cpu":
        warn_if_oversubscribed(int(n_devices))
    return OnWorkerPool(pool_for(int(n_devices)), timeout)
