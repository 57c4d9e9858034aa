"""A parameter-server shard: one contiguous range of the flattened parameters and its
optimizer state, a Ray actor of the asynchronous mode.

The flattened parameters are the model's trainable parameters in ``model.parameters()``
order (a tied parameter once), concatenated. Shard ``i`` of ``P`` owns elements
``bounds[i] .. bounds[i + 1]`` (``flat_bounds``). It builds the task's model and optimizer
itself, from the run's seed (so it starts where every worker starts), and keeps, for each
parameter its range overlaps, that piece as a parameter of an optimizer of the task's class
with the task's param groups: element-wise optimizers only, as under ZeRO, so the pieces
update exactly as the whole would.

Its calls run one at a time in the order the coordinator submits them (a Ray actor's
calls from one caller are ordered): ``apply`` the update of version ``v``, then a
``params`` submitted after it returns the pieces at exactly version ``v`` on every shard,
so a worker always pulls one consistent model version. A ``copy_state`` submitted there
copies the shard's state at exactly ``v``, the same version on every shard: the shard
keeps it, and another actor (``Keeper``: the next shard, or a keeper of its own when
there is one shard) keeps a copy in its memory, so that a lost shard can be rebuilt.

Shard 0 also keeps the model's buffers (BatchNorm's running statistics): a worker starts
its gradient from the buffers of the version it pulled, and an applied update adds the
change its forward made to them (``apply``'s ``buffer_change``); a skipped, refused or
lost update leaves no trace (docs/async.md).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from elastic_dp.config import TrainConfig
from elastic_dp.durable.checkpoint import (
    Checkpoint,
    Part,
    add_piece,
    dtype_name,
    optimizer_state,
    part_files,
    write_part,
)
from elastic_dp.durable.storage import Storage
from elastic_dp.faults import Fault, FaultHook
from elastic_dp.malloc import keep_freed_memory
from elastic_dp.state.zero.chunks import check_elementwise
from elastic_dp.task import Task, trainable


def flat_bounds(numel: int, shards: int) -> list[int]:
    """Where each of ``shards`` contiguous ranges of ``numel`` elements starts, and the end."""
    base, extra = divmod(numel, shards)
    bounds = [0]
    for i in range(shards):
        bounds.append(bounds[-1] + base + (i < extra))
    return bounds


SNAPSHOTS_KEPT = 2
"""Copies kept of each shard, by the shard and by its keeper: the two newest."""

State = dict[str, Any]
"""A shard's state at one version: ``version``, ``masters`` and ``state`` (per piece, its
optimizer state), in host memory."""


class Keeper:
    """Holds other shards' copies in its memory (each shard is one for the next)."""

    def __init__(self) -> None:
        keep_freed_memory()  # each update's pull and copy reuse the last one's memory (elastic_dp.malloc)
        self.kept: dict[int, list[State]] = {}

    def keep(self, index: int, state: State) -> None:
        """Keep shard ``index``'s copy ``state`` (the two newest)."""
        self.kept[index] = [s for s in self.kept.get(index, []) if s["version"] != state["version"]][
            -(SNAPSHOTS_KEPT - 1):] + [state]

    def held(self) -> dict[int, list[int]]:
        """Shard index -> versions kept."""
        return {i: [s["version"] for s in copies] for i, copies in self.kept.items()}

    def export(self, index: int, version: int) -> State:
        return next(s for s in self.kept[index] if s["version"] == version)

    def node(self) -> str:
        """The Ray node this actor runs on (a draining one's shards move, ``AsyncMode``)."""
        import ray
        return ray.get_runtime_context().get_node_id()

    def trim(self, version: int) -> None:
        """Forget the copies of versions after ``version``: the model went back to it, and
        a later version will be another (a roll-back, or a checkpoint restored)."""
        self.kept = {i: [s for s in copies if s["version"] <= version] for i, copies in self.kept.items()}


