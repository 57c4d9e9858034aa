"""elastic_dp: elastic data-parallel training for PyTorch on Ray.

Public names: ``Trainer``, ``Task``, the config dataclasses, ``ElasticSampler``, ``Fault``
(fault injection), ``keep_workers`` (worker processes kept from one ``Trainer.fit()`` for
the next) and the exception classes. Everything else is internal.

``Trainer`` (the driver: the coordinator, the modes, Ray's placement) is imported when it
is first used, so that a worker process, which imports ``elastic_dp.worker``, does not
import the driver side (a tenth of its start-up CPU after torch and Ray).
"""

from typing import Any

from elastic_dp.config import CheckpointConfig, ClusterConfig, MetricsConfig, TrainConfig
from elastic_dp.control.membership.kept import keep_workers
from elastic_dp.data import ElasticSampler, split
from elastic_dp.errors import (
    CheckpointError,
    ClusterError,
    CollectiveError,
    ConfigError,
    ElasticDPError,
    MembershipError,
    NonFiniteError,
    PlacementError,
    StorageError,
    TaskError,
    WorkerError,
)
from elastic_dp.faults import Fault
from elastic_dp.observe.metrics import RunSummary
from elastic_dp.task import Task, load_task


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from elastic_dp.api import Trainer

        return Trainer
    raise AttributeError(f"module 'elastic_dp' has no attribute {name!r}")


__all__ = [
    "Trainer", "Task", "load_task", "TrainConfig", "ClusterConfig", "CheckpointConfig", "MetricsConfig",
    "ElasticSampler", "split", "RunSummary",
    "ElasticDPError", "ConfigError", "TaskError", "PlacementError", "CheckpointError", "StorageError", "WorkerError",
    "CollectiveError", "MembershipError", "ClusterError", "NonFiniteError", "Fault", "keep_workers",
]
