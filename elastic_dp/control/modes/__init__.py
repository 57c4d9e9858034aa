"""Training modes: how a run trains, chosen once from the configuration.

The coordinator drives a mode through ``TrainingMode`` (``.base``) and never branches on
which one it has. Every mode is built the same way, from the run's ``ModeContext``
(``.context``); adding a mode means adding a package here and an entry to ``MODES``.

    sync/      synchronous data parallelism: one collective group per generation, the state
               replicated (ZeRO-0) or sharded (ZeRO-1/2) by a layout
    asyncsgd/  asynchronous SGD: parameter-server shards, leases, bounded staleness
    diloco/    DiLoCo / local SGD: windows of one outer step, membership changes at their ends
"""

from __future__ import annotations

from elastic_dp.control.modes.asyncsgd import AsyncMode
from elastic_dp.control.modes.base import Failure, MembersLost, Recovery, RecoveryResult, TrainingMode
from elastic_dp.control.modes.context import ModeContext
from elastic_dp.control.modes.diloco import DiLoCoMode
from elastic_dp.control.modes.sync import SyncMode

MODES = {"sync": SyncMode, "async": AsyncMode, "diloco": DiLoCoMode}
"""Each training mode (``TrainConfig.mode``, ``--mode``) by name."""


def make_mode(context: ModeContext) -> TrainingMode:
    """The training mode the configuration asks for, built from the run's context."""
    return MODES[context.train.mode](context)


__all__ = ["make_mode", "MODES", "ModeContext", "TrainingMode", "Failure", "MembersLost", "Recovery",
           "RecoveryResult"]
