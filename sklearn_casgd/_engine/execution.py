"""How a rank's epochs execute, decided in one place: steps, exchange, kernels, compiling.

:func:`step_context` decides, from the plan and the rank's data, whether
the steps run from the rows or the Gram, which exchange combines the
ranks, and which of the Triton kernels run them (the fused row steps, the
epoch kernel, the fused pass); :func:`prepare` then launches each chosen
kernel once (a kernel that cannot launch leaves its work to the torch
code, with a warning), compiles the torch steps where that pays, and says
whether CUDA graphs replay them; :func:`describe` reports the outcome
(``fit_stats_["execution"]``). The per-device switches are here; each
one's evidence is in ``docs/tuning.md``.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from .._accel import sparse_steps
from .._accel.triton import available as triton_available
from .._accel.triton import pass_supports
from .._accel.triton import supports as triton_supports
from .._data.storage import CSRMatrix
from .._glm.families import Family
from . import epoch_kernel
from .comm import Communicator
from .epochs import batch_sizes, compile_kernels, outer_iterations, with_zero_snapshot
from .exchange import prefer_row_exchange
from .precision import PrecisionPolicy
from .snapshot import full_pass
from .solver_state import SolverConfig
from .state import LocalData, ModelState, Preconditioner, RowExchange, StepContext

if TYPE_CHECKING:
    from .fit import FitPlan

# compile="auto" compiles the inner steps when one epoch has at least this many
# outer iterations: where the time saved per outer iteration repays the
# compile time within an epoch or a few (docs/tuning.md).
AUTO_COMPILE_MIN_OUTER = {"cpu": 100_000, "cuda": 1_000}

# Whether fits run the row steps' recurrence as one Triton kernel, by device
# type (faster than the compiled steps on CUDA, docs/tuning.md); on the CPU
# the kernel only runs interpreted (tests). With it on, fits compile nothing.
FUSED_ROW_STEPS = {"cpu": False, "cuda": True}
# Whether one-device fits run each epoch's steps as one Triton launch
# (epoch_kernel), by device type. Off until bench_gpu.py's check has timed
# it against the fused row steps on a GPU; on the CPU it only runs
# interpreted (tests).
EPOCH_KERNEL = {"cpu": False, "cuda": False}
# The same for sparse rows, whose epoch kernel is numba's on the CPU
# (_accel.sparse_steps; where numba is installed): no CUDA kernel yet.
SPARSE_EPOCH_KERNEL = {"cpu": True, "cuda": False}
# Whether one-device fits run the full pass as one Triton launch
# (_accel.triton.pass_terms), by device type; off until bench_gpu.py has timed it.
FUSED_PASS = {"cpu": False, "cuda": False}
# Whether one-device fits replay their outer iterations from CUDA graphs,
# by device type. Off until benchmarks/bench_gpu.py ("graphs") has timed a
# fit with them on a GPU and held it to the eager one; on the CPU they only
# run eagerly (tests).
CUDA_GRAPHS = {"cpu": False, "cuda": False}
# Whether an epoch's order is a Feistel permutation computed on the device
# (permutation), by device type: on a GPU, torch.randperm on the CPU and
# the copy made the epoch wait; on the CPU randperm is several times faster.
DEVICE_ORDER = {"cpu": False, "cuda": True}


@dataclass(frozen=True)
class Execution:
    """How a rank's epochs ran (``fit_stats_["execution"]``)."""

    steps: str  # "rows" (one rank, or the rows gathered), "gram" (its all-reduce), "newton"
    exchange: str  # "none" (one rank), "all-reduce" or "all-gather"
    fused: bool  # the row steps' recurrence as one Triton kernel an outer iteration
    epoch_kernel: bool  # each epoch's steps as one Triton launch
    fused_pass: bool  # the full pass as one Triton launch
    compiled: bool  # the torch steps compiled
    graphs: bool  # outer iterations replayed from CUDA graphs

    def report(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}


def row_exchange(
    plan: FitPlan, X_block: torch.Tensor | CSRMatrix, widths: tuple[int, ...]
) -> RowExchange | None:
    """The row all-gather where it beats the Gram all-reduce (several ranks, dense rows).

    Sparse rows always take the Gram all-reduce (gathering them is not
    implemented); Newton epochs gather their own rows (``.curvature``);
    averaged SGD sums each rank's own columns of its iterates (no replica).
    An L1 penalty's proximal step (s=1) runs on the replica after a gather,
    else on each rank's own columns after each step's all-reduce.
    """
    if not widths or isinstance(X_block, CSRMatrix) or plan.newton or plan.average:
        return None
    if gathers_rows(plan, plan.config.s, list(widths), X_block.device.type):
        return RowExchange(widths)
    return None


