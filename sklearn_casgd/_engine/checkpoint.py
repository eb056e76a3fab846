"""Checkpoints of a fit: every rank's weights and the epoch loop's state, on disk.

A fit with a checkpoint directory writes, every ``every`` epochs, one file
per rank (its weight block and whatever of its state a resumed loop needs
bit for bit) and then, once every rank's file is on disk, a manifest that
names the epoch, the loop's state (equal on every rank) and the identity
of the fit: its data, parameters and ranks. A checkpoint is complete only
once its manifest is: each file is written to a temporary name, flushed
to disk and renamed over the last (``os.replace`` is atomic), so a rank
killed at any moment leaves the last complete checkpoint readable.

Every checkpoint proves itself: the manifest holds each rank file's
SHA-256 and a SHA-256 of its own other fields, and both are checked before
anything is read (torch's zip reader checks no checksum: one flipped byte of
a tensor's data was read back as a weight of 1.3e38); every field of the
manifest is validated. Files are written 0600 in a directory made 0700, and
temporary files a dead writer left are removed when a fit starts.

A fit started on a directory with a manifest of the same identity resumes
there: the weights and the loop's state are those the interrupted fit had
after that epoch, and the epochs that follow take the same steps as the
uninterrupted fit. A manifest of another identity is refused, naming what
differs. Every rank reads the directory, so several machines need it on
a shared file system.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from .comm import Communicator

MANIFEST = "manifest.json"

# The manifest's layout; a manifest of another format is refused.
FORMAT = 2

# The names _atomic_write gives its temporary files (a writer's pid in them).
_TEMPORARY = re.compile(r"^\..+\.\d+\.tmp$")

# The data's fingerprint is float sums over X, y and the weights: equal data
# read on another machine may differ in the last bits of a sum.
_FINGERPRINT_RTOL = 1e-9


@dataclass(frozen=True)
class CheckpointSpec:
    """Where a fit writes its checkpoints, how often, and the one it resumes. Picklable.

    ``identity`` names what a checkpoint must match to be resumed (JSON
    values: the data's fingerprint as a list of floats under ``"data"``,
    strings and numbers otherwise); ``resumed`` is the manifest of the
    checkpoint this fit continues, or None.
    """

    directory: str
    every: int
    identity: dict[str, Any]
    resumed: dict | None = None

    @property
    def resumed_epoch(self) -> int | None:
        return None if self.resumed is None else int(self.resumed["epoch"])

    @property
    def loop(self) -> dict | None:
        """The epoch loop's state in the checkpoint resumed (``_Run.loop_state``)."""
        return None if self.resumed is None else self.resumed["loop"]


def solver_state_to_json(state: dict) -> dict:
    """A ``SolverState.state_dict()`` as JSON values: the generator's bytes as hex."""
    return {**state, "generator": state["generator"].hex()}


def solver_state_from_json(state: dict) -> dict:
    """The ``SolverState.state_dict()`` that :func:`solver_state_to_json` wrote."""
    return {**state, "generator": bytes.fromhex(state["generator"])}


