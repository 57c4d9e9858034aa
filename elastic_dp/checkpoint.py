"""Durable, world-size-independent checkpoints (DESIGN invariant 7).

Layout of one checkpoint, a directory named for the number of committed steps::

    CKPT_DIR/step-00000120/
        model.safetensors       model.state_dict(), keys as in the model
        optimizer.safetensors   optimizer tensors keyed "<param name>/<state key>", and "rng/torch"
        manifest.json           step, sampler settings, optimizer param groups and
                                non-tensor state, world size at save, sha256 of each file

Tensors are stored without pickle (safetensors). Optimizer state is keyed by parameter
*name*, not by position or rank, so a checkpoint saved by N workers loads at M. A
checkpoint is written under a temporary name, every file and the directory are fsynced,
and only then is it renamed into place: a crash leaves either the whole checkpoint or
none. Loading checks every file against its checksum before using it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_PREFIX = "step-"


@dataclass(slots=True)
class TrainingState:
    """Everything a checkpoint holds, in memory."""

    step: int
    """Committed steps: the next step to run."""
    model: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]
    sampler: dict[str, int]
    world_size: int
    rng: torch.Tensor
    """The torch RNG state of rank 0, restored on every worker on resume."""


def _detached(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # clone: tied weights share storage, which safetensors refuses to save.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file atomically (temporary name, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        save_file(_detached(tensors), str(tmp))
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def probe_writable(directory: Path) -> None:
    """Create ``directory`` and write and remove a file in it; OSError when that fails."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".probe-{uuid.uuid4().hex}"
    probe.write_bytes(b"ok")
    probe.unlink()


# -- optimizer state <-> name-keyed tensors ----------------------------------------------
def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer``'s state into tensors keyed by parameter name and JSON metadata.

    ``names`` maps ``id(param)`` to the parameter's name in the model.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        meta = {k: v for k, v in group.items() if k != "params"}
        meta["params"] = [names[id(p)] for p in group["params"]]
        groups.append(meta)
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{names[id(p)]}/{key}"] = value
                else:
                    scalars.setdefault(names[id(p)], {})[key] = value
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str],
                         tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Inverse of ``optimizer_state``, for an optimizer over the same named parameters."""
    ours = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    theirs = [g["params"] for g in meta["param_groups"]]
    if ours != theirs:
        raise CheckpointError("the checkpoint's optimizer param groups do not match this task's "
                              "optimizer: resume with the job (and optimizer factory) that saved it")
    index = {name: i for i, name in enumerate(n for group in ours for n in group)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        state.setdefault(index[name], {})[field] = value
    for name, fields in meta["scalars"].items():
        state.setdefault(index[name], {}).update(fields)
    groups = []
    for g, group in zip(meta["param_groups"], ours):
        groups.append({**g, "params": [index[n] for n in group]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def merge_shards(parts: list[TrainingState]) -> TrainingState:
    """Join the ZeRO ranks' parts of one training state into a whole one.

    Each part holds slices of some parameters' optimizer state, placed by
    ``optimizer_meta["slices"][key] = [start, shape]``; the model comes from the part that
    has one (rank 0). The result is the same as a stage-0 worker's state.
    """
    first = next((p for p in parts if p.model), parts[0])
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, list[int], torch.Tensor]]] = {}
    for part in parts:
        slices = part.optimizer_meta.get("slices", {})
        for key, value in part.optimizer_tensors.items():
            if key in slices:
                start, shape = slices[key]
                pieces.setdefault(key, []).append((start, shape, value))
            else:
                tensors.setdefault(key, value)
    for key, found in pieces.items():
        shape = found[0][1]
        flat = torch.zeros(math.prod(shape), dtype=found[0][2].dtype)
        covered = 0
        for start, _, value in found:
            flat[start:start + value.numel()] = value.reshape(-1)
            covered += value.numel()
        if covered != flat.numel():
            raise CheckpointError(f"the workers' shards cover {covered} of the {flat.numel()} elements of {key}")
        tensors[key] = flat.reshape(shape)
    meta = {k: v for k, v in first.optimizer_meta.items() if k != "slices"}
    return TrainingState(step=first.step, model=first.model, optimizer_tensors=tensors, optimizer_meta=meta,
                         sampler=first.sampler, world_size=first.world_size, rng=first.rng)


# -- checkpoint directories --------------------------------------------------------------
class CheckpointStore:
    """Saves, finds and loads checkpoints in one directory."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3) -> None:
        self.dir = Path(directory)
        self.keep = keep

    def check_writable(self) -> None:
        """Fail now, before training, if checkpoints could not be written."""
        try:
            probe_writable(self.dir)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {str(self.dir)!r} is not writable "
                                  f"({exc.strerror or exc}): pass a writable --checkpoint-dir") from None

    def save(self, state: TrainingState) -> Path:
        final = self.dir / f"{_PREFIX}{state.step:08d}"
        tmp = self.dir / f".tmp-{final.name}-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            files = {"model.safetensors": state.model,
                     "optimizer.safetensors": {**state.optimizer_tensors, "rng/torch": state.rng}}
            checksums = {}
            for name, tensors in files.items():
                save_file(_detached(tensors), str(tmp / name))
                _fsync_file(tmp / name)
                checksums[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
            manifest = {"format": FORMAT_VERSION, "step": state.step, "sampler": state.sampler,
                        "world_size": state.world_size, "optimizer": state.optimizer_meta,
                        "files": checksums, "created": time.time()}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            _fsync_file(tmp / "manifest.json")
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again (e.g. after a resume)
                old = self.dir / f".old-{final.name}-{uuid.uuid4().hex}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._prune()
        return final

    def _complete(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir()
                 if p.name.startswith(_PREFIX) and (p / "manifest.json").is_file()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))

    def _prune(self) -> None:
        for old in self._complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        found = self._complete()
        return found[-1] if found else None

    def load(self, path: Path | None = None) -> TrainingState:
        """Load ``path`` (default: the latest checkpoint), verifying every checksum."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint to resume from in {str(self.dir)!r}: drop --resume "
                                  "or pass the --checkpoint-dir that a run saved into")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable manifest.json ({exc})") from None
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {str(path)!r} has format {manifest.get('format')}, "
                                  f"this elastic_dp reads format {FORMAT_VERSION}")
        for name, expected in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}")
            if _sha256(file) != expected["sha256"]:
                raise CheckpointError(f"checkpoint file {str(file)!r} does not match its sha256 in "
                                      "manifest.json (corrupted or modified): delete this checkpoint "
                                      "directory to resume from an older one")
        optimizer_tensors = load_file(str(path / "optimizer.safetensors"))
        rng = optimizer_tensors.pop("rng/torch")
        state = TrainingState(step=manifest["step"], model=load_file(str(path / "model.safetensors")),
                              optimizer_tensors=optimizer_tensors, optimizer_meta=manifest["optimizer"],
                              sampler=manifest["sampler"], world_size=manifest["world_size"], rng=rng)
        return state


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
