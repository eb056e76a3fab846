"""Communicators: how partial sums of the column blocks are combined.

Every collective of a fit goes through a communicator, which counts it
(``n_allreduce``: calls of any collective, ``allreduce_bytes``: their
payload, the gathered output for an all-gather). A fit issues one
all-reduce (or, where that is smaller, one all-gather) per outer iteration, one per epoch
(training loss and L2 penalty, from which every stopping decision is
taken), and a fixed few per fit: two barriers around the epoch loop, a
broadcast of rank 0's seed when ``random_state=None`` and the fit spans
an existing job, and one all-reduce that gathers the weights there.

Two gloo ranks sum and gather by exchanging one message each way
(:class:`_PairExchange`) instead of calling gloo's collectives: the same
bits (``a + b`` is ``b + a``, so both ranks hold the same sum, as gloo's
2-rank all-reduce gives), in less time (``docs/tuning.md``, "Collectives").

On the CPU gloo moves the bytes on its own transport thread, which has to
take a core from a rank's compute thread when every core runs one (the
pool gives each rank ``cores // ranks`` threads). The communicator yields
its core (``os.sched_yield``) right after posting a collective, and again
after waiting for one that little work overlapped: a blocking all-reduce
(s=1 steps, the per-epoch sums); not after the Gram all-reduce, which the
next Gram's GEMMs overlap, nor after the rows' all-gather, which a run of
outer iterations' steps overlaps, where the second yield cost time
(docs/distributed.md, "Yielding the core", has the measurements). Beside
other busy processes a yield hands one of them the core for a whole
scheduler slice: ranks do not yield when other processes run as their fit
starts (:func:`~sklearn_casgd._distributed.threads.ranks_yield`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor, which now raises a FutureWarning.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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

    def start_all_gather(self, output: torch.Tensor, local: torch.Tensor) -> PendingReduce:
        """Start gathering every rank's 1-d ``local`` into ``output`` (rank r's at ``r * len``)."""

    def broadcast(self, buffer: torch.Tensor, src: int = 0) -> None:
        """Copy rank ``src``'s ``buffer`` to every rank, in place."""

    def barrier(self) -> None:
        """Wait until every rank has arrived (and this rank's device is idle)."""

    def reset_time(self) -> None:
        """Forget the time spent in collectives so far (the counts stay)."""

    def keeping_the_core(self) -> contextlib.AbstractContextManager[None]:
        """Within the block no collective yields this rank's core (timing the transport)."""


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
        return DONE

    def start_all_gather(self, output: torch.Tensor, local: torch.Tensor) -> PendingReduce:
        output.copy_(local)
        return DONE

    def broadcast(self, buffer: torch.Tensor, src: int = 0) -> None:
        return None

    def barrier(self) -> None:
        return None

    def reset_time(self) -> None:
        return None

    def keeping_the_core(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _Done:
    """A collective already complete (one rank's sum): nothing to wait for."""

    def wait(self) -> None:
        return None


DONE = _Done()


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (a no-op on the CPU).

    CUDA kernels and NCCL collectives return before they finish: wall
    clocks read around them measure launches unless the device is
    synchronized first.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StreamWaits:
    """Time the compute stream spent waiting for collectives, measured with CUDA events.

    ``wait()`` on an NCCL work makes the current stream wait, not the host;
    a pair of events around it measures that wait on the device without
    synchronizing. The pairs are summed when read (and every few thousand,
    to bound their number).
    """

    _MAX_PENDING = 4096

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    def wait(self, work: dist.Work) -> None:
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record()
        work.wait()
        after.record()
        self._pending.append((before, after))
        if len(self._pending) >= self._MAX_PENDING:
            self.seconds()

    def seconds(self) -> float:
        if self._pending:
            self._pending[-1][1].synchronize()
            self._seconds += sum(b.elapsed_time(a) for b, a in self._pending) / 1e3
            self._pending.clear()
        return self._seconds

    def reset(self) -> None:
        self._pending.clear()
        self._seconds = 0.0


class _PairExchange:
    """A collective of two ranks as one message each way: send ours, receive the peer's.

    The all-reduce adds the peer's buffer to ours after both messages are
    done (the send reads ``buffer`` until then); the all-gather receives
    straight into the peer's slot of ``output``. Gloo's own collectives
    cost more on two ranks (``docs/tuning.md``, "Collectives";
    ``benchmarks/bench_collectives.py`` compares them).
    """

    def __init__(self, comm: TorchCommunicator, send: torch.Tensor, into: torch.Tensor) -> None:
        # Point-to-point waits ignore the group's timeout once it is changed
        # (each fit on a pool sets its own): they are given it explicitly.
        self._timeout = comm.timeout
        self._works = [
            dist.isend(send, group_dst=comm.peer, group=comm.group),
            dist.irecv(into, group_src=comm.peer, group=comm.group),
        ]

    def wait(self) -> None:
        for work in self._works:
            work.wait(self._timeout)


class _PairSum(_PairExchange):
    """The two-rank all-reduce of ``buffer``: it holds ``ours + theirs`` after ``wait()``."""

    def __init__(self, comm: TorchCommunicator, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._received = torch.empty_like(buffer)
        super().__init__(comm, buffer, self._received)

    def wait(self) -> None:
        super().wait()
        self._buffer.add_(self._received)


class _TimedWork:
    """A ``torch.distributed`` work handle whose wait counts as collective time.

    With ``yield_after`` the wait ends by yielding the core (see the module
    docstring).
    """

    def __init__(
        self, work: dist.Work | _PairExchange, comm: TorchCommunicator, yield_after: bool
    ) -> None:
        self.work = work
        self.comm = comm
        self.yield_after = yield_after

    def wait(self) -> None:
        comm = self.comm
        if comm._stream_waits is not None:
            comm._stream_waits.wait(self.work)
            return
        started = time.perf_counter()
        self.work.wait()
        if self.yield_after:
            comm._yield_core()
        comm._host_seconds += time.perf_counter() - started


class TorchCommunicator:
    """A ``torch.distributed`` process group, with every collective counted.

    ``timeout`` bounds each wait for the other ranks (the fit's timeout).
    ``yields``: on the CPU, yield the core around collectives (the module
    docstring); False where other busy processes would take it.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout: timedelta,
        yields: bool = True,
    ) -> None:
        self.group = group
        self.device = device
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.n_allreduce = 0
        self.allreduce_bytes = 0
        # Time blocked in collectives: on the CPU the wall time starting them
        # and waiting for them (computing while one is in flight is not
        # counted); on CUDA the time the compute stream waited for them.
        self._host_seconds = 0.0
        self._stream_waits = _StreamWaits() if device.type == "cuda" else None
        # The other rank of a 2-rank gloo group, which collectives exchange with directly.
        pairs = (
            self.world_size == 2
            and device.type == "cpu"
            and dist.get_backend(group) == dist.Backend.GLOO
        )
        self.peer = 1 - self.rank if pairs else None
        # NCCL's progress is on the device; only gloo's transport thread needs a core.
        self._yields = yields and device.type == "cpu" and hasattr(os, "sched_yield")

    @property
    def allreduce_seconds(self) -> float:
        waits = 0.0 if self._stream_waits is None else self._stream_waits.seconds()
        return self._host_seconds + waits

    def reset_time(self) -> None:
        """Forget the collective time so far (counts stay)."""
        self._host_seconds = 0.0
        if self._stream_waits is not None:
            self._stream_waits.reset()

    def _count(self, buffer: torch.Tensor, started: float) -> None:
        self.n_allreduce += 1
        self.allreduce_bytes += buffer.numel() * buffer.element_size()
        if self._stream_waits is None:
            self._host_seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def keeping_the_core(self) -> Iterator[None]:
        """Within the block no collective yields this rank's core.

        Timings of the collectives (:func:`.cost.measure_comm`) read the
        transport this way: a rank that yields beside a busy process gives
        it the core for a scheduler slice, which would be timed as the
        collective's latency, a different one from process to process.
        """
        yields, self._yields = self._yields, False
        try:
            yield
        finally:
            self._yields = yields

    def _yield_core(self) -> None:
        """Let gloo's transport thread run now; callers count the time as blocked."""
        if self._yields:
            os.sched_yield()

    def all_reduce(self, buffer: torch.Tensor) -> None:
        self._start_all_reduce(buffer, yield_after=True).wait()

    def start_all_reduce(self, buffer: torch.Tensor) -> PendingReduce:
        # The engine forms the next Gram while this is in flight: no yield after it.
        return self._start_all_reduce(buffer, yield_after=False)

    def _start_all_reduce(self, buffer: torch.Tensor, yield_after: bool) -> _TimedWork:
        started = time.perf_counter()
        if self.peer is not None:
            work = _PairSum(self, buffer)
        else:
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._yield_core()
        self._count(buffer, started)
        return _TimedWork(work, self, yield_after)

    def start_all_gather(self, output: torch.Tensor, local: torch.Tensor) -> PendingReduce:
        started = time.perf_counter()
        if self.peer is not None:
            slots = output.view(2, -1)
            slots[self.rank].copy_(local)
            work = _PairExchange(self, local, slots[self.peer])
        else:
            work = _all_gather_single(output, local, group=self.group, async_op=True)
        self._yield_core()
        self._count(output, started)
        # The steps of a run of outer iterations overlap it: no yield after it.
        return _TimedWork(work, self, yield_after=False)

    def broadcast(self, buffer: torch.Tensor, src: int = 0) -> None:
        started = time.perf_counter()
        dist.broadcast(buffer, group_src=src, group=self.group)
        self._count(buffer, started)

    def barrier(self) -> None:
        # A one-element all-reduce (the same on gloo and NCCL), then the host
        # waits for the device: clocks read after a barrier are honest.
        self.all_reduce(torch.zeros(1, device=self.device))
        synchronize(self.device)