def step_context(
    plan: FitPlan,
    policy: PrecisionPolicy,
    comm: Communicator,
    preconditioner: Preconditioner | None,
    X_block: torch.Tensor | CSRMatrix,
    widths: tuple[int, ...],
    exchange: RowExchange | None,
) -> StepContext:
    """The steps' context with every execution switch decided (nothing launched yet)."""
    device_type = X_block.device.type
    n_rows = X_block.shape[0]
    n_outputs = plan.coef_init.shape[1]
    sparse = isinstance(X_block, CSRMatrix)
    row_steps = exchange is not None or (comm.world_size == 1 and not sparse)
    ctx = StepContext(
        plan.family,
        policy,
        plan.penalty,
        plan.fit_intercept,
        comm,
        preconditioner,
        exchange=exchange,
        # Every column of the rows at hand: the steps need no Gram.
        row_steps=row_steps,
        fused=row_steps
        and not plan.newton
        and fused_switch(plan, device_type)
        and _fused_covers(plan, n_rows, X_block.shape[1], exchange, device_type),
        newton=plan.newton,
        curvature_rows=plan.curvature_rows,
        column_widths=widths if plan.newton else (),
        device_order=DEVICE_ORDER.get(device_type, False),
        averaged=bool(plan.average),
        replica_scale=None
        if exchange is None or plan.column_scale is None
        else torch.as_tensor(
            plan.column_scale, dtype=policy.update_accumulate, device=X_block.device
        ),
        certificate=plan.gap_certificate(),
    )
    if _epoch_kernel(plan, device_type, sparse) and epoch_kernel.covers(
        ctx, X_block, plan.config.batch_size, n_outputs
    ):
        ctx = replace(ctx, epoch_kernel=True, fused=False)
    elif sparse and not plan.newton and comm.world_size == 1 and device_type == "cpu":
        _warn_without_numba()
    if _switch(FUSED_PASS, plan.fused_pass, device_type) and _fused_pass_covers(
        ctx, X_block, n_outputs
    ):
        ctx = replace(ctx, fused_pass=True)
    return ctx


def prepare(
    ctx: StepContext,
    plan: FitPlan,
    data: LocalData,
    state: ModelState,
    config: SolverConfig,
) -> tuple[StepContext, bool, float]:
    """Launch the chosen kernels once and compile where it pays, before the clock starts.

    Returns the context as it will run, whether CUDA graphs replay the
    outer iterations, and the seconds spent compiling.
    """
    X = data.X
    sparse = isinstance(X, CSRMatrix)
    device = X.device
    if ctx.fused_pass:
        ctx = _fused_pass_context(ctx, data, state)
    # The fused kernel is the steps' fusion: where it covers the fit's outer
    # iterations nothing is compiled (a ragged tail runs the eager torch steps);
    # where it does not (a wide tile) the torch steps compile.
    if ctx.fused:
        ctx = _fused_context(ctx, data, state, config)
    if ctx.epoch_kernel:
        ctx = _epoch_kernel_context(ctx, data, state, config)
    compile_seconds = 0.0
    outer_per_epoch = math.ceil(len(batch_sizes(X.shape[0], config.batch_size)) / config.s)
    # torch.compile does not take sparse rows (the estimator refuses compile=True
    # then); Newton epochs run no minibatch steps: nothing to compile or capture.
    if (
        not sparse
        and not ctx.fused
        and not ctx.epoch_kernel
        and not plan.newton
        and use_compiled(plan.compile, device, outer_per_epoch)
    ):
        started = time.perf_counter()
        ctx = _compiled_context(plan, ctx, data, state, config)
        compile_seconds = time.perf_counter() - started
    graphs = (
        ctx.comm.world_size == 1
        and not sparse
        and not plan.newton
        and not plan.penalty.proximal  # its step is not captured in the graphs
        and not plan.average  # nor the average's sum
        and not ctx.epoch_kernel
        and _graphs(plan, device.type)
    )
    return ctx, graphs, compile_seconds


