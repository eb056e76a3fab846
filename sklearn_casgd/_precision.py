"""The precision policy: nine choices that fix the rounding of one outer iteration.

The names follow the error analysis of mixed-precision CA-SGD: where X and
the margins are stored, what goes into the Gram GEMM and what it
accumulates and returns in, what crosses the network, and in what the
inner recurrence and the weight update run. The ``"bf16"`` preset is the
paper's recipe: X and margins stored in bfloat16, the Gram formed from
bfloat16 inputs with float32 accumulation *and* float32 output, and
everything downstream in float32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PRESETS", "PrecisionPolicy", "resolve_policy"]


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of the nine precision choices of one outer iteration.

    Parameters
    ----------
    name : str
        Preset name reported in ``fit_stats_["precision"]``.
    x_storage : torch.dtype
        Dtype in which the engine stores X (its one copy of the data).
    margin_storage : torch.dtype
        Dtype in which the margins ``Y_p w_p`` are kept.
    gram_input : torch.dtype
        Dtype of the operands of the Gram GEMM.
    gram_accumulate : torch.dtype
        Dtype in which the Gram GEMM accumulates and returns its result.
    gram_comm : torch.dtype
        Dtype in which Gram blocks are communicated.
    margin_comm : torch.dtype
        Dtype in which margins are communicated.
    recurrence : torch.dtype
        Dtype of the s inner steps (raw predictions, residuals, intercept).
    update_accumulate : torch.dtype
        Dtype of the margin and weight-update GEMMs.
    weight_storage : torch.dtype
        Dtype of the weights.
    """

    name: str
    x_storage: torch.dtype
    margin_storage: torch.dtype
    gram_input: torch.dtype
    gram_accumulate: torch.dtype
    gram_comm: torch.dtype
    margin_comm: torch.dtype
    recurrence: torch.dtype
    update_accumulate: torch.dtype
    weight_storage: torch.dtype

    @property
    def comm_dtype(self) -> torch.dtype:
        """Dtype of the single packed all-reduce buffer (the wider of the two)."""
        return torch.promote_types(self.gram_comm, self.margin_comm)

    @property
    def is_low_precision_storage(self) -> bool:
        return self.x_storage in (torch.bfloat16, torch.float16)


def _uniform(name: str, dtype: torch.dtype) -> PrecisionPolicy:
    return PrecisionPolicy(name, *([dtype] * 9))


def _recipe(name: str, low: torch.dtype) -> PrecisionPolicy:
    high = torch.float32
    return PrecisionPolicy(
        name=name,
        x_storage=low,
        margin_storage=low,
        gram_input=low,
        gram_accumulate=high,
        gram_comm=high,
        margin_comm=high,
        recurrence=high,
        update_accumulate=high,
        weight_storage=high,
    )


PRESETS: dict[str, PrecisionPolicy] = {
    "fp64": _uniform("fp64", torch.float64),
    "fp32": _uniform("fp32", torch.float32),
    "bf16": _recipe("bf16", torch.bfloat16),
    "fp16": _recipe("fp16", torch.float16),
}


def resolve_policy(precision: str, device: torch.device) -> PrecisionPolicy:
    """Turn a ``precision`` parameter into a policy for ``device``.

    ``"auto"`` is the bf16 recipe on CUDA devices that support bfloat16 and
    fp32 elsewhere (CPU bfloat16 GEMMs are not faster than fp32 ones).
    """
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return PRESETS["bf16"]
        return PRESETS["fp32"]
    try:
        return PRESETS[precision]
    except KeyError:
        raise ValueError(
            f"precision must be 'auto' or one of {sorted(PRESETS)}, got {precision!r}."
        ) from None


def gram_operand(Y: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """``Y`` rounded to the Gram input dtype, laid out for :func:`gram`.

    CPU bf16/fp16 GEMMs round their output to the input dtype, so on the CPU
    the (exact) upcast to the accumulation dtype happens here, once per
    outer iteration; CUDA keeps the low-precision operand for its
    fp32-output GEMM.
    """
    operand = Y.to(policy.gram_input)
    if operand.is_cuda and _cuda_out_dtype_supported():
        return operand
    return operand.to(policy.gram_accumulate)


def gram(
    rows: torch.Tensor,
    cols: torch.Tensor,
    policy: PrecisionPolicy,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rows @ cols.T`` of :func:`gram_operand` outputs, returned in ``gram_accumulate``.

    With ``out`` the product is written there (converted if its dtype differs).
    """
    accumulate = policy.gram_accumulate
    if rows.dtype == accumulate:
        product = torch.mm(
            rows, cols.T, out=out if out is not None and out.dtype == accumulate else None
        )
    else:
        product = torch.mm(rows, cols.T, out_dtype=accumulate)
    if out is not None and product is not out:
        out.copy_(product)
        return out
    return product


@functools.cache
def _cuda_out_dtype_supported() -> bool:
    """Whether this torch build has the fp32-output low-precision CUDA GEMM."""
    probe = torch.ones((2, 2), dtype=torch.bfloat16, device="cuda")
    try:
        return torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


@contextlib.contextmanager
def matmul_precision(policy: PrecisionPolicy, device: torch.device) -> Iterator[None]:
    """Pin CUDA float32 matmuls to IEEE float32 (no TF32) for the fit, then restore."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = saved


def check_representable(max_abs: float, policy: PrecisionPolicy, what: str) -> None:
    """Raise ``ValueError`` when values of size ``max_abs`` overflow the storage dtype."""
    limit = torch.finfo(policy.x_storage).max
    if max_abs > limit:
        raise ValueError(
            f"{what} has values up to {max_abs:.3g} in absolute value, beyond the "
            f"range of {policy.x_storage} (max {limit:.3g}) used by "
            f"precision={policy.name!r}. Scale the data (e.g. StandardScaler) or "
            "use precision='bf16' or 'fp32'."
        )


def check_targets_representable(
    target: np.ndarray, sample_weight: np.ndarray, policy: PrecisionPolicy
) -> None:
    """Raise ``ValueError`` when y, the weights or their products overflow the recurrence dtype.

    The gradient sums ``n`` products ``sample_weight * (prediction - y)``, so
    their bound, not only each factor's, must stay finite.
    """
    limit = float(torch.finfo(policy.recurrence).max)
    largest_y = float(np.abs(target).max(initial=0.0))
    largest_weight = float(sample_weight.max(initial=0.0))
    for what, value in [
        ("y", largest_y),
        ("sample_weight (times class_weight)", largest_weight),
        ("sum of sample_weight * |y|", (largest_y + 1.0) * largest_weight * target.shape[0]),
    ]:
        if not value < limit:
            raise ValueError(
                f"The {what} reaches {value:.3g}, beyond the range of {policy.recurrence} "
                f"(max {limit:.3g}) in which precision={policy.name!r} runs its steps. "
                "Rescale y or the weights, or use precision='fp64'."
            )
