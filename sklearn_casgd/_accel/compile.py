"""A function compiled once per input signature and called without dynamo's per-call work.

A ``torch.compile``'d function pays dynamo's Python entry and its guards
on every call, which on the CPU cost more than a small graph's own work
(``docs/tuning.md``, "Compiling and fusing"). The compiled inner steps run
once per outer iteration; ``benchmarks/bench_kernel.py`` times them both
ways side by side. :class:`StaticCompiled` compiles ahead of time
(``torch.compile(...).aot_compile``, where this torch has it) for the
exact inputs it is first called with, and keeps one artifact per input
signature: the shapes, strides, dtypes and devices of the tensors (and
which are ``None``). That key stands in for dynamo's guards on the
tensors, so the artifact's own guard check is switched off; the function's
other arguments are fixed when the object is made (``functools.partial``).
The price is compile time: ``aot_compile`` skips torch's compile caches
(0.3-4.1 s per shape where a cached ``torch.compile`` takes under 1 s).
Where ``aot_compile`` is missing, or with ``ahead_of_time=False``, the
``torch.compile``'d function itself is called, guards and all. Either way
nothing compiles while torch's cache folders are open to other users
(``compile_cache.py``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .compile_cache import check_compile_caches

_COMPILING = threading.Lock()
_MAX_ATTEMPTS = 8  # of an ahead-of-time compile that asks to restart its analysis

TensorSignature = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device, bool] | None


def input_signature(args: tuple[torch.Tensor | None, ...]) -> tuple[TensorSignature, ...]:
    """What a compiled graph assumes of its tensor inputs; ``None`` stays ``None``."""
    return tuple(
        None if arg is None else (arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad)
        for arg in args
    )


class StaticCompiled:
    """``fn`` compiled with ``fullgraph=True, dynamic=False`` per input signature.

    Every positional argument must be a tensor or ``None``. With
    ``ahead_of_time=False`` (or a torch without ``aot_compile``) every call
    goes through dynamo, whose guards pick or compile the graph.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: dict[str, Any] | None = None,
        ahead_of_time: bool = True,
    ) -> None:
        self._compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options or {})
        self.ahead_of_time = ahead_of_time and hasattr(self._compiled, "aot_compile")
        self._by_signature: dict[tuple[TensorSignature, ...], Callable[..., Any]] = {}

    @property
    def signatures(self) -> list[tuple[TensorSignature, ...]]:
        """The input signatures compiled so far."""
        return list(self._by_signature)

    def __call__(self, *args: torch.Tensor | None) -> Any:
        signature = input_signature(args)
        compiled = self._by_signature.get(signature)
        if compiled is None:
            with _COMPILING:  # fits in threads (joblib's threading backend) compile one at a time
                compiled = self._by_signature.get(signature)
                if compiled is None:
                    compiled = self._compile(args)
                    self._by_signature[signature] = compiled
        return compiled(*args)

    def _compile(self, args: tuple[torch.Tensor | None, ...]) -> Callable[..., Any]:
        check_compile_caches()  # compiled code is loaded from disk: not from others' files
        if not self.ahead_of_time:
            # Every signature is one more guard set on the code object that
            # every StaticCompiled of the same function shares: let dynamo
            # hold one more than it would.
            torch._dynamo.config.recompile_limit += 1
            return self._compiled
        for attempt in itertools.count(1):
            try:
                artifact = self._compiled.aot_compile((args, {}))
                break
            except torch._dynamo.exc.RestartAnalysis:
                # torch.compile traces again when its analysis asks to (a 0-d
                # tensor argument does, the first time in a process);
                # aot_compile raises instead: do what dynamo does.
                if attempt == _MAX_ATTEMPTS:
                    raise
        artifact.disable_guard_check()  # the signature is the guard (see the module docstring)
        return artifact
