"""The training modes by name: the driver half the coordinator drives (``--mode``)."""

from __future__ import annotations

from elastic_dp.control.modes.asyncsgd.mode import AsyncMode
from elastic_dp.control.modes.base import TrainingMode
from elastic_dp.control.modes.context import ModeContext
from elastic_dp.control.modes.diloco.mode import DiLoCoMode
from elastic_dp.control.modes.sync.mode import SyncMode

MODES = {"sync": SyncMode, "async": AsyncMode, "diloco": DiLoCoMode}
"""Each training mode's driver half, by name (``TrainConfig.mode``, ``--mode``; its settings:
``config.MODES``)."""


def make_mode(context: ModeContext) -> TrainingMode:
    """The training mode the configuration asks for, built from the run's context."""
    return MODES[context.train.mode.name](context)
