"""The training mode a run's configuration chose, built: its driver half for the
coordinator, its program for each worker.

The registry of modes is ``config.MODES`` (``--mode``): each entry is the mode's settings
part, which names the mode's driver and program (``driver``, ``program``: imported when a
run first builds them). Adding a mode is its package under ``elastic_dp.modes`` and that
one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_dp.config import MODES
from elastic_dp.modes.base import TrainingMode
from elastic_dp.modes.context import ModeContext
from elastic_dp.modes.program import Program
from elastic_dp.settings import implementation

if TYPE_CHECKING:
    from elastic_dp.worker.replica import Replica


def make_mode(context: ModeContext) -> TrainingMode:
    """The driver half of the mode the configuration asks for, built from the run's context."""
    return implementation(context.train.mode.driver)(context)


def make_program(replica: Replica) -> Program:
    """The worker side of the mode ``replica``'s configuration asks for."""
    return implementation(replica.config.mode.program)(replica)


def modes_with_call(name: str) -> list[str]:
    """The modes whose program has a call (or stream) ``name``."""
    return [mode for mode, settings in MODES.items()
            if name in (program := implementation(settings.program)).calls | program.streams]
