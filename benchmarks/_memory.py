"""Peak memory of this process and its children while a block runs (Linux).

Memory is the proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``:
pages shared between processes, such as torch's libraries in every rank,
count once in total), or the resident set size where Pss is not available.
Sampling reads every process's page tables, so measure memory in runs that
are not also timed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_INTERVAL_SECONDS = 0.01


def _field_bytes(path: str, field: str) -> int | None:
    """A ``kB`` field of a /proc file in bytes; None where the file or field is missing."""
    try:
        text = Path(path).read_text()
    except OSError:  # not available here, or the process just ended
        return None
    for line in text.splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return None


def _memory_bytes(pid: int) -> int:
    for path, field in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        found = _field_bytes(path, field)
        if found is not None:
            return found
    return 0


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                children = [int(child) for child in task.read_text().split()]
            except OSError:
                continue
            found.extend(children)
            frontier.extend(children)
    return found


def tree_memory_bytes(pid: int | None = None) -> int:
    """Memory of ``pid`` (default: this process) and all its descendants, in bytes."""
    pid = os.getpid() if pid is None else pid
    return sum(_memory_bytes(p) for p in [pid, *_descendants(pid)])


def _status_bytes(field: str) -> int:
    return _field_bytes("/proc/self/status", field) or 0


def _reset_high_water_mark() -> bool:
    """Reset this process's peak resident size (``VmHWM``); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Context manager: ``extra_bytes`` is the peak of the process tree's memory
    while the block ran, minus what it held when the block started.

    Sampled every 10 ms; a shorter spike of this process is caught by its
    resident high-water mark (``VmHWM``, reset when the block starts). 0
    where /proc is absent.
    """

    def __init__(self) -> None:
        self.extra_bytes = 0
        self._stop = threading.Event()
        self._available = Path("/proc/self/status").exists()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, tree_memory_bytes())
            self._stop.wait(_INTERVAL_SECONDS)

    def __enter__(self) -> PeakMemory:
        if self._available:
            self._high_water = _reset_high_water_mark()
            self._resident_before = _status_bytes("VmRSS:")
            self._before = self._peak = tree_memory_bytes()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._available:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, tree_memory_bytes())
            self.extra_bytes = self._peak - self._before
            if self._high_water:
                spike = _status_bytes("VmHWM:") - self._resident_before
                self.extra_bytes = max(self.extra_bytes, spike)
