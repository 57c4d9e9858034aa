"""The state strategy a run's configuration builds.

The stages themselves are registered once, in ``zero.settings.STAGES`` (``--zero``): each
stage's part names its strategy. A mode that reduces no gradients (``reduces_gradients``
of its settings) gets ``Unreduced``, which builds no reducer.
"""

from __future__ import annotations

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.config import TrainConfig
from elastic_dp.faults import FaultHook
from elastic_dp.settings import implementation
from elastic_dp.state.base import Strategy
from elastic_dp.state.replicated import Unreduced
from elastic_dp.state.units import UnitInit


def make_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                  config: TrainConfig, device: torch.device, faults: FaultHook | None = None,
                  units: list[torch.nn.Module] | None = None, init: UnitInit | None = None,
                  kept: list[torch.nn.Module] = ()) -> Strategy:
    """The strategy of the run's ZeRO stage (``config.stage``), built once; a sharded one
    re-cuts itself for every generation of ``group`` (``faults``: the process's, for the
    phases a strategy has). A stage that shards the parameters also takes the model's shard
    units (``units.model_units``) and ``init``, the rule that initialises a model built on
    the meta device unit by unit, and the modules ``kept`` in fp32 (``--param-dtype bf16``)."""
    if not config.mode.reduces_gradients:
        return Unreduced(model, optimizer, group, config, device)
    stage = config.stage
    built = {"units": units, "init": init, "kept": list(kept)} if stage.shards_parameters else {}
    return implementation(stage.strategy)(model, optimizer, group, config, device, faults, **built)
