"""Durable, world-size-independent checkpoints (docs/design.md), written by every rank.

The files of one checkpoint in its storage (``elastic_dp.durable.storage``: a local directory, a
shared mount or an object store), a directory named for the committed steps and the
attempt that wrote it::

    step-00000120-1f3a9c2e/
        model-00000.safetensors   rank 0's share of every model tensor (and rank 0's RNG)
        optim-00000.safetensors   rank 0's share of the optimizer state
        model-00001.safetensors   ...one pair per rank of the generation that saved it
        manifest.json             written last: the checkpoint exists once it is there

Every rank writes its own two files straight to the storage. Tensors are split into
flat pieces: a replicated tensor (every model tensor; all optimizer state at ZeRO stage
0) is cut into ``world_size`` contiguous ranges, one per rank, so no rank writes the
whole model alone; with ZeRO each rank writes the chunk of the optimizer state it owns.
The coordinator then writes ``manifest.json``: step, sampler, optimizer param groups,
0-dim optimizer tensors (step counts) as numbers, and for every tensor its shape, dtype
and pieces (file, offset, length), and each file's size and sha256. Object stores have no
atomic rename, so the manifest commits the checkpoint: a directory without one is an
abandoned save and is never read. No tensor passes through the driver.

Loading is parallel too: each rank reads the files it needs (all model files; with ZeRO
only the optimizer files that overlap its new chunk and its left neighbour's), checks
each against its sha256, and assembles whole tensors keyed by parameter *name*, so a
checkpoint saved at N workers and any ZeRO stage loads at M workers and any stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from elastic_dp.durable.storage import Storage
from elastic_dp.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
_PREFIX = "step-"
MANIFEST = "manifest.json"


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
        name, _, field_ = key.rpartition("/")
        state.setdefault(index[name], {})[field_] = value
    for name, fields in meta["scalars"].items():
        state.setdefault(index[name], {}).update(fields)
    groups = []
    for g, group in zip(meta["param_groups"], ours):
        groups.append({**g, "params": [index[n] for n in group]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- one rank's part: flat pieces of tensors -----------------------------------------------
@dataclass(slots=True)
class Part:
    """One rank's share of a checkpoint, copied into host memory (what a save stalls for)."""

    rank: int
    files: dict[str, dict[str, torch.Tensor]]
    """File name -> tensors to write (flat pieces, keyed as in the index)."""
    index: dict[str, dict]
    """Key -> {"shape", "dtype", "pieces": [[file, start, numel]]} of the pieces written here."""
    scalars: dict[str, list]
    """0-dim optimizer tensors: key -> [value, dtype]."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Rank 0's optimizer param groups and non-tensor state (others: empty)."""


REDUCTION = "reduction/"
"""The optimizer-state keys of a reduction's state (``comm.reductions``): one row a rank,
which the strategies' loaders leave to the reduction."""


def part_files(rank: int) -> tuple[str, str]:
    """The model and optimizer file names of part ``rank``."""
    return f"model-{rank:05d}.safetensors", f"optim-{rank:05d}.safetensors"


def add_piece(part: Part, file: str, key: str, value: torch.Tensor, start: int, shape: list[int]) -> None:
    """Put ``value``, the flat piece of tensor ``key`` (of ``shape``) from element ``start``
    on, into ``file`` of ``part`` (a copy in host memory); nothing when it is empty."""
    if value.numel():
        part.files[file][key] = value.detach().reshape(-1).to("cpu", copy=True).contiguous()
        part.index[key] = {"shape": shape, "dtype": dtype_name(value.dtype), "pieces": [[file, start, value.numel()]]}


