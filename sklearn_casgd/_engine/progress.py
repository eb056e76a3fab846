"""Progress of the epoch loop: a tqdm bar with the current loss, or nothing."""

from __future__ import annotations

import sys


class EpochProgress:
    """Report epochs as they end; ``verbose=0`` is silent.

    With ``verbose >= 1`` a tqdm bar over ``max_iter`` epochs shows the
    training loss and step size; without tqdm installed, one line per epoch
    is printed instead. Only rank 0 of a distributed fit reports. ``done``
    epochs were run before (a resumed checkpoint).
    """

    def __init__(self, max_iter: int, verbose: int, done: int = 0) -> None:
        self.verbose = verbose
        self.bar = None
        if not verbose:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=max_iter, initial=done, desc="CA-SGD", unit="epoch", file=sys.stdout)

    def update(self, epoch: int, loss: float, step_size: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.6g}", step=f"{step_size:.3g}", refresh=False)
            self.bar.update(1)
        elif self.verbose:
            print(f"-- Epoch {epoch + 1}, loss {loss:.6g}, step size {step_size:.4g}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
