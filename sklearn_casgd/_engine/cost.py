"""The cost model behind ``s="auto"``.

The time of an epoch with s steps per outer iteration is modelled as

    epoch(s) = ceil(n_batches / s) * outer(s)
    outer(1) = t_sgd + comm(4 b k)
    outer(s) = t_fixed + s t_step
               + max(b^2 s(s-1)/2 d_local / gemm_rate,
                     comm(4 (b^2 s(s-1)/2 + s b k)))                  (s >= 2)
    comm(bytes) = latency + bytes * seconds_per_byte                  (0 on one rank)

The max is there because the next outer iteration's Gram is formed while
this one's all-reduce is in flight. Where the steps run from the rows (one
rank, or several that all-gather the rows: ``FitShape.row_step_s``) there
is no Gram, and the outer iteration is

    outer(s) = t_fixed' + s t_step' + s b bytes_per_row * seconds_per_byte   (0 on one rank)

with the fixed and per-step costs timed on the row steps. The all-gather
needs no weights and is started an outer iteration ahead: its bytes cost
time (the transport's copies share the cores), its latency does not.

``t_sgd`` (one plain step), ``t_fixed`` and ``t_step`` (the per-outer and
per-inner-step costs of the s-step kernel, mostly dispatch) and
``gemm_rate`` (Gram multiply-adds per second) are timed once per process on
synthetic data of the fit's batch size, column-block width and number of
outputs. Latency and bandwidth are priced for a worker pool's ranks, which
share this machine (:data:`POOL_TRANSPORT`), and timed across a job's
ranks. Every timing reads a quiet call (:func:`quiet_seconds`), so that
busy processes beside the fit do not move its s. Rank 0 takes the largest
s predicted within :data:`S_TIE_MARGIN` of the fastest and broadcasts it,
and the choice is cached per (shape, device, world size, precision) in the
process, so refits choose the same s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import scipy.sparse as sp
import torch

from .._data.storage import CSRMatrix
from .._glm.families import BinomialFamily, Family
from .._glm.penalties import Penalty
from .batch import gather_outer_batch
from .comm import Communicator, LocalCommunicator, synchronize
from .curvature import form_newton_system, full_gradient, newton_step
from .precision import PrecisionPolicy, gram_block, gram_operand
from .recurrence import ca_outer_iteration, sgd_step
from .snapshot import full_pass
from .state import LocalData, ModelState, Preconditioner, Snapshot, StepContext

CANDIDATES = (1, 2, 4, 8, 16, 32)
_REPEATS = 15
# The share of timed calls faster than the one that counts (quiet_seconds).
QUIET_QUANTILE = 0.1
_MAX_TIMED_WIDTH = 256
# The s-step kernel is timed at s=2 and s=8 with batches of at most 64 rows:
# its fixed and per-step costs are dispatch, nearly independent of b, and
# the Gram part is extrapolated through the GEMM rate. Timing at b=256
# would allocate a Gram of 28 b^2 values (7 MiB), more than the O(n)
# bookkeeping of a fit with 200000 rows.
_TIMED_S = 8
_MAX_TIMED_BATCH = 64
# choose_s takes the largest s predicted within this share of the fastest epoch.
S_TIE_MARGIN = 0.1
# Largest share of the rows that one outer iteration of s="auto" takes.
MAX_OUTER_SHARE = 1 / 64
# The conjugate gradients' products a Newton epoch of several classes takes,
# on average over a fit (docs/tuning.md).
NEWTON_PRODUCTS = 5.0
_LOCAL_CACHE: dict[tuple, LocalCosts] = {}
CHOICES: dict[tuple, int] = {}


@dataclass(frozen=True)
class LocalCosts:
    """Seconds of the kernel's fixed costs and the Gram GEMM rate on one rank."""

    sgd_step: float
    outer_fixed: float
    inner_step: float
    gemm_rate: float  # Gram multiply-adds per second


