"""The sharded layout (ZeRO stages 1 to 3), seen from the coordinator.

Each rank owns one chunk of the state and its right neighbour in the snapshot ring keeps a
peer snapshot of it (``elastic_dp.state.zero.sharded``); the ring alternates between nodes
(``comm.mesh.Mesh.ring``), so that neighbour is on another node wherever the cluster
allows. Under ``--shard-scope host`` (HSDP) the ranks of each block (inside a host) hold
one copy of the state between them, and a chunk's copies on the other hosts are its
replicas: no peer snapshot is sent. After a failure the survivors report what they hold, and
``chunk_sources`` picks the newest step at which every old chunk is still held
somewhere; the holders export those chunks to Ray's object store, and each rank of the
next generation re-cuts its new chunk out of them. The exported chunks stay the source
until a generation has imported them: a worker lost while that generation forms costs
only another attempt with the same chunks. When every copy of a chunk is lost
(a chunk and its peer snapshot, or every replica), only the durable checkpoint can restore the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from elastic_dp.comm.feedback import lost_errors, rewinds_to
from elastic_dp.comm.mesh import Mesh
from elastic_dp.durable.checkpoint import Checkpoint
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult
from elastic_dp.modes.base import Failure, Recovery, RecoveryResult, classify
from elastic_dp.modes.sync.generations import Generations
from elastic_dp.state.zero.settings import Stage


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Where each old chunk comes from, all at one step."""

    step: int
    """The state step (committed steps) the next generation starts from."""
    sources: tuple[tuple[int, str], ...]
    """Per old chunk: (the old rank that holds it, ``live`` | ``own`` | ``peer``)."""


def chunk_sources(world_size: int, holdings: dict[int, dict],
                  right: Callable[[int], int] | None = None) -> ChunkPlan | None:
    """Pick the newest step at which every old chunk is still held somewhere.

    ``holdings`` maps each surviving old rank to what it reported: ``chunk`` and ``chunks``
    (which of how many chunks it holds; absent: its rank's of ``world_size``, one a rank),
    ``live`` (the step of its live chunk), ``own`` (steps of snapshots of its own chunk)
    and ``peer`` (steps of snapshots of its left neighbour's chunk). A chunk at step ``t``
    is held by a rank that holds it (live or own snapshot: under ``--shard-scope host``
    each chunk has a holder on every host, its replicas) or, where each chunk has one
    holder, by that holder's right neighbour (peer snapshot; ``right(rank)``: the old
    generation's snapshot ring, ``comm.mesh.Mesh.right``; default the next rank). None:
    every copy of some chunk is lost, and only a durable checkpoint can restore the state.
    """
    right = right or (lambda rank: (rank + 1) % world_size)
    chunks = next((h["chunks"] for h in holdings.values() if "chunks" in h), world_size)
    holders: dict[int, list[int]] = {}  # per chunk, the survivors that hold it, in rank order
    for rank in sorted(holdings):
        holders.setdefault(holdings[rank].get("chunk", rank), []).append(rank)
    steps = sorted({t for h in holdings.values() for t in (h["live"], *h["own"], *h["peer"])}, reverse=True)
    for step in steps:
        sources = []
        for chunk in range(chunks):
            held = holders.get(chunk, [])
            keeper = holdings.get(right(chunk)) if chunks == world_size > 1 else None  # one holder: the chunk's rank
            found = (next(((r, "live") for r in held if holdings[r]["live"] == step), None)
                     or next(((r, "own") for r in held if step in holdings[r]["own"]), None)
                     or ((right(chunk), "peer") if keeper is not None and step in keeper["peer"] else None))
            if found is None:
                break
            sources.append(found)
        else:
            return ChunkPlan(step, tuple(sources))
    return None


@dataclass(frozen=True, slots=True)
class _Exported:
    """Every chunk of one generation at ``step``, in the object store."""

    step: int
    world_size: int
    """How many chunks: the old generation's world size, or its block's under ``--shard-scope host``."""
    refs: list[Any]
    """Per old chunk, a ``ChunkState``."""


