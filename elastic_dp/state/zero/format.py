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

from collections.abc import Callable, Iterable

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


def named_state(buckets: list[Bucket], chunks: list[int], names: dict[int, str], rank: int, live: ChunkState,
                scalars: Callable[[str], dict[str, torch.Tensor] | None]) -> tuple[dict[str, torch.Tensor],
                                                                                  dict[str, list]]:
    """Rank ``rank``'s chunk state ``live`` keyed ``<param name>/<key>``: slices of
    parameters, placed by ``slices[key] = [start, shape]`` (``checkpoint.merge_parts``
    joins the ranks' parts), and each parameter's own 0-dim state (``scalars(name)``: its
    step count; None: the parameter was never updated, and has no state, as in a plain
    torch optimizer's). bf16/fp16 parameters also get their fp32 master values, under the
    key ``master``."""
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, list] = {}
    for b, bucket in enumerate(buckets):
        lo = rank * chunks[b]
        entries = {key: values[b] for key, values in live.state.items() if values[b].dim() > 0}
        for p, offset, a, e in _pieces(bucket, lo, lo + chunks[b]):
            name = names[id(p)]
            own = scalars(name)
            if own is None:
                continue
            fields = dict(entries, master=live.master[b]) if p.dtype != torch.float32 else entries
            for key, value in own.items():
                tensors[f"{name}/{key}"] = value
            for key, value in fields.items():
                tensors[f"{name}/{key}"] = value[a - lo:e - lo].clone()
                slices[f"{name}/{key}"] = [a - offset, list(p.shape)]
    return tensors, slices


def saved_counts(names: Iterable[str], scalars: dict[str, torch.Tensor], with_state: set[str]) -> dict[str, int]:
    """Each parameter's own count of updates in a checkpoint (``zero.unused``): its saved
    ``step`` (``scalars``: ``<name>/<key>``), or, for an optimizer that keeps no step count
    (SGD), 1 where it has state (``with_state``) and 0 where it has none."""
    counts = {}
    for name in names:
        step = scalars.get(f"{name}/step")
        counts[name] = round(float(step)) if step is not None else int(name in with_state)
    return counts


def _bucket_scalars(bucket: Bucket, names: dict[int, str], counts: dict[str, int],
                    scalars: dict[str, torch.Tensor], fields: set[str]) -> dict[str, torch.Tensor]:
    """A bucket's 0-dim state: that of its parameter with the highest count (``zero.unused``);
    zeros in its place where none was updated (the chunk then has no state)."""
    top = max((names[id(p)] for p in bucket.params), key=lambda n: counts[n])
    if counts[top] == 0:
        return {f: torch.zeros(()) for f in fields}
    return {f: scalars[f"{top}/{f}"].clone() for f in fields}


def whole_state(buckets: list[Bucket], names: dict[int, str], masters: list[torch.Tensor],
                tensors: dict[str, torch.Tensor], step: int) -> ChunkState:
    """Whole-parameter optimizer state keyed ``<param name>/<key>`` (a checkpoint's, saved
    at any world size and stage) as one rank's state of whole buckets (world size 1).
    ``masters`` are the buckets' fp32 values from the loaded parameters; a saved
    ``master`` replaces its parameter's part. A parameter without state (never updated)
    gets zeros and the count 0."""
    stepped = [names[id(p)] for bucket in buckets for p in bucket.params]
    tensors = {k: v for k, v in tensors.items() if k.rpartition("/")[0] in set(stepped)}  # not the reduction's
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        by_param.setdefault(name, {})[field] = value
    scalars = {k: v for k, v in tensors.items() if v.dim() == 0}
    fields = {k.rpartition("/")[2] for k, v in tensors.items() if v.dim() > 0} - {"master"}
    zero_dim = {k.rpartition("/")[2] for k in scalars}
    counts = saved_counts(stepped, scalars, {n for n, f in by_param.items() if set(f) - {"master"}})
    full = ChunkState(step=step, world_size=1, rank=0, master=[], steps=counts)
    for bucket, master in zip(buckets, masters):
        values = {f: None for f in fields}
        for p, offset in zip(bucket.params, bucket.offsets):
            saved = by_param.get(names[id(p)], {})
            if "master" in saved:
                master[offset:offset + p.numel()] = saved["master"].reshape(-1)
            for field in fields:
                value = saved.get(field)
                if value is None:
                    if counts[names[id(p)]]:
                        raise ValueError(f"optimizer state {field!r} is missing for {names[id(p)]}")
                    continue
                if values[field] is None:
                    values[field] = torch.zeros(bucket.numel, dtype=value.dtype)
                values[field][offset:offset + p.numel()] = value.reshape(-1)
        full.master.append(master)
        for field, value in values.items():
            full.state.setdefault(field, []).append(torch.zeros(bucket.numel) if value is None else value)
        for field, value in _bucket_scalars(bucket, names, counts, scalars, zero_dim).items():
            full.state.setdefault(field, []).append(value)
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
                      scalars: dict[str, torch.Tensor], counts: dict[str, int]) -> ChunkState:
    """Rank ``rank``'s chunk state out of the ranges ``chunk_ranges`` read (``got``), the
    optimizer's saved scalars (``<name>/<key>``, e.g. Adam's step) and each parameter's
    count of updates (``saved_counts``): the fp32 masters from a saved ``master`` where
    there is one, else from the parameters' values; zeros for a parameter never updated."""
    fields = [f for f in fields if f != "master"]
    zero_dim = {key.rpartition("/")[2] for key in scalars if key.rpartition("/")[0] in counts}
    state = ChunkState(step=step, world_size=world_size, rank=rank, master=[], steps=counts)
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
                    if counts[name]:
                        raise ValueError(f"optimizer state {f!r} is missing for {name}")
                    continue
                values[f][a - lo:e - lo] = value
        state.master.append(master)
        for f, value in [*values.items(), *_bucket_scalars(bucket, names, counts, scalars, zero_dim).items()]:
            state.state.setdefault(f, []).append(value)
    return state
