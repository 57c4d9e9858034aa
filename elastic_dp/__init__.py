"""elastic_dp: elastic data-parallel training for PyTorch on Ray.

Public names: ``Trainer``, ``Task``, the config dataclasses, ``ElasticSampler``, ``Fault``
(fault injection), ``keep_workers`` (worker processes kept from one ``Trainer.fit()`` for
the next) and the exception classes. Everything else is internal.

Each is imported when it is first used: a worker process, which imports
``elastic_dp.worker``, does not import the driver side (``Trainer``: the coordinator, the
modes, Ray's placement; a tenth of its start-up CPU after torch and Ray), and the
``elastic-dp`` command (``main``) loads torch and Ray itself, where a Ctrl-C is its to
report.
"""

import sys
from typing import Any

_PUBLIC = {
    "Trainer": "elastic_dp.api", "Task": "elastic_dp.task", "load_task": "elastic_dp.task",
    "TrainConfig": "elastic_dp.config", "ClusterConfig": "elastic_dp.config", "CheckpointConfig": "elastic_dp.config",
    "MetricsConfig": "elastic_dp.config", "ElasticSampler": "elastic_dp.data", "split": "elastic_dp.data",
    "RunSummary": "elastic_dp.observe.metrics", "Fault": "elastic_dp.faults",
    "keep_workers": "elastic_dp.control.membership.kept",
    **{name: "elastic_dp.errors" for name in (
        "ElasticDPError", "ConfigError", "TaskError", "PlacementError", "CheckpointError", "StorageError",
        "WorkerError", "CollectiveError", "MembershipError", "ClusterError", "NonFiniteError")},
}


def __getattr__(name: str) -> Any:
    """A public name, imported when it is first used."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'elastic_dp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def main() -> int:
    """The ``elastic-dp`` command (``elastic_dp.cli``), imported here: a Ctrl-C while torch
    and Ray load ends in one line and exit code 130, as one later does, not a traceback."""
    try:
        from elastic_dp.cli import main as command
    except KeyboardInterrupt:
        print("elastic-dp: interrupted before the run started: nothing was trained or written", file=sys.stderr)
        return 130
    return command()


__all__ = [
    "Trainer", "Task", "load_task", "TrainConfig", "ClusterConfig", "CheckpointConfig", "MetricsConfig",
    "ElasticSampler", "split", "RunSummary",
    "ElasticDPError", "ConfigError", "TaskError", "PlacementError", "CheckpointError", "StorageError", "WorkerError",
    "CollectiveError", "MembershipError", "ClusterError", "NonFiniteError", "Fault", "keep_workers",
]