@dataclass(frozen=True)
class DeviceProfile:
    """What an SVRG epoch costs on one device, per unit of work: the planner's prices.

    A step on b rows of d columns with k outputs costs ``fixed + b (d value +
    k row)``: the fixed part is dispatch (``step`` for a plain step,
    ``inner_step`` for each step of an outer iteration of s > 1 row steps,
    which also costs ``outer`` once), the rest grows with the rows touched
    (gathering, preconditioning, the margins and the update). The full pass
    costs ``n (d pass_value + k pass_row)``. Sparse rows count their stored
    values per row as d, and their plain step costs ``sparse_step`` fixed.
    :func:`measure_profile` times these on the device at hand; the planner
    reads a fixed profile per device type (:data:`PROFILES`), so that the
    same data gets the same batch size in every process.
    """

    step: float
    outer: float
    inner_step: float
    value: float
    row: float
    pass_value: float
    pass_row: float
    sparse_step: float
    # Newton epochs (curvature): seconds per multiply-add of forming and
    # factoring the curvature, per value of the weighted rows, per row of its
    # read of X and row Hessians, and the fixed seconds of forming, factoring
    # and solving.
    curvature_value: float = 0.0
    newton_value: float = 0.0
    newton_row: float = 0.0
    newton_step: float = 0.0
    # Sparse rows: a pass's seconds per stored value and per row, and the
    # epoch kernel's (_accel.sparse_steps) per stored value and per row.
    sparse_pass_value: float = 0.0
    sparse_pass_row: float = 0.0
    sparse_kernel_value: float = 0.0
    sparse_kernel_row: float = 0.0

    def local_costs(
        self, batch_size: int, width: float, n_outputs: int, sparse: bool = False
    ) -> LocalCosts:
        """The costs of steps on ``batch_size`` rows, as :func:`predict_epoch_seconds` reads them.

        No Gram is priced: on one device every s > 1 runs the row steps.
        """
        rows = batch_size * (width * self.value + n_outputs * self.row)
        fixed = self.sparse_step if sparse else self.step
        return LocalCosts(fixed + rows, self.outer, self.inner_step + rows, math.inf)

    def pass_seconds(self, n_samples: int, width: float, n_outputs: int) -> float:
        """Seconds of one full pass (SVRG's snapshot) over ``n_samples`` rows."""
        return n_samples * (width * self.pass_value + n_outputs * self.pass_row)

    def sparse_pass_seconds(self, n_samples: int, width: float, n_outputs: int) -> float:
        """Seconds of one pass over sparse rows of ``width`` stored values each."""
        return n_samples * (width * self.sparse_pass_value + n_outputs * self.sparse_pass_row)

    def sparse_kernel_seconds(self, n_samples: int, width: float, n_outputs: int) -> float:
        """Seconds of one epoch of the sparse epoch kernel's steps (without its pass)."""
        rows = n_samples * n_outputs
        return rows * (width * self.sparse_kernel_value + self.sparse_kernel_row)

    def newton_seconds(self, n_samples: int, width: float, n_outputs: int, ranks: int = 1) -> float:
        """Seconds a Newton epoch adds to its full pass: forming and solving the curvature.

        Each class's ``(d+1) x (d+1)`` block weighs the rows (``n (d+1)``
        values), multiplies them (``n (d+1)^2`` multiply-adds, shared by
        ``ranks``) and is factored in ``(d+1)^3 / 3``. Several classes add
        the conjugate gradients' products
        (:func:`.curvature.form_newton_system`), :data:`NEWTON_PRODUCTS` an
        epoch, each reading the rows twice as a pass does once.
        """
        size = width + 1
        values = n_outputs * n_samples * size
        work = n_outputs * (n_samples * size * size / ranks + size**3 / 3)
        seconds = (
            self.newton_step
            + n_samples * self.newton_row
            + values * self.newton_value
            + work * self.curvature_value
        )
        if n_outputs > 1:
            seconds += NEWTON_PRODUCTS * 2 * self.pass_seconds(n_samples, width, n_outputs)
        return seconds