def cut_part(state: TrainingState, rank: int, world_size: int) -> Part:
    """Rank ``rank``'s pieces of its (possibly partial) training ``state``: its range of
    every whole tensor, and the ZeRO slices it owns (``optimizer_meta["slices"]``)."""
    model_file, optim_file = part_files(rank)
    part = Part(rank=rank, files={model_file: {}, optim_file: {}}, index={}, scalars={})

    def add(file: str, key: str, value: torch.Tensor, start: int, shape: list[int]) -> None:
        add_piece(part, file, key, value, start, shape)

    def add_share(file: str, key: str, value: torch.Tensor) -> None:
        n = value.numel()
        lo, hi = rank * n // world_size, (rank + 1) * n // world_size
        add(file, key, value.reshape(-1)[lo:hi], lo, list(value.shape))

    for name, value in state.model.items():
        add_share(model_file, f"model/{name}", value)
    slices = state.optimizer_meta.get("slices", {})
    for name, value in state.optimizer_tensors.items():
        if value.dim() == 0:
            part.scalars[f"optim/{name}"] = [value.item(), dtype_name(value.dtype)]
        elif name in slices:
            start, shape = slices[name]
            add(optim_file, f"optim/{name}", value, start, shape)
        else:
            add_share(optim_file, f"optim/{name}", value)
    if rank == 0:
        add(model_file, "rng", state.rng, 0, list(state.rng.shape))
        part.meta = {k: v for k, v in state.optimizer_meta.items() if k != "slices"}
    part.files = {f: t for f, t in part.files.items() if t}
    return part


