"""Data-parallel strategies: how gradients are reduced and the optimizer updates.

A strategy is an object with one interface, built once per worker by ``make_strategy``;
the worker's step and its state calls do not branch on which one it has. ``Replicated``
is ZeRO stage 0: every worker holds full parameters, gradients and optimizer state, and
gradients are all-reduced in buckets overlapped with backward. ``elastic_dp.state.zero.stages.Sharded``
(stages 1 and 2) implements the same interface, and also what resharding needs
(``holdings``, ``export``, ``import_shards``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from elastic_dp.durable.checkpoint import TrainingState, Wanted, load_optimizer_state, optimizer_state
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.config import TrainConfig
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


def make_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                  config: TrainConfig, device: torch.device) -> Strategy:
    """The strategy of ``config.zero``, built once; a sharded one re-cuts itself for every
    generation of ``group``."""
    if config.zero:
        from elastic_dp.state.zero.stages import Sharded
        return Sharded(model, optimizer, group, config, device)
    return Replicated(model, optimizer, group, config, device)


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


class Replicated(BucketedGradients):
    """ZeRO stage 0: full replicas, bucketed all-reduce overlapped with backward."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: CollectiveGroup, config: TrainConfig, device: torch.device) -> None:
        self.model, self.group, self.device = model, group, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.optimizer = optimizer
        self.reducer = GradientReducer(self.params, group,
                                       bucket_bytes=int(config.bucket_mb * 2**20),
                                       first_bucket_bytes=config.first_bucket_bytes(device.type),
                                       reduce_fp32=config.reduce_fp32)

    def clip_grad_norm(self, max_norm: float) -> float:
        # Gradients are identical on every rank after the all-reduce, so the local norm
        # is the global norm and no further communication is needed.
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def optimizer_step(self, step: int) -> None:
        self.optimizer.step()

    def skip_update(self, step: int) -> None:
        pass  # nothing moved: parameters and optimizer state stay as they are

    def after_commit(self, step: int, fault=None) -> None:
        pass  # every worker holds the whole state: nothing to snapshot

    def settle(self) -> None:
        pass  # a step leaves nothing in flight

    def take_parameter_wait_s(self) -> float:
        return 0.0

    def drop_pending(self) -> None:
        pass

    def state_bytes(self) -> dict[str, int]:
        buffers = [b.buffer for b in self.reducer.buckets]
        return {"parameters": nbytes(self.params),
                "gradients": nbytes(buffers) + nbytes(
                    [p.grad for p in self.params if p.grad is not None and not inside(p.grad, buffers)]),
                "optimizer_state": nbytes([v for s in self.optimizer.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor)])}

    def sync_from(self, src: int) -> None:
        tensors = list(self.model.state_dict().values())
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        broadcast_tensors(self.group, tensors, src, self.device)

    def state_part(self) -> tuple[dict[str, torch.Tensor], dict]:
        return optimizer_state(self.optimizer, self.names)

    def wanted(self) -> Wanted | None:
        return None  # a full replica needs everything

    def load(self, state: TrainingState) -> None:
        # copies: the optimizer steps its state in place (0-dim step counts stay on the CPU)
        tensors = {k: v.to(self.device, copy=True) if v.dim() > 0 else v.clone()
                   for k, v in state.optimizer_tensors.items()
                   if not k.endswith("/master")}  # fp32 masters are ZeRO's; stage 0 has none
        load_optimizer_state(self.optimizer, self.names, tensors, state.optimizer_meta)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """``t`` shares memory with one of ``buffers`` (a gradient that is a bucket view)."""
    return any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
