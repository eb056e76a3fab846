"""Communicators: how partial sums of the column blocks are combined.

The engine only ever calls :meth:`Communicator.all_reduce` on one packed
buffer per outer iteration (plus a few per epoch and per fit). The local
communicator is used with one column block; it does no collective and
counts none.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Communicator(Protocol):
    """What the engine needs from a group of ranks."""

    rank: int
    world_size: int
    n_allreduce: int
    allreduce_bytes: int

    def all_reduce(self, buffer: torch.Tensor) -> None:
        """Sum ``buffer`` over all ranks, in place."""


class LocalCommunicator:
    """One rank holding all columns: reductions are the identity."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.n_allreduce = 0
        self.allreduce_bytes = 0

    def all_reduce(self, buffer: torch.Tensor) -> None:
        return None
