"""Entry point of a worker of a :class:`~sklearn_casgd.WorkerPool` (see :mod:`.launch`).

Arguments: the pool's private directory, this worker's rank, the number of
workers, the owner's pid, the file descriptor of this worker's message pipe,
the device type, the collective timeout in seconds, whether to arm the
parent-death signal, and its network (``create``, ``join:<pid>`` or
``host``, which the bootstrap acted on before this module was imported:
see :mod:`.netns`). The worker makes sure
it dies with its owner, joins the pool's process group through the
directory's ``FileStore`` and says ``ready``. Then, for every line on its
stdin (the run directory of a fit), it reads the spec, maps its column block
and unlinks it at once (the mapping keeps the pages; nothing outlives the
processes that use them), runs its block on the group, writes its weight
slice into the shared output and its result into the run directory, and
says ``done``, or ``error`` with the traceback as text; while it fits it says
``beat`` every second. An empty line or end of file on stdin closes the worker.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from .._engine.comm import TorchCommunicator
from .._engine.fit import fit_block
from .launch import BEAT_SECONDS, CAN_SET_GROUP_TIMEOUT, STARTUP_SECONDS, rank_device
from .rundir import (
    WorkerSpec,
    block_path,
    load_rows,
    map_block,
    map_output,
    read_private,
    remove_runs_of,
    result_path,
    sparse_block_paths,
    spec_path,
    store_path,
    write_private,
)
from .threads import numpy_blas_single_threaded, ranks_yield

_PR_SET_PDEATHSIG = 1
_PARENT_POLL_SECONDS = 0.5
# The parent-death signal, and how long it waits for the dying parent's last
# thread (and with it the parent's files) to end.
_DEATH_SIGNAL = signal.SIGUSR2
_DYING_SECONDS = 30.0
# Held by the thread that cleans up after a dead parent, and set once it has
# begun (re-entrant: a signal handler may run on the thread that holds it).
_ABANDONING = threading.RLock()
_CLEANING = threading.Event()
# Directories to remove if the owner dies: the pool's, and the current fit's.
_OWNED_DIRS: list[str] = []


def clean_up_after(parent_pid: int) -> None:
    """Remove what the dead owner left: the pool's directory, the fit's, a run it was writing."""
    for directory in list(_OWNED_DIRS):
        shutil.rmtree(directory, ignore_errors=True)
    remove_runs_of(parent_pid)


def abandon(parent_pid: int) -> None:
    """Clean up after the dead owner, then end this process.

    One thread does it, once: the death signal's handler, the parent watch
    and the main thread at end of file may all come here, and one's lock on
    the run directory would make it look held to another, whose exit would
    then end the first one's removal midway. Other threads wait here until
    the process ends; a signal handler that interrupts the cleanup on its
    own thread returns to it.
    """
    _ABANDONING.acquire()
    if _CLEANING.is_set():
        _ABANDONING.release()
        return
    _CLEANING.set()
    clean_up_after(parent_pid)
    os._exit(1)


def owner_is_gone(parent_pid: int, seconds: float) -> bool:
    """Whether ``parent_pid`` is gone within ``seconds`` (its pipes close before reparenting)."""
    deadline = time.monotonic() + seconds
    while os.getppid() == parent_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def die_with_parent(parent_pid: int, death_signal: bool) -> None:
    """End this process, and remove the directories it uses, when ``parent_pid`` ends.

    A parent killed outright (SIGKILL, a kernel restart) runs no cleanup, so
    its workers do it: Linux's parent-death signal (armed only when
    ``death_signal``, as it fires when the parent's starting thread ends)
    acts at once when this thread is in Python, and a watch on the parent
    covers a main thread blocked in a collective, workers started by
    another thread, and other systems.

    The death signal is :data:`_DEATH_SIGNAL`, not SIGTERM: it comes when
    the thread that started this worker ends, which in a dying parent can
    be well before its last thread (a parent that loaded pyarrow has a
    dozen, and unmapping a large process takes time), so this worker can
    still be its child then; a SIGTERM seen at such a moment could not be
    told from a process manager's.
    """

    def on_parent_death(*_: object) -> None:
        # The parent's files (its directory locks) close with its last thread.
        owner_is_gone(parent_pid, _DYING_SECONDS)
        abandon(parent_pid)

    def on_sigterm(*_: object) -> None:
        if os.getppid() != parent_pid:  # the parent is gone: clean up after it
            abandon(parent_pid)
        # A SIGTERM from anyone else (a process manager) ends this worker only: the
        # directories belong to the owner, which reports the signal and removes them.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(_DEATH_SIGNAL, on_parent_death)
    if death_signal and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, _DEATH_SIGNAL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent is already gone
        abandon(parent_pid)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_SECONDS)
        abandon(parent_pid)

    threading.Thread(target=watch, name="sklearn_casgd-parent-watch", daemon=True).start()


class Messages:
    """This worker's pipe to the owner: one JSON ``[kind, text]`` per line, never a pickle.

    The main thread and the heartbeat write to it; a lock keeps their lines whole.
    """

    def __init__(self, fd: int) -> None:
        self.pipe = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def say(self, kind: str, text: str = "") -> None:
        with self._lock:
            self.pipe.write(json.dumps([kind, text]) + "\n")
            self.pipe.flush()


def start_heartbeat(messages: Messages) -> threading.Event:
    """Say ``beat`` every ``BEAT_SECONDS`` while the returned event is set (during a fit).

    The owner hears a worker that computes, waits in a collective or
    prints; one that is stopped or frozen falls silent, and the owner gives
    up on it after the fit's timeout (see ``launch.SILENCE_MARGIN``).
    Between fits nobody reads the pipe, so it stays quiet.
    """
    fitting = threading.Event()

    def beat() -> None:
        while fitting.wait():
            messages.say("beat")
            time.sleep(BEAT_SECONDS)

    threading.Thread(target=beat, name="sklearn_casgd-heartbeat", daemon=True).start()
    return fitting


class ForwardedOutput(io.TextIOBase):
    """A stdout that sends what is written to the owner, which prints it (progress bars)."""

    def __init__(self, messages: Messages) -> None:
        self.messages = messages

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            self.messages.say("out", text)
        return len(text)


def _inject_fault(fault: str | None, rank: int) -> None:
    """The tests' failure hook (``launch._FAULT``, passed in the spec)."""
    if not fault or int(fault.split(":")[0]) != rank:
        return
    kind = fault.split(":")[1]
    if kind == "raise":
        raise RuntimeError(f"fault injected on rank {rank}")
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(3600)