def rank_file(directory: str | os.PathLike, rank: int, epoch: int) -> Path:
    return Path(directory) / f"rank-{rank}-epoch-{epoch}.pt"


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The manifest of the last complete checkpoint in ``directory``, or None if there is none.

    A ``ValueError`` names what is wrong with a manifest that cannot be
    trusted: not JSON, another format, a checksum that does not match its
    fields (a damaged file), or a field of the wrong type or range.
    """
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"Cannot read the checkpoint manifest {path}: {error}.") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"The checkpoint manifest {path} is not valid JSON: {error}.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a checkpoint manifest of format {FORMAT} (sklearn_casgd "
            f"{__version__}). Use another checkpoint_dir, or delete it to start afresh."
        )
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise ValueError(
            f"The checkpoint manifest {path} is damaged: its SHA-256 does not match its "
            "contents. Delete the directory to start afresh."
        )
    problems = manifest_problems(manifest)
    if problems:
        raise ValueError(
            f"The checkpoint manifest {path} is not one this library wrote: "
            + "; ".join(problems)
            + ". Delete the directory to start afresh."
        )
    return manifest


def _manifest_checksum(manifest: dict) -> str:
    """The SHA-256 of every field of ``manifest`` but the checksum, in canonical JSON."""
    fields = {name: value for name, value in manifest.items() if name != "checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_float(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _floats(value: Any) -> bool:
    return isinstance(value, list) and all(_is_float(item) for item in value)


# The epoch loop's fields (solver._Run.loop_state) and what each must be.
_LOOP_FIELDS = {
    "epochs": lambda v: _is_int(v, 1),
    "finished": lambda v: isinstance(v, bool),
    "s": lambda v: _is_int(v, 1),
    "solver_state": lambda v: isinstance(v, dict),
    "loss_curve": _floats,
    "epoch_seconds": _floats,
    "validation_scores": _floats,
    "n_outer": lambda v: _is_int(v),
    "lowest": _is_float,
    "lowest_gradient": _is_float,
    "gradient_bound": lambda v: v is None or _is_float(v),
    "gradient_unit": _is_float,
    "start_measurement": lambda v: v is None or isinstance(v, dict),
    "stalled": lambda v: isinstance(v, bool),
    "stopped_early": lambda v: isinstance(v, bool),
    "newton": lambda v: v is None or isinstance(v, dict),
}


def manifest_problems(manifest: dict) -> list[str]:
    """What in a (checksummed) manifest is not of the type and range this library writes."""
    problems = []
    if not isinstance(manifest.get("version"), str):
        problems.append("version is not a string")
    for name in ("epoch", "world_size"):
        if not _is_int(manifest.get(name), 1):
            problems.append(f"{name}={manifest.get(name)!r} is not a positive int")
    if not isinstance(manifest.get("identity"), dict):
        problems.append("identity is not a dict")
    files = manifest.get("files")
    if not (
        isinstance(files, dict)
        and all(
            isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)
            for digest in files.values()
        )
    ):
        problems.append("files is not a dict of SHA-256 digests")
    loop = manifest.get("loop")
    if not isinstance(loop, dict):
        return [*problems, "loop is not a dict"]
    for name, valid in _LOOP_FIELDS.items():
        if name not in loop:
            problems.append(f"loop.{name} is missing")
        elif not valid(loop[name]):
            problems.append(f"loop.{name}={loop[name]!r} is not what a loop records")
    if not problems and loop["epochs"] != manifest["epoch"]:
        problems.append(f"loop.epochs={loop['epochs']} is not epoch={manifest['epoch']}")
    return problems


def remove_temporaries(directory: str | os.PathLike) -> None:
    """Delete the temporary files that writers killed mid-write left in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if _TEMPORARY.match(name):
            Path(directory, name).unlink(missing_ok=True)


