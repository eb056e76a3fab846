"""A fit as data (:class:`FitPlan`) and the code that runs it on one rank.

:func:`.fit_plan.plan_fit` decides everything that depends on the whole
data (step size, intercept start, seed) once, into a plan. Any rank then
runs :func:`fit_block` on its column block (how its epochs execute:
:mod:`.execution`); the backends in :mod:`.._distributed.backends` only decide where
the ranks live.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .._data.storage import CSRMatrix, split_rows
from .._glm.families import Family
from .._glm.penalties import Penalty
from . import execution
from .average import RunningAverage
from .batch import gather_outer_batch
from .certificate import GapCertificate
from .checkpoint import CheckpointSpec, RankCheckpoints, solver_state_from_json
from .comm import Communicator, LocalCommunicator
from .cost import (
    CANDIDATES,
    POOL_TRANSPORT,
    FitShape,
    choose_s,
    measure_comm,
    measure_local,
    quiet_seconds,
)
from .epochs import order_dtype
from .polish import can_polish, polish, polishes
from .precision import PRESETS, PrecisionPolicy, matmul_precision, policy_for_solver
from .recurrence import ca_outer_iteration, longest_recurrence, recurrence_step
from .snapshot import HeldOut
from .solver import run_epochs
from .solver_state import SolverConfig, SolverResult, SolverState, StepSchedule
from .state import LocalData, ModelState, Preconditioner, StepContext
from .stepsize import largest_step

# Targets shifted (the target shift of least squares) this many values at a time.
_SHIFT_CHUNK_VALUES = 1 << 16


@dataclass(frozen=True)
class FitPlan:
    """Everything a rank needs to fit, besides its columns of X. Picklable."""

    family: Family
    precision: str  # a key of PRESETS
    device: str
    penalty: Penalty
    fit_intercept: bool
    config: SolverConfig
    learning_rate: str
    eta0: float
    power_t: float
    coef_init: np.ndarray  # (d, k) float64
    intercept_init: np.ndarray  # (k,) float64
    loss_offset: float
    # (k,) subtracted from the targets in float64 before they are rounded to
    # the recurrence dtype (a shift-invariant family, with an intercept); the
    # engine's intercept is then the intercept less it. None: no shift.
    target_shift: np.ndarray | None = None
    seed_from_rank0: bool = False  # random_state=None in a job: take rank 0's seed
    one_machine: bool = False  # the ranks share this machine (a worker pool): POOL_TRANSPORT
    auto_s: bool = False  # s="auto" not decided yet: the ranks time the kernels first
    column_center: np.ndarray | None = None  # (d,) preconditioner's center m (SVRG), or None
    column_scale: np.ndarray | None = None  # (d,) preconditioner's scale D (SVRG), or None
    column_spread: np.ndarray | None = None  # (d,) columns' RMS about the center, or None
    # X's rows are stored preconditioned, (x - m) / D rounded once
    # (_data.storage.stores_preconditioned).
    rows_preconditioned: bool = False
    decay_alpha: float | None = None  # the steps' scalar L2 rate when preconditioned
    compile: bool | str = False  # compile the inner steps: True, False or "auto"
    resume: dict | None = None  # a SolverState.state_dict() to continue from, or None
    n_held_out: int = 0  # the last rows are early stopping's held-out set, not trained on
    # "auto" (prefer_row_exchange decides), or "all-reduce"/"all-gather" to force one:
    # set only by benchmarks and tests. A rank without columns always gathers.
    exchange: str = "auto"
    # The row steps as one Triton kernel (_accel.triton): None takes FUSED_ROW_STEPS
    # of the device; True or False (benchmarks, tests) forces it.
    fused: bool | None = None
    # One device: each epoch's steps as one Triton launch (epoch_kernel). None
    # takes EPOCH_KERNEL of the device; True or False (benchmarks, tests) forces it.
    epoch_kernel: bool | None = None
    # One device: the full pass as one Triton launch. None takes FUSED_PASS of
    # the device; True or False (benchmarks, tests) forces it.
    fused_pass: bool | None = None
    # One device: replay the outer iterations from CUDA graphs (graphs). None
    # takes CUDA_GRAPHS of the device; True or False (benchmarks, tests) forces it.
    graphs: bool | None = None
    # SVRG's epochs as full-batch steps preconditioned by the curvature
    # (curvature; dense X): the planner's choice where they are faster.
    newton: bool = False
    # ... with the curvature formed from this many rows (None: every row).
    curvature_rows: int | None = None
    # Write checkpoints (and resume the one named there), or None.
    checkpoint: CheckpointSpec | None = None
    # Averaged SGD: the iterates count once this many rows were stepped on
    # (average.RunningAverage); 0: no averaging. ``average_init`` is the mean
    # a partial_fit continues ((d, k), (k,), engine coordinates), with the
    # count and rows in ``resume``.
    average: int = 0
    average_init: tuple[np.ndarray, np.ndarray] | None = None
    # ||X - m||_F^2 of the training rows (m: the center the engine's intercept
    # absorbs, or 0), for the gap certificate; None: the fit has none.
    frobenius_squared: float | None = None

    @property
    def policy(self) -> PrecisionPolicy:
        return policy_for_solver(PRESETS[self.precision], self.config.solver)

    def gap_certificate(self) -> GapCertificate | None:
        """The full pass's bound on the gap to the optimum, or None (:mod:`.certificate`).

        The rows are stored rounded to ``x_storage``: ``||X - m||_F`` grows by
        at most that rounding.
        """
        if self.frobenius_squared is None:
            return None
        rounding = 1.0 + torch.finfo(self.policy.x_storage).eps
        return GapCertificate(
            self.penalty.l2,
            self.family.self_concordance,
            self.fit_intercept,
            self.family.class_shift_invariant,
            self.frobenius_squared * rounding**2,
        )

    def stored_preconditioning(
        self, start: int, stop: int
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The center and scale that columns ``[start, stop)`` are stored with, or two Nones."""
        if not self.rows_preconditioned:
            return None, None
        return self.column_center[start:stop], self.column_scale[start:stop]

    def user_coefficients(
        self, coef: np.ndarray, intercept: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The engine's ``coef`` ``(d, k)`` and intercept in the user's coordinates.

        The engine fits centered columns and y less the intercept's start:
        undo both. Returns ``coef`` as ``(k, d)``, scikit-learn's layout.
        """
        user_intercept = intercept
        if self.column_center is not None:  # back from the centered rows' intercept
            user_intercept = user_intercept - self.column_center @ coef
        if self.target_shift is not None:
            user_intercept = user_intercept + self.target_shift
        return coef.T.copy(), user_intercept


@dataclass
class BlockResult:
    """What one rank produced: its weight slice and the fit's history and counts.

    With averaging (``FitPlan.average``) ``coef`` and ``intercept`` hold the
    last iterate's k columns, then the average's k.
    """

    coef: np.ndarray  # (d_local, k) float64; (d_local, 2k) averaged
    intercept: np.ndarray  # (k,) float64; (2k,) averaged
    solver: SolverResult
    n_allreduce: int
    allreduce_bytes: int
    allreduce_seconds: float
    s: int
    s_predictions: dict[int, float] | None  # the cost model's epoch seconds per s
    chosen_s: int | None = None  # the cost model's s (``s`` is less where C_s would underflow)
    compiled: bool = False  # whether the inner steps ran compiled
    exchange: str = "all-reduce"  # how outer iterations combined the ranks' parts
    compile_seconds: float = 0.0  # compiling them before the epochs (start-up, not training)
    execution: dict | None = None  # how the epochs ran (execution.Execution.report)


def column_blocks(n_features: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` column ranges; the first ``d % P`` get one extra column."""
    base, extra = divmod(n_features, world_size)
    sizes = [base + (rank < extra) for rank in range(world_size)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [(starts[rank], starts[rank + 1]) for rank in range(world_size)]


def _shifted_targets(
    target: np.ndarray, shift: np.ndarray | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``target - shift`` in ``dtype``: subtracted in float64 a chunk at a time.

    Shifted whole, the float64 copy of y was the fit's largest n-sized
    temporary; rounded to ``dtype`` first, y = 1e8 + x would lose x.
    """
    if shift is None:
        return torch.tensor(target, dtype=dtype, device=device)
    shifted = torch.empty(target.shape, dtype=dtype, device=device)
    step = max(1, _SHIFT_CHUNK_VALUES // max(1, target.shape[1]))
    for lo in range(0, target.shape[0], step):
        chunk = np.asarray(target[lo : lo + step], dtype=np.float64) - shift
        shifted[lo : lo + step] = torch.from_numpy(chunk)
    return shifted


# s="auto" for sparse rows on several ranks: the candidates timed, and the
# outer iterations timed for each (after one untimed: the first gathers' allocations).
SPARSE_S_CANDIDATES = (1, 2, 4, 8, 16)
SPARSE_S_REPEATS = 5


def fit_block(
    plan: FitPlan,
    X_block: torch.Tensor | CSRMatrix,
    target: np.ndarray,
    sample_weight: np.ndarray,
    columns: tuple[int, int],
    comm: Communicator,
) -> BlockResult:
    """Run the plan on this rank's column block, as stored (:meth:`FitPlan.stored_preconditioning`).

    The last ``plan.n_held_out`` rows are held out for early stopping.
    """
    policy = plan.policy
    device = X_block.device
    rec = policy.recurrence
    shift = plan.target_shift
    held_out = None
    if plan.n_held_out:
        n_train = target.shape[0] - plan.n_held_out
        X_block, X_held_out = split_rows(X_block, n_train)
        held_target = target[n_train:] if shift is None else target[n_train:] - shift
        held_out = HeldOut(X_held_out, held_target.copy(), sample_weight[n_train:].copy())
        target, sample_weight = target[:n_train], sample_weight[:n_train]
    if plan.seed_from_rank0:
        seed = torch.tensor([plan.config.seed], dtype=torch.int64, device=device)
        comm.broadcast(seed, src=0)
        plan = replace(plan, config=replace(plan.config, seed=int(seed.item())))
    predictions = None
    chosen_s = None
    checkpoint = plan.checkpoint
    resumed = None if checkpoint is None else checkpoint.loop
    if resumed is not None:
        # The s the interrupted fit ran (timed, or shortened for C_s's range)
        # and where its loop stood.
        state = solver_state_from_json(resumed["solver_state"])
        plan = replace(
            plan, auto_s=False, resume=state, config=replace(plan.config, s=int(resumed["s"]))
        )
    sparse = isinstance(X_block, CSRMatrix)
    if plan.auto_s and not sparse:  # sparse rows time their own outer iterations, below
        chosen_s, predictions = _choose_s(plan, X_block, target.shape[0], columns, comm)
        plan = replace(plan, config=replace(plan.config, s=chosen_s))
    decay_alpha = plan.penalty.l2 if plan.column_scale is None else plan.decay_alpha
    resume = None if plan.resume is None else SolverState.from_state_dict(plan.resume)
    eta = None if resume is None else resume.eta
    plan, max_eta = _recurrence_bounds(plan, eta, decay_alpha, rec, resumed is not None)
    data = LocalData(
        X=X_block,
        # Copies (a few values per row): the rows' targets and weights are never
        # the user's memory, which may be read-only (a pandas column).
        target=_shifted_targets(target, shift, rec, device),
        sample_weight=torch.tensor(sample_weight, dtype=rec, device=device),
    )
    del target, sample_weight
    start, stop = columns
    # Preconditioned, the steps run on v = D w.
    scale = np.ones(stop - start) if plan.column_scale is None else plan.column_scale[start:stop]
    coef = torch.as_tensor(
        plan.coef_init[start:stop] * scale[:, None], dtype=policy.weight_storage, device=device
    )
    intercept = torch.as_tensor(plan.intercept_init.copy(), dtype=rec, device=device)
    preconditioner = None
    if plan.column_scale is not None:
        acc = policy.update_accumulate
        preconditioner = Preconditioner(
            center=torch.as_tensor(plan.column_center[start:stop], dtype=acc, device=device),
            scale=torch.as_tensor(scale, dtype=acc, device=device),
            decay_alpha=plan.decay_alpha,
            spread=torch.as_tensor(plan.column_spread[start:stop], dtype=acc, device=device),
            in_storage=plan.rows_preconditioned,
        )
    widths = tuple(_widths(plan, comm.world_size)) if comm.world_size > 1 else ()
    exchange = execution.row_exchange(plan, X_block, widths)
    if exchange is None:
        state = ModelState(coef, intercept)
    else:  # every rank steps every rank's weights (RowExchange)
        state = ModelState.with_replica(coef, intercept, columns, len(plan.coef_init))
    if plan.average:
        mean = None
        if plan.average_init is not None:
            mean = (plan.average_init[0][start:stop], plan.average_init[1])
        # The iterates counted so far: those of the mean continued, or of the
        # sum a resumed checkpoint holds (set with its weights).
        continued = mean is not None or resumed is not None
        state.average = RunningAverage.starting(
            state.coef,
            state.intercept,
            plan.average,
            mean,
            count=resume.average_count if resume is not None and continued else 0,
            samples=0 if resume is None else resume.average_samples,
        )
    ctx = execution.step_context(plan, policy, comm, preconditioner, X_block, widths, exchange)
    if plan.auto_s and sparse:
        chosen_s, predictions = _time_sparse_s(ctx, data, state, plan.config.batch_size, comm)
        plan = replace(plan, config=replace(plan.config, s=chosen_s))
        plan, max_eta = _recurrence_bounds(plan, eta, decay_alpha, rec, resumed is not None)
    schedule = StepSchedule(plan.learning_rate, plan.eta0, plan.power_t, max_eta, eta)
    config = plan.config if comm.rank == 0 else replace(plan.config, verbose=0)
    checkpoints = None if checkpoint is None else RankCheckpoints(checkpoint, comm, device)
    with matmul_precision(policy, device):
        ctx, graphs, compile_seconds = execution.prepare(ctx, plan, data, state, config)
        config = replace(config, hands_over=can_polish(plan, ctx, data.X))
        solver = run_epochs(
            ctx,
            data,
            state,
            config,
            schedule,
            plan.loss_offset,
            resume,
            held_out,
            graphs,
            checkpoints,
        )
        if config.hands_over and polishes(plan, solver):
            ranks_plan = replace(plan, config=config)
            solver, state = polish(ranks_plan, ctx, data, state, solver, comm, widths)
    ran = execution.describe(ctx, graphs)
    coef_out = state.coef.detach().to(torch.float64).cpu().numpy() / scale[:, None]
    intercept_out = state.intercept.detach().to(torch.float64).cpu().numpy()
    if state.average is not None:  # the iterate, then the mean (the iterate before any counts)
        mean = state.average.mean() or (state.coef, state.intercept)
        mean_coef = mean[0].detach().to(torch.float64).cpu().numpy() / scale[:, None]
        coef_out = np.concatenate([coef_out, mean_coef], axis=1)
        mean_intercept = mean[1].detach().to(torch.float64).cpu().numpy()
        intercept_out = np.concatenate([intercept_out, mean_intercept])
    return BlockResult(
        coef=coef_out,
        intercept=intercept_out,
        solver=solver,
        n_allreduce=comm.n_allreduce,
        allreduce_bytes=comm.allreduce_bytes,
        allreduce_seconds=comm.allreduce_seconds,
        s=plan.config.s,
        s_predictions=predictions,
        chosen_s=chosen_s,
        compiled=ran.compiled,
        compile_seconds=compile_seconds,
        exchange=ran.exchange,
        execution=ran.report(),
    )


def _recurrence_bounds(
    plan: FitPlan, eta: float | None, decay_alpha: float, rec: torch.dtype, resumed: bool
) -> tuple[FitPlan, float]:
    """The plan with its s held in the recurrence's range, and the longest step.

    No step the fit starts with (``eta``, else ``eta0``) may decay C_s out
    of the recurrence's range; the step's growth (SVRG) stops where the L2
    decay factor would fall to 1/2 or where C_s would leave that range. A
    resumed fit keeps the s it ran.
    """
    if plan.newton:  # one step of Newton's length per epoch: no decay factor, no recurrence
        s, max_eta = 1, 1.0
    else:
        s = plan.config.s
        if not resumed:
            s = min(s, longest_recurrence(eta or plan.eta0, decay_alpha, rec))
        max_eta = min(largest_step(decay_alpha), recurrence_step(s, decay_alpha, rec))
    if s != plan.config.s:
        plan = replace(plan, config=replace(plan.config, s=s))
    return plan, max_eta


def _widths(plan: FitPlan, world_size: int) -> list[int]:
    """The ranks' column block widths."""
    return [stop - start for start, stop in column_blocks(len(plan.coef_init), world_size)]


def _time_sparse_s(
    ctx: StepContext, data: LocalData, state: ModelState, batch_size: int, comm: Communicator
) -> tuple[int, dict[int, float]]:
    """s for sparse rows on several ranks, from their own outer iterations timed here.

    The cost model prices dense rows only: the Gram of sparse rows costs
    what their overlap of columns makes it. Each candidate runs
    :data:`SPARSE_S_REPEATS` outer iterations of s batches (every rank the
    same, on copies of the weights, at step size 0: nothing moves) after
    one untimed, keeping the core (:meth:`.comm.TorchCommunicator.keeping_the_core`);
    rank 0's seconds per step of the fastest (:func:`.cost.quiet_seconds`)
    decide, broadcast to every rank.
    Returns the s and each candidate's seconds per step (rank 0's; {} on
    the others).
    """
    n_samples = data.X.shape[0]
    dtype = order_dtype(n_samples)
    seconds = {}
    with comm.keeping_the_core():
        for s in SPARSE_S_CANDIDATES:
            if s > 1 and s * batch_size > n_samples:
                break
            sizes = [min(batch_size, n_samples)] * s
            rows = torch.arange(sum(sizes), dtype=dtype, device=data.X.device)
            copy = ModelState(state.coef.clone(), state.intercept.clone())

            def outer_iteration(rows=rows, sizes=sizes, copy=copy, s=s):
                batch = gather_outer_batch(ctx, data, rows, sizes)
                ca_outer_iteration(ctx, data, copy, batch, [0.0] * s)

            seconds[s] = quiet_seconds(outer_iteration, data.X.device, SPARSE_S_REPEATS) / s
    best = min(seconds, key=seconds.get)
    chosen = torch.tensor([best], dtype=torch.int64, device=data.X.device)
    comm.broadcast(chosen, src=0)
    return int(chosen.item()), seconds if comm.rank == 0 else {}


def _choose_s(
    plan: FitPlan,
    X_block: torch.Tensor,
    n_samples: int,
    columns: tuple[int, int],
    comm: Communicator,
) -> tuple[int, dict[int, float] | None]:
    """s from the cost model, decided on rank 0 and broadcast to every rank.

    The kernels are timed here (:func:`.cost.measure_local`); the collectives
    of a worker pool's ranks are priced (:data:`.cost.POOL_TRANSPORT`), a
    job's timed (:func:`.cost.measure_comm`).
    """
    policy, device = plan.policy, X_block.device
    n_outputs = plan.coef_init.shape[1]
    width = columns[1] - columns[0]
    batch_size = plan.config.batch_size
    world_size = comm.world_size
    # Dense only (sparse rows time their own: _time_sparse_s): one rank always runs the row
    # steps; several do where they all-gather the rows (fit_block's choice).
    if world_size == 1:
        row_step_s = frozenset(CANDIDATES) - {1}
        gather_bytes_per_row = 0.0
    else:
        widths = _widths(plan, world_size)
        row_step_s = frozenset(
            s for s in CANDIDATES if s > 1 and execution.gathers_rows(plan, s, widths, device.type)
        )
        gather_bytes_per_row = world_size / 2 * max(widths) * policy.gram_input.itemsize
    # The row steps are timed as the fit will run them: fused or not.
    fused = execution.fused_switch(plan, device.type)
    local = measure_local(
        plan.family, policy, device, batch_size, width, n_outputs, world_size == 1, fused
    )
    row_local = local
    if world_size > 1 and row_step_s:
        n_features = len(plan.coef_init)
        row_local = measure_local(
            plan.family, policy, device, batch_size, n_features, n_outputs, True, fused
        )
    comm_costs = POOL_TRANSPORT.get(device.type) if plan.one_machine else None
    if comm_costs is None:
        comm_costs = measure_comm(comm, device)
    shape = FitShape(
        n_samples,
        batch_size,
        width,
        n_outputs,
        policy.comm_dtype.itemsize,
        row_step_s,
        gather_bytes_per_row,
    )
    s, predictions = choose_s(shape, local, comm_costs, row_local)
    if comm.world_size > 1:
        chosen = torch.tensor([s], dtype=torch.int64, device=X_block.device)
        comm.broadcast(chosen, src=0)
        s = int(chosen.item())
    return s, predictions if comm.rank == 0 else None


def fit_local(
    plan: FitPlan,
    X_storage: torch.Tensor | CSRMatrix,
    target: np.ndarray,
    sample_weight: np.ndarray,
) -> BlockResult:
    """One rank holding every column: no process group."""
    columns = (0, X_storage.shape[1])
    return fit_block(plan, X_storage, target, sample_weight, columns, LocalCommunicator())
