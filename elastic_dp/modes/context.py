"""What every training mode receives, the same way: ``ModeContext``, built once per run
(``api.build_coordinator``) and handed to the mode the configuration chose
(``modes.registry.make_mode``).

What every mode does alike lives beside it, each in its own module: the start (one dataset
on every worker, the resume check and event: ``.start``), the outputs (weights files and
the checkpoint's manifest commit: ``.saving``), the non-finite guard (``.guard``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_dp.config import CheckpointConfig, ClusterConfig, TrainConfig
from elastic_dp.faults import FaultPlan
from elastic_dp.modes.guard import NonFiniteGuard
from elastic_dp.observe.metrics import RunRecorder
from elastic_dp.task import Task


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeContext:
    """A run's settings and collaborators, as a mode receives them."""

    train: TrainConfig
    cluster: ClusterConfig
    recorder: RunRecorder
    faults: FaultPlan
    """The faults still to inject (``--inject``); the mode hands each to its worker."""
    task: Task | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    settings: dict[str, Any] = field(default_factory=dict)
    """The run's settings (``config.run_settings``), recorded in each checkpoint's manifest."""

    def guard(self) -> NonFiniteGuard:
        """The run's non-finite guard (``--on-nonfinite``, ``--max-nonfinite-steps``)."""
        return NonFiniteGuard(self.train.on_nonfinite, self.train.max_nonfinite_steps, self.recorder)
