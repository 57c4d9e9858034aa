"""ZeRO stage 3: the parameters sharded too (``--zero 3``).

The unit of stage 3 is a module: by default each child of the model's ``nn.ModuleList``s
(its repeated blocks; a list inside a unit belongs to that unit), or the task's own
(``Task.shard_units``); the parameters left over form the root unit, and a parameter
that two units share belongs to the root. A unit's parameters of one kind (param group,
dtype) are one flat buffer, a *piece*, cut into ``N`` chunks by the stages 1-2 rule (the
partition does not depend on ``N``, only the padding: ``chunks``), so the re-cut on a
resize, the peer snapshots, the holdings and the checkpoint's optimizer state are the
stages 1-2 ones (``sharded.Sharded``), with pieces where those have buckets.

Between steps a rank holds only its chunk of every piece (``param_chunks``; the fp32 masters,
which are the chunks themselves for fp32 parameters) and the parameters' full buffers
have no storage. In the forward the root is all-gathered first and kept to the end of the
backward; each unit is all-gathered before its forward (the next unit's gather is started
then, so it arrives while this one computes) and freed after it, except the last, whose
backward comes next, and except with ``--no-reshard-after-forward``, which keeps every
unit to its backward. In the backward a freed unit is gathered again as the gradient of
its output arrives (the unit before it prefetched then), and freed as soon as all its
parameters have their gradients. The gradients are reduce-scattered piece by piece as
backward completes them, into the rank's gradient chunks (``GradientReducer``'s scatter
mode, the pieces in backward order as its buckets: the last unit first, the root last,
carrying the vote), and the full gradients are released.

Collectives match by the order each rank issues them, which is the units' order: in the
forward from the first to the last, in the backward the reverse, and every unit takes its
turn on every rank, even where this rank's samples skip it (an MoE's experts as units of
their own): a skipped unit is gathered and freed in its turn, and its gradient pieces,
zeros, reduce-scattered in its turn of the backward (``_skip_forward``,
``_enter_backward``, ``_finish_backward``). A rank whose forward or backward
raises cannot follow that order any more: it aborts the generation's group (its peers'
collectives fail at once) and its error, which the step reports, ends the run as a task
error does at the other stages.

Micro-batches: every rank runs the same number of passes (``equal_passes``), and each
pass's gradients are reduce-scattered and added into the chunks (docs/zero.md).
"""

from __future__ import annotations

import time

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reducer import Bucket, GradientReducer, make_buckets
from elastic_dp.config import TrainConfig
from elastic_dp.errors import CollectiveError
from elastic_dp.faults import FaultHook
from elastic_dp.state.base import broadcast_tensors, nbytes
from elastic_dp.state.units import UnitInit, mixed_precision_hooks, model_units
from elastic_dp.state.zero.sharded import Sharded
from elastic_dp.state.zero.stage3_state import UnitChunks

WHOLE = 2**62
"""A bucket size no unit reaches: one piece per kind of parameter in a unit."""


