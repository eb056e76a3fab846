"""How a fit shares the cores between torch's threads and numpy's BLAS.

The engine's arithmetic runs in torch's thread pool; what numpy computes
during a fit is bookkeeping of O(n) or O(d) values (weighted means, dot
products of weights and targets). A BLAS call large enough to be threaded
wakes the BLAS library's worker threads, which then spin for a while
waiting for more work, on the cores that torch's threads need next: the
passes over X that follow run several times slower until they give up
(``docs/tuning.md``, "numpy's BLAS during a fit"). During a fit numpy's
BLAS therefore runs on the calling thread. A BLAS library that torch
itself loaded is left alone: it does the engine's products.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
from threadpoolctl import ThreadpoolController


@functools.cache
def _numpy_blas() -> ThreadpoolController:
    """The BLAS libraries loaded in this process, except torch's own (inspected once)."""
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    every_blas = ThreadpoolController().select(user_api="blas")
    others = [
        library.filepath
        for library in every_blas.lib_controllers
        if not os.path.realpath(library.filepath).startswith(torch_dir + os.sep)
    ]
    return every_blas.select(filepath=others)


@contextlib.contextmanager
def numpy_blas_single_threaded() -> Iterator[None]:
    """Within the block, numpy's BLAS runs on the calling thread; restored after."""
    with _numpy_blas().limit(limits=1):
        yield
