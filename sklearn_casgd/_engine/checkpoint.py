"""Checkpoints of a fit: every rank's weights and the epoch loop's state, on disk.

A fit with a checkpoint directory writes, every ``every`` epochs, one file
per rank (its weight block and whatever of its state a resumed loop needs
bit for bit) and then, once every rank's file is on disk, a manifest that
names the epoch, the loop's state (equal on every rank) and the identity
of the fit: its data, parameters and ranks. A checkpoint is complete only
once its manifest is: each file is written to a temporary name, flushed
to disk and renamed over the last (``os.replace`` is atomic), so a rank
killed at any moment leaves the last complete checkpoint readable.

A fit started on a directory with a manifest of the same identity resumes
there: the weights and the loop's state are those the interrupted fit had
after that epoch, and the epochs that follow take the same steps as the
uninterrupted fit. A manifest of another identity is refused, naming what
differs. Every rank reads the directory, so several machines need it on
a shared file system.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from .comm import Communicator

MANIFEST = "manifest.json"

# The manifest's layout; a manifest of another format is refused.
FORMAT = 1

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
    """The manifest of the last complete checkpoint in ``directory``, or None if there is none."""
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as error:
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
    return manifest


def resumable(directory: str | os.PathLike, identity: dict[str, Any]) -> dict | None:
    """The manifest to resume in ``directory``; None if there is none.

    Raises ``ValueError`` naming what differs when the checkpoint there was
    written by another fit (other data, parameters or ranks) or version.
    """
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
        problem, tensors = None, {}
        try:
            tensors = torch.load(path, map_location=self.device, weights_only=True)
            if not isinstance(tensors, dict):
                raise ValueError(f"expected a dict of tensors, got {type(tensors).__name__}")
        except FileNotFoundError:
            problem = "it is missing"
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
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
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = self.comm.rank
        cpu = {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}
        _atomic_write(rank_file(self.directory, rank, epoch), lambda f: torch.save(cpu, f))
        self.comm.barrier()
        if rank == 0:
            manifest = {
                "format": FORMAT,
                "version": __version__,
                "epoch": epoch,
                "world_size": self.comm.world_size,
                "identity": self.spec.identity,
                "loop": loop,
            }
            text = json.dumps(manifest, indent=1).encode()
            _atomic_write(self.directory / MANIFEST, lambda f: f.write(text))
        self.comm.barrier()
        for stale in self.directory.glob(f"rank-{rank}-epoch-*.pt"):
            if stale.name != rank_file(self.directory, rank, epoch).name:
                stale.unlink(missing_ok=True)


def _atomic_write(path: Path, write) -> None:
    """``write(file)`` to a temporary name beside ``path``, flushed to disk, then renamed to it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