# The planner's profile per device type, from ``python benchmarks/bench_planner.py
# --calibrate --repeats 5`` (docs/tuning.md: on which machine; CUDA's is coarse).
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile(
        step=6.4e-5,
        outer=1.9e-4,
        inner_step=2.6e-5,
        value=5.4e-10,
        row=2.0e-8,
        pass_value=3.5e-10,
        pass_row=1.2e-8,
        sparse_step=1.8e-4,
        curvature_value=9.0e-12,
        newton_value=1.0e-9,
        newton_row=6.0e-9,
        newton_step=2.4e-4,
        sparse_pass_value=2.5e-9,
        sparse_pass_row=3.0e-8,
        sparse_kernel_value=1.5e-8,
        sparse_kernel_row=1.0e-7,
    ),
    "cuda": DeviceProfile(
        step=1.5e-4,
        outer=2.0e-4,
        inner_step=3.0e-5,
        value=5.0e-12,
        row=5.0e-11,
        pass_value=5.0e-12,
        pass_row=5.0e-11,
        sparse_step=3.0e-4,
        curvature_value=1.0e-12,
        newton_value=1.0e-11,
        newton_row=1.0e-10,
        newton_step=1.0e-3,
    ),
}


def measure_profile(
    policy: PrecisionPolicy, device: torch.device, family: Family | None = None
) -> DeviceProfile:
    """Time SVRG's steps and full pass on synthetic rows here: a :class:`DeviceProfile`.

    Plain steps at 16 and 2048 rows of 8 and 256 columns (a least-squares
    fit of the fixed and per-row prices), outer iterations of s = 2 and 8
    row steps at 16 rows, full passes over 131072 rows of both widths, the
    curvature of Newton epochs formed over 16 rows of 8 columns and 16384
    of 8 to 256, and plain steps on sparse rows (1000 columns, 1 % stored).
    The rows are preconditioned as they are read, as a float32 X in the
    fp32 policy is.
    """
    family = BinomialFamily() if family is None else family
    generator = torch.Generator().manual_seed(0)
    n_rows, widths, batches, small = 16384, (8, 256), (16, 2048), 16
    pass_rows = 1 << 17  # passes over more rows than the caches hold, as a fit's
    order = torch.randperm(n_rows, generator=generator).to(device)
    steps, passes = {}, {}
    for width in widths:
        X = torch.randn(pass_rows, width, generator=generator).to(device, policy.x_storage)
        passes[width] = quiet_seconds(_ProfiledFit(X, family, policy).full_pass, device, 5)
        X = X[:n_rows]
        fit = _ProfiledFit(X, family, policy)
        for b in batches:
            steps[b, width] = quiet_seconds(fit.step(order[:b]), device)
        if width == widths[0]:
            outer = {s: quiet_seconds(fit.outer(order, small, s), device) for s in (2, _TIMED_S)}
    # t(b, d) = step + b d value + b row, least squares over the four points.
    points = list(steps)
    fitted = _least_squares([[1.0, b * d, b] for b, d in points], [steps[p] for p in points])
    step, value, row = (max(v, 0.0) for v in fitted)
    per_row = widths[0] * value + row
    inner = max((outer[_TIMED_S] - outer[2]) / (_TIMED_S - 2) - small * per_row, 0.0)
    outer_fixed = max(outer[2] - 2 * (inner + small * per_row), 0.0)
    pass_value = (passes[widths[1]] - passes[widths[0]]) / (pass_rows * (widths[1] - widths[0]))
    pass_value = max(pass_value, 0.0)
    pass_row = max(passes[widths[0]] / pass_rows - widths[0] * pass_value, 0.0)
    # Newton epochs: forming the curvature (one more read of X, the weighted
    # rows and their products) at five shapes, the step's solve at the
    # snapshot of a full pass. The fit is relative: each shape's error
    # counts as a share of its time, so that the narrow shapes, where the
    # weighing rather than the products dominates, are fitted as well.
    design, forming = [], []
    for rows, width in ((small, 8), (n_rows, 8), (n_rows, 32), (n_rows, 64), (n_rows, 256)):
        X_rows = torch.randn(rows, width, generator=generator).to(device, policy.x_storage)
        curved = _ProfiledFit(X_rows, family, policy, newton=True)
        curved.full_pass()
        seconds = quiet_seconds(curved.form_curvature, device)
        size = width + 1
        shape = [1.0, rows, rows * size, rows * size * size + size**3 / 3]
        design.append([term / seconds for term in shape])
        forming.append(1.0)
        if rows == small:
            solve = quiet_seconds(curved.newton_step, device)
    fixed, newton_row, newton_value, curvature_value = (
        max(v, 0.0) for v in _least_squares(design, forming)
    )
    dense = torch.rand(n_rows, 1000, generator=generator)
    dense[dense > 0.01] = 0.0
    X_sparse = CSRMatrix.from_scipy(sp.csr_matrix(dense.numpy()), device, policy.x_storage)
    sparse = quiet_seconds(_ProfiledFit(X_sparse, family, policy).step(order[:small]), device)
    per_sparse_row = X_sparse.values.numel() / n_rows * value + row
    return DeviceProfile(
        step=step,
        outer=outer_fixed,
        inner_step=inner,
        value=value,
        row=row,
        pass_value=pass_value,
        pass_row=pass_row,
        sparse_step=max(sparse - small * per_sparse_row, 0.0),
        curvature_value=curvature_value,
        newton_value=newton_value,
        newton_row=newton_row,
        newton_step=fixed + solve,
    )


