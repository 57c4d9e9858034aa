"""Each ZeRO stage's settings, and the registry that ``--zero`` chooses from.

Stage 0 (replicated state) reads none; stages 1-3 keep a copy of each worker's chunk on a
peer (``--snapshot-every``); stage 3 alone gathers parameters, and may keep them from the
forward to the backward (``--no-reshard-after-forward``). A setting of a stage the run
does not use is refused (``elastic_dp.settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from elastic_dp.errors import ConfigError
from elastic_dp.settings import setting


def _snapshot_every() -> Any:
    return setting(1, "--snapshot-every", "with ZeRO, each worker copies its chunk to its neighbour's host memory "
                   "every K committed steps (default 1; into memory both map when they share a host): a worker lost "
                   "k steps after the last copy costs a rollback and replay of those k steps")


def _check_snapshot_every(value: int) -> None:
    if value < 1:
        raise ConfigError(f"snapshot_every must be >= 1, got {value} (--snapshot-every)")


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage0:
    """Replicated state: every worker holds everything."""

    stage: ClassVar[int] = 0


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage1:
    """The optimizer state (and the fp32 masters of bf16 parameters) sharded."""

    stage: ClassVar[int] = 1
    snapshot_every: int = _snapshot_every()

    def __post_init__(self) -> None:
        _check_snapshot_every(self.snapshot_every)


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage2:
    """The gradients sharded too, reduce-scattered in buckets during backward."""

    stage: ClassVar[int] = 2
    snapshot_every: int = _snapshot_every()

    def __post_init__(self) -> None:
        _check_snapshot_every(self.snapshot_every)


@dataclass(kw_only=True, slots=True, frozen=True)
class Stage3:
    """The parameters sharded too, gathered unit by unit for the forward and the backward."""

    stage: ClassVar[int] = 3
    snapshot_every: int = _snapshot_every()
    reshard_after_forward: bool = setting(
        True, off="--no-reshard-after-forward",
        help="--zero 3: keep each unit's gathered parameters from its forward to its backward (one all-gather a unit "
             "less per step, for the memory of the whole model's parameters at the end of the forward)")

    def __post_init__(self) -> None:
        _check_snapshot_every(self.snapshot_every)


STAGES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
"""Each ZeRO stage's settings, by the stage's number (``--zero``)."""
