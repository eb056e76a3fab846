"""A private network namespace for the CPU workers of a pool (Linux).

gloo's connections between the workers go through a socket that listens on
the loopback interface for the pool's whole life; on the host's loopback
any local process can connect to it, and enough idle connections make gloo
abort the worker. In a network namespace of their own the workers have a
loopback interface that no other process can reach. An unprivileged process
gets one inside a new user namespace, where it maps its own uid and gid to
themselves (files keep their owners). Rank 0 creates the namespaces and the
other ranks join them, each before Python starts a thread (a multithreaded
process cannot enter a user namespace). Where user namespaces are not
allowed the workers stay on the host's loopback.

This module imports only the standard library: the worker bootstrap loads
it by path, before the package (and torch, with its threads) is imported.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import struct

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14s"  # struct ifreq: the name, then the flags (the rest unused here)
# The loopback interface of a new network namespace.
LOOPBACK = "lo"


def _call(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def create() -> bool:
    """Move this (single-threaded) process into new user and network namespaces.

    A forked child tries first: where the system refuses any step (no user
    namespaces, no uid map, loopback stays down) this process stays where it
    is and the answer is False.
    """
    child = os.fork()
    if child == 0:  # the trial: exit 0 if every step worked
        try:
            _move()
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        return False
    _move()
    return True


def _move() -> None:
    uid, gid = os.getuid(), os.getgid()
    _call("unshare", CLONE_NEWUSER | CLONE_NEWNET)
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _loopback_up()


def join(pid: int) -> None:
    """Enter the user and network namespaces of process ``pid``."""
    for kind in ("user", "net"):
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            _call("setns", fd, 0)
        finally:
            os.close(fd)


def _loopback_up() -> None:
    """A new network namespace's loopback interface starts down."""
    name = LOOPBACK.encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
        request = struct.pack(_IFREQ, name, 0, b"")
        flags = struct.unpack(_IFREQ, fcntl.ioctl(handle.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(handle.fileno(), _SIOCSIFFLAGS, struct.pack(_IFREQ, name, flags | _IFF_UP, b""))


def enter(mode: str, message_fd: int) -> None:
    """Do what the owner asked for this worker: ``create``, ``join:<pid>`` or ``host``.

    ``create`` says on the worker's message pipe where the workers' network
    is (``["network", "private"]``, or ``"host"`` where the system does not
    allow namespaces); a failed ``join`` raises, and the worker exits with it.
    """
    if mode == "create":
        where = "private" if create() else "host"
        os.write(message_fd, (json.dumps(["network", where]) + "\n").encode())
    elif mode.startswith("join:"):
        join(int(mode.split(":", 1)[1]))
