"""ZeRO's sharded state, the part stages 1 and 2 share, resharded on every resize.

The unit of sharding is the gradient bucket (``elastic_dp.comm.reducer``): each bucket's
flat buffer is padded to a multiple of the world size ``N`` and rank ``r`` owns its
``r``-th chunk; the partition does not depend on ``N``, only the padding does, so
resharding is a re-cut of the same flat vectors (``.chunks``). Per bucket a rank holds the
parameters (views into one flat buffer, all-gathered after each update and waited for in
the next forward's pre-hook), the fp32 master of its chunk and the optimizer state of its
chunk (a torch optimizer of the task's class over the master chunks: element-wise
optimizers only). Where the gradients live is the stage's (``stage1.ShardedOptimizer``,
``stage2.ShardedGradients``). Every ``snapshot_every`` steps a rank's chunk is copied to
its right neighbour (``.snapshots``), and after a failure the chunks are cut anew out of
what the survivors hold (``holdings``, ``export``, ``import_chunks``). Under
``--shard-scope host`` (HSDP) the state is cut over the ranks of a block inside one host
instead of every rank (``_cut``: ``shards`` chunks, ``shard`` this rank's), the parameters
are gathered inside the block, and the chunk's copies on the other hosts replace the peer
snapshot (docs/hosts.md). docs/zero.md walks through all of it, with the figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic_dp.comm.compression import make_compressor
from elastic_dp.comm.feedback import ErrorFeedback
from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import GradientReducer, make_buckets
from elastic_dp.comm.reductions import ReduceScatter, Reduction
from elastic_dp.config import TrainConfig
from elastic_dp.durable.checkpoint import TrainingState, Wanted
from elastic_dp.errors import CollectiveError, peer_error
from elastic_dp.faults import FaultHook
from elastic_dp.state.base import BucketedGradients, broadcast_tensors, inside, nbytes
from elastic_dp.state.buffers import BufferHistory, ModelBuffers
from elastic_dp.state.zero import format as zero_format
from elastic_dp.state.zero.chunks import ChunkState, check_elementwise, cut, needed_sources, unpack
from elastic_dp.state.zero.snapshots import SNAPSHOT_WAIT_S, Exchange, PeerSnapshots
from elastic_dp.state.zero.unused import Clock, OwnSteps, bucket_step, make_optimizer, step_pieces

logger = logging.getLogger(__name__)

class Sharded(BucketedGradients):
    """ZeRO's sharded state, built once per worker (a stage's subclass says where the
    gradients live: ``_gradients``, ``_gradient_buffers``). Its cut depends on the world size, so
    it is re-cut for each generation of ``group`` (``_current``) when that generation
    starts: its first step, or the state it is given (``sync_from``, ``load``,
    ``import_chunks``). Until then it still holds, and can export, the last generation's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                 config: TrainConfig, device: torch.device, faults: FaultHook | None = None) -> None:
        check_elementwise(optimizer, config.stage.number)
        self.faults = faults or FaultHook()  # the phase ``snapshot`` is here
        self.model, self.base_optimizer, self.device = model, optimizer, device
        self.group, self.config = group, config
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.base_groups = optimizer.param_groups
        self.generation: int | None = None  # of the cut below; None: not built yet
        self.snapshots = PeerSnapshots()
        compressor = config.buckets.compressor  # --compress: the compressor reduce-scatters (stages 1 and 2)
        self.reduction: Reduction = (make_compressor(group, compressor, config.seed) if compressor is not None
                                     else ReduceScatter(group, config.mode.zero.shard_scope))
        """Each bucket's collective, kept across the generations' reducers (``comm.reductions``)."""
        if isinstance(self.reduction, ErrorFeedback):
            self.reduction.rewinds = True  # the chunks may be restored a committed step back
        self.buffers = ModelBuffers(model)
        self.history = BufferHistory(self.buffers)
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.own = OwnSteps([self.names[id(p)] for p in model.parameters() if p.requires_grad and id(p) in stepped])
        """Each stepped parameter's own count of updates (``zero.unused``), in ``params`` order."""
        self._clocks: dict[int, Clock] = {}  # param group -> its 0-dim state by count (``zero.unused``)
        self._gathers: dict[int, Any] = {}  # bucket -> its parameter all-gather, in flight
        self.defer_gather: bool | None = None
        """Whether a step leaves its all-gather to the next forward (None: not learnt yet)."""
        self._seen: set[int] = set()  # parameters whose module ran forward (while learning)
        self._parameter_wait_s = 0.0  # this step's forwards, waiting for all-gathers
        for module in model.modules():
            ids = [id(p) for p in module.parameters(recurse=False)]
            if ids:
                module.register_forward_pre_hook(lambda _module, _args, ids=ids: self._before_forward(ids))

    def _current(self) -> None:
        """Re-cut the state for the group's generation, if it changed."""
        if self.generation != self.group.generation:
            if self.generation is not None:
                self.reducer.close()
            self._build()

    def _build(self) -> None:
        self._gathers = {}  # the last generation's (``drop_pending``)
        group, config, optimizer = self.group, self.config, self.base_optimizer
        self._cut(group)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.params = [p for p in self.model.parameters() if p.requires_grad and id(p) in group_of]
        bucket_bytes, first_bytes = config.buckets.bucket_bytes, config.buckets.first_bucket_bytes(self.device.type)
        self.buckets = make_buckets(self.params, bucket_bytes, config.buckets.reduce_fp32, first_bucket_bytes=first_bytes,
                                    group_of=group_of, pad_to=self.shards)
        self._index_buckets(group_of)
        order = {id(p): i for i, p in enumerate(self.params)}
        self.forward_order = sorted(range(len(self.buckets)),  # the first used first
                                    key=lambda b: min(order[id(p)] for p in self.buckets[b].params))

        # parameters become views into one flat buffer per bucket (gathered in place)
        self.param_buffers: list[torch.Tensor] = []
        for bucket in self.buckets:
            buffer = torch.zeros(bucket.padded, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
            for p, offset in zip(bucket.params, bucket.offsets):
                view = buffer[offset:offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
            self.param_buffers.append(buffer)
        self.masters = []
        for buffer, chunk in zip(self.param_buffers, self.chunks):
            own = buffer[self.shard * chunk:(self.shard + 1) * chunk]
            self.masters.append(torch.nn.Parameter(own if own.dtype == torch.float32 else own.float()))
        # fp32 parameters are their own masters: a peer snapshot then leaves them out
        # (the neighbour has them from the all-gather) and sends the optimizer state alone
        self.snapshots.configure(group, 0 if any(b.dtype != torch.float32 for b in self.param_buffers)
                                 else sum(self.chunks), peers=self.replicas == 1)

        self.reducer = GradientReducer(self.params, group, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bytes,
                                       reduce_fp32=config.buckets.reduce_fp32, group_of=group_of, pad_to=self.shards,
                                       reduction=self.reduction, **self._gradients())
        self._make_optimizer()

    def _cut(self, group: CollectiveGroup) -> None:
        """This generation's ranks, and how the state is cut among them (``--shard-scope``):
        ``shards`` chunks, this rank's ``shard``-th; ``replicas`` copies of each, the ranks
        of this rank's ``replica`` group holding the same chunk as it; ``shard_group`` the
        ranks that hold the other chunks of this rank's copy (the parameter all-gathers')."""
        self.world_size, self.rank, self.generation = group.world_size, group.rank, group.generation
        self.shards, self.shard = self.reduction.parts, self.reduction.part
        self.replicas = self.world_size // self.shards
        self.shard_group = group if self.replicas == 1 else group.subgroup("shard")
        self.first_copy = self.replicas == 1 or self.rank == group.mesh.group("replica", self.rank)[0]
        """This rank's chunk is the first copy of it: what a checkpoint holds of it, this rank writes."""
        self.left_chunk = self._left()
        """The chunk whose peer snapshots this rank keeps in this generation (None: none)."""

    def _index_buckets(self, group_of: dict[int, int]) -> None:
        """Per bucket of ``buckets``: its chunk, its elements, its param group; each
        parameter's bucket."""
        self.chunks = [b.padded // self.shards for b in self.buckets]
        self.numels = [b.numel for b in self.buckets]
        self.bucket_group = [group_of[id(b.params[0])] for b in self.buckets]
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.members = [[self.index[id(p)] for p in bucket.params] for bucket in self.buckets]
        """Per bucket, its parameters' indices in ``params`` (and ``own.counts``)."""

    def _make_optimizer(self) -> None:
        """The task's optimizer class over the master chunks, in the task's param groups;
        no state yet (the live chunk is at step 0 until given one)."""
        optimizer = self.base_optimizer
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [m for m, gi in zip(self.masters, self.bucket_group) if gi == i]}
                  for i, g in enumerate(optimizer.param_groups)]
        self.optimizer = make_optimizer(optimizer, groups)
        self.live_step = 0
        self.holds_state = False
        """The live chunk holds the run's state (of ``live_step``), given since the cut was built."""

    def _gradients(self) -> dict:
        """How the reducer reduces this stage's gradients (``GradientReducer``'s scatter
        arguments), for the buckets just built."""
        raise NotImplementedError

    def _gradient_buffers(self) -> list[torch.Tensor]:
        """The tensors that hold this stage's gradients (``state_bytes``)."""
        raise NotImplementedError

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    # -- the step (before_last_backward .. abandon come from BucketedGradients) -------------
    def zero_grad(self) -> None:
        if self.generation != self.group.generation:
            raise RuntimeError(f"generation {self.group.generation} got no state before its first step "
                               "(sync_from, load or import_chunks)")
        self._parameter_wait_s = 0.0
        self.reducer.zero_grad()
    def _grad_chunk(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s reduced gradient chunk: stage 2's own tensor, or stage 1's part of
        the full buffer (the rest of which holds this rank's local gradient)."""
        return self.reducer.chunks[b]

    def clip_grad_norm(self, max_norm: float) -> float:
        grads = self.reducer.chunks  # each rank holds the global gradient of its chunk only
        total_sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum().reshape(1)
        try:  # after the vote: a peer lost now fails the update here, not the step's vote
            self.shard_group.all_reduce(total_sq)  # one copy of every chunk
        except Exception as exc:
            raise self._collective_error("gradient norm all-reduce", exc) from None
        total = total_sq.sqrt().reshape(())
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return float(total)

    def skip_update(self, step: int) -> None:
        self.live_step = step + 1  # the chunk is unchanged, and now the state of step + 1

    @torch.no_grad()
    def optimizer_step(self, step: int) -> None:
        """Update the chunk for committed step ``step`` bucket by bucket, in the order the
        forward uses them, starting each bucket's parameter all-gather once it is updated
        (waited for in the next forward, or now: ``defer_gather``)."""
        self._wait_gathers()  # a bucket no forward used (a parameter without a gradient)
        pending = self.snapshots.pending
        if pending is not None and pending.masters_pending:
            self._copy_left_masters(pending)  # before this step's all-gather overwrites them
        if self.defer_gather is None:
            unseen = [self.names[id(p)] for p in self.params if id(p) not in self._seen]
            self.defer_gather, self._seen = not unseen, set()
            if unseen:
                logger.warning("ZeRO: the first step ran no forward of the module that holds parameters %s (read "
                               "outside that module's forward, or a module the step skipped, such as an expert "
                               "no sample chose); the parameter all-gather is waited for at the end of each step",
                               ", ".join(unseen[:5]) + (" ..." if len(unseen) > 5 else ""))
        failed = None
        before, after = self._counts_after()
        for b in self.forward_order:  # what the forward needs first is updated and sent first
            self._update(b, self._grad_chunk(b), before, after)
            master, own = self.masters[b], self._own_params(b)
            if own.data_ptr() != master.data_ptr():
                own.copy_(master)
            if failed is None:  # its all-gather runs while the next bucket is updated
                try:
                    self._start_gather(b)
                except Exception as exc:  # the chunk is still updated whole before this is raised
                    failed = exc
        self.live_step, self.own.counts = step + 1, after
        if failed is not None:
            raise self._collective_error("parameter all-gather", failed)
        if not self.defer_gather:
            self._wait_gathers()

    def _counts_after(self) -> tuple[list[int], list[int]]:
        """Each parameter's own count of updates before this update and after it (the ones
        no rank used, ``unused``, stay)."""
        unused = {id(p) for p in self.unused}
        before = self.own.counts
        return before, [c + (id(p) not in unused) for c, p in zip(before, self.params)]

    def _update(self, b: int, grad: torch.Tensor, before: list[int], after: list[int]) -> None:
        """Update bucket ``b``'s master chunk by its reduced gradient chunk ``grad``: as one
        tensor where every parameter in it is used and in step with its bucket, else piece
        by piece (``zero.unused``: a parameter no rank used is left as it is)."""
        master = self.masters[b]
        grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        low, high = bucket_step(before, self.members[b]), bucket_step(after, self.members[b])
        lo = self.shard * self.chunks[b]
        pieces = [(self.index[id(p)], a - lo, e - lo)
                  for p, _, a, e in zero_format._pieces(self.buckets[b], lo, lo + self.chunks[b])]
        if high == low + 1 and all(before[i] == low and after[i] == high for i, _, _ in pieces):
            master.grad = grad
            self.optimizer.step()  # this bucket's master alone: the others have no gradient
            master.grad = None
            return
        g = self.bucket_group[b]
        state = self.optimizer.state[master]
        step_pieces(self.base_optimizer, self.optimizer.param_groups[g], self._clock(g), state, master, grad,
                    [(before[i], a, e) for i, a, e in pieces if after[i] > before[i]], high)
        if not state:
            self.optimizer.state.pop(master, None)

    def _clock(self, g: int) -> Clock:
        if g not in self._clocks:
            self._clocks[g] = Clock(self.base_optimizer, self.optimizer.param_groups[g], self.masters[0].device)
        return self._clocks[g]

    def _copy_left_masters(self, pending: Exchange) -> None:
        """Complete the left neighbour's snapshot in flight with its master chunks, out of this rank's
        gathered parameters (their all-gather has been waited for, the next not started)."""
        left, offset = self.group.mesh.left(self.rank), 0
        for buffer, chunk in zip(self.param_buffers, self.chunks):
            pending.received[offset:offset + chunk].copy_(buffer[left * chunk:(left + 1) * chunk])
            offset += chunk
        pending.masters_pending = False

    def _own_params(self, b: int) -> torch.Tensor:
        chunk = self.chunks[b]
        return self.param_buffers[b][self.shard * chunk:(self.shard + 1) * chunk]

    def _start_gather(self, b: int) -> None:
        """Start the all-gather of bucket ``b``'s parameters from this rank's chunk."""
        self._gathers[b] = self.shard_group.all_gather_async(self.param_buffers[b], self._own_params(b))

    def _wait_gathers(self, buckets=None) -> None:
        """Wait for the all-gathers of ``buckets`` (default: all) still in flight."""
        for b in list(self._gathers) if buckets is None else buckets:
            work = self._gathers.pop(b, None)
            if work is not None:
                try:
                    work.wait()
                except Exception as exc:
                    raise self._collective_error("parameter all-gather", exc) from None

    def _gather_params(self) -> None:
        try:
            for b in self.forward_order:
                self._start_gather(b)
        except Exception as exc:
            raise self._collective_error("parameter all-gather", exc) from None
        self._wait_gathers()

    def _before_forward(self, ids: list[int]) -> None:
        """A module's forward pre-hook: the buckets of its parameters must have arrived."""
        if self.defer_gather is None:
            self._seen.update(ids)
        if self._gathers:
            start = time.perf_counter()
            self._wait_gathers({self.bucket_of[i] for i in ids if i in self.bucket_of})
            self._parameter_wait_s += time.perf_counter() - start

    def take_parameter_wait_s(self) -> float:
        wait, self._parameter_wait_s = self._parameter_wait_s, 0.0
        return wait

    def settle(self) -> None:
        """Wait for the parameters still being gathered (before they are read outside a step)."""
        self._wait_gathers()

    def drop_pending(self) -> None:
        """Before the group is re-configured, and after it was aborted (``WorkerActor.configure_group``:
        a peer may be gone, and tearing the group down must not wait for it): forget what is in
        flight on it (a new generation re-gathers the parameters from the chunks it is given)."""
        self.snapshots.drop()  # its thread is done with the old group before it goes
        self._gathers = {}

    def _collective_error(self, what: str, exc: Exception) -> CollectiveError:
        return CollectiveError(f"gen {self.generation} rank {self.rank} step {self.live_step}: {what} failed: "
                               f"{peer_error(exc)}", rank=self.rank, step=self.live_step)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker holds for parameters, gradients and optimizer state (with the
        fp32 masters when they are separate from the parameters); snapshots apart."""
        grads = self._gradient_buffers()
        stray = [p.grad for p in self.params if p.grad is not None and not inside(p.grad, grads)]
        separate = [m for b, m in enumerate(self.masters) if m.data_ptr() != self._own_params(b).data_ptr()]
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"parameters": nbytes(self.param_buffers), "gradients": nbytes(grads) + nbytes(stray),
                "optimizer_state": nbytes(state) + nbytes(separate),
                "snapshots": self.snapshots.bytes_held()}

    # -- peer snapshots ----------------------------------------------------------------------
    def after_commit(self, step: int) -> None:
        """At state step ``step`` (committed steps), when a snapshot is due: wait for the
        last one to arrive, copy the chunk and start sending it to the right neighbour."""
        self.history.keep(step, self._steps_held())  # the live step is ``step`` now
        self.own.keep(step, self._steps_held())
        if self.world_size == 1 or step % self.config.mode.zero.snapshot_every:
            return
        self._receive_snapshot()
        own = self.snapshots.keep_own(self.export("live", step))
        self.faults.at("snapshot")
        if self.replicas > 1:
            return  # every chunk has a replica on another host: no peer snapshot (own ones bridge a torn step)
        on_device = self.group.backend == "nccl" and self.masters  # NCCL sends from the GPU; gloo from the host
        self.snapshots.send(own, self.masters[0].device if on_device else None)

    def _steps_held(self) -> set[int]:
        return {self.live_step, *(s.step for s in self.snapshots.own), *(s.step for s in self.snapshots.peer)}

    def _receive_snapshot(self, timeout_s: float | None = None) -> None:
        """Wait for the peer snapshot in flight (up to ``timeout_s``) and keep it; a failed
        or timed-out transfer raises CollectiveError (and is not kept)."""
        step = self.snapshots.pending.step if self.snapshots.pending is not None else None
        try:
            arrived = self.snapshots.wait(timeout_s)
        except Exception as exc:
            raise self._collective_error(f"peer snapshot of step {step}", exc) from None
        if arrived is None:
            return
        if arrived.masters_pending:  # no step since: the parameters of its step, once gathered
            self._wait_gathers()  # a failed all-gather fails the snapshot (CollectiveError)
            self._copy_left_masters(arrived)
        self.snapshots.keep_peer(arrived)

    def holdings(self) -> dict[str, object]:
        """What this rank can export: its live chunk's step and its snapshots' steps (a
        peer snapshot still in flight is waited for briefly; one that fails is dropped)."""
        try:
            self._receive_snapshot(SNAPSHOT_WAIT_S)
        except CollectiveError as exc:
            logger.info("%s: dropped", exc)
        return {"rank": self.rank, "chunk": self.shard, "chunks": self.shards, "live": self.live_step,
                "own": [s.step for s in self.snapshots.own],
                "peer": [s.step for s in self.snapshots.peer], **self.snapshots.sizes()}

    def export(self, kind: str, step: int) -> ChunkState:
        """A chunk as a ChunkState: ``live``, or the ``own`` / ``peer`` snapshot of ``step``."""
        if kind == "live":
            if step != self.live_step:
                raise ValueError(f"live chunk is at step {self.live_step}, not {step}")
            # no copies of CPU tensors: a snapshot packs them into a new vector at once, and
            # Ray serialises an export when the call returns (step counts, changed in place
            # by the optimizer, are cloned)
            # a bucket no parameter of which was updated yet has no state: zeros in its place
            # (``_set_live`` leaves them out again)
            examples = {k: v for m in self.masters for k, v in self.optimizer.state.get(m, {}).items()
                        if isinstance(v, torch.Tensor)}
            state: dict[str, list[torch.Tensor]] = {}
            for b, master in enumerate(self.masters):
                held = self.optimizer.state.get(master, {})
                for key, example in examples.items():
                    value = held.get(key)
                    if value is None:
                        value = torch.zeros_like(example, device="cpu") if example.dim() == 0 else torch.zeros(
                            master.numel(), dtype=example.dtype)
                    value = value.detach()
                    state.setdefault(key, []).append(value.clone() if value.dim() == 0 else value.to("cpu"))
            return ChunkState(step=step, world_size=self.shards, rank=self.shard,
                              master=[m.detach().to("cpu", torch.float32) for m in self.masters], state=state,
                              buffers=self.history.of(step, self.live_step), steps=self.own.of(step, self.live_step))
        snap = self.snapshots.find(kind, step)
        rank = self.shard if kind == "own" else self.left_chunk  # peers: one copy, shard = rank
        shard = unpack(snap, self.chunks, self.shards, rank)
        shard.buffers = self.history.of(step, self.live_step)
        shard.steps = self.own.of(step, self.live_step)
        return shard

    # -- resharding ----------------------------------------------------------------------
    def _left(self) -> int | None:
        """The rank whose peer snapshot this rank keeps (None: peer snapshots are not kept,
        one rank or replicas on other hosts); with peer snapshots each chunk has one copy,
        and a chunk's index is its rank."""
        return self.group.mesh.left(self.rank) if self.replicas == 1 and self.world_size > 1 else None

    def _kept(self) -> list[int]:
        """The chunks this rank holds: its own, and its left neighbour's where it keeps that one's peer snapshot."""
        left = self._left()
        return [self.shard] if left is None else [self.shard, left]

    def needed_sources(self, old_chunks: int) -> list[int]:
        """Old chunks that overlap this rank's new chunk or its left neighbour's."""
        left = self._left()
        return needed_sources(self.shard, self.shard if left is None else left, self.numels, self.shards, old_chunks)

    def import_chunks(self, fetch: Callable[[list[int]], list[ChunkState]], old_world_size: int, step: int) -> int:
        """Become this generation's rank from the old generation's chunks at ``step``
        (``old_world_size`` of them: one a rank, or a block's under ``--shard-scope host``);
        ``fetch(old_chunks)`` returns those chunks: only the ones needed that this rank
        does not hold (``_held``). Returns how many it fetched."""
        held = self._held(old_world_size, step)  # the last generation's, before the re-cut
        if isinstance(self.reduction, ErrorFeedback):  # --compress: the errors of the same step as the chunks
            self.reduction.rewind(step)
        self._current()
        needed = self.needed_sources(old_world_size)
        asked = [i for i in needed if i not in held]
        chunks = {**{i: held[i] for i in needed if i in held}, **dict(zip(asked, fetch(asked)))}
        self.load_chunks(chunks.__getitem__, old_world_size, step)
        return len(asked)

    def _held(self, old_world_size: int, step: int) -> dict[int, ChunkState]:
        """The old chunks at ``step`` this rank holds from the last generation, which a
        re-cut takes from here and not from the object store: its own (live, or its own
        snapshot) and its left neighbour's peer snapshot. None before the first generation,
        or where the old cut is not the one the chunks are of (``old_world_size``); the live
        chunk only once it was given the state (an import cut short leaves a cut without it)."""
        if self.generation in (None, self.group.generation) or self.shards != old_world_size:
            return {}
        held: dict[int, ChunkState] = {}
        if self.holds_state and self.live_step == step:
            held[self.shard] = self.export("live", step)
        elif any(s.step == step for s in self.snapshots.own):
            held[self.shard] = self.export("own", step)
        if self.left_chunk is not None and any(s.step == step for s in self.snapshots.peer):
            held[self.left_chunk] = self.export("peer", step)
        return held

    @torch.no_grad()
    def load_chunks(self, fetch: Callable[[int], ChunkState], old_world_size: int, step: int) -> None:
        """Become this generation's rank from the old chunks; then gather the parameters.

        A collective: every rank of the new generation calls it. Afterwards the rank holds
        its chunk at ``step`` and, as snapshots, a copy of it and of its left neighbour's.
        """
        self._current()
        own = cut(self.shard, self.numels, self.shards, fetch, old_world_size, step)
        self._set_live(own)
        self._gather_params()
        left = self._left()
        self.snapshots.reset(own, None if left is None else cut(left, self.numels, self.shards, fetch, old_world_size,
                                                                step))

    @torch.no_grad()
    def _set_live(self, shard: ChunkState) -> None:
        self.settle()
        self.own.reset(shard.step, shard.steps)
        for b, master in enumerate(self.masters):
            master.copy_(shard.master[b])
            own = self._own_params(b)
            if own.data_ptr() != master.data_ptr():
                own.copy_(master)
            state = {}
            for key, values in shard.state.items():
                value = values[b]
                state[key] = value.clone() if value.dim() == 0 else value.to(master.device, copy=True)
            if state and bucket_step(self.own.counts, self.members[b]):
                self.optimizer.state[master] = state
            else:
                self.optimizer.state.pop(master, None)
        self.live_step, self.holds_state = shard.step, True
        self.history.reset(shard.step, shard.buffers)

    @torch.no_grad()
    def reset_from_params(self, step: int) -> None:
        """Start from the model's parameters (equal on every rank) and empty optimizer state."""
        shard = ChunkState(step=step, world_size=self.shards, rank=self.shard,
                           master=[self._own_params(b).detach().float().cpu() for b in range(len(self.buckets))],
                           buffers=self.history.current())
        self._set_live(shard)
        left = self._left()
        self.snapshots.reset(shard, ChunkState(step=step, world_size=self.shards, rank=left,
                                               master=self._peer_masters(left)) if left is not None else None)

    def _peer_masters(self, left: int) -> list[torch.Tensor]:
        """Rank ``left``'s chunk of every bucket's parameters, as fp32 on the host."""
        return [buf[left * c:(left + 1) * c].detach().float().cpu() for buf, c in zip(self.param_buffers, self.chunks)]

    # -- state: initial sync, checkpoint parts, loading ---------------------------------------
    def sync_from(self, src: int) -> None:
        """Take rank ``src``'s parameters (into this generation's buffers) and start every chunk from them."""
        self._current()
        broadcast_tensors(self.group, list(self.model.state_dict().values()), src, self.device)
        self.reset_from_params(step=0)

    def state_part(self) -> tuple[dict[str, torch.Tensor], dict]:
        return self.named_state()

    def wanted(self) -> Wanted:
        """All model tensors, and the optimizer state of this rank's new chunk and its left
        neighbour's (the peer snapshot it keeps): a checkpoint's other files are not read."""
        self._current()
        return zero_format.wanted(self.buckets, self.chunks, self.names, self._kept())

    def load(self, state: TrainingState) -> None:
        self._current()
        self.load_named(state.optimizer_tensors, state.step)

    def named_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's part of the optimizer state in a checkpoint's keys
        (``zero_format.named_state``): none where another rank holds the first copy of its
        chunk (``--shard-scope host``)."""
        live = self.export("live", self.live_step)
        tensors, slices = (zero_format.named_state(self.buckets, self.chunks, self.names, self.shard, live,
                                                   self._own_scalars(live.steps or {}))
                           if self.first_copy else ({}, {}))
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self.names[id(p)] for p in base["params"]]}
                  for g, base in zip(self.optimizer.param_groups, self.base_groups)]
        return tensors, {"param_groups": groups, "scalars": {}, "slices": slices}

    def _own_scalars(self, counts: dict[str, int]) -> Callable[[str], dict[str, torch.Tensor] | None]:
        """Each parameter's own 0-dim state by name, at its count in ``counts`` (None: never updated)."""
        group = {self.names[id(p)]: self.bucket_group[self.bucket_of[id(p)]] for p in self.params}

        def scalars(name: str) -> dict[str, torch.Tensor] | None:
            count = counts.get(name, 0)
            return {k: v.cpu() for k, v in self._clock(group[name]).at(count).items()} if count else None
        return scalars

    def load_named(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Load whole-parameter optimizer state keyed ``<param name>/<key>`` (a checkpoint's,
        saved at any world size and stage), after the model's parameters were loaded."""
        masters = [self.param_buffers[b][:bucket.numel].detach().float().cpu() for b, bucket in enumerate(self.buckets)]
        full = zero_format.whole_state(self.buckets, self.names, masters, tensors, step)
        full.buffers = self.history.current()  # loaded with the model's state
        self.load_chunks(lambda _: full, 1, step)
