"""What every training mode's settings part says of its mode (``config.MODES`` holds one
subclass per mode: its fields are the mode's settings, ``elastic_dp.settings``).

Besides its settings, a mode's part names its two halves (``driver``, ``program``:
``modes.registry``) and answers, for the parts of elastic_dp that are the same in every
mode, the few questions whose answer depends on the mode; the defaults are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(kw_only=True, slots=True, frozen=True)
class ModeSettings:
    """The part of the run that ``--mode`` chooses."""

    name: ClassVar[str]
    """``--mode``'s value."""
    driver: ClassVar[str]
    """The driver half (``modes.base.TrainingMode``), as ``module:Class``."""
    program: ClassVar[str]
    """The worker half (``modes.program.Program``), as ``module:Class``."""
    reduces_gradients: ClassVar[bool] = False
    """Whether the workers' strategy reduces gradients in buckets (else it builds no
    reducer: ``state.replicated.Unreduced``)."""
    steps_task_optimizer: ClassVar[bool] = False
    """Whether each worker steps the task's optimizer once per step of the run, in order,
    so that a ``Task.scheduler`` (a torch LRScheduler over it) steps with it."""

    def check(self, train: Any) -> None:
        """What this mode's settings need of the run's core (``TrainConfig``)."""

    def check_run(self, train: Any, cluster: Any, checkpoint: Any) -> None:
        """What this mode needs of the run's other settings (``api.Trainer``)."""

    def unreachable(self, fault: Any, train: Any) -> str | None:
        """Why ``--inject`` ``fault`` can never fire in this mode, or None (``faults``)."""
        return None
