"""How a pool's fit fails: the error that names the rank to blame, and why.

When one rank fails its peers fail too, inside a collective, a moment
later or earlier; :meth:`Reports.root_cause` picks the rank whose own code
raised, or that exited, or that stopped answering.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from . import rundir

# Errors with these words are a rank's peers noticing a failure, not the failure.
_PEER_ERROR_MARKERS = ("gloo", "Timed out", "Connection closed", "NCCL")


# NCCL's watchdog aborts a rank whose collective timed out (it raises nothing).
_WATCHDOG_MARKERS = ("Watchdog caught collective operation timeout", "Timed out", "timed out")


class DistributedFitError(RuntimeError):
    """A rank of a distributed fit failed, stopped answering or did not start.

    Parameters
    ----------
    rank : int
        The rank that failed (the silent one when a peer timed out waiting).
    details : str
        Its traceback or exit status, followed by the state of every rank.
    """

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} of the distributed fit failed:\n{details}")
        self.rank = rank
        self.details = details


@dataclass
class Reports:
    """What every rank has said (or how it ended) while the parent waits for one answer."""

    world_size: int
    answered: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)
    exits: dict[int, tuple[int | None, str]] = field(default_factory=dict)  # code, stderr tail

    def failed(self) -> bool:
        return bool(self.errors or self.exits)

    def all_answered(self) -> bool:
        return len(self.answered) == self.world_size

    def all_reported(self) -> bool:
        return all(self._ended(rank) for rank in range(self.world_size))

    def _ended(self, rank: int) -> bool:
        return rank in self.answered or rank in self.errors or rank in self.exits

    def silent(self) -> list[int]:
        """Ranks still running that reported neither an error nor an answer."""
        return [rank for rank in range(self.world_size) if not self._ended(rank)]

    def states(self) -> str:
        lines = []
        for rank in range(self.world_size):
            if rank in self.errors:
                state = "raised"
            elif rank in self.exits:
                state = f"exited with code {self.exits[rank][0]}"
            elif rank in self.answered:
                state = "finished"
            else:
                state = "still running (no error reported: stuck or waiting for a peer)"
            lines.append(f"  rank {rank}: {state}")
        return "\nState of every rank:\n" + "\n".join(lines)

    def root_cause(self, timeout: float) -> DistributedFitError:
        """The error that names the failing rank.

        When one rank fails, its peers fail too, inside a collective, a moment
        later or earlier: prefer a rank whose own code raised, then a rank
        that exited without reporting an error; a collective timeout with a
        silent rank names that rank.
        """
        states = self.states()
        for rank, details in self.errors.items():
            if not any(marker in details for marker in _PEER_ERROR_MARKERS):
                return DistributedFitError(rank, details + states)
        for rank, (code, tail) in self.exits.items():
            if rank in self.errors:  # it left because it raised (reported above)
                continue
            culprit, details = exit_error(rank, code, tail, self.silent())
            return DistributedFitError(culprit, details + states)
        rank, details = next(iter(self.errors.items()))
        stuck = self.silent()
        if "Timed out" in details and stuck:
            details = (
                f"it stopped answering: rank {rank} timed out after {timeout} s waiting for it "
                f"in a collective.\nRank {rank}'s error:\n{details}"
            )
            rank = stuck[0]
        return DistributedFitError(rank, details + states)


def exit_error(rank: int, code: int | None, tail: str, silent: list[int]) -> tuple[int, str]:
    """The rank to blame and the message when worker ``rank`` exited without an answer.

    An abort by NCCL's watchdog names the peer that never answered (a rank
    still running that reported nothing), like a gloo timeout does.
    """
    details = f"worker {exit_cause(code)}.\n{tail}"
    silent = [r for r in silent if r != rank]
    if code is not None and code < 0 and silent and any(m in tail for m in _WATCHDOG_MARKERS):
        return silent[0], (
            f"it stopped answering: rank {rank} was aborted by the collective watchdog "
            f"after waiting for it.\nRank {rank}'s {details}"
        )
    return rank, details


def exit_cause(code: int | None) -> str:
    """How a worker ended, from its exit status, with the likely cause of a signal."""
    if code is None:
        return "closed its pipe and did not exit"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    cause = _SIGNAL_CAUSES.get(name, "")
    return f"was killed by {name} (exit code {code}){cause}"


# What a signal most likely means for a worker.
_SIGNAL_CAUSES = {
    "SIGBUS": (
        ": a write to a memory-mapped file of the run directory failed, most likely because "
        f"{rundir.SHARED_MEMORY_DIR} (or the temporary directory) is full"
    ),
    "SIGKILL": ": by the kernel's out-of-memory killer, a user or a process manager",
    "SIGTERM": ": by a user or a process manager",
}
