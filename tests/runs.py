"""One run of the Python API as the tests make it (``Trainer(...).fit()`` on the test's
Ray cluster), and what it wrote: the one helper the end-to-end tests share."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, TrainConfig, Trainer
from elastic_dp.observe.metrics import RunSummary
from elastic_dp.task import Task
from tests.records import read_lines


@dataclasses.dataclass
class Run:
    """A finished run: its summary, its configuration and its ``--out``."""

    summary: RunSummary
    config: TrainConfig
    out: Path | str

    def lines(self, name: str) -> list[dict]:
        """``<out>/<name>.jsonl`` (a local ``--out``)."""
        return read_lines(Path(self.out) / f"{name}.jsonl")

    @property
    def events(self) -> list[dict]:
        return self.lines("events")

    def changes(self) -> list[dict]:
        """The ``membership_changed`` events."""
        return [e for e in self.events if e["kind"] == "membership_changed"]

    def weights(self, name: str = "final") -> dict:
        return load_file(Path(self.out) / f"{name}.safetensors")


def fit(task: Task, out: Path | str, *, workers: int = 2, min_workers: int | None = None, inject=(),
        checkpoint: CheckpointConfig | None = None, cluster: dict[str, Any] | None = None,
        config: TrainConfig | None = None, **train: Any) -> Run:
    """Train ``task`` with ``config`` (default: the task's defaults) changed by ``train``
    (settings by name) on ``workers`` (``min_workers``: the MIN of ``--workers MIN:MAX``)
    into ``out``, without a progress bar."""
    config = dataclasses.replace(config or task.defaults, **train)
    summary = Trainer(task, train=config,
                      cluster=ClusterConfig(workers=workers, min_workers=min_workers, **(cluster or {})),
                      checkpoint=checkpoint, out_dir=str(out), progress=False, inject=list(inject)).fit()
    return Run(summary, config, out)
