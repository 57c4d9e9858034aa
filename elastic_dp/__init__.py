"""elastic_dp: elastic data-parallel training for PyTorch on Ray.

Public names: ``Trainer``, ``Task``, the config dataclasses, ``ElasticSampler``, ``Fault``
(fault injection) and the exception classes. Everything else is internal.
"""

from elastic_dp.api import Trainer
from elastic_dp.config import CheckpointConfig, ClusterConfig, MetricsConfig, TrainConfig
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

__all__ = [
    "Trainer", "Task", "load_task", "TrainConfig", "ClusterConfig", "CheckpointConfig", "MetricsConfig",
    "ElasticSampler", "split", "RunSummary",
    "ElasticDPError", "ConfigError", "TaskError", "PlacementError", "CheckpointError", "StorageError", "WorkerError",
    "CollectiveError", "MembershipError", "ClusterError", "NonFiniteError", "Fault",
]
