"""Input handling shared by the estimators: devices and weights."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.utils.validation import _check_sample_weight, _num_samples


def resolve_device(device: str) -> torch.device:
    """``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` to a checked ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}.")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} was requested but CUDA is not available.")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r} does not exist: {torch.cuda.device_count()} CUDA "
                "device(s) are visible."
            )
    return resolved


def check_sample_weight(sample_weight, X: np.ndarray) -> np.ndarray:
    """Float64 weights of length n, finite, non-negative and not all zero.

    No weights are ones as a read-only view of a single value: n float64
    ones held for the whole fit were 3 % of a 1e6 x 64 float32 X's bytes.
    """
    if sample_weight is None:
        return np.broadcast_to(np.float64(1.0), (_num_samples(X),))
    return _check_sample_weight(sample_weight, X, dtype=np.float64, ensure_non_negative=True)
