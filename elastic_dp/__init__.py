"""elastic_dp: elastic data-parallel training for PyTorch on Ray.

Public names: ``Trainer``, ``Task``, the config dataclasses, ``ElasticSampler``, ``Fault``
(fault injection) and the exception classes. Everything else is internal.
"""

from .api import Trainer
from .config import CheckpointConfig, ClusterConfig, MetricsConfig, TrainConfig
from .data import ElasticSampler, split
from .errors import (CheckpointError, ClusterError, CollectiveError, ConfigError, ElasticDPError,
                     MembershipError, NonFiniteError, PlacementError, StorageError, TaskError, WorkerError)
from .faults import Fault
from .metrics import RunSummary
from .task import Task, load_task

__all__ = [
    "Trainer", "Task", "load_task", "TrainConfig", "ClusterConfig", "CheckpointConfig", "MetricsConfig",
    "ElasticSampler", "split", "RunSummary",
    "ElasticDPError", "ConfigError", "TaskError", "PlacementError", "CheckpointError", "StorageError", "WorkerError",
    "CollectiveError", "MembershipError", "ClusterError", "NonFiniteError", "Fault",
]
