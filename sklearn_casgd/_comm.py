"""Communicators: how partial sums of the column blocks are combined.

Every collective of a fit goes through a communicator, which counts it
(``n_allreduce``: calls of any collective, ``allreduce_bytes``: their
payload). A fit issues one all-reduce per outer iteration, one per epoch
(training loss and L2 penalty, from which every stopping decision is
taken), and a fixed few per fit: two barriers around the epoch loop, a
broadcast of rank 0's seed when ``random_state=None`` and the fit spans
an existing job, and one all-reduce that gathers the weights there.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
import torch.distributed as dist


class PendingReduce(Protocol):
    """An all-reduce in flight."""

    def wait(self) -> None:
        """Block until the sum is in the buffer."""


class Communicator(Protocol):
    """What the engine needs from a group of ranks."""

    rank: int
    world_size: int
    n_allreduce: int
    allreduce_bytes: int
    allreduce_seconds: float

    def all_reduce(self, buffer: torch.Tensor) -> None:
        """Sum ``buffer`` over all ranks, in place."""

    def start_all_reduce(self, buffer: torch.Tensor) -> PendingReduce:
        """Start summing ``buffer`` over all ranks; it holds the sum after ``wait()``.

        Work that does not touch ``buffer`` may run in between.
        """

    def broadcast(self, buffer: torch.Tensor, src: int = 0) -> None:
        """Copy rank ``src``'s ``buffer`` to every rank, in place."""

    def barrier(self) -> None:
        """Wait until every rank has arrived."""


class LocalCommunicator:
    """One rank holding all columns: no collective, none counted."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.n_allreduce = 0
        self.allreduce_bytes = 0
        self.allreduce_seconds = 0.0

    def all_reduce(self, buffer: torch.Tensor) -> None:
        return None

    def start_all_reduce(self, buffer: torch.Tensor) -> PendingReduce:
        return _DONE

    def broadcast(self, buffer: torch.Tensor, src: int = 0) -> None:
        return None

    def barrier(self) -> None:
        return None


class _Done:
    """The sum of one rank: nothing to wait for."""

    def wait(self) -> None:
        return None


_DONE = _Done()


class _TimedWork:
    """A ``torch.distributed`` work handle whose wait counts as collective time."""

    def __init__(self, work: dist.Work, comm: TorchCommunicator) -> None:
        self.work = work
        self.comm = comm

    def wait(self) -> None:
        started = time.perf_counter()
        self.work.wait()
        self.comm.allreduce_seconds += time.perf_counter() - started


class TorchCommunicator:
    """A ``torch.distributed`` process group, with every collective counted."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.n_allreduce = 0
        self.allreduce_bytes = 0
        # Wall time blocked in collectives: starting them and waiting for them
        # (time spent computing while one is in flight is not counted).
        self.allreduce_seconds = 0.0

    def _count(self, buffer: torch.Tensor, started: float) -> None:
        self.n_allreduce += 1
        self.allreduce_bytes += buffer.numel() * buffer.element_size()
        self.allreduce_seconds += time.perf_counter() - started

    def all_reduce(self, buffer: torch.Tensor) -> None:
        self.start_all_reduce(buffer).wait()

    def start_all_reduce(self, buffer: torch.Tensor) -> PendingReduce:
        started = time.perf_counter()
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._count(buffer, started)
        return _TimedWork(work, self)

    def broadcast(self, buffer: torch.Tensor, src: int = 0) -> None:
        started = time.perf_counter()
        dist.broadcast(buffer, group_src=src, group=self.group)
        self._count(buffer, started)

    def barrier(self) -> None:
        # A one-element all-reduce: a barrier that works the same on gloo and NCCL.
        self.all_reduce(torch.zeros(1, device=self.device))