class FullySharded(UnitChunks, Sharded):
    """ZeRO stage 3 (``--zero 3``). ``units``: the model's shard units (None: the default
    ones, ``units.model_units``); ``init``: for a model built on the meta device, the rule
    that initialises it unit by unit (the first cut materialises each unit, keeps its
    chunks of it and frees it before the next)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: CollectiveGroup,
                 config: TrainConfig, device: torch.device, faults: FaultHook | None = None,
                 units: list[torch.nn.Module] | None = None, init: UnitInit | None = None,
                 kept: list[torch.nn.Module] = ()) -> None:
        self._computed: dict[int, torch.dtype] = {}
        """``--param-dtype bf16``: the fp32 parameters gathered and computed in bf16 (by id; the
        ``kept`` modules' stay fp32); their chunks' fp32 values are the masters."""
        if config.stage.gathers_bf16:
            kept_params = {id(p) for m in kept for p in m.parameters()}
            self._computed = {id(p): torch.bfloat16 for p in model.parameters()
                              if p.dtype == torch.float32 and id(p) not in kept_params}
            mixed_precision_hooks(model, units if units is not None else model_units(model, None), kept)
        super().__init__(model, optimizer, group, config, device, faults)
        self.defer_gather = True  # nothing is gathered after an update: each forward gathers
        self.reshard_after_forward = config.mode.zero.reshard_after_forward
        self.units = units if units is not None else model_units(model, None)
        self.init = init
        self.root = len(self.units)
        """The root unit's index (the units are ``0 .. root - 1``, in forward order)."""
        model.register_forward_pre_hook(lambda _m, _a: self._before_model())
        model.register_forward_hook(lambda _m, _a, _o: self._after_model())
        for u, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda _m, _a, u=u: self._before_unit(u))
            unit.register_forward_hook(lambda _m, _a, out, u=u: self._after_unit(u, out))
        self._sums: list[torch.Tensor] | None = None
        """With micro-batches, during a step: the reduced gradient chunks of its micro-batches before the last."""
        self._gathered: set[int] = set()  # units whose full parameters are here (or on their way)
        self._backward_started: set[int] = set()
        self._forward_next = 0  # the next unit whose turn it is in this forward (the units go in order)
        self._backward_next = -1  # the next unit whose turn it is in this backward (the units in reverse)
        self._backward_last: int | None = None  # the last unit whose turn it was in this backward

    # -- the cut ------------------------------------------------------------------------------
    def _build(self) -> None:
        self._gathers, self._gathered = {}, set()
        group, config, optimizer = self.group, self.config, self.base_optimizer
        self._cut(group)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.params = [p for p in self.model.parameters() if p.requires_grad and id(p) in group_of]
        stepped = {id(p) for p in self.params}
        owner = {id(m): u for u, unit in enumerate(self.units) for m in unit.modules()}
        owners: dict[int, set[int]] = {}  # the units whose modules use each parameter (the root's too)
        for module in self.model.modules():
            for p in module.parameters(recurse=False):
                if id(p) in stepped:
                    owners.setdefault(id(p), set()).add(owner.get(id(module), self.root))
        unit_of = {i: next(iter(us)) if len(us) == 1 else self.root for i, us in owners.items()}
        members: list[list[torch.nn.Parameter]] = [[] for _ in range(self.root + 1)]
        for p in self.params:
            members[unit_of.get(id(p), self.root)].append(p)
        # pieces in backward order (the reducer launches them in this order): the last unit
        # first, the root, whose parameters the forward uses first and last, at the end
        self.buckets: list[Bucket] = []
        self.unit_buckets: dict[int, list[int]] = {}
        for u in [*reversed(range(self.root)), self.root]:
            pieces = make_buckets(members[u], WHOLE, config.buckets.reduce_fp32, group_of=group_of, pad_to=self.shards,
                                  dtype_of=lambda p: self._computed.get(id(p), p.dtype))
            self.unit_buckets[u] = list(range(len(self.buckets), len(self.buckets) + len(pieces)))
            self.buckets.extend(pieces)
        self.unit_params = {u: [p for b in bs for p in self.buckets[b].params] for u, bs in self.unit_buckets.items()}
        self._index_buckets(group_of)
        self.unit_of = {id(p): u for u, ps in self.unit_params.items() for p in ps}
        self.forward_order = [b for u in [self.root, *range(self.root)] for b in self.unit_buckets[u]]

        # parameters become views into one flat buffer per piece, whose storage exists only
        # while the piece is gathered; the rank keeps its chunk of it (``param_chunks``). Unit by
        # unit in the initialisation rule's order: a model built on the meta device is
        # materialised one unit at a time, and each unit freed before the next
        self.param_buffers = [torch.empty(0)] * len(self.buckets)
        self.param_chunks = [torch.empty(0)] * len(self.buckets)
        self._fp32_chunks: dict[int, torch.Tensor] = {}  # --param-dtype bf16: the masters, as built
        for u in range(self.root + 1):
            if self.init is not None:
                self.init.unit(u)
            for b in self.unit_buckets[u]:
                self._lay_out(b)
        self.masters = [torch.nn.Parameter(self._fp32_chunks.pop(b) if b in self._fp32_chunks else
                                           s if s.dtype == torch.float32 else s.float())
                        for b, s in enumerate(self.param_chunks)]
        self.snapshots.configure(group, 0, peers=self.replicas == 1)  # no rank holds another's parameters between steps

        self.grad_chunks = [torch.zeros(c, dtype=b.dtype, device=b.params[0].device)
                            for b, c in zip(self.buckets, self.chunks)]
        self._sums = None
        self.reducer = GradientReducer(self.params, group, bucket_bytes=WHOLE, reduce_fp32=config.buckets.reduce_fp32,
                                       group_of=group_of, pad_to=self.shards, scatter_into=self.grad_chunks,
                                       buckets=self.buckets, reduction=self.reduction)
        self._grads_pending = {u: set() for u in self.unit_buckets}
        self._free_hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._make_optimizer()

    def _lay_out(self, b: int) -> None:
        """Piece ``b``'s flat buffer, its parameters views into it, and this rank's chunk of
        the values they had when the model was built (none after a re-cut: imported). Under
        ``--param-dtype bf16`` the buffer is bf16 and the parameters become views of it; the
        chunk's fp32 values as built are its master (``_fp32_chunks``)."""
        bucket = self.buckets[b]
        first = bucket.params[0]
        dtype = self._computed.get(id(first), first.dtype)
        buffer = torch.zeros(bucket.padded, dtype=dtype, device=first.device)
        whole = first.untyped_storage().size() > 0  # the model as built, or its unit (not a re-cut's freed views)
        chunk = bucket.padded // self.shards
        values = buffer if dtype == first.dtype else torch.zeros(bucket.padded, dtype=first.dtype, device=first.device)
        for p, offset in zip(bucket.params, bucket.offsets):
            if whole:
                values[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = buffer[offset:offset + p.numel()].view_as(p)
        if values is not buffer:  # fp32 as built: the master chunk; the gathered buffer in bf16
            if whole:
                self._fp32_chunks[b] = values[self.shard * chunk:(self.shard + 1) * chunk].clone()
            buffer.copy_(values)
        self.param_chunks[b] = buffer[self.shard * chunk:(self.shard + 1) * chunk].clone()
        self.param_buffers[b] = buffer
        buffer.untyped_storage().resize_(0)

    def _current(self) -> None:
        if self.generation != self.group.generation and self.generation is not None:
            for hook in self._free_hooks:  # the new cut's come with it
                hook.remove()
        super()._current()

    def _gradient_buffers(self) -> list[torch.Tensor]:
        return self.grad_chunks

    def _own_params(self, b: int) -> torch.Tensor:
        return self.param_chunks[b]

    # -- gathering and freeing units ----------------------------------------------------------
    def _start_gather(self, b: int) -> None:
        buffer = self.param_buffers[b]
        storage = buffer.untyped_storage()
        if storage.size() == 0:
            storage.resize_(buffer.numel() * buffer.element_size())
        self._gathers[b] = self.shard_group.all_gather_async(buffer, self.param_chunks[b])

    def _gather(self, u: int, wait: bool) -> None:
        """Start unit ``u``'s all-gather unless it is here or on its way; with ``wait``, wait for it."""
        if u not in self._gathered:
            self._gathered.add(u)
            try:
                for b in self.unit_buckets[u]:
                    self._start_gather(b)
            except Exception as exc:
                raise self._collective_error("parameter all-gather", exc) from None
        if wait:  # the step's parameter wait: in the forward and in the backward
            start = time.perf_counter()
            self._wait_gathers([b for b in self.unit_buckets[u] if b in self._gathers])
            self._parameter_wait_s += time.perf_counter() - start

    def _free(self, units: list[int]) -> None:
        for u in units:
            if u in self._gathered:
                self._wait_gathers([b for b in self.unit_buckets[u] if b in self._gathers])
                for b in self.unit_buckets[u]:
                    self.param_buffers[b].untyped_storage().resize_(0)
                self._gathered.discard(u)

    def _gather_all(self) -> None:
        for u in [self.root, *range(self.root)]:
            self._gather(u, wait=False)
        self._wait_gathers()

    def _free_all(self) -> None:
        self._free(list(range(self.root + 1)))

    def _before_forward(self, ids: list[int]) -> None:
        pass  # stages 1-2's wait for the update's all-gather: here each unit's hooks gather

    def _before_model(self) -> None:
        if self.generation != self.group.generation:
            return  # a forward outside training before any state (an evaluation is after one)
        self._backward_started = set()
        self._forward_next, self._backward_next, self._backward_last = 0, self.root - 1, None
        self._gather(self.root, wait=False)
        if self.root:
            self._gather(0, wait=False)  # prefetched: it arrives while the root's first modules compute
        self._gather(self.root, wait=True)

    def _after_model(self) -> None:
        if self.generation != self.group.generation:
            return
        for v in range(self._forward_next, self.root):  # the units this rank's samples skipped at the end
            self._skip_forward(v)
        self._forward_next = self.root
        if not torch.is_grad_enabled():  # no backward follows (an evaluation): free everything now
            self._free_all()

    def _before_unit(self, u: int) -> None:
        if self.generation != self.group.generation or u in self._backward_started:
            return  # (a recomputation in the backward runs the unit's forward again)
        for v in range(self._forward_next, u):  # units this rank's samples skipped (an expert no sample chose)
            self._skip_forward(v)
        self._forward_next = max(self._forward_next, u + 1)
        self.faults.at("gather_forward")
        self._gather(u, wait=True)
        if u + 1 < self.root:
            self._gather(u + 1, wait=False)

    def _skip_forward(self, v: int) -> None:
        """Unit ``v``'s forward did not run on this rank: its gathers are issued as if it had
        (the collectives of every rank must match), and it is freed as after a forward."""
        self._gather(v, wait=False)
        if v + 1 < self.root:
            self._gather(v + 1, wait=False)
        if not torch.is_grad_enabled() or (self.reshard_after_forward and v + 1 < self.root):
            self._free([v])

    def _after_unit(self, u: int, out) -> None:
        if self.generation != self.group.generation or u in self._backward_started:
            return
        if not torch.is_grad_enabled():  # no backward follows (an evaluation, a sample)
            self._free([u])
            return
        if self.reshard_after_forward and u + 1 < self.root:
            self._free([u])
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(lambda grad, u=u: self._before_backward(u))

    def _before_backward(self, u: int) -> None:
        """The gradient of unit ``u``'s output has arrived: its backward comes next."""
        if u in self._backward_started:
            return
        for v in range(self._backward_next, u, -1):  # units whose backward this rank skips
            self._enter_backward(v, skipped=True)
        self._enter_backward(u, skipped=False)

    def _enter_backward(self, u: int, skipped: bool) -> None:
        """Unit ``u``'s turn in the backward, in the same order on every rank (the units from
        the last to the first, whether this rank's samples used them or not): the unit
        before it is done (its parameters without a gradient settled, so that its pieces'
        reduce-scatters start here on every rank), ``u`` gathered again if freed and
        ``u - 1``'s gather started; a skipped unit is freed at once (no gradient comes)."""
        if self._backward_last is not None:
            self.reducer.settle(self.unit_params[self._backward_last])
        self._backward_last, self._backward_next = u, u - 1
        if not skipped:
            self._backward_started.add(u)
            self.faults.at("gather_backward")
        self._gather(u, wait=not skipped)
        if u >= 1:
            self._gather(u - 1, wait=False)
        if skipped:
            self._free([u])
        else:
            self._grads_pending[u] = {id(p) for p in self.unit_params[u]}

    def _finish_backward(self) -> None:
        """The backward has ended: the units below the last one this rank's backward reached
        take their turns, so every rank has issued the same gathers and reduce-scatters."""
        for v in range(self._backward_next, -1, -1):
            self._enter_backward(v, skipped=True)
        if self._backward_last is not None:
            self.reducer.settle(self.unit_params[self._backward_last])
            self._backward_last = None

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is complete: a unit whose every parameter has one is freed."""
        u = self.unit_of.get(id(param))
        pending = self._grads_pending.get(u)
        if u == self.root or not pending:
            return
        pending.discard(id(param))
        if not pending:
            self._free([u])

    # -- the step --------------------------------------------------------------------------
    equal_passes = True

    def zero_grad(self) -> None:
        super().zero_grad()
        self._grads_pending = {u: set() for u in self.unit_buckets}
        self._sums = None

    def before_backward(self) -> None:
        """A micro-batch before the last: its gradients are reduce-scattered too, as its
        backward produces them, and added into the chunks (no full gradient outlives its unit)."""
        self.reducer.arm()

    def after_backward(self) -> None:
        try:
            self._finish_backward()
            self.reducer.finish()  # its vote is not the step's: that travels with the last micro-batch
        except Exception as exc:
            raise self._collective_error("gradient reduce-scatter", exc) from None
        finally:
            self._free_all()
        if self._sums is None:
            self._sums = [torch.zeros_like(c) for c in self.grad_chunks]
        for s, c in zip(self._sums, self.grad_chunks):
            s.add_(c)

    def reduce_gradients(self):
        try:
            self._finish_backward()
            vote = super().reduce_gradients()
        finally:
            self._free_all()  # the root, and a unit whose backward some parameter skipped
        if self._sums is not None:  # the micro-batches before the last; released: only the step holds them
            for c, s in zip(self.grad_chunks, self._sums):
                c.add_(s)
            self._sums = None
        return vote

    def abandon(self) -> None:
        super().abandon()
        try:
            self._free_all()
        except Exception:  # noqa: BLE001 — the group failed; its gathers with it
            self._gathers, self._gathered = {}, set()
            _ = [b.untyped_storage().resize_(0) for b in self.param_buffers]

    def after_local_error(self) -> None:
        """This rank's forward or backward raised: it cannot issue the collectives its
        peers wait for in the order they do, so the generation's group is aborted (their
        collectives fail at once) and the step ends here."""
        self.group.abort(self.group.generation)
        raise CollectiveError(f"gen {self.generation} rank {self.rank}: the group was aborted after this rank's "
                              "forward or backward raised", rank=self.rank, step=self.live_step)

    @torch.no_grad()
    def optimizer_step(self, step: int) -> None:
        """Update the chunks; nothing is gathered: the next forward gathers each unit."""
        before, after = self._counts_after()
        for b in self.forward_order:
            self._update(b, self.grad_chunks[b], before, after)
            master = self.masters[b]
            if self.param_chunks[b].data_ptr() != master.data_ptr():
                self.param_chunks[b].copy_(master)
        self.live_step, self.own.counts = step + 1, after

    def _gather_params(self) -> None:
        pass  # after a re-cut or a load: gathered on demand

    def drop_pending(self) -> None:
        super().drop_pending()
        for buffer in self.param_buffers if self.generation is not None else ():
            buffer.untyped_storage().resize_(0)
        self._gathered = set()

    def state_bytes(self) -> dict[str, int]:
        separate = [m for m, s in zip(self.masters, self.param_chunks) if m.data_ptr() != s.data_ptr()]
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"parameters": nbytes(self.param_chunks), "gradients": nbytes(self.grad_chunks),
                "optimizer_state": nbytes(state) + nbytes(separate), "snapshots": self.snapshots.bytes_held()}

    # -- state ------------------------------------------------------------------------------
    def sync_from(self, src: int) -> None:
        """Take rank ``src``'s buffers and start every chunk with empty optimizer state. The
        parameters are the chunks the ranks hold (no rank has more than its own): built
        alike on every rank, by the same seed and rule."""
        self._current()
        broadcast_tensors(self.group, self.buffers.tensors(), src, self.device)
        self.reset_from_params(step=0)

    def _peer_masters(self, left: int) -> list[torch.Tensor]:
        """Rank ``left``'s chunks, each unit gathered in turn and freed."""
        masters: list[torch.Tensor] = [torch.empty(0)] * len(self.buckets)
        for u in [self.root, *range(self.root)]:
            self._gather(u, wait=True)
            for b in self.unit_buckets[u]:
                c = self.chunks[b]
                masters[b] = self.param_buffers[b][left * c:(left + 1) * c].to("cpu", torch.float32, copy=True)
            self._free([u])
        return masters


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    return [t for o in items for t in _tensors(o)]
