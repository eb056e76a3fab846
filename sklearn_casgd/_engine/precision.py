"""The precision policy: nine choices that fix the rounding of one outer iteration.

The names follow the error analysis of mixed-precision CA-SGD: where X and
the margins are stored, what goes into the Gram GEMM and what it
accumulates and returns in, what crosses the network, and in what the
inner recurrence and the weight update run. The ``"bf16"`` preset is the
paper's recipe: X and margins stored in bfloat16, the Gram formed from
bfloat16 inputs with float32 accumulation *and* float32 output, and
everything downstream in float32. SVRG runs it with float32 margins
(:func:`policy_for_solver`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = ["PRESETS", "PrecisionPolicy", "policy_for_solver", "resolve_policy"]


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


def policy_for_solver(policy: PrecisionPolicy, solver: str) -> PrecisionPolicy:
    """``policy`` as ``solver`` runs it: SVRG keeps the margins in the recurrence dtype.

    SVRG's step subtracts each row's loss gradient at the snapshot (from
    the exact raw predictions of the full pass) from its gradient at the
    current weights (from the outer iteration's margins). Margins rounded to
    bfloat16 leave a difference even at the snapshot itself: a floor under
    the full gradient (with it no s=8 bf16 fit on the 11 real datasets of
    ``docs/benchmarks.md`` reached ``tol=1e-5``). The margins
    are formed and sent in float32 anyway (``margin_comm``), never stored:
    rounding them saves nothing. Plain SGD, the paper's method, keeps the
    recipe.
    """
    if solver != "svrg" or policy.margin_storage.itemsize >= policy.recurrence.itemsize:
        return policy
    return replace(policy, margin_storage=policy.recurrence)


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


def gram_operand_dtype(policy: PrecisionPolicy, device: torch.device) -> torch.dtype:
    """The dtype in which the Gram GEMM reads its operands on ``device``.

    CPU bf16/fp16 GEMMs round their output to the input dtype, so on the CPU
    the (exact) upcast to the accumulation dtype happens once per outer
    iteration, before the GEMM; CUDA reads the low-precision operand and
    returns float32 (``torch.mm(..., out_dtype=...)``).
    """
    if policy.gram_input == policy.gram_accumulate:
        return policy.gram_input
    if device.type == "cuda" and cuda_out_dtype_supported():
        return policy.gram_input
    return policy.gram_accumulate


def gram_operand(Y: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """``Y`` rounded to the Gram input dtype, in the dtype :func:`gram_block` reads."""
    operand = Y.to(policy.gram_input)
    return operand.to(gram_operand_dtype(policy, Y.device))


def gram_block(
    rows: torch.Tensor,
    cols: torch.Tensor,
    accumulate: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rows @ cols.T`` of :func:`gram_operand` outputs, accumulated in ``accumulate``.

    With ``out`` the product is written there in place (converted if its
    dtype differs).
    """
    if out is not None and out.dtype != accumulate:
        out.copy_(gram_block(rows, cols, accumulate))
        return out
    if rows.dtype == accumulate:
        return torch.mm(rows, cols.T) if out is None else torch.mm(rows, cols.T, out=out)
    # CUDA's low-precision GEMM with an fp32 result.
    if out is None:
        return torch.mm(rows, cols.T, out_dtype=accumulate)
    return torch.mm(rows, cols.T, out_dtype=accumulate, out=out)


@functools.cache
def cuda_out_dtype_supported() -> bool:
    """Whether this torch build has the fp32-output bf16 GEMM on CUDA.

    Only "this build has no such kernel" counts as no (it then warns once:
    the Gram is formed from upcast operands, correct but slower); any other
    error, an out-of-memory or a broken device, is raised.
    """
    probe = torch.ones((2, 2), dtype=torch.bfloat16, device="cuda")
    try:
        supported = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (NotImplementedError, TypeError) as error:
        warnings.warn(
            "This torch build has no fp32-output bf16 GEMM on CUDA "
            f"(torch.mm(..., out_dtype=torch.float32) raised {type(error).__name__}); the "
            "Gram is formed from operands upcast to float32: the same result, more memory "
            "traffic.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return supported


@contextlib.contextmanager
def matmul_precision(policy: PrecisionPolicy, device: torch.device) -> Iterator[None]:
    """Pin CUDA float32 matmuls to IEEE float32 (no TF32) for the fit, then restore.

    Uses ``torch.backends.cuda.matmul.fp32_precision`` where torch has it
    (setting the legacy ``allow_tf32`` beside the new API makes torch raise
    on mixed use), else the legacy flag.
    """
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, ieee = (
        ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    )
    saved = getattr(matmul, name)
    setattr(matmul, name, ieee)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def check_representable(max_abs: float, policy: PrecisionPolicy, what: str) -> None:
    """Raise ``ValueError`` when values of size ``max_abs`` overflow the storage dtype."""
    limit = torch.finfo(policy.x_storage).max
    if max_abs > limit:
        wider = [
            name for name, other in PRESETS.items() if torch.finfo(other.x_storage).max > max_abs
        ]
        raise ValueError(
            f"{what} has values up to {max_abs:.3g} in absolute value, beyond the "
            f"range of {policy.x_storage} (max {limit:.3g}) used by "
            f"precision={policy.name!r}. Scale the data (e.g. StandardScaler)"
            + (f" or use precision={' or '.join(map(repr, wider))}." if wider else ".")
        )


def check_targets_representable(
    target: np.ndarray,
    sample_weight: np.ndarray,
    policy: PrecisionPolicy,
    shift: np.ndarray | None = None,
) -> None:
    """Raise ``ValueError`` when y, the weights or their products overflow the recurrence dtype.

    The gradient sums ``n`` products ``sample_weight * (prediction - y)``, so
    their bound, not only each factor's, must stay finite. With ``shift``
    (per column) the targets checked are ``target - shift``, as the steps
    see them (measured from the columns' extremes: no copy of y).
    """
    limit = float(torch.finfo(policy.recurrence).max)
    largest_y = 0.0
    if target.shape[0]:
        shift = np.zeros(target.shape[1]) if shift is None else shift
        above, below = target.max(axis=0) - shift, shift - target.min(axis=0)
        largest_y = float(np.maximum(above, below).max())
    largest_weight = float(sample_weight.max(initial=0.0))
    if largest_weight > 0 and torch.tensor(largest_weight, dtype=policy.recurrence) == 0:
        raise ValueError(
            f"The largest sample_weight (times class_weight) is {largest_weight:.3g}: every "
            f"weight rounds to 0 in {policy.recurrence}, in which precision={policy.name!r} "
            "runs its steps. Multiply the weights by a constant c and alpha by c (the same "
            "minimizer), or use precision='fp64'."
        )
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


def check_alpha_representable(alpha: float, policy: PrecisionPolicy) -> None:
    """Raise ``ValueError`` when ``alpha`` overflows the dtype the steps run in."""
    limit = float(torch.finfo(policy.recurrence).max)
    if not alpha < limit:
        raise ValueError(
            f"alpha={alpha:.3g} is beyond the range of {policy.recurrence} (max {limit:.3g}) "
            f"in which precision={policy.name!r} runs its steps. At such a penalty the "
            "coefficients are 0 to working precision: use a smaller alpha, or "
            "precision='fp64'."
        )