def resumable(directory: str | os.PathLike, identity: dict[str, Any]) -> dict | None:
    """The manifest to resume in ``directory``; None if there is none.

    Raises ``ValueError`` naming what differs when the checkpoint there was
    written by another fit (other data, parameters or ranks) or version.
    """
    remove_temporaries(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    differs = []
    if manifest.get("version") != __version__:
        differs.append(f"sklearn_casgd version ({manifest.get('version')} there)")
    saved = manifest.get("identity", {})
    for name in sorted(set(saved) | set(identity)):
        if not _same(name, saved.get(name), identity.get(name)):
            differs.append(f"{name} ({saved.get(name)!r} there, {identity.get(name)!r} here)")
    if differs:
        raise ValueError(
            f"The checkpoint in {directory} was written by another fit; it differs in: "
            + "; ".join(differs)
            + ". Fit with the same data and parameters to resume it, or use another "
            "checkpoint_dir (one per fit: a grid search needs one per candidate)."
        )
    return manifest


def _same(name: str, saved: Any, current: Any) -> bool:
    if name == "data" and isinstance(saved, list) and isinstance(current, list):
        return len(saved) == len(current) and all(
            math.isclose(a, b, rel_tol=_FINGERPRINT_RTOL, abs_tol=1e-12)
            for a, b in zip(saved, current, strict=True)
        )
    return saved == current


class RankCheckpoints:
    """One rank's side of the checkpoints: its own file, and the manifest on rank 0."""

    def __init__(self, spec: CheckpointSpec, comm: Communicator, device: torch.device) -> None:
        self.spec = spec
        self.comm = comm
        self.device = device
        self.directory = Path(spec.directory)

    def load(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of the checkpoint resumed; if any rank fails, a ValueError on all.

        A rank whose file is missing or unreadable names it; the others
        learn of it through one all-reduce, so that no rank waits for one
        that gave up.
        """
        epoch = self.spec.resumed_epoch
        path = rank_file(self.directory, self.comm.rank, epoch)
        expected = self.spec.resumed["files"].get(path.name)
        problem, tensors = None, {}
        try:
            payload = path.read_bytes()
            if hashlib.sha256(payload).hexdigest() != expected:
                raise _Damaged
            tensors = torch.load(io.BytesIO(payload), map_location=self.device, weights_only=True)
            if not isinstance(tensors, dict):
                raise ValueError(f"expected a dict of tensors, got {type(tensors).__name__}")
        except FileNotFoundError:
            problem = "it is missing"
        except _Damaged:
            problem = (
                "is damaged: its SHA-256 does not match the manifest's"
                if expected is not None
                else "is not among the files the manifest names"
            )
        except pickle.UnpicklingError:
            # torch's message advises weights_only=False: never, for a file found on disk.
            problem = "holds objects other than tensors, which are not loaded"
        except (OSError, RuntimeError, ValueError, EOFError) as error:
            problem = f"it cannot be read ({type(error).__name__}: {error})"
        failed = torch.tensor([0.0 if problem is None else 1.0])
        self.comm.all_reduce(failed)
        if problem is not None:
            raise ValueError(
                f"Rank {self.comm.rank} cannot resume the checkpoint of epoch {epoch} in "
                f"{self.directory}: its file {path.name} {problem}. Delete the directory "
                "to start afresh."
            )
        if float(failed) > 0:
            raise ValueError(
                f"Rank {self.comm.rank} stops: {int(failed)} other rank(s) cannot read their "
                f"file of the checkpoint of epoch {epoch} in {self.directory}."
            )
        return tensors

    def save(self, epoch: int, loop: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Write this rank's tensors after ``epoch`` epochs; rank 0 then writes the manifest.

        The manifest is written only once every rank's file is on disk
        (a barrier), and older files are removed only once it is (another):
        at every moment the directory holds one complete checkpoint.
        """
        _private_directory(self.directory)
        rank = self.comm.rank
        cpu = {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}
        buffer = io.BytesIO()
        torch.save(cpu, buffer)
        payload = buffer.getvalue()
        path = rank_file(self.directory, rank, epoch)
        _atomic_write(path, lambda f: f.write(payload))
        digests = self._gather_digests(hashlib.sha256(payload).digest())
        if rank == 0:
            manifest = {
                "format": FORMAT,
                "version": __version__,
                "epoch": epoch,
                "world_size": self.comm.world_size,
                "identity": self.spec.identity,
                "loop": loop,
                "files": {
                    rank_file(self.directory, r, epoch).name: digest.hex()
                    for r, digest in enumerate(digests)
                },
            }
            manifest["checksum"] = _manifest_checksum(manifest)
            text = json.dumps(manifest, indent=1).encode()
            _atomic_write(self.directory / MANIFEST, lambda f: f.write(text))
        self.comm.barrier()
        for stale in self.directory.glob(f"rank-{rank}-epoch-*.pt"):
            if stale.name != path.name:
                stale.unlink(missing_ok=True)

    def _gather_digests(self, digest: bytes) -> list[bytes]:
        """Every rank's file digest, on every rank, once every file is on disk (one all-reduce)."""
        table = torch.zeros(
            (self.comm.world_size, len(digest)), dtype=torch.float64, device=self.device
        )
        table[self.comm.rank] = torch.tensor(list(digest), dtype=torch.float64)
        self.comm.all_reduce(table)
        return [bytes(int(value) for value in row) for row in table.tolist()]


class _Damaged(Exception):
    """A rank file whose bytes are not the ones its manifest names."""


def _private_directory(directory: Path) -> None:
    """Make ``directory`` (and its parents) where missing, the directory itself 0700."""
    if not directory.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask


def _atomic_write(path: Path, write) -> None:
    """``write(file)`` to a temporary name beside ``path``, flushed to disk, then renamed to it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
