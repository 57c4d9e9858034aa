"""What the worker actor needs from a mode's worker side (its program), and the defaults.

A mode's program runs in the worker, over its ``Replica``; the mode's driver half calls
it through the actor's two entry points (``WorkerActor.call`` and ``WorkerActor.stream``),
which reach only the methods the program names in ``calls`` and ``streams``. The actor
itself never asks which mode it runs: leaving, aborting, evaluating and checkpointing go
through the hooks below, whose defaults fit a program that keeps no state of its own
beyond the replica's.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

if TYPE_CHECKING:
    from elastic_dp.durable.checkpoint import Checkpoint, Part
    from elastic_dp.worker.replica import Replica


class Program:
    """A mode's worker side over a ``Replica`` (a subclass per mode, built by the actor from
    the registry: ``modes.registry.make_program``)."""

    calls: ClassVar[frozenset[str]] = frozenset()
    """Its methods the driver half calls (``WorkerActor.call(name, ...)``)."""
    streams: ClassVar[frozenset[str]] = frozenset()
    """Its generator methods, whose items stream back one by one (``WorkerActor.stream``)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def abort(self) -> None:
        """The group is being aborted: a call waiting for the driver (not in a collective,
        which the group's abort releases) ends."""

    def leave(self) -> None:
        """This worker is asked to leave (SIGTERM): what it runs ends at its next boundary."""

    def evaluating(self) -> ContextManager[None]:
        """Held while the replica evaluates: the model's parameters are the run's inside."""
        return contextlib.nullcontext()

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """This rank's share of a checkpoint after ``step``, copied into host memory."""
        return self.replica.checkpoint_part(step, sampler)

    def load_checkpoint(self, checkpoint: Checkpoint) -> Any:
        """Read this rank's needs of ``checkpoint`` and load them."""
        return self.replica.load_checkpoint(checkpoint)
