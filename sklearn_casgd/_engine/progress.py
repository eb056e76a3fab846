"""Progress of the epoch loop: a tqdm bar with the current loss, or nothing."""

from __future__ import annotations

import sys


class EpochProgress:
    """Report epochs as they end; ``verbose=0`` is silent.

    With ``verbose >= 1`` a tqdm bar counts the epochs and shows the
    training loss, the step size and, where a stopping test on the gradient
    decides the end (SVRG), the gradient's largest entry against its bound.
    The bar has no total while it runs (the test, not ``max_iter``, ends
    most fits: a total of ``max_iter`` promised hours), and ends at the
    epochs run ("42/42"). Without tqdm installed, one line per epoch is
    printed instead. Only rank 0 of a distributed fit reports. ``done``
    epochs were run before (a resumed checkpoint).
    """

    def __init__(self, verbose: int, done: int = 0) -> None:
        self.verbose = verbose
        self.bar = None
        if not verbose:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=None, initial=done, desc="CA-SGD", unit="epoch", file=sys.stdout)

    def update(
        self,
        epoch: int,
        loss: float,
        step_size: float,
        gradient: float | None = None,
        bound: float | None = None,
    ) -> None:
        """Epoch ``epoch`` ended at ``loss``; ``gradient`` and its stopping ``bound`` if tested."""
        toward = None if gradient is None or bound is None else f"{gradient:.2g}/{bound:.2g}"
        if self.bar is not None:
            postfix = {"loss": f"{loss:.6g}", "step": f"{step_size:.3g}"}
            if toward is not None:
                postfix["gradient"] = toward
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif self.verbose:
            line = f"-- Epoch {epoch + 1}, loss {loss:.6g}, step size {step_size:.4g}"
            if toward is not None:
                line += f", gradient {toward}"
            print(line, flush=True)

    def close(self) -> None:
        """End the bar at the epochs run."""
        if self.bar is not None:
            self.bar.total = self.bar.n  # close() draws the bar once more, with it
            self.bar.close()
