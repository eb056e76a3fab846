"""The numba code of :mod:`.sparse_steps`: an epoch of minibatch steps on CSR rows.

Imported only where numba is installed (the ``sparse`` extra). The weights
are held as ``w = a v + B mu + q c^T``: ``a`` the L2 decay's running
product (lazily scaled weights: the decay is O(1) a step), ``B`` the
weight of SVRG's dense control variate ``mu`` (``B <- decay B - eta``: the
term costs O(1) a step, not O(d)), and ``c`` the weight of the centering
shift ``q = m / D`` of preconditioned rows (``Y~^T r = Z^T r - q 1^T r``:
its dense part folds into ``c``). A step reads and writes only the
batch's nonzero columns of ``v``; ``q . v`` is kept up to date with
them. Every value is computed in float64, whatever X's storage dtype.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .._glm.families import (
    KERNEL_BINOMIAL,
    KERNEL_MULTINOMIAL,
    KERNEL_SQUARED,
    KERNEL_TWEEDIE,
)
from . import numba_cache  # noqa: F401  (before the kernels are defined: their cache folder)

# v is folded back into a scale of 1 when the scale falls under this: the
# steps divide by it, and 1e-9 keeps their quotients far from overflow.
SMALLEST_SCALE = 1e-9


@numba.njit(cache=True, inline="always")
def _softplus(z: float) -> float:
    if z > 0.0:
        return z + math.log1p(math.exp(-z))
    return math.log1p(math.exp(z))


@numba.njit(cache=True, inline="always")
def _sigmoid(z: float) -> float:
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@numba.njit(cache=True)
def _loss_and_gradient(family, power, raw, target, out, with_loss):
    """Row loss (0 unless ``with_loss``) and ``dl/dz`` of one row's raw predictions into ``out``."""
    k = raw.shape[0]
    loss = 0.0
    if family == KERNEL_MULTINOMIAL:
        top = raw[0]
        for o in range(1, k):
            top = max(top, raw[o])
        total = 0.0
        for o in range(k):
            out[o] = math.exp(raw[o] - top)
            total += out[o]
        for o in range(k):
            out[o] = out[o] / total - target[o]
        if with_loss:
            loss = top + math.log(total)
            for o in range(k):
                loss -= raw[o] * target[o]
        return loss
    z, y = raw[0], target[0]
    if family == KERNEL_BINOMIAL:
        out[0] = _sigmoid(z) - y
        if with_loss:
            loss = _softplus(z) - y * z
    elif family == KERNEL_SQUARED:
        out[0] = z - y
        if with_loss:
            loss = 0.5 * (z - y) * (z - y)
    elif family == KERNEL_TWEEDIE:
        if power == 1.0:
            out[0] = math.exp(z) - y
            if with_loss:
                loss = math.exp(z) - y * z
        elif power == 2.0:
            out[0] = 1.0 - y * math.exp(-z)
            if with_loss:
                loss = z + y * math.exp(-z)
        else:
            upper, lower = math.exp((2.0 - power) * z), math.exp((1.0 - power) * z)
            out[0] = upper - y * lower
            if with_loss:
                loss = upper / (2.0 - power) - y * lower / (1.0 - power)
    return loss


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask the cache for ``array[index]`` ahead of its use (LLVM's prefetch: no load, no fault)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_pointer = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]),
            "llvm.prefetch.p0i8",
        )
        address = builder.bitcast(builder.gep(data, [args[1]]), byte_pointer)
        # A read, kept in every cache level, of data (not instructions).
        builder.call(prefetch, [address, int32(0), int32(3), int32(1)])
        return context.get_dummy_value()

    return types.none(array, index), codegen


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are ``bits`` (a uint32), as C's bit cast."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def _value(values, p):
    """Stored value ``p`` as a float64: bfloat16 values arrive as their 16 bits (uint16)."""


@overload(_value, inline="always")
def _value_of(values, p):
    # Resolved by the array's type when compiling: no branch in the loop (a
    # run-time one kept the float32 loop from being optimised).
    if values.dtype == types.uint16:
        return lambda values, p: np.float64(
            _float32_from_bits(np.uint32(values[p]) << np.uint32(16))
        )
    return lambda values, p: np.float64(values[p])


@numba.njit(cache=True, inline="always")
def _prefetch_ahead(crow, col, values, order, lo, batch_size):
    """Ask for the next batch's stored values and the one after's row pointers.

    The rows are in random order: their stored values are asked for a batch
    ahead of the step that reads them, their row pointers two.
    """
    n = order.shape[0]
    ahead = lo + batch_size
    for i in range(min(n, ahead + batch_size) - min(n, ahead)):
        r = order[ahead + i]
        _prefetch(col, crow[r])
        _prefetch(values, crow[r])
    ahead += batch_size
    for i in range(min(n, ahead + batch_size) - min(n, ahead)):
        _prefetch(crow, order[ahead + i])


@numba.njit(cache=True, inline="always")
def _batch_residuals(
    family, power, raw, order, lo, size, eta, target, weight, snapshot_gradient, residual,
    with_loss,
):  # fmt: skip
    """``r_i = eta / b * omega_i * (dl/dz(z_i) - dl/dz(z~_i))`` into ``residual``; the loss sum.

    ``raw`` holds the batch's raw predictions; an empty ``snapshot_gradient``
    means plain SGD (no ``z~``). The loss sum is weighted (0 unless ``with_loss``).
    """
    svrg = snapshot_gradient.shape[0] > 0
    k = raw.shape[1]
    loss_sum = 0.0
    for i in range(size):
        r = order[lo + i]
        loss = _loss_and_gradient(family, power, raw[i], target[r], residual[i], with_loss)
        loss_sum += weight[r] * loss
        factor = eta / size * weight[r]
        for o in range(k):
            if svrg:
                residual[i, o] -= snapshot_gradient[r, o]
            residual[i, o] *= factor
    return loss_sum


