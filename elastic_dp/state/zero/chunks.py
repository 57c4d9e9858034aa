"""ZeRO chunks as data: what a peer snapshot holds and what resharding moves and re-cuts.

Plain CPU tensor bookkeeping, no collectives (``elastic_dp.state.zero.sharded`` does those). Bucket
``b`` has ``numels[b]`` elements; at world size ``N`` its buffer is padded to a multiple
of ``N`` and rank ``r`` owns elements ``[r * c, (r + 1) * c)`` with ``c = ceil(numel / N)``.
The bucket partition does not depend on ``N``, so moving from ``N`` to ``M`` ranks is a
re-cut of the same flat vectors. ``check_elementwise`` says which optimizers may be sharded
at all, here and by the asynchronous mode's parameter servers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elastic_dp.errors import ConfigError

SNAPSHOTS_KEPT = 2


@dataclass(slots=True)
class ChunkState:
    """One rank's chunk of the training state at a step, on the CPU: what resharding moves."""

    step: int
    world_size: int
    rank: int
    master: list[torch.Tensor]
    """Per bucket, the fp32 master values of the chunk (padding included)."""
    state: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per optimizer-state key, per bucket: the chunk, or a 0-dim tensor (e.g. Adam's step)."""
    buffers: dict[str, torch.Tensor] | None = None
    """The model's buffers at ``step`` (equal on every rank: ``state.buffers``); None when
    the model has none."""
    steps: dict[str, int] | None = None
    """Each stepped parameter's own count of updates at ``step`` (equal on every rank:
    ``unused.OwnSteps``); None: none updated yet."""


@dataclass(slots=True)
class Snapshot:
    step: int
    flat: torch.Tensor
    """The chunk packed into one fp32 vector, in host memory: every bucket's master chunk
    first (``sum(chunks)`` elements, which a peer snapshot of fp32 parameters need not
    send), then each bucket's state chunks."""
    keys: tuple[tuple[str, bool], ...]
    """(state key, is 0-dim) in packing order."""


def keep(snapshots: list[Snapshot], snapshot: Snapshot) -> None:
    """Add ``snapshot`` to ``snapshots``, keeping the ``SNAPSHOTS_KEPT`` newest."""
    snapshots[:] = [s for s in snapshots if s.step != snapshot.step][-(SNAPSHOTS_KEPT - 1):] + [snapshot]


def state_keys(shard: ChunkState) -> tuple[tuple[str, bool], ...]:
    """``Snapshot.keys`` of ``shard``: (state key, is 0-dim), in packing order."""
    return tuple(sorted((k, v[0].dim() == 0) for k, v in shard.state.items()))


def packed_numel(shard: ChunkState) -> int:
    """The elements ``pack`` makes of ``shard``."""
    return sum(t.numel() for t in shard.master) + sum(t.numel() for v in shard.state.values() for t in v)


def pack(shard: ChunkState, out: torch.Tensor | None = None) -> Snapshot:
    """A chunk as one flat fp32 vector (what a peer snapshot sends); into ``out`` when it
    has the right size (reusing a buffer spares the page faults of a fresh one: on a CPU
    they cost more than the copy)."""
    keys = state_keys(shard)
    parts = [master.reshape(-1) for master in shard.master]
    for b in range(len(shard.master)):
        parts.extend(shard.state[k][b].reshape(-1).float() for k, _ in keys)
    if not parts:
        return Snapshot(shard.step, torch.zeros(0), keys)
    if out is not None and out.numel() == sum(p.numel() for p in parts) and out.dtype == torch.float32:
        return Snapshot(shard.step, torch.cat(parts, out=out), keys)
    return Snapshot(shard.step, torch.cat(parts), keys)


def spare(snapshots: list[Snapshot]) -> torch.Tensor | None:
    """Take the oldest snapshot out of a full ``snapshots`` and return its buffer for
    reuse (the next snapshot would drop it anyway); None when not full."""
    return snapshots.pop(0).flat if len(snapshots) >= SNAPSHOTS_KEPT else None


def unpack(snap: Snapshot, chunks: list[int], world_size: int, rank: int) -> ChunkState:
    """Inverse of ``pack`` for rank ``rank``'s chunk of sizes ``chunks`` (per bucket)."""
    shard = ChunkState(step=snap.step, world_size=world_size, rank=rank, master=[])
    offset = 0

    def take(n: int) -> torch.Tensor:
        nonlocal offset
        offset += n
        return snap.flat[offset - n:offset].clone()

    for chunk in chunks:
        shard.master.append(take(chunk))
    for chunk in chunks:
        for key, scalar in snap.keys:
            shard.state.setdefault(key, []).append(take(1).reshape(()) if scalar else take(chunk))
    return shard


def chunk_sizes(numels: list[int], world_size: int) -> list[int]:
    """Per bucket, the elements each of ``world_size`` ranks owns."""
    return [-(-n // world_size) for n in numels]


def sources(rank: int, numels: list[int], world_size: int, old_world_size: int) -> list[int]:
    """Old ranks whose chunks overlap new rank ``rank``'s chunk in some bucket."""
    found = set()
    for chunk, old in zip(chunk_sizes(numels, world_size), chunk_sizes(numels, old_world_size)):
        lo, hi = rank * chunk, (rank + 1) * chunk
        # i * old < hi and (i + 1) * old > lo: a range, not a scan of every old rank
        found.update(range(lo // old, min(old_world_size, (hi - 1) // old + 1)))
    return sorted(found) or [0]


def needed_sources(rank: int, left: int, numels: list[int], world_size: int, old_world_size: int) -> list[int]:
    """Old ranks whose chunks overlap new rank ``rank``'s chunk or its left neighbour's
    (``left``: the rank whose peer snapshot it keeps, ``comm.mesh.Mesh.left``)."""
    return sorted(set(sources(rank, numels, world_size, old_world_size))
                  | set(sources(left, numels, world_size, old_world_size)))


def cut(rank: int, numels: list[int], world_size: int, fetch: Callable[[int], ChunkState], old_world_size: int,
        step: int) -> ChunkState:
    """New rank ``rank``'s chunk at ``world_size``, cut out of the old generation's chunks
    (``fetch(old_rank)``, all at ``step``)."""
    template = fetch(sources(rank, numels, world_size, old_world_size)[0])
    out = ChunkState(step=step, world_size=world_size, rank=rank, master=[], buffers=template.buffers,
                     steps=template.steps)
    for key, values in template.state.items():  # 0-dim state (a step count) is the same everywhere
        out.state[key] = [v.clone() if v.dim() == 0 else None for v in values]
    chunks = zip(chunk_sizes(numels, world_size), chunk_sizes(numels, old_world_size))
    for b, (chunk, old) in enumerate(chunks):
        lo, hi = rank * chunk, (rank + 1) * chunk
        pieces = {"master": torch.zeros(chunk)}
        for key, values in template.state.items():
            if values[b].dim() > 0:
                pieces[key] = torch.zeros(chunk, dtype=values[b].dtype)
        for i in range(old_world_size):
            a, e = max(lo, i * old), min(hi, (i + 1) * old)
            if a >= e:
                continue
            src = fetch(i)
            if src.step != step or src.master[b].numel() != old:
                raise ValueError(f"old rank {i}'s chunk is at step {src.step} with {src.master[b].numel()} "
                                 f"elements in bucket {b}, expected step {step} and {old}")
            for key, piece in pieces.items():
                values = src.master if key == "master" else src.state[key]
                piece[a - lo:e - lo] = values[b][a - i * old:e - i * old]
        out.master.append(pieces.pop("master"))
        for key, piece in pieces.items():
            out.state[key][b] = piece
    return out


# Optimizers whose update of an element depends only on that element's parameter, gradient
# and state (and on scalars such as the step count): sharding them is exact.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta,
               torch.optim.Rprop)


def check_elementwise(optimizer: torch.optim.Optimizer, stage: int | str) -> None:
    """Raise ConfigError unless ``optimizer`` updates each element independently
    (``stage``: the ZeRO stage, or ``"async"`` for the parameter-server shards)."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        what, fix = (("--mode async", "--mode sync") if stage == "async" else (f"--zero {stage}", "--zero 0"))
        raise ConfigError(f"{what} shards optimizer state element by element, and "
                          f"{type(optimizer).__module__}.{type(optimizer).__name__} is not an element-wise "
                          f"optimizer elastic_dp knows ({names}): use one of those or run with {fix}")
