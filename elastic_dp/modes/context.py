"""What every training mode receives, the same way, and the pieces every mode uses.

``ModeContext`` is built once per run (``api.build_coordinator``) and handed to the mode
the configuration chose (``modes.registry.make_mode``). The shared pieces are the checks and records
whose meaning does not depend on how a run trains: one dataset on every worker, the resume check and event, the weights written, the
non-finite guard (``guard.NonFiniteGuard``), the checkpoint's manifest commit
(``saving.commit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from elastic_dp.config import CheckpointConfig, ClusterConfig, TrainConfig
from elastic_dp.data import check_resumable
from elastic_dp.durable.weights import TensorSpecs
from elastic_dp.errors import ConfigError, TaskError
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


def dataset_length(members: Sequence[Any]) -> int:
    """The length of the dataset every member built; a ``TaskError`` when they differ."""
    lengths = {m.info.dataset_len for m in members}
    if len(lengths) != 1:
        raise TaskError(f"workers built datasets of different lengths {sorted(lengths)}: the dataset "
                        "factory must build the same dataset on every worker")
    return lengths.pop()


def check_resume(resume: Any, train: TrainConfig, dataset_len: int) -> None:
    """Refuse a checkpoint this run cannot continue (another global batch, another dataset,
    another mode's checkpoint: ``--mode diloco``'s holds inner states the others do not)."""
    if resume is not None:
        check_resumable(resume.sampler, train, dataset_len=dataset_len)
        diloco = "diloco" in (resume.manifest.get("optimizer") or {})
        if diloco != (train.mode.name == "diloco"):
            saved = "--mode diloco" if diloco else "another mode"
            raise ConfigError(f"{resume.url} was saved by {saved}: resume it with the mode that saved it "
                              f"(this run is --mode {train.mode.name})")


def record_resume(recorder: RunRecorder, resume: Any, world_size: int) -> None:
    """The ``resumed`` event of a run that started from ``resume`` (None: nothing)."""
    if resume is not None:
        recorder.event("resumed", step=resume.step, saved_world_size=resume.world_size,
                       world_size=world_size, checkpoint=resume.url)


def write_weights(recorder: RunRecorder, name: str, state: Callable[[], dict[str, Any]],
                  on_worker: Callable[[Any, str], None] | None = None,
                  parts: Callable[[], tuple[TensorSpecs, Iterable[dict[str, Any]]]] | None = None) -> None:
    """``<out>/<name>.safetensors`` (nothing without ``--out``): to an ``--out`` URI by a
    worker straight from its memory where the mode has one that can (``on_worker(storage,
    file name)``), else by this driver from ``state()``, or from ``parts()`` (the file's
    ``TensorSpecs``, then its tensors a part at a time) where the mode gives them."""
    if recorder.storage is None:
        return
    if recorder.remote and on_worker is not None:
        on_worker(recorder.storage, f"{name}.safetensors")
    elif parts is not None:
        recorder.weight_parts(name, *parts())
    else:
        recorder.weights(name, state())
