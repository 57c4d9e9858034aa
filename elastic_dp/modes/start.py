"""What every training mode does alike as a run starts: the dataset every worker built, the
resume checkpoint this run can continue, and the event that says it did."""

from __future__ import annotations

from typing import Any, Sequence

from elastic_dp.config import TrainConfig
from elastic_dp.data import check_resumable
from elastic_dp.errors import ConfigError, TaskError
from elastic_dp.observe.metrics import RunRecorder


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
