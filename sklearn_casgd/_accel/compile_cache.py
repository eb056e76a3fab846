"""Refuse to compile when another local user can write into torch.compile's caches.

Inductor keeps compiled code on disk and loads it back by content hash:
Python modules, shared libraries, precompiled C++ headers and pickled
graphs. It finds them under a predictable folder,
``<tempdir>/torchinductor_<user>``, which it creates with
``os.makedirs(exist_ok=True)`` and never checks. Whoever creates that
folder first on a shared machine, or can write into it, can plant a file
under the hash of a kernel this library compiles and have it run in the
fit. ``TORCHINDUCTOR_CACHE_DIR`` does not move all of it: torch 2.13 still
writes its precompiled headers (and on CUDA its padding decisions) under
the default folder, so that folder is checked whatever the variable says.

:func:`check_compile_caches` runs before every compile: it creates the
default folder itself (mode 0700) when it is missing, and raises
:class:`UnsafeCompileCacheError` when the folder is not a real folder of
this user that only this user can write, or sits in a parent folder where
others could swap it. A folder named by ``TORCHINDUCTOR_CACHE_DIR`` is the
user's own choice and is not checked.
"""

from __future__ import annotations

import getpass
import os
import re
import stat
import tempfile
from pathlib import Path


class UnsafeCompileCacheError(RuntimeError):
    """The cache folder of torch.compile could hold code planted by another user.

    Raised by a fit with ``compile=True`` when torch's default cache folder,
    ``<tempdir>/torchinductor_<user>``, belongs to another user, can be
    written by other users, is a link, or lies in a folder where others
    could replace it; the message names the folder and the reason.
    ``compile="auto"`` runs the eager steps with a warning instead.
    """


def default_inductor_folder() -> Path:
    """``<tempdir>/torchinductor_<user>``, by torch's rule, without importing inductor.

    Importing ``torch._inductor`` creates the folder (mode 0755 under the
    usual umask): the folder is named here so that it can be made 0700 first.
    """
    try:
        username = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        username = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return Path(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", username))


def default_cache_folders() -> list[Path]:
    """The folders torch.compile writes under whatever ``TORCHINDUCTOR_CACHE_DIR`` says.

    The first is made (0700) where missing before inductor is imported.
    """
    first = default_inductor_folder()
    unsafe_folder_reason(first)  # makes it 0700 if missing; checked again by the caller
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folders = [Path(default_cache_dir())]
    if first not in folders:
        folders.insert(0, first)
    # torch reads the temporary directory for its precompiled headers once,
    # when inductor's code cache is imported: check that folder too.
    try:
        from torch._inductor import codecache

        header_folder = Path(getattr(codecache, "_HEADER_DIR", "")).parent
    except ImportError:  # pragma: no cover - a torch without inductor compiles nothing
        header_folder = folders[0]
    if header_folder != Path(".") and header_folder not in folders:
        folders.append(header_folder)
    return folders


def unsafe_folder_reason(folder: Path) -> str | None:
    """Why another local user could put files in ``folder``, or None.

    A missing folder is created, readable and writable by this user only.
    """
    if os.name != "posix":  # Windows' temporary folder is the user's own
        return None
    uid = os.geteuid()
    parent = folder.parent
    try:
        parent_stat = parent.stat()
    except FileNotFoundError:
        return f"its parent folder {parent} does not exist"
    if parent_stat.st_uid not in (0, uid):
        return f"its parent folder {parent} belongs to user id {parent_stat.st_uid}"
    if parent_stat.st_mode & 0o022 and not parent_stat.st_mode & stat.S_ISVTX:
        # Others may rename entries of a shared folder unless it is sticky (/tmp is).
        return f"its parent folder {parent} is writable by other users and not sticky"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    folder_stat = folder.lstat()
    if stat.S_ISLNK(folder_stat.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(folder_stat.st_mode):
        return "it is not a folder"
    if folder_stat.st_uid != uid:
        return f"it belongs to user id {folder_stat.st_uid}, not to this process's {uid}"
    mode = stat.S_IMODE(folder_stat.st_mode)
    if mode & 0o002 or (mode & 0o020 and not _is_private_group(folder_stat.st_gid)):
        return f"other users can write into it (mode {mode:#o}, group id {folder_stat.st_gid})"
    return None


def _is_private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group (named after the user, no other member).

    Under umask 002 (user private groups, as on Debian) torch creates its
    folder group-writable: that is no one else's write.
    """
    try:
        import grp
        import pwd

        group = grp.getgrgid(gid)
        user = pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return False
    return gid == os.getegid() and group.gr_name == user and set(group.gr_mem) <= {user}


def check_compile_caches() -> None:
    """Raise :class:`UnsafeCompileCacheError` unless torch.compile's default folders are safe."""
    for folder in default_cache_folders():
        reason = unsafe_folder_reason(folder)
        if reason is not None:
            raise UnsafeCompileCacheError(
                f"torch.compile's cache folder {folder} is not safe to load compiled "
                f"code from: {reason}. Remove it, or start Python with TMPDIR set to a "
                "folder only you can write to; or fit with compile=False."
            )
