"""Training modes: how a run trains, chosen once from the configuration.

The coordinator drives a mode through ``TrainingMode`` (``.base``) and never branches on
which one it has; adding a mode means adding a package here and a line to ``make_mode``.

    sync/    synchronous data parallelism: one collective group per generation, the state
             replicated (ZeRO-0) or sharded (ZeRO-1/2) by a layout
"""

from __future__ import annotations

from elastic_dp.config import ClusterConfig, TrainConfig
from elastic_dp.faults import FaultPlan
from elastic_dp.observe.metrics import RunRecorder
from elastic_dp.control.modes.base import Failure, MembersLost, Recovery, RecoveryResult, TrainingMode


def make_mode(train: TrainConfig, cluster: ClusterConfig, recorder: RunRecorder, faults: FaultPlan,
              task=None) -> TrainingMode:
    """The training mode the configuration asks for (``--mode``)."""
    if train.mode == "async":
        from elastic_dp.control.modes.asyncsgd import AsyncMode
        return AsyncMode(train, cluster, recorder, faults, task)
    from elastic_dp.control.modes.sync import SyncMode
    return SyncMode(train, cluster, recorder, faults)


__all__ = ["make_mode", "TrainingMode", "Failure", "MembersLost", "Recovery", "RecoveryResult"]