def write_part(storage: Storage, directory: str, part: Part) -> dict[str, Any]:
    """Write ``part``'s files into ``directory`` of ``storage``; what the manifest needs of it."""
    files = {}
    for name, tensors in part.files.items():
        data = save_bytes(tensors)
        storage.write(f"{directory}/{name}", data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return {"rank": part.rank, "files": files, "index": part.index, "scalars": part.scalars, "meta": part.meta}


def manifest_of(parts: list[dict[str, Any]], *, step: int, sampler: dict[str, int], world_size: int,
                settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of one checkpoint out of every rank's ``write_part`` report."""
    files, index, scalars = {}, {}, {}
    meta: dict[str, Any] = {}
    for report in sorted(parts, key=lambda r: r["rank"]):
        files.update(report["files"])
        for key, entry in report["index"].items():
            index.setdefault(key, {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": []})
            index[key]["pieces"].extend(entry["pieces"])
        for key, value in report["scalars"].items():
            scalars.setdefault(key, value)
        meta = meta or report["meta"]
    manifest = {"format": FORMAT_VERSION, "step": step, "sampler": sampler, "world_size": world_size,
                "settings": settings or {}, "optimizer": meta, "scalars": scalars, "tensors": index,
                "files": files, "created": time.time()}
    check_complete(manifest, "the new checkpoint")
    return manifest


def check_complete(manifest: dict[str, Any], where: str) -> None:
    """Every tensor's pieces cover it exactly once."""
    for key, entry in manifest["tensors"].items():
        covered = sum(numel for _, _, numel in entry["pieces"])
        if covered != math.prod(entry["shape"]):
            raise CheckpointError(f"{where}: the pieces of {key} cover {covered} of its "
                                  f"{math.prod(entry['shape'])} elements")


# -- reading ----------------------------------------------------------------------------
Wanted = Callable[[str, int, int], bool]
"""``wanted(key, start, numel)``: whether a reader needs that piece."""


def read_state(storage: Storage, directory: str, manifest: dict[str, Any],
               wanted: Wanted | None = None) -> TrainingState:
    """Read a checkpoint's files (only those holding a ``wanted`` piece), verify each
    against its sha256, and assemble whole tensors; pieces not read stay zero."""
    return assemble(manifest, _verified_loader(storage, directory, manifest), wanted)


def assemble(manifest: dict[str, Any], load: Callable[[str], dict[str, torch.Tensor]],
             wanted: Wanted | None = None) -> TrainingState:
    """The whole training state of ``manifest``, its files' tensors given by ``load(file)``."""
    return _collect(manifest, load, lambda key, start, numel: wanted is None or wanted(key, start, numel),
                    whole=lambda key: True, ranges={})[1]


def read_ranges(storage: Storage, directory: str, manifest: dict[str, Any], ranges: dict[str, list[tuple[int, int]]],
                whole: Callable[[str], bool]) -> tuple[dict[tuple[str, int, int], torch.Tensor], TrainingState]:
    """Of a checkpoint, only the flat element ranges ``ranges[key]`` of its tensors (each
    range a tensor of its own, keyed ``(key, start, stop)``) and the tensors ``whole(key)``
    selects (in the TrainingState returned, the others absent from it): only the files
    holding a piece of them are read (each verified against its sha256), one at a time,
    and nothing else of the tensors is allocated."""
    def needed(key: str, start: int, numel: int) -> bool:
        return whole(key) or any(a < start + numel and start < e for a, e in ranges.get(key, ()))

    return _collect(manifest, _verified_loader(storage, directory, manifest), needed, whole=whole, ranges=ranges)


def _verified_loader(storage: Storage, directory: str, manifest: dict[str, Any]) -> Callable[[str], dict]:
    def load(file: str) -> dict[str, torch.Tensor]:
        return load_bytes(_read_verified(storage, directory, file, manifest["files"][file]))
    return load


def _collect(manifest: dict[str, Any], load: Callable[[str], dict[str, torch.Tensor]],
             needed: Callable[[str, int, int], bool], *, whole: Callable[[str], bool],
             ranges: dict[str, list[tuple[int, int]]]) -> tuple[dict[tuple[str, int, int], torch.Tensor],
                                                              TrainingState]:
    """The files holding a ``needed`` piece, loaded one at a time: the tensors ``whole``
    selects assembled whole (pieces not read stay zero), and the element ranges ``ranges``
    asks for, each a tensor of its own keyed ``(key, start, stop)``."""
    tensors = manifest["tensors"]
    files = sorted({file for key, entry in tensors.items() for file, start, numel in entry["pieces"]
                    if needed(key, start, numel)})
    got = {(key, a, e): torch.zeros(e - a, dtype=_dtype(tensors[key]["dtype"]))
           for key, spans in ranges.items() if key in tensors for a, e in spans}
    flat = {key: torch.zeros(math.prod(entry["shape"]), dtype=_dtype(entry["dtype"]))
            for key, entry in tensors.items() if whole(key)}
    for file in files:
        for key, value in load(file).items():
            start = next(s for f, s, _ in tensors[key]["pieces"] if f == file)
            value = value.reshape(-1)
            if key in flat:
                flat[key][start:start + value.numel()] = value
            for a, e in ranges.get(key, ()):
                lo, hi = max(a, start), min(e, start + value.numel())
                if lo < hi:
                    got[(key, a, e)][lo - a:hi - a] = value[lo - start:hi - start]
    return got, _state_of(manifest, {key: value.reshape(tensors[key]["shape"]) for key, value in flat.items()})


def _state_of(manifest: dict[str, Any], whole: dict[str, torch.Tensor]) -> TrainingState:
    """The TrainingState of ``manifest`` with the tensors ``whole`` (by checkpoint key)."""
    optimizer = {k.removeprefix("optim/"): v for k, v in whole.items() if k.startswith("optim/")}
    for key, (value, dtype) in manifest["scalars"].items():
        optimizer[key.removeprefix("optim/")] = torch.tensor(value, dtype=_dtype(dtype))
    return TrainingState(step=manifest["step"],
                         model={k.removeprefix("model/"): v for k, v in whole.items() if k.startswith("model/")},
                         optimizer_tensors=optimizer, optimizer_meta=manifest["optimizer"],
                         sampler=manifest["sampler"], world_size=manifest["world_size"], rng=whole["rng"])


def _read_verified(storage: Storage, directory: str, file: str, expected: dict[str, Any]) -> bytes:
    where = storage.url(f"{directory}/{file}")
    try:
        data = storage.read(f"{directory}/{file}")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {where} is missing: delete the checkpoint "
                              f"{storage.url(directory)} to resume from an older one") from None
    if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"checkpoint file {where} does not match its sha256 in manifest.json (corrupted "
                              f"or modified): delete the checkpoint {storage.url(directory)} to resume from an "
                              "older one")
    return data


def merge_parts(parts: list[TrainingState]) -> TrainingState:
    """Join the ZeRO ranks' parts of one training state into a whole one: what a
    checkpoint those ranks wrote would read back as."""
    cut = [cut_part(p, rank, len(parts)) for rank, p in enumerate(parts)]
    reports = [{"rank": p.rank, "files": {}, "index": p.index, "scalars": p.scalars, "meta": p.meta} for p in cut]
    manifest = manifest_of(reports, step=parts[0].step, sampler=parts[0].sampler, world_size=parts[0].world_size)
    files = {name: tensors for p in cut for name, tensors in p.files.items()}
    return assemble(manifest, files.__getitem__)


# -- the checkpoints of one run ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A committed checkpoint: where it is and its manifest (what workers load from)."""

    storage: Storage
    directory: str
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def sampler(self) -> dict[str, int]:
        return self.manifest["sampler"]

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def url(self) -> str:
        return self.storage.url(self.directory)

    def read(self, wanted: Wanted | None = None) -> TrainingState:
        return read_state(self.storage, self.directory, self.manifest, wanted)

    def read_ranges(self, ranges: dict[str, list[tuple[int, int]]],
                    whole: Callable[[str], bool]) -> tuple[dict[tuple[str, int, int], torch.Tensor], TrainingState]:
        return read_ranges(self.storage, self.directory, self.manifest, ranges, whole)


class CheckpointStore:
    """Begins, commits, finds and prunes the checkpoints of one run in one storage."""

    def __init__(self, storage: Storage | str, *, keep: int = 3) -> None:
        self.storage = storage if isinstance(storage, Storage) else Storage(storage, "--checkpoint-dir")
        self.keep = keep

    @property
    def url(self) -> str:
        return self.storage.url()

    def check_writable(self) -> None:
        """Fail now, before training, if checkpoints could not be written."""
        self.storage.check_writable()

    def begin(self, step: int) -> str:
        """A new directory for the checkpoint of ``step`` (each attempt its own)."""
        return f"{_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"

    def commit(self, directory: str, manifest: dict[str, Any]) -> Checkpoint:
        """Write the manifest (the checkpoint exists from now on), then prune old ones."""
        self.storage.write(f"{directory}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        self._prune(directory)
        return Checkpoint(self.storage, directory, manifest)

    def _entries(self) -> list[tuple[int, str, bool]]:
        """(step, directory, committed) of every checkpoint directory, oldest first."""
        found = []
        for name, is_dir in self.storage.list():
            if is_dir and name.startswith(_PREFIX) and name[len(_PREFIX):].split("-")[0].isdigit():
                found.append((int(name[len(_PREFIX):].split("-")[0]), name,
                              self.storage.exists(f"{name}/{MANIFEST}")))
        return sorted(found)

    def _prune(self, newest: str) -> None:
        entries = self._entries()
        committed = [name for _, name, done in entries if done]
        for name in committed[:-self.keep]:
            self.storage.delete(name)
        step = next(s for s, name, _ in entries if name == newest)
        for s, name, done in entries:  # saves abandoned before this one (one save is in flight at most)
            if not done and s <= step and name != newest:
                self.storage.delete(name)

    def discard_uncommitted(self) -> list[str]:
        """Delete the checkpoint directories that never got their manifest (a save cut short:
        no writer is left), and return them."""
        partial = [name for _, name, done in self._entries() if not done]
        for name in partial:
            self.storage.delete(name)
        return partial

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint; None when there is none."""
        committed = [name for _, name, done in self._entries() if done]
        return self.open(committed[-1]) if committed else None

    def open(self, directory: str) -> Checkpoint:
        where = self.storage.url(directory)
        try:
            manifest = json.loads(self.storage.read(f"{directory}/{MANIFEST}"))
        except (FileNotFoundError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {where} has an unreadable manifest.json ({exc}): delete it to "
                                  "resume from an older one") from None
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {where} has format {manifest.get('format')}, this elastic_dp "
                                  f"reads format {FORMAT_VERSION}: resume it with the elastic_dp that saved it")
        check_complete(manifest, f"checkpoint {where}")
        return Checkpoint(self.storage, directory, manifest)

    def load(self) -> Checkpoint:
        """The latest checkpoint, for a run that must resume."""
        found = self.latest()
        if found is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.url}: drop --resume "
                                  "or pass the --checkpoint-dir (or --storage) that a run saved into")
        return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in a checkpoint manifest")
    return value