def describe(ctx: StepContext, graphs: bool) -> Execution:
    """How the epochs of ``ctx`` ran."""
    if ctx.comm.world_size == 1:
        exchange = "none"
    else:
        exchange = "all-reduce" if ctx.exchange is None else "all-gather"
    return Execution(
        steps="newton" if ctx.newton else ("rows" if ctx.row_steps or ctx.epoch_kernel else "gram"),
        exchange=exchange,
        fused=ctx.fused,
        epoch_kernel=ctx.epoch_kernel,
        fused_pass=ctx.fused_pass,
        compiled=ctx.compiled,
        graphs=graphs,
    )


_WARNED_WITHOUT_NUMBA = []


def _warn_without_numba() -> None:
    """Say once a process that sparse minibatch steps run without their epoch kernel."""
    if sparse_steps.available() or _WARNED_WITHOUT_NUMBA:
        return
    _WARNED_WITHOUT_NUMBA.append(True)
    warnings.warn(
        "numba is not installed: this fit's minibatch steps on sparse rows run through "
        "torch, several times slower than in the epoch kernel. `pip install "
        "sklearn_casgd[sparse]` installs numba.",
        UserWarning,
        stacklevel=5,
    )


def sparse_kernel_planned(device_type: str, world_size: int, family: Family | None) -> bool:
    """Whether a sparse fit's steps will run in the epoch kernel, as its planning needs to know.

    The batch size depends on it (:func:`.planner.plan_execution`); the
    decision itself is :func:`step_context`'s, which also checks X's dtype.
    """
    return (
        world_size == 1
        and SPARSE_EPOCH_KERNEL.get(device_type, False)
        and family is not None
        and family.kernel_code is not None
        and sparse_steps.available()
    )


def fused_switch(plan: FitPlan, device_type: str) -> bool:
    """Whether the row steps run as one Triton kernel (where it covers them)."""
    return FUSED_ROW_STEPS.get(device_type, False) if plan.fused is None else plan.fused


def _epoch_kernel(plan: FitPlan, device_type: str, sparse: bool) -> bool:
    """Whether a one-device fit runs each epoch's steps as one launch (where it covers them)."""
    if plan.newton:  # full-batch steps: no minibatch steps to run
        return False
    by_device = SPARSE_EPOCH_KERNEL if sparse else EPOCH_KERNEL
    return _switch(by_device, plan.epoch_kernel, device_type)


def _switch(by_device: dict[str, bool], forced: bool | None, device_type: str) -> bool:
    """A per-device default, unless the plan forces it."""
    return by_device.get(device_type, False) if forced is None else forced


def _fused_pass_covers(ctx: StepContext, X: torch.Tensor | CSRMatrix, n_outputs: int) -> bool:
    """Whether the fused pass can run this fit's passes on X's device (one rank, dense).

    Not where the fit's stopping test reads the gap certificate, whose sums
    the fused pass does not form.
    """
    return (
        ctx.comm.world_size == 1
        and ctx.certificate is None
        and not isinstance(X, CSRMatrix)
        and X.shape[0] > 0
        and not ctx.samples_by_curvature
        and triton_available(X.device.type)
        and pass_supports(ctx.family, n_outputs, X.shape[1])
    )


def _fused_pass_context(ctx: StepContext, data: LocalData, state: ModelState) -> StepContext:
    """``ctx`` with the fused pass launched once now (on a few rows), or without it if it fails."""
    rows = min(16, data.X.shape[0])
    few = LocalData(data.X[:rows], data.target[:rows], data.sample_weight[:rows])
    try:
        full_pass(ctx, few, state, 0.0)  # reads the weights, changes nothing
    except Exception as error:
        warnings.warn(
            f"The fused Triton pass failed to run ({type(error).__name__}: {error}); "
            "the fit runs the torch pass.",
            RuntimeWarning,
            stacklevel=2,
        )
        return replace(ctx, fused_pass=False)
    return ctx


def _graphs(plan: FitPlan, device_type: str) -> bool:
    """Whether a one-device fit replays its outer iterations from CUDA graphs."""
    return CUDA_GRAPHS.get(device_type, False) if plan.graphs is None else plan.graphs


def _fused_covers(
    plan: FitPlan,
    n_samples: int,
    local_width: int,
    exchange: RowExchange | None,
    device_type: str,
) -> bool:
    """Whether the fused kernel runs the fit's full outer iterations on this device.

    Where it does not (the multinomial, a tile over ``_accel.triton.MAX_TILE``, no
    triton) the fit is not a fused one: its torch steps compile as without.
    """
    if n_samples == 0 or not triton_available(device_type):
        return False
    sizes = outer_iterations(n_samples, plan.config.batch_size, plan.config.s)[0][1]
    width = local_width if exchange is None else sum(exchange.widths)
    return triton_supports(plan.family, sizes, plan.coef_init.shape[1], width)


