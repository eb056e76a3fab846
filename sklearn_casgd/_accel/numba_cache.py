"""numba's on-disk cache in this user's private folder, never in the installed package.

numba caches compiled code beside the source (``__pycache__`` of the
package) unless told otherwise, which writes pickled index files and
compiled code into the install at run time. Imported before the kernels
are defined: their cache goes to ``NUMBA_CACHE_DIR`` where the user set it,
else to ``$XDG_CACHE_HOME/sklearn_casgd/numba`` (``~/.cache`` by default),
made 0700 before numba first reads it.
"""

from __future__ import annotations

import os


def private_cache_dir() -> str:
    """The folder numba caches the kernels in, made (0700) where it is this library's own."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "sklearn_casgd", "numba")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)  # makedirs' mode is masked by the umask
    return folder


def use_private_cache() -> None:
    """Point numba's cache at :func:`private_cache_dir`, imported before or not."""
    folder = private_cache_dir()
    os.environ["NUMBA_CACHE_DIR"] = folder
    import numba.core.config

    numba.core.config.CACHE_DIR = folder


use_private_cache()