class _ProfiledFit:
    """An SVRG fit's steps and full pass on rows X, for :func:`measure_profile` to time."""

    def __init__(
        self,
        X: torch.Tensor | CSRMatrix,
        family: Family,
        policy: PrecisionPolicy,
        newton: bool = False,
    ):
        n_rows, width = X.shape
        device, acc, rec = X.device, policy.update_accumulate, policy.recurrence
        target = torch.zeros((n_rows, 1), dtype=rec, device=device)
        coef = torch.zeros((width, 1), dtype=policy.weight_storage, device=device)
        self.state = ModelState(coef, torch.zeros(1, dtype=rec, device=device))
        snapshot = Snapshot(torch.zeros_like(target), torch.zeros_like(coef), self.state.intercept)
        self.data = LocalData(X, target, torch.ones(n_rows, dtype=rec, device=device), snapshot)
        preconditioner = Preconditioner(
            torch.full((width,), 0.01, dtype=acc, device=device),
            torch.full((width,), 1.1, dtype=acc, device=device),
            1e-4,
            spread=torch.ones(width, dtype=acc, device=device),
        )
        row_steps = not isinstance(X, CSRMatrix)
        self.ctx = StepContext(
            family,
            policy,
            Penalty(1e-4),
            True,
            LocalCommunicator(),
            preconditioner,
            row_steps=row_steps,
            newton=newton,
        )

    def full_pass(self) -> None:
        snapshot, _ = full_pass(self.ctx, self.data, self.state, 0.0)
        self.data = replace(self.data, snapshot=snapshot)

    def form_curvature(self) -> None:
        self.newton_system = form_newton_system(self.ctx, self.data, self.state)

    def newton_step(self) -> None:
        gradient = full_gradient(self.ctx, self.data.snapshot)
        newton_step(self.ctx, self.state, gradient, 1e-6, self.newton_system)

    def step(self, rows: torch.Tensor):
        return lambda: sgd_step(self.ctx, self.data, self.state, rows, 1e-6, False)

    def outer(self, order: torch.Tensor, batch_size: int, s: int):
        group = (order[: s * batch_size], [batch_size] * s)

        def run():
            batch = gather_outer_batch(self.ctx, self.data, *group)
            ca_outer_iteration(self.ctx, self.data, self.state, batch, [1e-6] * s)

        return run