def _margin_columns(plan: FitPlan) -> int:
    """Columns of the margins: ``k``, and ``2k`` under SVRG (``Y w`` and ``Y mu``)."""
    return plan.coef_init.shape[1] * (2 if plan.config.solver == "svrg" else 1)


def gathers_rows(plan: FitPlan, s: int, widths: list[int], device_type: str) -> bool:
    """Whether outer iterations of s steps all-gather the rows (several ranks, dense X).

    Every rank decides from the same global shapes: the same exchange
    everywhere. A rank without columns always gathers; s=1 otherwise
    reduces its margins (plain SGD's steps, :func:`.recurrence.sgd_step`),
    except with an L1 part, whose s is 1 whatever the cost: there the
    bytes decide, as for s > 1 (gathered rows of many steps travel at once).
    """
    if min(widths) == 0:
        return True
    if plan.exchange != "auto":
        return plan.exchange == "all-gather"
    if s == 1 and not plan.penalty.proximal:
        return False
    group = [plan.config.batch_size] * s
    return prefer_row_exchange(group, widths, _margin_columns(plan), plan.policy, device_type)


def use_compiled(setting: bool | str, device: torch.device, outer_per_epoch: int) -> bool:
    """Whether the inner steps run compiled: ``compile=True``, or ``"auto"`` on long epochs."""
    if setting != "auto":
        return bool(setting)
    return outer_per_epoch >= AUTO_COMPILE_MIN_OUTER.get(
        device.type, AUTO_COMPILE_MIN_OUTER["cuda"]
    )


def _compiled_context(
    plan: FitPlan, ctx: StepContext, data: LocalData, state: ModelState, config: SolverConfig
) -> StepContext:
    """``ctx`` with compiled inner steps, compiled now (before the clock starts).

    With ``compile="auto"`` a failure to compile falls back to the eager
    steps with a warning; with ``compile=True`` it is raised.
    """
    try:
        compiled = compile_kernels(replace(ctx, compiled=True), data, state, config)
    except Exception as error:
        if plan.compile is True:
            raise
        warnings.warn(
            f"compile='auto': torch.compile failed ({type(error).__name__}: {error}); "
            "the fit runs the eager steps.",
            RuntimeWarning,
            stacklevel=2,
        )
        return ctx
    return compiled


def _fused_context(
    ctx: StepContext, data: LocalData, state: ModelState, config: SolverConfig
) -> StepContext:
    """``ctx`` with its fused kernel launched once now, or without it where that fails.

    Triton compiles the kernel at its first launch, into its cache folder,
    for the device at hand. Where it cannot (no writable cache, no driver
    it knows) the fit runs the torch steps with a warning instead of
    failing, as a fit whose compile="auto" fails does.
    """
    try:
        compile_kernels(ctx, data, state, config)  # runs the fit's first shape, changing nothing
    except Exception as error:
        warnings.warn(
            f"The fused Triton kernel failed to run ({type(error).__name__}: {error}); "
            "the fit runs the torch steps.",
            RuntimeWarning,
            stacklevel=2,
        )
        return replace(ctx, fused=False)
    return ctx


def _epoch_kernel_context(
    ctx: StepContext, data: LocalData, state: ModelState, config: SolverConfig
) -> StepContext:
    """``ctx`` with the epoch kernel launched once now, or without it where that fails.

    The launch takes one batch at step size 0 on copies of the weights
    (nothing changes), with a snapshot of zeros for SVRG; as
    :func:`_fused_context`, a kernel Triton (or numba) cannot build leaves
    the fit to the torch steps with a warning.
    """
    n_rows = min(config.batch_size, data.X.shape[0])
    data = with_zero_snapshot(data, state, config)
    copy = ModelState(state.coef.clone(), state.intercept.clone())
    order = torch.arange(n_rows, device=data.X.device)
    kind = "numba" if isinstance(data.X, CSRMatrix) else "Triton"
    try:
        epoch_kernel.run_epoch(ctx, data, copy, order, [0.0], config.batch_size, True)
    except Exception as error:
        warnings.warn(
            f"The {kind} epoch kernel failed to run ({type(error).__name__}: {error}); "
            "the fit runs the torch steps.",
            RuntimeWarning,
            stacklevel=2,
        )
        return replace(ctx, epoch_kernel=False)
    return ctx
