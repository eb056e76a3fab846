"""Outer iterations replayed from CUDA graphs: a few launches each instead of ~170.

On one GPU the engine is launch-bound: an outer iteration launched from
Python takes several times its device work (``docs/tuning.md``,
``CUDA_GRAPHS``). :class:`OuterGraphs` captures the outer
iteration of a fit's shape once and replays it for every outer iteration of
that shape: the host then copies the rows' indices into the graph's buffer,
the step coefficients when they changed, and launches the replay.

What a graph reads must stay at the addresses it was captured with, so the
rows, the step coefficients, the SVRG snapshot and the loss live in buffers
of the graph's own, filled before each replay (the snapshot once an
epoch); the weights are updated in place as everywhere. An outer iteration
of another shape (an epoch's ragged tail) runs as before.

On the CPU there are no CUDA graphs: the same buffers feed the same
function, called eagerly, which is how the tests hold this path to the
plain loop without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .batch import gather_outer_batch
from .recurrence import ca_outer_iteration, step_coefficients
from .state import LocalData, ModelState, Snapshot, StepContext

_CAPTURE_LOCK = threading.Lock()


class _Captured:
    """One outer-iteration shape: captured on its first run (CUDA), or called eagerly (CPU)."""

    def __init__(
        self,
        ctx: StepContext,
        data: LocalData,
        state: ModelState,
        sizes: Sequence[int],
        loss: torch.Tensor,
        rows_dtype: torch.dtype,
    ) -> None:
        device = data.X.device
        self.sizes = list(sizes)
        self.state = state
        self.loss = loss
        self.rows = torch.zeros(sum(sizes), dtype=rows_dtype, device=device)
        self.coefficients = torch.zeros(
            (5, len(sizes) + 1), dtype=ctx.policy.recurrence, device=device
        )
        self.last_coefficients: torch.Tensor | None = None

        def outer_iteration() -> None:
            batch = gather_outer_batch(ctx, data, self.rows, self.sizes)
            loss_sum, _ = ca_outer_iteration(ctx, data, state, batch, self.coefficients)
            loss.add_(loss_sum)

        self.outer_iteration = outer_iteration
        self.replay: Callable[[], None] | None = None if device.type == "cuda" else outer_iteration

    def run(self, rows: torch.Tensor, coefficients: torch.Tensor) -> None:
        self.rows.copy_(rows)
        # step_coefficients hands out one tensor per distinct steps: a constant
        # step copies once an epoch.
        if coefficients is not self.last_coefficients:
            self.coefficients.copy_(coefficients)
            self.last_coefficients = coefficients
        if self.replay is None:  # captured with this run's rows and steps in the buffers
            self.replay = capture(self.outer_iteration, self.state, self.loss, self.rows.device)
        self.replay()


def capture(
    outer_iteration: Callable[[], None],
    state: ModelState,
    loss: torch.Tensor,
    device: torch.device,
) -> Callable[[], None]:
    """``outer_iteration`` captured in a CUDA graph; its ``replay``.

    Two warm-up calls on a side stream first (cuBLAS workspaces, Triton's
    and inductor's first launches), as CUDA graphs need; they must not move
    the fit, so the weights and the loss are put back after them.
    """
    kept = (state.coef.clone(), state.intercept.clone(), loss.clone())
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            outer_iteration()
    torch.cuda.current_stream(device).wait_stream(side)
    state.coef.copy_(kept[0])
    state.intercept.copy_(kept[1])
    loss.copy_(kept[2])
    graph = torch.cuda.CUDAGraph()
    # Thread-local: CUDA work of another thread (a fit of a threaded
    # GridSearchCV) does not invalidate this capture; one capture at a time.
    with _CAPTURE_LOCK, torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outer_iteration()
    return graph.replay


class OuterGraphs:
    """The captured outer iterations of one fit on one device, by batch sizes.

    :meth:`begin_epoch` before each epoch, then :meth:`run` for each outer
    iteration; :attr:`loss` holds the epoch's weighted loss sum of the
    outer iterations run here. Only the first shape met is captured (an
    epoch's full outer iterations): others return False from :meth:`run`
    and run as before.
    """

    def __init__(self, ctx: StepContext, data: LocalData, state: ModelState) -> None:
        self.ctx = ctx
        self.state = state
        snapshot = data.snapshot
        self.snapshot = None
        if snapshot is not None:
            self.snapshot = Snapshot(
                torch.empty_like(snapshot.gradient),
                torch.empty_like(snapshot.mean_gradient),
                torch.empty_like(snapshot.mean_gradient_intercept),
            )
        self.data = replace(data, snapshot=self.snapshot)
        self.loss = torch.zeros((), dtype=ctx.policy.recurrence, device=data.X.device)
        self.captured: _Captured | None = None

    def begin_epoch(self, data: LocalData) -> None:
        """Take ``data``'s snapshot into the graphs' buffers and zero the loss."""
        here = (data.X, data.target, data.sample_weight)
        captured = (self.data.X, self.data.target, self.data.sample_weight)
        if any(a is not b for a, b in zip(here, captured, strict=True)):
            raise RuntimeError("CUDA graphs were captured on other rows than this epoch's.")
        if self.snapshot is not None:
            self.snapshot.gradient.copy_(data.snapshot.gradient)
            self.snapshot.mean_gradient.copy_(data.snapshot.mean_gradient)
            self.snapshot.mean_gradient_intercept.copy_(data.snapshot.mean_gradient_intercept)
        self.loss.zero_()

    def run(self, rows: torch.Tensor, sizes: Sequence[int], etas: Sequence[float]) -> bool:
        """Replay the outer iteration of ``sizes`` on ``rows``; False if it is not captured."""
        if self.captured is None:
            self.captured = _Captured(self.ctx, self.data, self.state, sizes, self.loss, rows.dtype)
        elif list(sizes) != self.captured.sizes:
            return False
        policy = self.ctx.policy
        coefficients = step_coefficients(
            etas, sizes, self.ctx.decay_alpha, policy.recurrence, rows.device
        )
        self.captured.run(rows, coefficients)
        return True
