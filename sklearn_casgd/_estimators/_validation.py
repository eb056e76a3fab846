"""Input handling shared by the estimators: devices, arrays, weights, data scales."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.utils.validation import _check_sample_weight

# Values per chunk when scanning X: the float64 temporaries of a chunk stay
# around 1 MiB whatever the width, and the scan never copies the whole array.
_SCAN_VALUES = 1 << 17


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


def largest_abs(X, center: np.ndarray | None = None, scale: np.ndarray | None = None) -> float:
    """Largest absolute value of X, by chunks (no ``|X|`` copy); of the stored values if sparse.

    With ``center`` m and ``scale`` D (dense X), of ``(x - m) / D``.
    """
    if sp.issparse(X):
        return float(np.abs(X.data).max(initial=0.0))
    largest = 0.0
    rows = max(1, _SCAN_VALUES // max(1, X.shape[1]))
    for start in range(0, X.shape[0], rows):
        chunk = X[start : start + rows]
        if scale is not None:
            chunk = (chunk - center) / scale
        largest = max(largest, float(chunk.max()), -float(chunk.min()))
    return largest


def check_sample_weight(sample_weight, X: np.ndarray) -> np.ndarray:
    """Float64 weights of length n, finite, non-negative and not all zero."""
    return _check_sample_weight(sample_weight, X, dtype=np.float64, ensure_non_negative=True)
