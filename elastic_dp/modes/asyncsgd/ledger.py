"""The asynchronous mode's bookkeeping, without Ray or torch: which sampler step each
worker holds, and the one global order of applied updates.

Steps are leased in order (a step whose worker died is leased again first). When a
worker's gradient of step ``k``, computed on model version ``b``, comes back while the
model is at version ``V``, applying it would produce version ``V + 1`` with staleness
``V - b`` (the updates applied in between). Staler than ``max_staleness``, it is refused
and the worker computes the same step again on the current version (``recomputed``).
Otherwise it gets version ``V + 1`` and its learning-rate multiplier: the run's warmup and
batch scaling at update ``V`` (``TrainConfig.lr_factor``), divided by ``t + 1`` for
staleness ``t >= 1`` with ``staleness_lr="inverse"``.

With ``max_staleness`` 0 only one step is leased at a time: every gradient is computed on
the version before it and updates are applied in step order, as in the synchronous mode.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class Update:
    """One applied update: a line of ``updates.jsonl``."""

    version: int
    """The model version it produced (1-based; 0 is the initial model)."""
    step: int
    """The sampler step whose global batch it trained."""
    base_version: int
    """The version its gradient was computed on."""
    worker: int
    staleness: int
    lr_scale: float
    """The multiplier on the optimizer's base learning rates."""

    def record(self) -> dict[str, Any]:
        return asdict(self)


class Ledger:
    """Leases and the order of updates, from ``version`` (updates applied so far)."""

    def __init__(self, version: int, *, max_staleness: int, staleness_lr: str,
                 lr_factor: Callable[[int], float]) -> None:
        self.version = version
        self.next_step = version  # steps before this were leased (and, once drained, applied)
        self.max_staleness, self.staleness_lr, self.lr_factor = max_staleness, staleness_lr, lr_factor
        self.again: list[int] = []  # steps to lease again (their worker died), sorted
        self.leased: dict[Any, int] = {}  # worker -> its step
        self.recomputed = 0
        self.applied: dict[int, Update] = {}  # version -> its update, for a roll-back and the histogram

    def may_lease(self, limit: int, new: bool = True) -> bool:
        """Another step may be leased: one to lease again, or (``new``) one left before
        ``limit``; with staleness 0 only while none is out."""
        if self.max_staleness == 0 and self.leased:
            return False
        return bool(self.again) or (new and self.next_step < limit)

    def lease(self, worker: Any) -> int:
        """Lease the next step to ``worker`` (which holds none)."""
        assert worker not in self.leased, worker
        if self.again:
            step = self.again.pop(0)
        else:
            step, self.next_step = self.next_step, self.next_step + 1
        self.leased[worker] = step
        return step

    def settle(self, worker: Any, base_version: int) -> Update | None:
        """``worker``'s gradient of its step, computed on ``base_version``, arrived: the
        update to apply, or None when it is too stale (the worker keeps its step)."""
        staleness = self.version - base_version
        if staleness > self.max_staleness:
            self.recomputed += 1
            return None
        step = self.leased.pop(worker)
        self.version += 1
        scale = self.lr_factor(self.version - 1)
        if self.staleness_lr == "inverse" and staleness >= 1:
            scale /= staleness + 1
        update = Update(self.version, step, base_version, worker, staleness, scale)
        self.applied[self.version] = update
        return update

    def roll_back(self, version: int) -> list[int]:
        """The model is back at ``version`` (a lost parameter-server shard rebuilt from a
        copy): the steps of later updates, and every step out, are leased again.
        Returns the steps to lease again."""
        undone = [self.applied.pop(v).step for v in range(version + 1, self.version + 1) if v in self.applied]
        undone += list(self.leased.values())
        self.leased.clear()
        self.again = sorted(self.again + undone)
        self.version = version
        return undone

    def release(self, worker: Any) -> int | None:
        """``worker`` is gone: its step is leased again first. Returns that step."""
        step = self.leased.pop(worker, None)
        if step is not None:
            bisect.insort(self.again, step)
        return step

    def carry(self, earlier: Ledger) -> None:
        """Count ``earlier``'s updates up to this ledger's version, and its recomputed ones,
        as this ledger's own (a run restored from its checkpoint mid-way)."""
        self.applied |= {v: u for v, u in earlier.applied.items() if v <= self.version}
        self.recomputed += earlier.recomputed

    @property
    def staleness(self) -> Counter:
        """How many of the updates in the model had each staleness (undone ones not counted)."""
        return Counter(u.staleness for u in self.applied.values())

    @property
    def idle(self) -> bool:
        """No step is out: the applied updates are exactly steps ``0 .. version - 1``
        (when nothing is to be leased again)."""
        return not self.leased


def copy_plan(shards: int, alive: set[int], own: dict[int, list[int]],
                  kept: dict[Any, dict[int, list[int]]], keeper_of: Callable[[int], Any]) -> tuple[int, list] | None:
    """The newest version at which every shard's state is still held: by the shard itself
    (alive, ``own`` copy) or by its keeper (``kept[keeper_of(i)][i]``, the keeper alive:
    only live keepers are in ``kept``). Returns it and, per shard, ``("own", i)`` or
    ``("kept", keeper)``; None when some shard's state is lost with its keeper's copy."""
    versions = {v for vs in own.values() for v in vs} | {v for k in kept.values() for vs in k.values() for v in vs}
    for version in sorted(versions, reverse=True):
        sources = []
        for i in range(shards):
            if i in alive and version in own.get(i, []):
                sources.append(("own", i))
            elif version in kept.get(keeper_of(i), {}).get(i, []):
                sources.append(("kept", keeper_of(i)))
            else:
                break
        else:
            return version, sources
    return None
