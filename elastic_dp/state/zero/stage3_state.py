"""ZeRO stage 3's model state: the model's weights a unit at a time, the checkpoint part of
a rank (its chunks), and loading a checkpoint or a whole training state into the chunks.

``UnitChunks`` is the model-state part of the ``Strategy`` interface for a strategy whose
parameters live as chunks of units, the sibling of ``state.base.WholeModel`` (every
parameter whole on every rank, stages 0 to 2); ``stage3.FullySharded`` is built of it and
``zero.sharded.Sharded``, and it uses their cut (pieces, chunks, units) and gathers."""

from __future__ import annotations

import torch

from elastic_dp.durable.checkpoint import (
    REDUCTION,
    Checkpoint,
    Part,
    TrainingState,
    add_piece,
    cut_part,
    part_files,
)
from elastic_dp.durable.weights import TensorSpecs
from elastic_dp.state.base import copied_state
from elastic_dp.state.zero import format as zero_format


class UnitChunks:
    """``Strategy``'s model state, weights, checkpoint part and loading, where no rank holds
    the whole model (every call here that reads parameters is a collective)."""

    def training_state(self, step: int, sampler: dict[str, int]) -> TrainingState:
        return copied_state(self, step, sampler)

    def model_state(self) -> dict[str, torch.Tensor]:
        """A collective: the model's whole state dict, gathered unit by unit into host memory."""
        parts = {k: v for i in range(len(self.weight_parts())) for k, v in self.weight_part(i).items()}
        return {k: parts[k] for k in self.model.state_dict(keep_vars=True)}

    def _weight_units(self) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """The state dict's entries by unit: the root's with everything not a stepped
        parameter (buffers) first, then each unit's; a tied parameter under each name."""
        units: dict[int, list[tuple[str, torch.Tensor]]] = {u: [] for u in [self.root, *range(self.root)]}
        for k, v in self.model.state_dict(keep_vars=True).items():
            units[self.unit_of.get(id(v), self.root)].append((k, v))
        return list(units.items())

    def weight_parts(self) -> list[TensorSpecs]:
        self._current()
        return [[(k, torch.float32 if id(v) in self._computed else v.dtype, list(v.shape)) for k, v in entries]
                for _, entries in self._weight_units()]

    def weight_part(self, i: int) -> dict[str, torch.Tensor]:
        """A collective: part ``i`` of ``weight_parts`` (a unit, or the root) gathered, copied
        into host memory and freed; a parameter gathered in bf16 (``--param-dtype bf16``)
        as its fp32 master, the dtype the model holds it in."""
        self.settle()
        u, entries = self._weight_units()[i]
        masters = self._gathered_masters(u)
        self._gather(u, wait=True)
        try:
            return {k: masters.get(id(v), v).detach().to("cpu", copy=True) for k, v in entries}
        finally:
            self._free([u])

    def _gathered_masters(self, u: int) -> dict[int, torch.Tensor]:
        """A collective: unit ``u``'s fp32 masters of the parameters it gathers in bf16, whole
        (by the parameter's id; none where the unit has none)."""
        whole = {}
        for b in self.unit_buckets[u]:
            bucket = self.buckets[b]
            if id(bucket.params[0]) not in self._computed:
                continue
            full = torch.empty(bucket.padded, dtype=torch.float32, device=self.masters[b].device)
            self.shard_group.all_gather_async(full, self.masters[b].detach()).wait()
            whole.update({id(p): full[o:o + p.numel()].view(p.shape) for p, o in zip(bucket.params, bucket.offsets)})
        return whole

    def checkpoint_part(self, step: int, sampler: dict[str, int]) -> Part:
        """This rank's chunk of every parameter and of its optimizer state, its range of the
        buffers (and rank 0's metadata), copied."""
        self.settle()
        stepped = {id(p) for p in self.params}
        keys: dict[int, list[str]] = {}  # a tied parameter is in the state dict under each of its names
        rest = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) in stepped:
                keys.setdefault(id(v), []).append(k)
            else:
                rest[k] = v
        tensors, meta = self.state_part()
        part = cut_part(TrainingState(step=step, model=rest, optimizer_tensors=tensors, optimizer_meta=meta,
                                      sampler=sampler, world_size=self.world_size, rng=torch.get_rng_state()),
                        self.rank, self.world_size)
        model_file = part_files(self.rank)[0]
        part.files.setdefault(model_file, {})
        for b, bucket in enumerate(self.buckets if self.first_copy else ()):  # one copy of each chunk is written
            lo = self.shard * self.chunks[b]
            for p, offset, a, e in zero_format._pieces(bucket, lo, lo + self.chunks[b]):
                values = self.masters[b] if id(p) in self._computed else self.param_chunks[b]  # the model's dtype
                for key in keys[id(p)]:
                    add_piece(part, model_file, f"model/{key}", values[a - lo:e - lo].detach(), a - offset,
                              list(p.shape))
        part.files = {f: t for f, t in part.files.items() if t}
        return part

    def load_state(self, state: TrainingState) -> None:
        """A collective: load a whole (world-size-independent) training state."""
        self._current()
        self.settle()
        self._gathered = set(range(self.root + 1))  # the buffers get the loaded values, not a gather
        for buffer in self.param_buffers:
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        try:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name in state.model:
                        p.copy_(state.model[name].to(p.device))
            self._load_buffers(state.model)
            self.load_named(state.optimizer_tensors, state.step)  # from the full buffers just loaded
        finally:
            self._free_all()
        torch.set_rng_state(state.rng)

    def load(self, state: TrainingState) -> None:
        self.load_state(state)

    @torch.no_grad()
    def _load_buffers(self, model: dict[str, torch.Tensor]) -> None:
        """The model's buffers from a state dict's (those it has)."""
        for name, buffer in zip(self.buffers.names, self.buffers.tensors()):
            if name in model:
                buffer.copy_(model[name].to(buffer.device))

    def load_checkpoint(self, checkpoint: Checkpoint) -> TrainingState:
        """A collective: load ``checkpoint`` (saved at any stage and world size) reading only
        what this rank holds: its chunk of every piece and its left neighbour's (the peer
        snapshot), of the parameters and of their optimizer state, and the buffers. No
        parameter is allocated whole. Returns what was read (the buffers, the optimizer's
        metadata and scalars: the scheduler's state is there)."""
        self._current()
        self.settle()
        tensors = checkpoint.manifest["tensors"]
        fields = sorted({k.rpartition("/")[2] for k in tensors  # the reduction's rows are not the optimizer's
                         if k.startswith("optim/") and not k.startswith(f"optim/{REDUCTION}")})
        ranks = self._kept()
        ranges = zero_format.chunk_ranges(self.buckets, self.chunks, self.names, ranks, fields)
        params = {f"model/{k}" for k, v in self.model.state_dict(keep_vars=True).items() if id(v) in self.unit_of}
        got, state = checkpoint.read_ranges(ranges, whole=lambda k: k == "rng" or (k.startswith("model/")
                                                                                  and k not in params))
        self._load_buffers(state.model)
        stepped = {n: p for n, p in ((self.names[id(p)], p) for p in self.params)}
        with_state = {k.removeprefix("optim/").rpartition("/")[0] for k in tensors if k.startswith("optim/")
                      and not k.endswith("/master")}
        counts = zero_format.saved_counts(stepped, state.optimizer_tensors, with_state)
        chunk = [zero_format.chunk_from_ranges(self.buckets, self.chunks, self.names, r, self.shards,
                                               state.step, got, fields, state.optimizer_tensors, counts)
                 for r in ranks]
        for c in chunk:
            c.buffers = self.history.current()
        self._set_live(chunk[0])
        self.snapshots.reset(chunk[0], chunk[1] if len(chunk) > 1 else None)
        torch.set_rng_state(state.rng)
        return state