def join_group(
    pool_dir: str, rank: int, world_size: int, device: torch.device, timeout: float
) -> None:
    """Form the pool's process group with every worker present."""
    store = dist.FileStore(str(store_path(pool_dir)), -1)
    # The rendezvous waits for the slowest rank to start; collectives then
    # time out after each fit's own timeout.
    store.set_timeout(timedelta(seconds=timeout + STARTUP_SECONDS))
    # Meet at a start line first, so the group forms with every rank present.
    store.set(f"started/{rank}", b"1")
    store.wait([f"started/{r}" for r in range(world_size)])
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )


def run_fit(run_dir: str, rank: int, device: torch.device) -> None:
    """Fit this rank's block of the run directory's problem on the pool's group."""
    spec: WorkerSpec = read_private(spec_path(run_dir))
    torch.set_num_threads(spec.threads_per_worker)
    if CAN_SET_GROUP_TIMEOUT:  # else the pool was started with this timeout
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=spec.timeout))
    plan = spec.plan
    X_block = map_block(spec, rank, plan.policy.x_storage).to(device)
    # The mapping keeps the pages alive (an empty block has no file); a
    # sparse block was read into memory.
    for path in [block_path(run_dir, rank), *sparse_block_paths(run_dir, rank)]:
        path.unlink(missing_ok=True)
    target, sample_weight = load_rows(run_dir)
    _inject_fault(spec.fault, rank)
    yields = ranks_yield(len(spec.blocks))
    comm = TorchCommunicator(None, device, timedelta(seconds=spec.timeout), yields)
    start, stop = spec.blocks[rank]
    with numpy_blas_single_threaded():
        result = fit_block(plan, X_block, target, sample_weight, (start, stop), comm)
    output = map_output(spec)
    output[start:stop] = result.coef
    output.flush()
    del output  # unmapped now: the pool outlives the fit's files
    write_private(result_path(run_dir, rank), result)


def serve(argv: list[str], messages: Messages) -> bool:
    """Join the group and run the fits sent on stdin; whether it ended at end of file."""
    pool_dir, rank, world_size = argv[0], int(argv[1]), int(argv[2])
    timeout = float(argv[6])
    count = torch.cuda.device_count() if torch.device(argv[5]).type == "cuda" else 0
    device = rank_device(argv[5], rank, world_size, count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join_group(pool_dir, rank, world_size, device, timeout)
    fitting = start_heartbeat(messages)
    messages.say("ready")
    # An empty line closes the worker (a forked copy of the owner may hold the
    # pipe open, so end of file may never come); end of file means the owner died.
    while line := sys.stdin.readline():
        if not (run_dir := line.strip()):
            return False
        _OWNED_DIRS.append(run_dir)
        sys.stdout = ForwardedOutput(messages)
        fitting.set()
        try:
            run_fit(run_dir, rank, device)
        finally:
            if device.type == "cuda":  # the fit's cached blocks back to the device between fits
                torch.cuda.empty_cache()
            fitting.clear()
            sys.stdout = sys.__stdout__
            _OWNED_DIRS.remove(run_dir)
        messages.say("done")
    return True


def raise_open_file_limit() -> None:
    """Soft limit on open files up to the hard one.

    gloo aborts a worker whose accept() finds no free descriptor, and on the
    host's loopback any local process may connect to the workers' listener:
    idle connections beyond the soft limit would end the worker.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str]) -> None:
    pool_dir, parent_pid, message_fd = argv[0], int(argv[3]), int(argv[4])
    raise_open_file_limit()
    _OWNED_DIRS.append(pool_dir)
    die_with_parent(parent_pid, death_signal=argv[7] == "1")
    messages = Messages(message_fd)
    try:
        try:
            at_end_of_file = serve(argv, messages)
        except BaseException:
            # A failed rank leaves: its group is not reused (the owner starts a new one).
            messages.say("error", traceback.format_exc())
            sys.exit(1)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Closed: by the owner (an empty line), or by its death (end of file), which
        # the parent-death signal does not report for workers started by a thread.
        if at_end_of_file and owner_is_gone(parent_pid, seconds=2.0):
            abandon(parent_pid)
    finally:
        # However this thread ends (an error writing to the dead owner, its
        # group's teardown): with the owner gone, the cleanup another thread
        # began ends the process, not this thread's exit midway through it.
        if _CLEANING.is_set() or os.getppid() != parent_pid:
            abandon(parent_pid)
