"""Each ZeRO stage's state strategy, and the one a run's stage builds."""

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
"""Each ZeRO stage's strategy, by the stage's number (``--zero``; its settings:
``zero.settings.STAGES``)."""


def make_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                  config: TrainConfig, device: torch.device, faults: FaultHook | None = None,
                  units: list[torch.nn.Module] | None = None, init: UnitInit | None = None) -> Strategy:
    """The strategy of the run's ZeRO stage (``config.stage``), built once; a sharded one re-cuts itself for every
    generation of ``group`` (``faults``: the process's, for the phases a strategy has;
    ``units``: the model's shard units (``units.model_units``) and ``init``: the rule that
    initialises a model built on the meta device unit by unit, for stage 3)."""
    if config.stage == 3:
        return FullySharded(model, optimizer, group, config, device, faults, units, init)
    if config.stage:
        return STAGES[config.stage](model, optimizer, group, config, device, faults)
    return Replicated(model, optimizer, group, config, device)
