"""One epoch of minibatch steps on CSR rows as one compiled loop, on the CPU (numba).

The torch steps on sparse rows (:func:`.._engine.recurrence.sgd_step`) take
~40 small operations a step, each with its own overhead, multiply all d
weights by the L2 decay and subtract SVRG's dense control variate from
all d of them. Here one compiled loop walks the epoch's batches, touching
only their nonzero columns, the decay and the control variate O(1) a
step (the weights' form is in :mod:`.sparse_kernel`). It takes the same
steps as :func:`.._engine.recurrence.sgd_step`, in float64 (the tests hold
it to the torch steps to 1e-12 in a float64 fit).

numba is optional (``pip install sklearn_casgd[sparse]``) and imported only
when the kernel first runs; without it the torch steps run. Its compiled
code is cached on disk, so a process compiles only the dtypes it has not
seen before (a few seconds each, once a machine).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
import torch

from .._data.storage import Centering, CSRMatrix
from .._glm.families import Family

# The storage dtypes of X's values the kernel reads (float16 has no numba type).
_VALUE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def available() -> bool:
    """Whether numba is installed."""
    return importlib.util.find_spec("numba") is not None


def _kernels():
    """The numba kernels' module (imported on first use: numba's import takes time)."""
    from . import sparse_kernel

    return sparse_kernel


def supports(family: Family, X: CSRMatrix) -> bool:
    """Whether the kernel covers this family and CSR matrix (a CPU one, a covered dtype)."""
    return (
        family.kernel_code is not None
        and X.device.type == "cpu"
        and X.dtype in _VALUE_DTYPES
        and X.shape[0] > 0
    )


def has_duplicates(X: sp.csr_matrix) -> bool | None:
    """Whether a row of X stores a column twice (O(nnz), no copy); None without numba."""
    if not available():
        return None
    kernel = _kernels().has_duplicates
    indptr, indices = X.indptr, X.indices
    if indptr.dtype != indices.dtype:  # one signature: int64 row pointers only if needed
        indptr = indptr.astype(indices.dtype)
    return bool(kernel(indptr, indices, X.shape[1]))


def _float64(tensor: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
    """``tensor`` as a float64 numpy array (shared where it already is one); empty for None."""
    if tensor is None:
        return np.zeros(shape)
    return tensor.detach().to(torch.float64).contiguous().numpy()


def epoch_steps(
    family: Family,
    X: CSRMatrix,
    order: torch.Tensor,
    target: torch.Tensor,
    sample_weight: torch.Tensor,
    coef: torch.Tensor,
    intercept: torch.Tensor,
    etas: Sequence[float],
    batch_size: int,
    decay_alpha: float,
    fit_intercept: bool,
    centering: Centering | None,
    snapshot_gradient: torch.Tensor | None,
    mean_gradient: torch.Tensor | None,
    mean_gradient_intercept: torch.Tensor | None,
    with_loss: bool,
    l1: float = 0.0,
) -> torch.Tensor | None:
    """The steps over the rows ``order`` at ``etas``; ``coef`` and ``intercept`` updated in place.

    Batches of ``batch_size`` rows (the last may be shorter), one step size
    each. With ``centering`` the rows are ``(x - m) D^{-1}``, with
    ``mean_gradient`` (SVRG) each step subtracts the control variate, and
    with ``l1`` > 0 each step ends with the L1 part's proximal step
    (:mod:`.sparse_prox_kernel`; rows as stored only).
    Returns the weighted loss sum of the steps as a 0-d tensor in
    ``target``'s dtype (``with_loss``), else None.
    """
    if l1 > 0.0 and centering is not None:
        raise ValueError("The proximal steps read the rows as stored: no centering.")
    k = coef.shape[1]
    values = X.values
    bf16 = values.dtype == torch.bfloat16
    values_array = values.view(torch.int16).numpy().view(np.uint16) if bf16 else values.numpy()
    # The kernel writes the new weights into these (coef's own memory where it is float64).
    weights, biases = _float64(coef, ()), _float64(intercept, ())
    # The arguments both kernels take first and last.
    rows = (
        X.crow.numpy(),
        X.col.numpy(),
        values_array,
        order.to(torch.int64).numpy(),
        _float64(target, ()),
        _float64(sample_weight, ()),
        weights,
        biases,
        np.asarray(etas, dtype=np.float64),
        batch_size,
        float(decay_alpha),
    )
    control_variate = (
        _float64(snapshot_gradient, (0, k)),
        _float64(mean_gradient, (0, k)),
        _float64(mean_gradient_intercept, (k,)),
        with_loss,
    )
    family_code = (family.kernel_code, float(family.kernel_power))
    if l1 > 0.0:
        _kernels()
        from .sparse_prox_kernel import epoch_prox_steps

        loss = epoch_prox_steps(*rows, float(l1), fit_intercept, *family_code, *control_variate)
    else:
        loss = _kernels().epoch_steps(
            *rows,
            fit_intercept,
            *family_code,
            _float64(None if centering is None else centering.inverse_scale, (0,)),
            _float64(None if centering is None else centering.shift[:, None], (0, 1)),
            *control_variate,
        )
    if weights.ctypes.data != coef.data_ptr():
        coef.copy_(torch.from_numpy(weights))
    if biases.ctypes.data != intercept.data_ptr():
        intercept.copy_(torch.from_numpy(biases))
    if not with_loss:
        return None
    return torch.tensor(loss, dtype=target.dtype)
