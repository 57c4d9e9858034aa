"""State strategies: how a worker holds the training state, reduces gradients and updates.

A strategy is an object with one interface (``base.Strategy``), built once per worker by
``make_strategy``; the worker's step and its state calls do not branch on which one it
has. Strategies are named by what they keep:

    replicated.Replicated           ZeRO stage 0: every worker holds everything; gradients
                                    all-reduced in buckets overlapped with backward
    zero/stage1.ShardedOptimizer    stage 1: the optimizer state sharded
    zero/stage2.ShardedGradients    stage 2: the gradients too
    zero/stage3.FullySharded        stage 3: the parameters too, gathered unit by unit

The sharded ones (``zero.sharded.Sharded``) also implement what resharding needs
(``base.Resharding``: ``holdings``, ``export``, ``import_chunks``).
"""

from __future__ import annotations

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.config import TrainConfig
from elastic_dp.faults import FaultHook
from elastic_dp.state.base import Strategy
from elastic_dp.state.replicated import Replicated
from elastic_dp.state.units import UnitInit
from elastic_dp.state.zero.sharded import Sharded
from elastic_dp.state.zero.stage1 import ShardedOptimizer
from elastic_dp.state.zero.stage2 import ShardedGradients
from elastic_dp.state.zero.stage3 import FullySharded

STAGES = {0: Replicated, 1: ShardedOptimizer, 2: ShardedGradients, 3: FullySharded}
"""Each ZeRO stage's strategy (``TrainConfig.zero``)."""


def make_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                  config: TrainConfig, device: torch.device, faults: FaultHook | None = None,
                  units: list[torch.nn.Module] | None = None, init: UnitInit | None = None) -> Strategy:
    """The strategy of ``config.zero``, built once; a sharded one re-cuts itself for every
    generation of ``group`` (``faults``: the process's, for the phases a strategy has;
    ``units``: the model's shard units (``units.model_units``) and ``init``: the rule that
    initialises a model built on the meta device unit by unit, for stage 3)."""
    if config.zero == 3:
        return FullySharded(model, optimizer, group, config, device, faults, units, init)
    if config.zero:
        return STAGES[config.zero](model, optimizer, group, config, device, faults)
    return Replicated(model, optimizer, group, config, device)


__all__ = ["Strategy", "make_strategy", "STAGES", "Replicated", "Sharded", "ShardedOptimizer", "ShardedGradients", "FullySharded"]
