"""Busy processes for the benchmarks that measure a fit beside them."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator


def _spin(stop) -> None:
    """A process that holds a core until ``stop`` is set: a Python loop that never sleeps."""
    count = 0
    while not stop.is_set():
        for _ in range(100_000):
            count += 1


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """Within the block, ``count`` processes spin, one core's worth each."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinners = [context.Process(target=_spin, args=(stop,)) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    time.sleep(1.0 if count else 0.0)  # the spinners started and running
    try:
        yield
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
