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
so a worker always pulls one consistent model version.
"""

from __future__ import annotations

import inspect

import torch

from ...config import TrainConfig
from ...task import Task, trainable


def flat_bounds(numel: int, shards: int) -> list[int]:
    """Where each of ``shards`` contiguous ranges of ``numel`` elements starts, and the end."""
    base, extra = divmod(numel, shards)
    bounds = [0]
    for i in range(shards):
        bounds.append(bounds[-1] + base + (i < extra))
    return bounds


class ParameterShard:
    """Elements ``lo .. hi`` of the flattened parameters, and their optimizer state."""

    def __init__(self, task: Task, config: TrainConfig, lo: int, hi: int) -> None:
        from ...zero import check_shardable

        torch.set_num_threads(1)
        torch.manual_seed(config.seed)
        model = task.model()
        optimizer = task.optimizer(model)
        check_shardable(optimizer, "async")
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.lo, self.hi, self.version = lo, hi, 0
        by_tensor: dict[int, list[str]] = {}
        for key, tensor in model.state_dict(keep_vars=True).items():
            by_tensor.setdefault(id(tensor), []).append(key)
        self.aliases = {name: by_tensor[id(p)] for name, p in model.named_parameters()}
        """Every state-dict key of a parameter (a tied one has several)."""
        self.pieces: list[tuple[str, int, int, int]] = []  # (name, start in the param, length, start in the shard)
        masters: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.param_groups]
        self.masters: list[torch.nn.Parameter] = []
        offset = 0
        for name, p in trainable(model, optimizer):
            a, e = max(lo, offset), min(hi, offset + p.numel())
            if a < e:
                piece = torch.nn.Parameter(p.detach().reshape(-1)[a - offset:e - offset].float().clone())
                self.pieces.append((name, a - offset, e - a, a - lo))
                self.masters.append(piece)
                masters[group_of[id(p)]].append(piece)
            offset += p.numel()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                  for g, ps in zip(optimizer.param_groups, masters) if ps]
        self.base_lrs = [g["lr"] for g in groups]
        accepted = inspect.signature(type(optimizer)).parameters
        self.optimizer = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def params(self) -> torch.Tensor:
        """This shard's elements at the current version, as one flat fp32 vector."""
        return torch.cat([m.detach() for m in self.masters]) if self.masters else torch.zeros(0)

    @torch.no_grad()
    def apply(self, version: int, grad: torch.Tensor, lr_scale: float, skip: bool = False) -> int:
        """Apply update ``version`` (the next one): ``grad`` is this shard's piece of the
        gradient; ``skip``: a non-finite gradient, the version passes with no change."""
        if version != self.version + 1:
            raise RuntimeError(f"shard [{self.lo}, {self.hi}) is at version {self.version}: update "
                               f"{version} arrived out of order")
        if not skip:
            for master, (_, _, length, start) in zip(self.masters, self.pieces):
                master.grad = grad[start:start + length].to(master.dtype)
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * lr_scale
            self.optimizer.step()
            for master in self.masters:
                master.grad = None
        self.version = version
        return version

    def model_part(self) -> list[tuple[str, int, torch.Tensor]]:
        """(state-dict key, start within it, values) of every piece, under each key of a tied
        parameter: the weights are assembled from the shards' parts."""
        return [(key, start, m.detach().clone()) for (name, start, _, _), m in zip(self.pieces, self.masters)
                for key in self.aliases[name]]
