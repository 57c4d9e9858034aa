"""What the worker's step needs from a state strategy (``Strategy``), and the pieces
the strategies share."""

from __future__ import annotations

from typing import Protocol

import torch

from elastic_dp.durable.checkpoint import TrainingState, Wanted
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import GradientReducer


class Strategy(Protocol):
    """What the worker's step needs from a data-parallel strategy."""

    def zero_grad(self) -> None:
        """Zero the gradients before a step (or after one that did not commit)."""

    def before_last_backward(self) -> None:
        """Called before the backward of a step's last micro-batch."""

    def note_nonfinite(self) -> None:
        """A loss of this step was not finite: this rank votes to skip the update."""

    def note_error(self) -> None:
        """This rank's step raised: it votes against the commit."""

    def note_stop(self) -> None:
        """This rank was asked to end its window after this step: the vote tells every rank."""

    def reduce_gradients(self) -> list[float]:
        """Complete the step's gradient reduction; gradients are then global. Returns the
        commit vote summed over the ranks, which travelled with the last bucket: [ranks
        with an error, ranks with a non-finite loss or local gradient, ranks asked to end
        the window after this step]."""

    def abandon(self) -> None:
        """Forget a step that failed part-way."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping."""

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer param groups that are stepped (the learning rate is set on these)."""

    def optimizer_step(self, step: int) -> None:
        """Apply the update of committed step ``step`` (only after the commit vote passed)."""

    def skip_update(self, step: int) -> None:
        """Committed step ``step`` makes no update (a non-finite loss or gradient)."""

    def after_commit(self, step: int, fault=None) -> None:
        """After the update, at ``step`` committed steps: peer snapshots when due."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for parameters, gradients and optimizer state (with masters)."""

    def settle(self) -> None:
        """Wait for what the last step left in flight that the parameters depend on,
        before they are read outside a step (ZeRO's parameter all-gather)."""

    def take_parameter_wait_s(self) -> float:
        """Seconds this step's forwards have waited for their parameters (ZeRO's
        all-gathers, left in flight by the last update); 0 where nothing is waited for."""

    def drop_pending(self) -> None:
        """The group is about to be re-configured: abandon what is in flight on it."""

    # -- state: initial sync, checkpoint parts, loading ---------------------------------------
    def sync_from(self, src: int) -> None:
        """A collective: make this worker's state equal rank ``src``'s fresh model's."""

    def state_part(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This worker's part of the optimizer state: tensors keyed ``<param name>/<key>``
        and JSON metadata (``checkpoint.merge_shards`` joins the parts of several workers)."""

    def wanted(self) -> Wanted | None:
        """Which pieces of a checkpoint this worker reads to load it (None: all)."""

    def load(self, state: TrainingState) -> None:
        """Load a whole, world-size-independent state after the model's parameters were
        loaded (with ZeRO a collective: every rank calls it)."""


def broadcast_tensors(group: CollectiveGroup, tensors: list[torch.Tensor], src: int, device: torch.device) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s."""
    for t in tensors:
        if t.device == device:
            group.broadcast(t, src)
        else:  # e.g. Adam's CPU "step" counter when the group is NCCL
            t.copy_(group.broadcast(t.to(device), src))


class BucketedGradients:
    """The gradient part of the Strategy interface, for a strategy whose ``reducer`` (a
    GradientReducer) reduces the gradients during backward."""

    reducer: GradientReducer

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def before_last_backward(self) -> None:
        self.reducer.arm()

    def note_nonfinite(self) -> None:
        self.reducer.note_nonfinite()

    def note_error(self) -> None:
        self.reducer.note_error()

    def note_stop(self) -> None:
        self.reducer.note_stop()

    def reduce_gradients(self) -> list[float]:
        return self.reducer.finish()

    def abandon(self) -> None:
        self.reducer.disarm()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """``t`` shares memory with one of ``buffers`` (a gradient that is a bucket view)."""
    return any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