class ParameterShard(Keeper):
    """Elements ``lo .. hi`` of the flattened parameters, and their optimizer state."""

    def __init__(self) -> None:
        super().__init__()  # the process starts (and imports torch) while the workers are placed
        self.faults = FaultHook()

    def setup(self, task: Task, config: TrainConfig, lo: int, hi: int) -> None:
        """Build the model and optimizer, and take elements ``lo .. hi`` of them."""
        self.own: list[State] = []
        self.device = torch.device("cuda", 0) if config.mode.ps_device == "cuda" else torch.device("cpu")
        torch.set_num_threads(1)
        torch.manual_seed(config.seed)
        model = task.model()
        optimizer = task.optimizer(model)
        check_elementwise(optimizer, "async")
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.lo, self.hi, self.version = lo, hi, 0
        by_tensor: dict[int, list[str]] = {}
        for key, tensor in model.state_dict(keep_vars=True).items():
            by_tensor.setdefault(id(tensor), []).append(key)
        self.aliases = {name: by_tensor[id(p)] for name, p in model.named_parameters()}
        """Every state-dict key of a parameter (a tied one has several)."""
        self.shapes = {name: (list(p.shape), p.dtype) for name, p in model.named_parameters()}
        self.buffers = {k: v.detach().clone() for k, v in model.state_dict().items()
                        if all(k not in keys for keys in self.aliases.values())}
        """The model's other state (buffers): shard 0 keeps it, at the current version."""
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups = optimizer_state(optimizer, names)[1]["param_groups"]
        """The task's param groups by parameter name, as a checkpoint records them."""
        self.pieces: list[tuple[str, int, int, int]] = []  # (name, start in the param, length, start in the shard)
        masters: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.param_groups]
        self.masters: list[torch.nn.Parameter] = []
        offset = 0
        for name, p in trainable(model, optimizer):
            a, e = max(lo, offset), min(hi, offset + p.numel())
            if a < e:
                piece = torch.nn.Parameter(  # a copy: a view would keep the whole model alive
                    p.detach().reshape(-1)[a - offset:e - offset].to(self.device, torch.float32, copy=True))
                self.pieces.append((name, a - offset, e - a, a - lo))
                self.masters.append(piece)
                masters[group_of[id(p)]].append(piece)
            offset += p.numel()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                  for g, ps in zip(optimizer.param_groups, masters) if ps]
        self.base_lrs = [g["lr"] for g in groups]
        self._grad = torch.empty(hi - lo, dtype=torch.float32)
        """The gradient piece of the update being applied, copied out of the object store."""
        accepted = inspect.signature(type(optimizer)).parameters
        self.optimizer = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def params(self) -> np.ndarray:
        """This shard's elements at the current version, as one flat fp32 vector: a NumPy
        array, which Ray hands to a worker on the same node without a copy."""
        if not self.masters:
            return np.zeros(0, dtype=np.float32)
        return torch.cat([m.detach() for m in self.masters]).cpu().numpy()

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """The model's buffers at the current version (shard 0's; empty elsewhere)."""
        return self.buffers

    @torch.no_grad()
    def apply(self, version: int, grad: np.ndarray, lr_scale: float, skip: bool = False,
              fault: Fault | None = None, buffer_change: dict[str, torch.Tensor] | None = None) -> int:
        """Apply update ``version`` (the next one): ``grad`` is this shard's piece of the
        gradient (a read-only NumPy array in Ray's object store); ``skip``: a non-finite
        gradient, the version passes with no change; ``fault``: ``--inject
        kill:...:phase=shard``, fired first; ``buffer_change`` (shard 0): what the
        update's forward changed in the buffers it started from, added to them."""
        self.faults.arm(fault)  # the coordinator hands a shard its fault with the update
        self.faults.at("shard")
        if version != self.version + 1:
            raise RuntimeError(f"shard [{self.lo}, {self.hi}) is at version {self.version}: update "
                               f"{version} arrived out of order")
        if not skip:
            np.copyto(self._grad.numpy(), grad)  # the one copy: out of the store, into memory we may write
            for master, (_, _, length, start) in zip(self.masters, self.pieces):
                master.grad = self._grad[start:start + length].to(master.device, master.dtype)
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * lr_scale
            self.optimizer.step()
            for master in self.masters:
                master.grad = None
            if buffer_change:
                self.buffers = {k: v + buffer_change[k].to(v.dtype) if k in buffer_change else v
                                for k, v in self.buffers.items()}
        self.version = version
        return version

    # -- copies: a lost shard is rebuilt from its keeper's copy ---------------------------
    def copy_state(self) -> State:
        """Copy this shard's state at its version into host memory; keep it and return it
        (the coordinator hands it to this shard's keeper)."""
        copied = {"version": self.version, "masters": [m.detach().to("cpu", copy=True) for m in self.masters],
                "state": [{k: v.detach().to("cpu", copy=True) for k, v in self.optimizer.state.get(m, {}).items()
                           if isinstance(v, torch.Tensor)} for m in self.masters],  # in host memory
                "buffers": self.buffers}  # replaced, never changed in place, by apply
        self.own = [s for s in self.own if s["version"] != self.version][-(SNAPSHOTS_KEPT - 1):] + [copied]
        return copied

    def own_versions(self) -> list[int]:
        return [s["version"] for s in self.own]

    def own_copy(self, version: int) -> State:
        return next(s for s in self.own if s["version"] == version)

    @torch.no_grad()
    def restore(self, copied: State) -> int:
        """Become the shard of ``copied`` (its own or its keeper's copy of it)."""
        for master, value, state in zip(self.masters, copied["masters"], copied["state"]):
            master.copy_(value)
            if state:  # 0-dim step counts stay where the optimizer keeps them (host, unless fused/capturable)
                self.optimizer.state[master] = {k: v.clone() if v.dim() == 0 else v.to(master.device, copy=True)
                                                for k, v in state.items()}
            else:
                self.optimizer.state.pop(master, None)
        self.version = copied["version"]
        self.buffers = copied.get("buffers", self.buffers)
        self.own = [s for s in self.own if s["version"] <= self.version]
        self.trim(self.version)
        return self.version

    # -- checkpoints: the same format as the synchronous mode's ----------------------------
    def write_checkpoint(self, storage: Storage, directory: str, index: int) -> dict:
        """Write this shard's pieces of the model and of the optimizer state as part
        ``index`` of the checkpoint in ``directory``; what the manifest needs of it."""
        model_file, optim_file = part_files(index)
        part = Part(rank=index, files={model_file: {}, optim_file: {}}, index={}, scalars={})
        for (name, start, _, _), master in zip(self.pieces, self.masters):
            shape, dtype = self.shapes[name]
            for key in self.aliases[name]:
                add_piece(part, model_file, f"model/{key}", master.detach().to(dtype), start, shape)
            for field, value in self.optimizer.state.get(master, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    part.scalars[f"optim/{name}/{field}"] = [value.item(), dtype_name(value.dtype)]
                else:
                    add_piece(part, optim_file, f"optim/{name}/{field}", value, start, shape)
        if index == 0:
            for key, value in self.buffers.items():
                add_piece(part, model_file, f"model/{key}", value, 0, list(value.shape))
            add_piece(part, model_file, "rng", torch.get_rng_state(), 0, [torch.get_rng_state().numel()])
            part.meta = {"param_groups": self.groups, "scalars": {}}
        part.files = {f: t for f, t in part.files.items() if t}
        return write_part(storage, directory, part)

    @torch.no_grad()
    def load_checkpoint(self, checkpoint: Checkpoint) -> int:
        """Take this shard's pieces from ``checkpoint`` (saved by either mode, at any worker
        or shard count); only the files holding them are read. Returns its step."""
        names = {name for name, _, _, _ in self.pieces}
        bounds = {name: (start, start + length) for name, start, length, _ in self.pieces}

        def wanted(key: str, start: int, numel: int) -> bool:
            kind, _, rest = key.partition("/")
            if kind == "model" and rest in self.buffers:
                return True
            name = rest if kind == "model" else rest.rpartition("/")[0]
            if kind not in ("model", "optim") or name not in names:
                return False
            lo, hi = bounds[name]
            return start < hi and lo < start + numel

        state = checkpoint.read(wanted)
        self.own, self.kept = [], {}  # copies of another history
        for (name, start, length, _), master in zip(self.pieces, self.masters):
            master.copy_(state.model[name].reshape(-1)[start:start + length].float())
            fields = {}
            for key, value in state.optimizer_tensors.items():
                param, _, field = key.rpartition("/")
                if param == name:
                    fields[field] = value.clone() if value.dim() == 0 else \
                        value.reshape(-1)[start:start + length].to(master.device, master.dtype, copy=True)
            if fields:
                self.optimizer.state[master] = fields
            else:
                self.optimizer.state.pop(master, None)
        self.buffers = {k: state.model[k].clone() if k in state.model else v for k, v in self.buffers.items()}
        self.version = checkpoint.step
        return self.version

    def model_part(self) -> list[tuple[str, int, torch.Tensor]]:
        """(state-dict key, start within it, values) of every piece, under each key of a tied
        parameter: the weights are assembled from the shards' parts."""
        return [(key, start, m.detach().to("cpu", copy=True)) for (name, start, _, _), m in zip(self.pieces, self.masters)
                for key in self.aliases[name]]
