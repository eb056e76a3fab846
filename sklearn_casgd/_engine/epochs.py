"""One epoch's walk: the row order, its outer iterations, and the steps over them.

:func:`one_epoch` runs an epoch's outer iterations as the step context
says (plain steps, s-step outer iterations, CUDA graphs, the epoch kernel,
or a row exchange with the rows sent ahead); :func:`compile_kernels` runs
the fit's shapes once before the clock starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from . import epoch_kernel
from .batch import OuterBatch, gather_outer_batch
from .comm import PendingReduce
from .exchange import outer_per_exchange, replicate_weights, start_row_exchange
from .graphs import OuterGraphs
from .permutation import draw_keys, feistel_order
from .recurrence import ca_outer_iteration, sgd_step, warm_up
from .solver_state import SolverConfig, StepSchedule
from .state import LocalData, ModelState, Snapshot, StepContext

_CPU = torch.device("cpu")


def order_dtype(n_samples: int) -> torch.dtype:
    """The dtype of an epoch's row indices: int32 where they fit."""
    return torch.int32 if n_samples <= torch.iinfo(torch.int32).max else torch.int64


def draw_epoch_order(
    n_samples: int,
    shuffle: bool,
    generator: torch.Generator,
    device: torch.device = _CPU,
    on_device: bool = False,
) -> torch.Tensor:
    """Row order of one epoch, on ``device``, from the fit's (CPU) ``generator``.

    int32 indices where they fit: half the memory, and the same permutation.
    ``on_device`` (``StepContext.device_order``): a Feistel permutation
    computed there (:mod:`.permutation`); else ``torch.randperm`` draws it
    on the CPU (copied from pinned memory to a CUDA device, so that the copy
    does not stop the host).
    """
    dtype = order_dtype(n_samples)
    if not shuffle:
        return torch.arange(n_samples, dtype=dtype, device=device)
    if on_device:
        return feistel_order(n_samples, draw_keys(generator), device, dtype)
    order = torch.randperm(n_samples, generator=generator, dtype=dtype)
    if device.type == "cuda":
        return order.pin_memory().to(device, non_blocking=True)
    return order.to(device)


def batch_sizes(n_samples: int, batch_size: int) -> list[int]:
    """The sizes of an epoch's batches, a ragged last one included."""
    full, tail = divmod(n_samples, batch_size)
    return [batch_size] * full + ([tail] if tail else [])


class OuterGroups(Sequence):
    """An epoch's outer iterations as ``(rows, batch sizes)``, each row slice taken when read.

    ``plan`` is :func:`outer_iterations`'; ``order`` the epoch's row order.
    A list of the slices held one tensor object an outer iteration: 3.5 MB
    for 1e6 rows at b = 256, 0.014x a 1e6 x 64 float32 X's bytes.
    """

    def __init__(self, order: torch.Tensor, plan: Sequence[tuple[int, list[int]]]) -> None:
        self.order, self.plan = order, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start, sizes = self.plan[index]
        return self.order[start : start + sum(sizes)], sizes


def outer_iterations(n_samples: int, batch_size: int, s: int) -> OuterPlan:
    """``(start row, batch sizes)`` of each outer iteration of an epoch, tail included."""
    return OuterPlan(n_samples, batch_size, s)


