"""ZeRO's chunks in a checkpoint's terms: which saved tensors a rank needs, its part of
the optimizer state keyed by parameter name, and whole-parameter state cut back into
buckets.

A checkpoint keys optimizer state ``<param name>/<key>`` (``exp_avg``, ``step``, and
``master`` for the fp32 copy of a bf16/fp16 parameter), whole-parameter values, so it
loads at any world size and stage. A ZeRO rank holds, per bucket, a chunk of the flat
bucket: ``[rank * chunk, (rank + 1) * chunk)`` of the parameters packed at their offsets.
These functions map between the two; ``zero.Sharded`` calls them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from elastic_dp.comm.reducer import Bucket
from elastic_dp.durable.checkpoint import Wanted
from elastic_dp.state.zero.chunks import ChunkState


def _pieces(bucket: Bucket, lo: int, hi: int):
    """(param, offset, a, e) for each parameter of ``bucket`` that overlaps its flat range
    ``[lo, hi)``, ``[a, e)`` the overlap in flat bucket positions."""
    for p, offset in zip(bucket.params, bucket.offsets):
        a, e = max(lo, offset), min(hi, offset + p.numel())
        if a < e:
            yield p, offset, a, e


def wanted(buckets: list[Bucket], chunks: list[int], names: dict[int, str], ranks: Iterable[int]) -> Wanted:
    """All model tensors, and of the optimizer state only what overlaps the chunks of
    ``ranks``: a checkpoint's other files are not read."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for b, bucket in enumerate(buckets):
        for r in ranks:
            for p, offset, a, e in _pieces(bucket, r * chunks[b], (r + 1) * chunks[b]):
                ranges.setdefault(names[id(p)], []).append((a - offset, e - offset))

    def wanted(key: str, start: int, numel: int) -> bool:
        if not key.startswith("optim/"):
            return True
        name = key.removeprefix("optim/").rpartition("/")[0]
        return any(a < start + numel and start < e for a, e in ranges.get(name, ()))
    return wanted


def named_state(buckets: list[Bucket], chunks: list[int], names: dict[int, str], rank: int,
                live: ChunkState) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """Rank ``rank``'s chunk state ``live`` keyed ``<param name>/<key>``: slices of
    parameters, placed by ``slices[key] = [start, shape]`` (``checkpoint.merge_parts``
    joins the ranks' parts). bf16/fp16 parameters also get their fp32 master values, under
    the key ``master``."""
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, list] = {}
    for b, bucket in enumerate(buckets):
        lo = rank * chunks[b]
        entries = {key: values[b] for key, values in live.state.items()}
        for p, offset, a, e in _pieces(bucket, lo, lo + chunks[b]):
            name = names[id(p)]
            fields = dict(entries, master=live.master[b]) if p.dtype != torch.float32 else entries
            for key, value in fields.items():
                if value.dim() == 0:
                    tensors[f"{name}/{key}"] = value
                else:
                    tensors[f"{name}/{key}"] = value[a - lo:e - lo].clone()
                    slices[f"{name}/{key}"] = [a - offset, list(p.shape)]
    return tensors, slices


def whole_state(buckets: list[Bucket], names: dict[int, str], masters: list[torch.Tensor],
                tensors: dict[str, torch.Tensor], step: int) -> ChunkState:
    """Whole-parameter optimizer state keyed ``<param name>/<key>`` (a checkpoint's, saved
    at any world size and stage) as one rank's state of whole buckets (world size 1).
    ``masters`` are the buckets' fp32 values from the loaded parameters; a saved
    ``master`` replaces its parameter's part."""
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        by_param.setdefault(name, {})[field] = value
    full = ChunkState(step=step, world_size=1, rank=0, master=[])
    for bucket, master in zip(buckets, masters):
        values: dict[str, torch.Tensor] = {}
        for p, offset in zip(bucket.params, bucket.offsets):
            for field, value in by_param.get(names[id(p)], {}).items():
                if field == "master":
                    master[offset:offset + p.numel()] = value.reshape(-1)
                elif value.dim() == 0:
                    values[field] = value.clone()
                else:
                    values.setdefault(field, torch.zeros(bucket.numel, dtype=value.dtype))
                    values[field][offset:offset + p.numel()] = value.reshape(-1)
        full.master.append(master)
        for field, value in values.items():
            full.state.setdefault(field, []).append(value)
    if any(len(v) != len(buckets) for v in full.state.values()):
        raise ValueError("optimizer state is missing for some parameters")
    return full


def chunk_ranges(buckets: list[Bucket], chunks: list[int], names: dict[int, str], ranks: Iterable[int],
                 fields: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
    """The flat ranges of each checkpoint key that the chunks of ``ranks`` cover: of
    ``model/<name>`` and of each ``optim/<name>/<field>`` (``fields``: the saved optimizer
    state's tensors, ``master`` among them where saved)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for r in ranks:
        for b, bucket in enumerate(buckets):
            for p, offset, a, e in _pieces(bucket, r * chunks[b], (r + 1) * chunks[b]):
                name = names[id(p)]
                for key in [f"model/{name}", *(f"optim/{name}/{f}" for f in fields)]:
                    ranges.setdefault(key, []).append((a - offset, e - offset))
    return ranges


def chunk_from_ranges(buckets: list[Bucket], chunks: list[int], names: dict[int, str], rank: int, world_size: int,
                      step: int, got: dict[tuple[str, int, int], torch.Tensor], fields: Iterable[str],
                      scalars: dict[str, torch.Tensor]) -> ChunkState:
    """Rank ``rank``'s chunk state out of the ranges ``chunk_ranges`` read (``got``) and the
    optimizer's saved scalars (``<name>/<key>``, e.g. Adam's step): the fp32 masters from a
    saved ``master`` where there is one, else from the parameters' values."""
    fields = [f for f in fields if f != "master"]
    per_step = {key.rpartition("/")[2]: value for key, value in scalars.items()}  # the same for every parameter
    state = ChunkState(step=step, world_size=world_size, rank=rank, master=[])
    for b, bucket in enumerate(buckets):
        lo, c = rank * chunks[b], chunks[b]
        master = torch.zeros(c, dtype=torch.float32)
        values = {f: torch.zeros(c, dtype=torch.float32) for f in fields}  # a chunk of padding only keeps zeros
        for p, offset, a, e in _pieces(bucket, lo, lo + c):
            name, span = names[id(p)], (a - offset, e - offset)
            saved = got.get((f"optim/{name}/master", *span), got[(f"model/{name}", *span)])
            master[a - lo:e - lo] = saved.float()
            for f in fields:
                value = got.get((f"optim/{name}/{f}", *span))
                if value is None:
                    raise ValueError(f"optimizer state {f!r} is missing for {name}")
                values[f][a - lo:e - lo] = value
        state.master.append(master)
        for f, value in [*values.items(), *((f, v.clone()) for f, v in per_step.items())]:
            state.state.setdefault(f, []).append(value)
    return state