@numba.njit(cache=True, inline="always")
def _row_dot(col, values, first, last, inverse_scale, weights, o):
    """``z . weights[:, o]`` over the stored values ``[first, last)`` (``z = x / D`` if scaled)."""
    total = 0.0
    if inverse_scale.shape[0] > 0:
        for p in range(first, last):
            j = col[p]
            total += _value(values, p) * inverse_scale[j] * weights[j, o]
    else:
        for p in range(first, last):
            total += _value(values, p) * weights[col[p], o]
    return total


@numba.njit(cache=True, inline="always")
def _row_update(col, values, first, last, inverse_scale, weights, o, change):
    """``weights[:, o] -= change * z`` over the stored values ``[first, last)``."""
    if inverse_scale.shape[0] > 0:
        for p in range(first, last):
            j = col[p]
            weights[j, o] -= change * _value(values, p) * inverse_scale[j]
    else:
        for p in range(first, last):
            j = col[p]
            weights[j, o] -= change * _value(values, p)


@numba.njit(cache=True, nogil=True)
def epoch_steps(
    crow,
    col,
    values,
    order,
    target,
    weight,
    coef,
    intercept,
    etas,
    batch_size,
    decay_alpha,
    fit_intercept,
    family,
    power,
    inverse_scale,
    shift,
    snapshot_gradient,
    mean_gradient,
    mean_gradient_intercept,
    with_loss,
):
    """The steps over the rows ``order`` in batches of ``batch_size``; updates coef in place.

    ``coef`` (d, k) and ``intercept`` (k,) are float64 and hold the
    weights on return. Empty ``inverse_scale``/``shift`` mean rows as
    stored; an empty ``mean_gradient`` means plain SGD (no control
    variate). Returns the weighted loss sum of the steps (0 unless
    ``with_loss``).
    """
    d, k = coef.shape
    n = order.shape[0]
    centered = shift.shape[0] > 0
    svrg = mean_gradient.shape[0] > 0

    v = coef.copy()
    scale = 1.0  # a
    drift = 0.0  # B
    folded = np.zeros(k)  # c
    shift_v = np.zeros(k)  # q . v
    shift_mu = np.zeros(k)  # q . mu
    shift_shift = 0.0  # q . q
    if centered:
        for j in range(d):
            shift_shift += shift[j, 0] * shift[j, 0]
            for o in range(k):
                shift_v[o] += shift[j, 0] * v[j, o]
                if svrg:
                    shift_mu[o] += shift[j, 0] * mean_gradient[j, o]
    beta = intercept.copy()
    raw = np.empty((batch_size, k))
    residual = np.empty((batch_size, k))
    row_shift = np.empty(batch_size)  # each row's z . q
    loss_sum = 0.0

    for t in range(etas.shape[0]):
        lo = t * batch_size
        size = min(n, lo + batch_size) - lo
        eta = etas[t]
        _prefetch_ahead(crow, col, values, order, lo, batch_size)
        # The batch's raw predictions, all at the weights before the step.
        for i in range(size):
            r = order[lo + i]
            first, last = crow[r], crow[r + 1]
            if centered:
                row_shift[i] = _row_dot(col, values, first, last, inverse_scale, shift, 0)
            for o in range(k):
                z = scale * _row_dot(col, values, first, last, inverse_scale, v, o) + beta[o]
                if svrg:
                    z += drift * _row_dot(col, values, first, last, inverse_scale, mean_gradient, o)
                if centered:
                    z += row_shift[i] * folded[o]
                    z -= scale * shift_v[o] + drift * shift_mu[o] + shift_shift * folded[o]
                raw[i, o] = z
        loss_sum += _batch_residuals(
            family, power, raw, order, lo, size, eta, target, weight, snapshot_gradient, residual,
            with_loss,
        )  # fmt: skip
        # w <- decay w - Y~^T r - eta mu, with Y~^T r = Z^T r - q 1^T r.
        decay = 1.0 - eta * decay_alpha
        scale *= decay
        drift = drift * decay - (eta if svrg else 0.0)
        for o in range(k):
            folded[o] *= decay
        inverse = 1.0 / scale
        for i in range(size):
            r = order[lo + i]
            for o in range(k):
                change = residual[i, o] * inverse
                _row_update(col, values, crow[r], crow[r + 1], inverse_scale, v, o, change)
                if centered:
                    shift_v[o] -= change * row_shift[i]
        for o in range(k):
            total = 0.0
            for i in range(size):
                total += residual[i, o]
            if centered:
                folded[o] += total
            if fit_intercept:
                beta[o] -= total
                if svrg:
                    beta[o] -= eta * mean_gradient_intercept[o]
        if scale < SMALLEST_SCALE:
            for j in range(d):
                for o in range(k):
                    v[j, o] *= scale
            for o in range(k):
                shift_v[o] *= scale
            scale = 1.0

    for j in range(d):
        for o in range(k):
            w = scale * v[j, o]
            if svrg:
                w += drift * mean_gradient[j, o]
            if centered:
                w += shift[j, 0] * folded[o]
            coef[j, o] = w
    intercept[:] = beta
    return loss_sum


@numba.njit(cache=True, nogil=True)
def has_duplicates(indptr, indices, n_columns):
    """Whether a CSR row stores a column twice, in any order: one pass, one mark per column."""
    last_row = np.full(n_columns, -1, np.int64)
    for r in range(indptr.shape[0] - 1):
        for p in range(indptr[r], indptr[r + 1]):
            j = indices[p]
            if last_row[j] == r:
                return True
            last_row[j] = r
    return False
