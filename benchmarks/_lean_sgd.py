"""A lean FP32 minibatch SGD loop on one device: the fair baseline for ``bench_gpu.py``.

What a GPU engineer would write for binary logistic regression, and nothing
else: per step two ``index_select`` (the batch's rows and labels), ``addmv``
for the margins, ``sigmoid``, ``sub``, a scale, ``addmv_`` of ``X_b^T r``
with the L2 decay as its ``beta``, and a ``sum`` for the intercept (about
nine kernels). The same steps run three ways:

* ``"eager"``: one Python call per step;
* ``"graphed"`` (CUDA): :data:`STEPS_PER_GRAPH` steps captured in one CUDA
  graph, replayed with each group's rows copied into its static index
  buffer; the ragged tail runs eagerly;
* ``"compiled"``: the step through ``torch.compile``, and on CUDA graphed
  as above.

Each step is ``coef <- (1 - eta alpha) coef - (eta / b) X_b^T (sigmoid(X_b
coef + beta) - y_b)``, ``beta <- beta - (eta / b) sum(...)``: the engine's
plain SGD (``docs/design.md``, section 2), so that speedups against it
compare the same arithmetic.
"""

from __future__ import annotations

import torch

STEPS_PER_GRAPH = 128
MODES = ("eager", "graphed", "compiled")


class LeanSGD:
    """Binary logistic minibatch SGD on ``X`` (n, d) and labels ``y`` (n,), on X's device."""

    def __init__(
        self, X: torch.Tensor, y: torch.Tensor, *, eta: float, alpha: float, batch_size: int
    ):
        self.X, self.y = X, y.to(X.dtype)
        self.eta, self.alpha, self.batch_size = eta, alpha, batch_size
        self.coef = torch.zeros(X.shape[1], dtype=X.dtype, device=X.device)
        self.intercept = torch.zeros((), dtype=X.dtype, device=X.device)
        self._compiled = None
        self._graphs: dict[str, tuple] = {}

    def step(self, rows: torch.Tensor) -> None:
        """One SGD step on the rows ``rows`` (a full batch: the scale is ``eta / b``)."""
        self._step(self.X, self.y, self.coef, self.intercept, rows)

    def _step(self, X, y, coef, intercept, rows) -> None:
        batch = X.index_select(0, rows)
        residual = torch.sigmoid(torch.addmv(intercept, batch, coef)) - y.index_select(0, rows)
        residual.mul_(self.eta / rows.shape[0])
        coef.addmv_(batch.t(), residual, beta=1.0 - self.eta * self.alpha, alpha=-1.0)
        intercept.sub_(residual.sum())

    def epoch(self, order: torch.Tensor, mode: str = "eager") -> None:
        """Steps over ``order`` (row indices on X's device) in batches of ``batch_size``.

        ``mode``: ``"eager"``, ``"graphed"`` (eager off CUDA) or ``"compiled"``.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        b = self.batch_size
        full = order.shape[0] // b
        done = self._replay(order, full, mode) if self.X.is_cuda and mode != "eager" else 0
        step = self._compiled_step if mode == "compiled" else self.step
        for i in range(done, full):
            step(order[i * b : (i + 1) * b])
        if full * b < order.shape[0]:  # the ragged tail, eagerly (its own scale)
            self.step(order[full * b :])

    def _compiled_step(self, rows: torch.Tensor) -> None:
        if self._compiled is None:
            self._compiled = torch.compile(self._step, dynamic=False)
        self._compiled(self.X, self.y, self.coef, self.intercept, rows)

    def _replay(self, order: torch.Tensor, full: int, mode: str) -> int:
        """Replay groups of :data:`STEPS_PER_GRAPH` steps from one CUDA graph; steps done."""
        b, k = self.batch_size, STEPS_PER_GRAPH
        groups = full // k
        if not groups:
            return 0
        graph, static_rows = self._graphs.get(mode) or self._capture(mode, order.dtype)
        for g in range(groups):
            static_rows.copy_(order[g * k * b : (g + 1) * k * b].view(k, b))
            graph.replay()
        return groups * k

    def _capture(self, mode: str, dtype: torch.dtype):
        """Capture STEPS_PER_GRAPH steps on static index buffers (weights restored after)."""
        step = self._compiled_step if mode == "compiled" else self.step
        static_rows = torch.zeros(
            (STEPS_PER_GRAPH, self.batch_size), dtype=dtype, device=self.X.device
        )
        kept = self.coef.clone(), self.intercept.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (allocations, autotuning)
            for rows in static_rows[:3]:
                step(rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for rows in static_rows:
                step(rows)
        self.coef.copy_(kept[0])
        self.intercept.copy_(kept[1])
        self._graphs[mode] = graph, static_rows
        return graph, static_rows

    def loss(self) -> float:
        """The objective: mean log loss plus ``alpha / 2 ||coef||^2``."""
        margins = torch.addmv(self.intercept, self.X, self.coef)
        log_loss = torch.nn.functional.binary_cross_entropy_with_logits(margins, self.y)
        return float(log_loss + 0.5 * self.alpha * self.coef.square().sum())
