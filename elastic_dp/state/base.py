"""What a worker needs from a state strategy (``Strategy``; ``Resharding`` for a strategy
whose state is cut over the ranks), and the pieces the strategies share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Protocol

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import GradientReducer
from elastic_dp.comm.reductions import Reduction
from elastic_dp.comm.vote import Ballot, Vote
from elastic_dp.durable.checkpoint import Checkpoint, Part, TrainingState, Wanted, cut_part
from elastic_dp.durable.weights import TensorSpecs
from elastic_dp.state.buffers import ModelBuffers


class Strategy(Protocol):
    """What the worker's step needs from a data-parallel strategy."""

    buffers: ModelBuffers
    """The model's buffers, which the step saves, restores and agrees on (``.buffers``)."""

    @property
    def reduction(self) -> Reduction:
        """How the gradients cross the ranks (``comm.reductions``); the step saves its state
        and restores it as it does the buffers'."""

    def zero_grad(self) -> None:
        """Zero the gradients before a step (or after one that did not commit)."""

    equal_passes: bool
    """Every rank must run the same number of forward and backward passes in a step
    (ZeRO-3, whose passes are collectives): a rank with fewer micro-batches than another
    runs passes that add nothing (``Replica.forward_backward``)."""

    def before_last_backward(self) -> None:
        """Called before the backward of a step's last micro-batch."""

    def before_backward(self) -> None:
        """Called before the backward of each micro-batch but the last."""

    def counts_use(self, counts: bool) -> None:
        """Whether the next backward's gradients mark their parameters used (False: a pass
        that adds nothing, ``equal_passes``). A parameter no backward of the step on any
        rank gave a gradient gets no update, as plain PyTorch leaves a ``None`` gradient."""

    def after_backward(self) -> None:
        """Called after the backward of each micro-batch but the last."""

    @property
    def ballot(self) -> Ballot:
        """This rank's vote on the step, which the gradient reduction carries."""

    def before_vote(self, call: Callable[[], None] | None) -> None:
        """Have ``call`` called just before this rank's ballot leaves with the reduction
        (the last moment to add to it; fault injection's ``allreduce`` phase)."""

    def reduce_gradients(self) -> Vote:
        """Complete the step's gradient reduction; gradients are then global. Returns the
        commit vote summed over the ranks, which travelled with the last bucket."""

    def abandon(self) -> None:
        """Forget a step that failed part-way."""

    def after_local_error(self) -> None:
        """This rank's forward or backward raised: keep the step's collectives in lockstep
        with the peers, so that every rank hears of it in the vote (ZeRO-3, which cannot,
        aborts the group and raises ``CollectiveError``)."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping."""

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer param groups that are stepped (the learning rate is set on these)."""

    def optimizer_step(self, step: int) -> None:
        """Apply the update of committed step ``step`` (only after the commit vote passed)."""

    def skip_update(self, step: int) -> None:
        """Committed step ``step`` makes no update (a non-finite loss or gradient)."""

    def after_commit(self, step: int) -> None:
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
        and JSON metadata (``checkpoint.merge_parts`` joins the parts of several workers)."""

    def wanted(self) -> Wanted | None:
        """Which pieces of a checkpoint this worker reads to load it (None: all)."""

    def load(self, state: TrainingState) -> None:
        """Load a whole, world-size-independent state after the model's parameters were
        loaded (with ZeRO a collective: every rank calls it)."""

    def load_checkpoint(self, checkpoint: Checkpoint) -> TrainingState:
        """Read what this worker needs of ``checkpoint`` and load it (with ZeRO a
        collective); returns what was read (its optimizer metadata holds the scheduler's)."""

    # -- the model's state: the strategy owns it -----------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict, copied to the host."""

    def weight_parts(self) -> list[TensorSpecs]:
        """The run's weights file in parts, the tensors of each: (name, dtype, shape)."""

    def weight_part(self, i: int) -> dict[str, torch.Tensor]:
        """Part ``i`` of the run's weights (at ZeRO stage 3 a collective that gathers it)."""

    def training_state(self, step: int, sampler: dict[str, int]) -> TrainingState:
        """This worker's state at ``step`` committed steps, copied: whole where it is
        replicated, this rank's part where it is sharded (``checkpoint.merge_parts``)."""

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """This rank's share of a checkpoint at ``step``, copied into host memory."""

    def load_state(self, state: TrainingState) -> None:
        """Load a whole (world-size-independent) training state, the model's included;
        with ZeRO a collective."""


class Resharding(Protocol):
    """What a strategy whose state is cut over the ranks adds: after a failure, what this
    rank holds, a chunk out of it, and the new generation's chunks cut out of the old."""

    def holdings(self) -> dict:
        """The steps of the chunks this rank holds: live, its own snapshots, its left
        neighbour's (``modes.sync.sharded.chunk_sources`` picks from them)."""

    def export(self, kind: str, step: int) -> Any:
        """A chunk: ``live``, or the ``own`` / ``peer`` snapshot of ``step``."""

    def import_chunks(self, fetch: Callable[[list[int]], list[Any]], old_world_size: int, step: int) -> int:
        """A collective over the new generation: become its rank from the old ranks'
        chunks at ``step`` (``fetch(old_ranks)``: only the ones needed and not held here
        are asked); returns how many were fetched."""


