"""State strategies: how a worker holds the training state, reduces gradients and updates.

A strategy is an object with one interface (``base.Strategy``), built once per worker by
``make_strategy``; the worker's step and its state calls do not branch on which one it
has. ``replicated.Replicated`` is ZeRO stage 0: every worker holds full parameters,
gradients and optimizer state, and gradients are all-reduced in buckets overlapped with
backward. ``zero.stages.Sharded`` (stages 1 and 2) implements the same interface, and
also what resharding needs (``holdings``, ``export``, ``import_shards``).
"""

from __future__ import annotations

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.config import TrainConfig
from elastic_dp.faults import FaultHook
from elastic_dp.state.base import Strategy
from elastic_dp.state.replicated import Replicated
from elastic_dp.state.zero.stages import Sharded


def make_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                  config: TrainConfig, device: torch.device, faults: FaultHook | None = None) -> Strategy:
    """The strategy of ``config.zero``, built once; a sharded one re-cuts itself for every
    generation of ``group`` (``faults``: the process's, for the phases a strategy has)."""
    if config.zero:
        return Sharded(model, optimizer, group, config, device, faults)
    return Replicated(model, optimizer, group, config, device)


__all__ = ["Strategy", "make_strategy", "Replicated", "Sharded"]
