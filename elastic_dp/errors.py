"""One exception hierarchy for elastic_dp.

Every message says what went wrong and which setting or input to change. The classes
carry only a message, so they pickle cleanly when they cross from a worker actor to the
coordinator.
"""

from __future__ import annotations


class ElasticDPError(Exception):
    """Base class of every error elastic_dp raises on purpose."""


class ConfigError(ElasticDPError, ValueError):
    """A setting is invalid; the message names the setting (or CLI flag) to change."""


class TaskError(ElasticDPError):
    """The task (job module, model, dataset, loss or optimizer factory) is unusable."""


class ClusterError(ElasticDPError):
    """The Ray cluster cannot be reached; the message names the address and the setting."""


class PlacementError(ElasticDPError):
    """The cluster cannot place the requested workers within the placement timeout."""


class MembershipError(ElasticDPError):
    """The run cannot keep enough workers alive; the message says what to change."""


class NonFiniteError(ElasticDPError):
    """Steps had a non-finite loss or gradient (no update was applied); the message names
    the step, the ranks and the setting (``--on-nonfinite``, ``--max-nonfinite-steps``)."""


class CheckpointError(ElasticDPError):
    """A checkpoint cannot be written, found, or trusted (missing file, bad checksum)."""


class WorkerError(ElasticDPError):
    """A worker failed a step; carries the worker's rank, the step and its error text."""

    def __init__(self, message: str, *, rank: int = -1, step: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step

    def __reduce__(self):  # keep keyword fields (and the subclass) across the Ray actor boundary
        return (_rebuild_worker_error, (type(self), str(self), self.rank, self.step))


def _rebuild_worker_error(cls: type, message: str, rank: int, step: int) -> "WorkerError":
    return cls(message, rank=rank, step=step)


class CollectiveError(WorkerError):
    """A step's collective failed on a healthy worker: a peer died or hung, or the group
    was aborted. Recoverable: the survivors re-form the group and re-run the step."""


class StorageError(CheckpointError):
    """Storage (``--checkpoint-dir``, ``--storage``, an ``--out`` URI) cannot be opened,
    reached, read or written; the message names the location and the setting."""
