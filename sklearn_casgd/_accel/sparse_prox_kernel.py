"""The numba code of :mod:`.sparse_steps` with an L1 part: proximal steps on CSR rows.

A proximal step soft-thresholds every coefficient after every step, and
SVRG's control variate moves every coefficient too, so the lazily scaled
weights of :mod:`.sparse_kernel` do not carry over. Instead each
coefficient is brought up to date only when a batch reads it (and once at
the end of the epoch): between two such reads it took steps that saw none
of its column, each the one-dimensional map

    x <- S_tau(a x - e),    a = 1 - eta alpha_2,  e = eta mu_j,  tau = eta alpha_1,

with ``S_tau`` the soft-threshold. For a run of steps of one size that map
is fixed, piecewise affine and monotone, so its iterates are monotone and
cross each of its three pieces at most once: :func:`_repeat_prox` takes
the steps within a piece in closed form (a geometric series) and the steps
that leave a piece one at a time. Rows stored as they are (no centering or
scaling: preconditioned sparse rows move every coefficient every step, and
run the torch steps). Every value is computed in float64.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .sparse_kernel import _batch_residuals, _prefetch_ahead, _value


@numba.njit(cache=True, inline="always")
def _soft_threshold(z: float, tau: float) -> float:
    if z > tau:
        return z - tau
    if z < -tau:
        return z + tau
    return 0.0


@numba.njit(cache=True)
def _repeat_positive(x, m, a, c, boundary):
    """Steps of ``x <- a x - c`` while the input stays above ``boundary``, at most ``m``.

    ``x > boundary`` on entry. Returns ``(x, steps taken)``; at least the
    steps that are certainly within the piece, all but the last one or two
    near its edge (the caller takes those exactly).
    """
    if a == 1.0:
        if c <= 0.0:  # rising: never leaves the piece
            return x - m * c, m
        inside = math.ceil((x - boundary) / c)  # inputs x - i c > boundary: i < (x - b) / c
    else:
        fixed = c / (a - 1.0)  # x_k = fixed + a^k (x - fixed)
        if x <= fixed or fixed >= boundary:  # rising, or falling to a point inside
            return fixed + a**m * (x - fixed), m
        inside = math.ceil(math.log((boundary - fixed) / (x - fixed)) / math.log(a))
    steps = min(m, max(inside - 2, 0))  # rounding near the edge: those go one at a time
    if a == 1.0:
        return x - steps * c, steps
    return fixed + a**steps * (x - fixed), steps


@numba.njit(cache=True)
def _repeat_prox(x, m, a, e, tau):
    """``m`` steps of ``x <- S_tau(a x - e)``, in closed form within each affine piece.

    The pieces: ``a x - e > tau`` (``x <- a x - (e + tau)``), below ``-tau``
    (the mirror image: ``x -> -x``, ``e -> -e``), and between (``x <- 0``,
    where ``|e| <= tau`` keeps it for good).
    """
    while m > 0:
        z = a * x - e
        if z > tau or z < -tau:
            sign = 1.0 if z > tau else -1.0
            # In the mirrored frame the piece is the upper one: a (s x) - (s e) > tau.
            boundary = (sign * e + tau) / a
            moved, steps = _repeat_positive(sign * x, m, a, sign * e + tau, boundary)
            if steps == 0:  # at the piece's edge: one exact step
                x = _soft_threshold(z, tau)
                m -= 1
            else:
                x = sign * moved
                m -= steps
        else:
            x = 0.0
            m -= 1
            if abs(e) <= tau:  # S_tau(-e) = 0: zero from here on
                return 0.0
    return x


@numba.njit(cache=True)
def _catch_up(w, j, o, first, stop, etas, run_end, decay_alpha, l1, mean_gradient, svrg):
    """``w[j, o]`` after the steps ``[first, stop)``, which read none of column j."""
    x = w[j, o]
    t = first
    while t < stop:
        end = min(run_end[t], stop)
        eta = etas[t]
        e = eta * mean_gradient[j, o] if svrg else 0.0
        x = _repeat_prox(x, end - t, 1.0 - eta * decay_alpha, e, eta * l1)
        t = end
    w[j, o] = x


@numba.njit(cache=True, nogil=True)
def epoch_prox_steps(
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
    l1,
    fit_intercept,
    family,
    power,
    snapshot_gradient,
    mean_gradient,
    mean_gradient_intercept,
    with_loss,
):
    """The proximal steps over the rows ``order`` in batches of ``batch_size``; coef in place.

    :func:`.sparse_kernel.epoch_steps`' arguments less the preconditioner's,
    plus ``l1``, the L1 part's strength: each step is the torch steps'
    ``w <- S_{eta l1}((1 - eta decay_alpha) w - eta mu - X_b^T r)``.
    """
    d, k = coef.shape
    n = order.shape[0]
    n_steps = etas.shape[0]
    svrg = mean_gradient.shape[0] > 0
    w = coef.copy()
    beta = intercept.copy()
    # Each coefficient is current as of the start of step last[j].
    last = np.zeros(d, np.int64)
    run_end = np.empty(n_steps, np.int64)  # the end of the run of equal steps from t
    for t in range(n_steps - 1, -1, -1):
        if t + 1 < n_steps and etas[t + 1] == etas[t]:
            run_end[t] = run_end[t + 1]
        else:
            run_end[t] = t + 1
    touched_at = np.full(d, -1, np.int64)
    touched = np.empty(d, np.int64)
    gradient = np.zeros((d, k))
    raw = np.empty((batch_size, k))
    residual = np.empty((batch_size, k))
    loss_sum = 0.0

    for t in range(n_steps):
        lo = t * batch_size
        size = min(n, lo + batch_size) - lo
        eta = etas[t]
        _prefetch_ahead(crow, col, values, order, lo, batch_size)
        # The batch's columns brought up to date, then its raw predictions.
        n_touched = 0
        for i in range(size):
            r = order[lo + i]
            for p in range(crow[r], crow[r + 1]):
                j = col[p]
                if touched_at[j] != t:
                    touched_at[j] = t
                    touched[n_touched] = j
                    n_touched += 1
                    if last[j] < t:
                        for o in range(k):
                            _catch_up(
                                w,
                                j,
                                o,
                                last[j],
                                t,
                                etas,
                                run_end,
                                decay_alpha,
                                l1,
                                mean_gradient,
                                svrg,
                            )
                        last[j] = t
        for i in range(size):
            r = order[lo + i]
            for o in range(k):
                z = beta[o]
                for p in range(crow[r], crow[r + 1]):
                    z += _value(values, p) * w[col[p], o]
                raw[i, o] = z
        loss_sum += _batch_residuals(
            family, power, raw, order, lo, size, eta, target, weight, snapshot_gradient, residual,
            with_loss,
        )  # fmt: skip
        for i in range(size):
            r = order[lo + i]
            for p in range(crow[r], crow[r + 1]):
                x = _value(values, p)
                for o in range(k):
                    gradient[col[p], o] += residual[i, o] * x
        # The step on the batch's columns: decay, control variate, rows, threshold.
        decay = 1.0 - eta * decay_alpha
        tau = eta * l1
        for q in range(n_touched):
            j = touched[q]
            for o in range(k):
                z = decay * w[j, o] - gradient[j, o]
                if svrg:
                    z -= eta * mean_gradient[j, o]
                w[j, o] = _soft_threshold(z, tau)
                gradient[j, o] = 0.0
            last[j] = t + 1
        for o in range(k):
            total = 0.0
            for i in range(size):
                total += residual[i, o]
            if fit_intercept:
                beta[o] -= total
                if svrg:
                    beta[o] -= eta * mean_gradient_intercept[o]

    for j in range(d):
        if last[j] < n_steps:
            for o in range(k):
                _catch_up(
                    w, j, o, last[j], n_steps, etas, run_end, decay_alpha, l1, mean_gradient, svrg
                )
    coef[:, :] = w
    intercept[:] = beta
    return loss_sum