class WholeModel:
    """The model-state part of the ``Strategy`` interface, for a strategy whose workers
    each hold every parameter whole (stages 0 to 2; stage 3's sibling part is
    ``zero.stage3_state.UnitChunks``): the state dict is the model's own, and a checkpoint
    part is this rank's range of each tensor (``checkpoint.cut_part``). Needs ``model``,
    ``group`` and ``device``, and the strategy's ``settle``, ``state_part`` and ``load``."""

    model: torch.nn.Module
    group: CollectiveGroup
    device: torch.device

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.weights().items()}

    def weights(self) -> dict[str, torch.Tensor]:
        self.settle()
        return self.model.state_dict()

    def load_checkpoint(self, checkpoint: Checkpoint) -> TrainingState:
        state = checkpoint.read(self.wanted())  # every file checked against its sha256 before any collective
        self.load_state(state)
        return state

    def weight_parts(self) -> list[TensorSpecs]:
        return [[(k, v.dtype, list(v.shape)) for k, v in self.weights().items()]]  # one part: the whole model

    def weight_part(self, i: int) -> dict[str, torch.Tensor]:
        return self.weights()

    def training_state(self, step: int, sampler: dict[str, int]) -> TrainingState:
        return copied_state(self, step, sampler)

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """Only the pieces this rank writes are copied."""
        self.settle()
        tensors, meta = self.state_part()
        live = TrainingState(step=step, model=self.model.state_dict(), optimizer_tensors=tensors,
                             optimizer_meta=meta, sampler=sampler, world_size=self.group.world_size,
                             rng=torch.get_rng_state())
        return cut_part(live, self.group.rank, self.group.world_size)

    def load_state(self, state: TrainingState) -> None:
        self.settle()  # no gather still in flight may overwrite what is loaded
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.model.items()})
        self.load(state)
        torch.set_rng_state(state.rng)


def copied_state(strategy: Any, step: int, sampler: dict[str, int]) -> TrainingState:
    """``Strategy.training_state`` from the strategy's ``model_state`` and ``state_part``."""
    strategy.settle()
    tensors, meta = strategy.state_part()
    return TrainingState(step=step, model=strategy.model_state(),
                         optimizer_tensors={k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
                         optimizer_meta=meta, sampler=sampler, world_size=strategy.group.world_size,
                         rng=torch.get_rng_state())


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
    reduction: Reduction
    """The reducer's reduction, built once with the strategy (its state outlives a
    generation's reducer)."""
    equal_passes = False

    unused: Sequence[torch.nn.Parameter] = ()
    """The parameters the last reduced step gave no gradient on any rank (``reduce_gradients``)."""

    def zero_grad(self) -> None:
        self.reducer.zero_grad()
        self.unused = ()

    def counts_use(self, counts: bool) -> None:
        self.reducer.counting = counts

    def before_backward(self) -> None:
        pass  # the gradients of the micro-batches before the last accumulate where they are

    def after_backward(self) -> None:
        pass

    def before_last_backward(self) -> None:
        self.reducer.arm()

    @property
    def ballot(self) -> Ballot:
        return self.reducer.ballot

    def before_vote(self, call: Callable[[], None] | None) -> None:
        self.reducer.before_vote = call

    def reduce_gradients(self) -> Vote:
        vote = self.reducer.finish()
        self.unused = self.reducer.unused(vote)
        return vote

    def abandon(self) -> None:
        self.reducer.disarm()

    def after_local_error(self) -> None:
        self.reducer.ballot.error()
        self.reducer.arm()  # every bucket is launched by the reduction, zeros where no gradient came


class LocalGradients:
    """The gradient part of the Strategy interface, for a strategy whose gradients stay on
    the worker (a mode that reduces none: its program calls ``zero_grad`` and reads
    ``.grad``, and casts no vote). ``zero_grad`` leaves the gradients as the reducer's
    buckets did in these modes, so that an optimizer steps the same parameters: a zero
    gradient on each fp32 parameter (a bucket view), none on a bf16 or fp16 one (its
    bucket was fp32: no view). A parameter no forward uses keeps that (issue 43)."""

    params: list[torch.nn.Parameter]
    equal_passes = False

    @property
    def reduction(self) -> Reduction:
        raise RuntimeError("a strategy whose gradients stay on the worker has no reduction: its mode reduces them")

    def zero_grad(self) -> None:
        for p in self.params:
            if p.dtype in (torch.bfloat16, torch.float16):
                p.grad = None
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()

    def before_backward(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def before_last_backward(self) -> None:
        pass  # nothing is reduced: the gradients are complete when the backward is

    def counts_use(self, counts: bool) -> None:
        pass  # the mode's program steps the gradients as they are

    @property
    def ballot(self) -> Ballot:
        raise RuntimeError("a strategy whose gradients stay on the worker casts no vote")

    def before_vote(self, call: Callable[[], None] | None) -> None:
        raise RuntimeError("a strategy whose gradients stay on the worker casts no vote")

    def reduce_gradients(self) -> Vote:
        raise RuntimeError("a strategy whose gradients stay on the worker reduces none: its mode reduces them")

    def abandon(self) -> None:
        self.zero_grad()

    def after_local_error(self) -> None:
        pass  # no collective to keep in lockstep


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """``t`` shares memory with one of ``buffers`` (a gradient that is a bucket view)."""
    return any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