class OuterPlan(Sequence):
    """:func:`outer_iterations`, each entry formed when read.

    Groups of ``s`` batches of ``batch_size`` rows, the last batch ragged
    and the last group short. A list of the entries held about 200 bytes
    an outer iteration (0.8 MB for 1e6 rows at b = 256, beside the 4 MB
    epoch order).
    """

    def __init__(self, n_samples: int, batch_size: int, s: int) -> None:
        self.n_samples, self.batch_size, self.s = n_samples, batch_size, s
        self.n_batches = -(-n_samples // batch_size) if n_samples else 0

    def __len__(self) -> int:
        return -(-self.n_batches // self.s)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        first = index * self.s
        sizes = [
            min(self.batch_size, self.n_samples - batch * self.batch_size)
            for batch in range(first, min(first + self.s, self.n_batches))
        ]
        return first * self.batch_size, sizes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


def with_zero_snapshot(data: LocalData, state: ModelState, config: SolverConfig) -> LocalData:
    """``data`` with a snapshot of zeros under SVRG: a warm-up launch's control variate."""
    if config.solver != "svrg":
        return data
    zeros = Snapshot(
        torch.zeros_like(data.target),
        torch.zeros_like(state.coef),
        torch.zeros_like(state.intercept),
    )
    return replace(data, snapshot=zeros)


def compile_kernels(
    ctx: StepContext, data: LocalData, state: ModelState, config: SolverConfig
) -> StepContext:
    """Compile the kernels of the fit's outer-iteration shape; ``ctx`` back.

    The torch steps with ``ctx.compiled``; the fused kernel (``ctx.fused``),
    which Triton compiles at its first launch, otherwise.

    Runs the shape once on index zero (nothing changes), with a snapshot of
    zeros for SVRG: compiling is start-up, like starting the ranks, so it
    happens before the epochs' clock starts. An epoch whose rows do not
    fill its last s batches ends with an outer iteration of its own shape:
    that one runs once per epoch, so it stays eager (the returned context's
    ``eager_sizes``) instead of costing seconds of compiling, and the folds
    of a cross-validation, whose tails differ, compile nothing new.
    """
    n_samples = data.X.shape[0]
    data = with_zero_snapshot(data, state, config)
    plan = outer_iterations(n_samples, config.batch_size, config.s)
    first, tail = tuple(plan[0][1]), tuple(plan[-1][1])
    ctx = replace(ctx, eager_sizes=frozenset({tail} if tail != first else ()))
    rows = torch.zeros(sum(first), dtype=order_dtype(n_samples), device=data.X.device)
    warm_up(ctx, data, state, rows, list(first))
    return ctx


def one_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    groups: Sequence[tuple[torch.Tensor, list[int]]],
    schedule: StepSchedule,
    first_step: int,
    config: SolverConfig,
    graphs: OuterGraphs | None = None,
) -> torch.Tensor:
    """Run the outer iterations ``(rows, batch sizes)`` of one epoch; the weighted loss sum.

    SVRG, which measures its objective in the full pass, does not use the
    sum: its plain steps (s=1) skip the loss and leave it 0. With
    ``ctx.epoch_kernel`` the epoch is :func:`kernel_epoch`'s. With
    ``graphs`` the outer iterations of the captured shape replay from it,
    and the others (a ragged tail) run as without; plain SGD's eager steps
    (s=1, not compiled) do not use them. With a row exchange see
    :func:`gathered_epoch` (at s=1 too: an L1 part's steps, whose rows
    travel ahead of them).
    """
    epoch_loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
    step = first_step
    if config.s == 1 and not ctx.compiled and ctx.exchange is None:
        # SVRG's objective comes from its full pass: its steps skip the loss.
        with_loss = config.solver != "svrg"
        for rows, sizes in groups:
            eta = schedule.step_sizes(step, sizes, config.batch_size)[0]
            loss = sgd_step(ctx, data, state, rows, eta, with_loss)
            if with_loss:
                epoch_loss += loss
            step += 1
        return epoch_loss
    if graphs is not None:
        graphs.begin_epoch(data)
        for rows, sizes in groups:
            etas = schedule.step_sizes(step, sizes, config.batch_size)
            step += len(sizes)
            if not graphs.run(rows, sizes, etas):
                batch = gather_outer_batch(ctx, data, rows, sizes)
                epoch_loss += ca_outer_iteration(ctx, data, state, batch, etas)[0]
        return epoch_loss + graphs.loss
    if ctx.exchange is not None:
        return gathered_epoch(ctx, data, state, groups, schedule, first_step, config)
    batch = gather_outer_batch(ctx, data, *groups[0])
    for i, (_, sizes) in enumerate(groups):
        upcoming = groups[i + 1] if i + 1 < len(groups) else None
        etas = schedule.step_sizes(step, sizes, config.batch_size)
        loss_sum, batch = ca_outer_iteration(ctx, data, state, batch, etas, upcoming)
        epoch_loss += loss_sum
        step += len(sizes)
    return epoch_loss


def kernel_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    order: torch.Tensor,
    sizes: list[int],
    schedule: StepSchedule,
    first_step: int,
    config: SolverConfig,
) -> torch.Tensor:
    """:func:`one_epoch` with ``ctx.epoch_kernel``: every step over ``order`` in one launch.

    ``sizes`` are the batches' (:func:`batch_sizes`); SVRG's loss sum is 0.
    """
    epoch_loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
    etas = schedule.step_sizes(first_step, sizes, config.batch_size)
    with_loss = config.solver != "svrg"
    loss = epoch_kernel.run_epoch(ctx, data, state, order, etas, config.batch_size, with_loss)
    return epoch_loss if loss is None else epoch_loss + loss


def gathered_epoch(
    ctx: StepContext,
    data: LocalData,
    state: ModelState,
    groups: Sequence[tuple[torch.Tensor, list[int]]],
    schedule: StepSchedule,
    first_step: int,
    config: SolverConfig,
) -> torch.Tensor:
    """:func:`one_epoch` with a :class:`.state.RowExchange`: the rows travel ahead.

    The epoch starts from every rank's weights (:func:`replicate_weights`).
    The outer iterations go in runs of :func:`outer_per_exchange`, whose
    rows one all-gather carries; a run's steps run while the next run's
    rows are in flight.
    """
    data = replace(data, snapshot=replicate_weights(ctx, state, data.snapshot))
    per_exchange = outer_per_exchange(ctx.exchange, sum(groups[0][1]), ctx.policy.gram_input)
    runs = [groups[i : i + per_exchange] for i in range(0, len(groups), per_exchange)]

    def start(run: list[tuple[torch.Tensor, list[int]]]) -> tuple[list[OuterBatch], PendingReduce]:
        batches = [gather_outer_batch(ctx, data, rows, sizes) for rows, sizes in run]
        return batches, start_row_exchange(ctx, batches)

    epoch_loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
    step = first_step
    batches, pending = start(runs[0])
    for i in range(len(runs)):
        pending.wait()
        following = start(runs[i + 1]) if i + 1 < len(runs) else None
        for batch in batches:
            etas = schedule.step_sizes(step, batch.sizes, config.batch_size)
            epoch_loss += ca_outer_iteration(ctx, data, state, batch, etas)[0]
            step += len(batch.sizes)
        if following is not None:
            batches, pending = following
    return epoch_loss


def epoch_objective(
    ctx: StepContext,
    state: ModelState,
    epoch_loss: torch.Tensor,
    loss_offset: float,
    n_samples: int,
) -> float:
    """Mean training loss of the epoch plus the penalty at its end."""
    stats = torch.cat([epoch_loss.to(torch.float64).reshape(1), ctx.penalty.norms(state.coef)])
    # Only the penalty differs between ranks; the loss is replicated.
    stats[0] /= ctx.comm.world_size
    ctx.comm.all_reduce(stats)
    return float((stats[0].item() + loss_offset) / n_samples + ctx.penalty.value(stats[1:]))