def _least_squares(design: list[list[float]], values: list[float]) -> list[float]:
    """The coefficients of the least-squares fit of ``values`` by the columns of ``design``."""
    matrix = torch.tensor(design, dtype=torch.float64)
    target = torch.tensor(values, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(matrix, target).solution[:, 0].tolist()


@dataclass(frozen=True)
class CommCosts:
    """All-reduce latency (seconds) and inverse bandwidth (seconds per byte)."""

    latency: float
    seconds_per_byte: float


def quiet_seconds(run, device: torch.device, repeats: int = _REPEATS) -> float:
    """Wall seconds of ``run()`` on a quiet machine: a fast one of ``repeats`` timed calls.

    Other processes on the cores only ever add time, in bursts (a rank
    waiting for a collective loses a scheduler slice to a busy process):
    the median of calls timed beside them grows with the load, the fastest
    tenth (:data:`QUIET_QUANTILE`) barely does (``docs/tuning.md``, "A busy
    machine"). The s chosen from these timings is then the s of a quiet
    machine, whether a process started beside busy ones or not.
    The device is synchronized around every call: without it a CUDA kernel
    (or NCCL collective) would be timed by its launch, and the model would
    pick a far too large s.
    """
    run()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[int(QUIET_QUANTILE * (repeats - 1))]


def measure_local(
    family: Family,
    policy: PrecisionPolicy,
    device: torch.device,
    batch_size: int,
    width: int,
    n_outputs: int,
    row_steps: bool = False,
    fused: bool = False,
) -> LocalCosts:
    """Time the kernels on synthetic data of this shape (cached per process).

    With ``row_steps`` the outer iterations run the row steps, which form no
    Gram (:attr:`StepContext.row_steps`), and with ``fused`` as one Triton
    kernel where it covers them.
    """
    # Timing is capped at 256 columns: the dispatch costs barely depend on the
    # width, and the Gram part is extrapolated through the measured GEMM rate.
    width = min(width, _MAX_TIMED_WIDTH)
    key = (
        type(family).__name__, policy.name, str(device), batch_size, width, n_outputs, row_steps,
        fused,
    )  # fmt: skip
    if key in _LOCAL_CACHE:
        return _LOCAL_CACHE[key]
    generator = torch.Generator().manual_seed(0)
    timed_batch = min(batch_size, _MAX_TIMED_BATCH)
    rows = max(_TIMED_S * timed_batch, 3 * batch_size)
    X = torch.randn(rows, width, generator=generator).to(device=device, dtype=policy.x_storage)
    target = torch.zeros((rows, n_outputs), dtype=policy.recurrence, device=device)
    target[:, 0] = 1.0
    data = LocalData(X, target, torch.ones(rows, dtype=policy.recurrence, device=device))
    state = ModelState(
        torch.zeros((width, n_outputs), dtype=policy.weight_storage, device=device),
        torch.zeros(n_outputs, dtype=policy.recurrence, device=device),
    )
    ctx = StepContext(
        family, policy, Penalty(1e-4), True, LocalCommunicator(), row_steps=row_steps,
        fused=row_steps and fused,
    )  # fmt: skip
    index = torch.arange(rows, device=device)

    def outer(s):
        group = (index[: s * timed_batch], [timed_batch] * s)

        def run():
            batch = gather_outer_batch(ctx, data, *group)
            ca_outer_iteration(ctx, data, state, batch, [1e-6] * s)

        return run

    t_sgd = quiet_seconds(lambda: sgd_step(ctx, data, state, index[:batch_size], 1e-6), device)
    t2, t8 = quiet_seconds(outer(2), device), quiet_seconds(outer(_TIMED_S), device)
    operand = gram_operand(X, policy)
    b = batch_size
    # A b x 2b block, about the size of the blocks at small s (and rates of
    # small GEMMs are what matters: large ones run near peak anyway).
    gemm_seconds = quiet_seconds(
        lambda: gram_block(operand[:b], operand[b : 3 * b], policy.gram_accumulate), device
    )
    # A rank without columns (more ranks than features) still times its steps.
    gemm_rate = 2 * b * b * max(width, 1) / max(gemm_seconds, 1e-9)

    def gram_seconds(s):
        return 0.0 if row_steps else timed_batch**2 * s * (s - 1) / 2 * width / gemm_rate

    inner = max((t8 - gram_seconds(8) - t2 + gram_seconds(2)) / (_TIMED_S - 2), 0.0)
    fixed = max(t2 - gram_seconds(2) - 2 * inner, 0.0)
    costs = LocalCosts(t_sgd, fixed, inner, gemm_rate)
    _LOCAL_CACHE[key] = costs
    return costs


def measure_comm(comm: Communicator, device: torch.device) -> CommCosts | None:
    """Latency and bandwidth of the group's all-reduce; None on one rank."""
    if comm.world_size == 1:
        return None
    small = torch.zeros(32, device=device)
    large = torch.zeros(1 << 16, device=device)  # 256 KiB
    with comm.keeping_the_core():
        t_small = quiet_seconds(lambda: comm.all_reduce(small), device, repeats=31)
        t_large = quiet_seconds(lambda: comm.all_reduce(large), device, repeats=31)
    per_byte = max((t_large - t_small) / (large.numel() * 4 - small.numel() * 4), 0.0)
    return CommCosts(latency=t_small, seconds_per_byte=per_byte)


# The collectives of a worker pool's ranks, processes of one machine, per
# device type: priced, not timed. A timing moves with the other processes'
# load and s follows it; priced, the same data gets the same s in every
# process. The 2-rank exchange's medians at 4 B and 1 MiB from
# ``python benchmarks/bench_collectives.py`` (docs/tuning.md, "A busy machine").
POOL_TRANSPORT: dict[str, CommCosts] = {
    "cpu": CommCosts(latency=2.1e-4, seconds_per_byte=8.6e-10),
}


@dataclass(frozen=True)
class FitShape:
    """What the model needs to know about a fit."""

    n_samples: int
    batch_size: int
    width: int  # columns of the widest rank's block
    n_outputs: int
    element_bytes: int = 4  # size of a communicated value (the policy's comm dtype)
    # The s whose steps run from the rows (one rank: every s; several: where
    # the rows are all-gathered), and what the all-gather moves per row, in
    # bytes of an all-reduce that costs the same (``P / 2`` times a rank's).
    row_step_s: frozenset[int] = frozenset()
    gather_bytes_per_row: float = 0.0


def predict_epoch_seconds(
    s: int,
    shape: FitShape,
    local: LocalCosts,
    comm: CommCosts | None,
    row_local: LocalCosts | None = None,
) -> float:
    """The model's time of one epoch with s steps per outer iteration.

    ``row_local`` are the costs timed on the row steps, for the s in
    ``shape.row_step_s`` (``local`` when None).
    """
    b, k = shape.batch_size, shape.n_outputs

    def communicate(values, element_bytes=shape.element_bytes):
        if comm is None:
            return 0.0
        return comm.latency + values * element_bytes * comm.seconds_per_byte

    n_batches = math.ceil(shape.n_samples / b)
    if s == 1:
        return n_batches * (local.sgd_step + communicate(b * k))
    if s in shape.row_step_s:
        rows = local if row_local is None else row_local
        exchange = (
            0.0 if comm is None else s * b * shape.gather_bytes_per_row * comm.seconds_per_byte
        )
        return math.ceil(n_batches / s) * (rows.outer_fixed + s * rows.inner_step + exchange)
    gram_values = b**2 * s * (s - 1) / 2
    gram_seconds = gram_values * shape.width / local.gemm_rate
    outer = (
        local.outer_fixed
        + s * local.inner_step
        + max(gram_seconds, communicate(gram_values + s * b * k))
    )
    return math.ceil(n_batches / s) * outer


def choose_s(
    shape: FitShape,
    local: LocalCosts,
    comm: CommCosts | None,
    row_local: LocalCosts | None = None,
) -> tuple[int, dict[int, float]]:
    """The largest s predicted within :data:`S_TIE_MARGIN` of the fastest, and every prediction.

    The model prices a collective at its latency; in a fit the ranks also
    wait for each other's compute, which costs every collective more, so
    fewer collectives are worth a little predicted time. And timed costs
    vary from process to process: where the model's curve is flat, the
    margin keeps the choice from following that noise.

    An outer iteration holds a few copies of its ``s b`` rows (gathered,
    preconditioned, the next one gathered during the collective): s is
    kept to at most ``1 / MAX_OUTER_SHARE`` of the rows, so that they stay
    a few percent of X.
    """
    max_rows = shape.n_samples * MAX_OUTER_SHARE
    candidates = [s for s in CANDIDATES if s == 1 or s * shape.batch_size <= max_rows]
    predictions = {s: predict_epoch_seconds(s, shape, local, comm, row_local) for s in candidates}
    near_fastest = min(predictions.values()) * (1 + S_TIE_MARGIN)
    return max(s for s in candidates if predictions[s] <= near_fastest), predictions