class ShardedLayout:
    """ZeRO stages 1 and 2: every member holds one chunk; re-formation re-cuts them."""

    def __init__(self, generations: Generations, sampler_state: Callable[[], dict[str, int]],
                 stage: Stage | None = None, compressed: bool = False) -> None:
        self.gens = generations
        self.compressed = compressed
        """The gradients are compressed with error feedback (``--compress``, stages 1 and 2): a
        re-formation also asks the survivors whether every lost worker's error has its copy
        among them, and whether their errors go back to the step the chunks are restored at."""
        self.exported: _Exported | None = None
        """Chunks exported for a re-formation that has not completed yet."""
        self.restoring = False
        """A restart from the checkpoint began and did not complete: the chunks are mixed."""

    def started(self, step: int) -> None:
        self.exported, self.restoring = None, False

    def stepped(self, step: int, results: dict[Any, StepResult]) -> None:
        pass  # what each member holds is asked after a failure (chunk_holdings)

    def reform(self, members: list[Any], failure: Failure, faults: dict[int, Fault]) -> RecoveryResult:
        if self.restoring:
            return RecoveryResult(Recovery.STATE_LOST, reason="workers were lost while the run restarted from "
                                                              "the checkpoint")
        if self.exported is None:
            old = self.gens.members
            holders = [m for m in failure.survivors if m in old]
            missing = self._export(holders)
            if missing is not None:
                lost = [r for r, m in enumerate(old) if m not in holders]
                return RecoveryResult(Recovery.STATE_LOST,
                                      reason=f"ranks {lost} of {len(old)} were lost together, and with them {missing}")
        step = self.exported.step
        lost = self._errors_lost(failure, step) if self.compressed else None
        if lost is not None:
            return RecoveryResult(Recovery.STATE_LOST, reason=lost)
        fetched = self._import(members, faults)
        return RecoveryResult(classify(failure, step), step, details={"restored_step": step, "chunks_fetched": fetched})

    def _errors_lost(self, failure: Failure, step: int) -> str | None:
        """What of the ``--compress`` error feedback the re-formation cannot restore at
        ``step`` (None: nothing is lost): an error that left with its copy, or errors a
        survivor holds only of other steps (``ErrorFeedback.rewind`` keeps two)."""
        holders = [m for m in failure.survivors if m in self.gens.members]
        if not holders:
            return None
        asked = list(self.gens.run(holders, {m.actor.call.remote("reduction_holdings"): m for m in holders}).values())
        lost = lost_errors(asked)
        if lost:
            return (f"the --compress error feedback of {lost} lost worker(s) went with the neighbour that held its copy "
                    "(a host, or two neighbours, lost together)")
        if not rewinds_to(asked, step):
            return f"the --compress error feedback is not held of step {step}, where the ZeRO chunks are restored"
        return None

    def resize(self, members: list[Any]) -> None:
        self._export(self.gens.members)  # every chunk is live at this step
        self._import(members, {})

    def before_window(self, step: int, limit: int, standby: list[Any]) -> int:
        return limit  # a spare holds no chunk before it is promoted (docs/elastic.md)

    def copies(self) -> dict[Any, int]:
        return {}

    def _export(self, holders: list[Any]) -> str | None:
        """Export the newest complete set of the current generation's chunks that
        ``holders`` hold; None when done, else what was lost (some chunk is held by nobody)."""
        old = self.gens.members
        reports = self.gens.run(holders, {m.actor.chunk_holdings.remote(): m for m in holders})
        rank_of = {m: rank for rank, m in enumerate(old)}
        ring = Mesh(tuple(m.info.node_id for m in old))
        plan = chunk_sources(len(old), {rank_of[m]: r for m, r in reports.items()}, ring.right)
        if plan is None:
            replicated = any(r.get("chunks", len(old)) < len(old) for r in reports.values())
            return "every replica of a ZeRO chunk (--shard-scope host)" if replicated else \
                "a ZeRO chunk and its peer snapshot"
        metas, refs = {}, []
        for holder, kind in plan.sources:
            meta, ref = old[holder].actor.export_chunk.remote(kind, plan.step)
            metas[meta] = old[holder]
            refs.append(ref)
        self.gens.run(holders, metas)  # exported before the holders join the next generation
        self.exported = _Exported(plan.step, len(refs), refs)
        return None

    def _import(self, members: list[Any], faults: dict[int, Fault]) -> int:
        """Form the generation over ``members`` and cut its chunks out of the exported ones;
        returns how many of those the ranks fetched from the object store (a rank takes the
        ones it holds from itself: its own chunk and its left neighbour's snapshot)."""
        self.gens.form(members, faults)
        src = self.exported
        fetched = self.gens.call_all("import_chunks", src.refs, src.world_size, src.step)
        self.exported = None
        return sum(fetched.values())

    def load(self, checkpoint: Checkpoint) -> None:
        self.exported, self.restoring = None, True
        self.gens.call_all("load_checkpoint", checkpoint)  # a collective: every rank re-cuts its chunk
        self.restoring = False

    def restore(self, members: list[Any], checkpoint: Checkpoint) -> None:
        self.exported, self.restoring = None, True
        self.gens.form(members)
        self.load(checkpoint)
