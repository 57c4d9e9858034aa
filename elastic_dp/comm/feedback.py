"""Error feedback that survives membership changes: what the compressors of ``--compress``
share (``compression.PowerSGD``, ``quantize.Int8Compression``; docs/compression.md).

A compressor's result is not the sum of what the ranks sent, and each rank keeps what its
compression missed, its *error*, to add to its next gradient. The errors are state no
other rank holds, so, as a ZeRO chunk's, each one has a copy on a neighbour:

- every step each rank's error is copied to its right neighbour in the *near ring*
  (``Mesh.near_ring``: the ranks of its host, or the ranks alone on theirs), by the
  compressor's step on the reduction's thread; the commit vote is cast on that thread after
  it (``cast``), so a step commits only where every copy arrived;
- a new generation's first step (``resize``) hands the error of each worker that left to
  the rank that held its copy, which adds it to its own; a joiner has none; every error is
  copied to its new neighbour, and that is what a step that does not commit goes back to;
- a re-formation asks the survivors what they hold (``holdings``, ``lost_errors``): an
  error that left with its copy sends the run back to its checkpoint;
- a checkpoint holds each rank's error as a row of ``reduction/error/<bucket>``; a resume
  hands their sum to rank 0 and none to the others (``load_rows``);
- at ZeRO stages 1 and 2 (``rewinds``) each rank keeps its errors and copies as of the step
  before too, since a re-formation may restore the chunks a committed step back
  (``rewind``), and a new generation cuts each error to its bucket's new padding.

A worker is known by a random token of its reduction's, which the ranks tell each other in
each new generation.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.reductions import Reduction, ReductionThread

logger = logging.getLogger(__name__)


class ErrorFeedback(Reduction):
    """A compressor's errors, their copies and what a membership change does to them
    (module docstring). A subclass reduces (``launch``, on ``self._thread``, setting
    ``self._threaded`` where it does), keeps ``errors[index]`` and ``copies[index]`` up to
    date in each step, and may keep state of its own that every rank holds alike
    (``agree``, ``state``, ``load_state``, ``_kept``, ``_put_back``)."""

    sums = False  # an approximation of the sum: the vote is cast on a channel of its own
    thread: ClassVar[str] = "edp-compress"

    def __init__(self, group: CollectiveGroup) -> None:
        super().__init__(group)
        self.errors: dict[int, torch.Tensor] = {}
        """This rank's error, by bucket."""
        self.copies: dict[int, torch.Tensor] = {}
        """The near ring's left neighbour's error, by bucket, as of this rank's own (its copy:
        it comes back from here if that worker is lost)."""
        self.copy_of: int | None = None
        """The token of the worker whose error ``copies`` holds."""
        self.errors_lost = 0
        """Workers whose error left the run with them and their copy (a lost host, or two neighbours)."""
        self._token = int.from_bytes(os.urandom(7), "little")  # this worker's, among a generation's
        self._members: set[int] = set()  # the tokens of the generation the errors were last cut for
        self._threaded = False  # this step sent a bucket to the thread: the vote goes there too
        self._saved: tuple | None = None
        self.at: int | None = None
        """The steps the errors are of (this step's: they are replaced as its reduction
        runs, kept if it commits); None where not counted (a checkpoint's, none yet)."""
        self._saved_at: int | None = None  # the steps of the state ``save`` kept
        self._begun: int | None = None  # the step under way (``begin``); None: not counted
        self.rewinds = False
        """Keep the state of the step before too (``_history``): ZeRO stages 1 and 2, whose
        re-formation may restore the chunks one committed step back (``rewind``). Costs one
        more set of errors and copies."""
        self._history: dict[int, tuple] = {}
        """With ``rewinds``, the state as of each of the last two steps begun (what ``save``
        kept at each, by its number)."""
        self._thread = ReductionThread(self.thread, lambda: self.group.generation)

    def _world(self, generation: int) -> CollectiveGroup:
        """The process group a compressor's thread reduces on: the generation's ``world``
        sub-group, its own, so that the training thread's collectives on the generation's
        group (the buckets it leaves, the vote where none went to the thread) go on in their
        own order meanwhile; a launch of an older generation raises ``CollectiveError``."""
        self._check(generation)
        return self.group.subgroup("world", generation=generation)

    # -- the vote, after the copies ----------------------------------------------------------------
    def cast(self, ballot: Any, carried: bool) -> tuple[Any, Any]:
        """Where buckets were reduced on the thread in this step, the vote and the payload go
        there too, on the reduction's group, after them: a rank's vote counts once its copies
        of the errors have arrived, so that a step commits only where each error has its copy."""
        if not self._threaded:
            return super().cast(ballot, carried)
        vote = ballot.tensor.clone()
        payload = ballot.payload.clone() if ballot.payload is not None else None
        generation = self.group.generation

        def send() -> None:
            group = self.group.subgroup("world", generation=generation)
            works = [group.all_reduce_async(vote)] + ([group.all_reduce_async(payload)] if payload is not None else [])
            for work in works:
                work.wait()

        done = self._thread.submit(send)
        return (done, vote), ((done, payload) if payload is not None else None)

    # -- state between steps ---------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        return {f"error/{b}": e for b, e in self.errors.items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.errors = {int(k.removeprefix("error/")): v for k, v in state.items() if k.startswith("error/")}

    def _kept(self) -> tuple:
        """What ``save`` keeps of a subclass's own state (its tensors are replaced, not changed)."""
        return ()

    def _put_back(self, kept: tuple) -> None:
        """``restore``: a subclass's own state back from what ``_kept`` returned."""

    def begin(self, step: int) -> None:
        self._begun = step

    def save(self) -> None:
        # a step replaces the errors and the copies with new tensors: keeping references is a copy
        step = self._begun
        self._saved, self._saved_at = (dict(self.errors), dict(self.copies), self._kept()), step
        self.at = None if step is None else step + 1
        if step is None or not self.rewinds:
            self._history = {}
        else:
            self._history = {s: kept for s, kept in self._history.items() if s == step - 1}
            self._history[step] = self._saved

    def restore(self) -> None:
        if self._saved is not None:
            errors, copies, kept = self._saved
            self.errors, self.copies = dict(errors), dict(copies)
            self._put_back(kept)
            self.at = self._saved_at

    def rewind(self, step: int) -> None:
        """Back to the errors (and copies) as of ``step`` steps, for a re-formation that
        restores ZeRO's chunks at ``step`` (``Sharded.import_chunks``): this step's state, or
        the one ``save`` kept at the start of one of the last two steps (a step that
        committed here and is re-run: a worker lost in its optimizer, found in the next
        step). The coordinator asked first (``holdings``: ``steps``) that every survivor can."""
        if self.at is None or self.at == step:
            return
        if step not in self._history:
            raise RuntimeError(f"--compress: the error feedback is held of steps {self.holdings()['steps']}, not of "
                               f"step {step}, where the re-formation restores the state")
        self._saved, self._saved_at = self._history[step], step
        self.restore()

    # -- a new generation ------------------------------------------------------------------------
    def holds(self) -> bool:
        """This rank holds the state every rank holds alike (``agree`` takes it from the first that does)."""
        return bool(self.errors)

    def agree(self, source: int) -> dict[str, torch.Tensor]:
        """Rank ``source``'s state that every rank holds alike, on every rank (as ``state``
        names it; none here)."""
        return {}

    def resize(self, world_size: int) -> None:
        """A new generation: the errors of the workers that left are taken over by the ranks
        that held their copies, the state every rank holds alike is taken from the first rank
        that holds it (a joiner holds none of it), and each rank's error is copied to its
        near neighbour again: the errors' sum is the one the last generation left. Nothing
        changes until every collective of it is done, and then it is what this step's
        ``restore`` goes back to: a generation that fails here or in its first step leaves
        the next one the same errors to take over."""
        group = self.group
        # the buckets' lengths (padded to the world size under ZeRO): the padding's error is zero
        self.errors = {b: _fit(e, self._numel(b)) for b, e in self.errors.items()}
        self.copies = {b: _fit(e, self._numel(b)) for b, e in self.copies.items()}
        told = torch.zeros(3, world_size, dtype=torch.int64)  # each rank's token; holds the state; holds errors
        told[0, group.rank], told[1, group.rank], told[2, group.rank] = self._token, self.holds(), bool(self.errors)
        group.all_reduce_async(told).wait()
        tokens = told[0].tolist()
        gone = self._members - set(tokens) if self.errors else set()
        adopted = self.copy_of in gone and bool(self.copies)
        errors = dict(self.errors)
        if adopted:  # the worker this rank held a copy of left: its error goes on here
            for b, copy in self.copies.items():
                errors[b] = errors[b] + copy if b in errors else copy
        counts = torch.zeros(2, world_size, dtype=torch.int64)
        counts[0, group.rank], counts[1, group.rank] = len(gone), int(adopted)
        group.all_reduce_async(counts).wait()
        holders = [r for r in range(world_size) if told[1, r]]
        agreed = self.agree(holders[0] if holders else 0) if world_size > 1 else {}
        right, left = group.mesh.near_right(group.rank), group.mesh.near_left(group.rank)
        copies = self._copy_errors(errors, right, left) if bool(told[2].any()) else {}
        # every collective is done: the new generation's state
        self._members = set(tokens)
        if agreed:
            self.load_state(agreed)
        self.errors, self.copies = errors, copies
        self.copy_of = None if left == group.rank else tokens[left]
        self.save()  # of the same step: the step under way's restore goes back here
        lost = int(counts[0].max()) - int(counts[1].sum())
        if lost > 0:
            self.errors_lost += lost
            if group.rank == int(torch.nonzero(counts[0])[0]):
                logger.warning("gen %d rank %d: --compress: the error feedback of %d worker(s) that left went with "
                               "them, and no rank held its copy (a lost host, or two neighbours): from here the run "
                               "is off the replay contract by their errors (docs/compression.md)",
                               group.generation, group.rank, lost)

    def _numel(self, index: int) -> int:
        """The length of bucket ``index``'s error."""
        raise NotImplementedError

    def _buckets_with_errors(self) -> list[int]:
        """The buckets whose errors a step keeps (every rank alike)."""
        raise NotImplementedError

    def _copy_errors(self, errors: dict[int, torch.Tensor], right: int, left: int) -> dict[int, torch.Tensor]:
        """Each rank's ``errors`` to its near right neighbour (``Mesh.near_right``), as the
        steps copy them; the left neighbour's, received (none without a neighbour)."""
        copies: dict[int, torch.Tensor] = {}
        if left == self.group.rank:
            return copies
        for b in self._buckets_with_errors():  # every rank sends every bucket: a joiner's are zeros
            own = errors.get(b)
            sent = own if own is not None else torch.zeros(self._numel(b), dtype=torch.float32)
            received = torch.empty(self._numel(b), dtype=sent.dtype)
            for work in self.group.exchange_async(sent, right, received, left):
                work.wait()
            copies[b] = received
        return copies

    def holdings(self) -> dict[str, Any]:
        """This worker's token, whose error it holds a copy of, the tokens of the generation its
        errors are cut for, and whether it holds errors: from the survivors' answers a
        re-formation finds an error that left with its copy (``lost_errors``) before any step."""
        return {"token": self._token, "copy_of": self.copy_of if self.copies else None,
                "members": sorted(self._members), "errors": bool(self.errors),
                "steps": sorted({*self._history, *([self.at] if self.at is not None else [])})}

    def load_rows(self, rows: dict[str, torch.Tensor], rank: int, world_size: int) -> None:
        """From a checkpoint: rank 0 takes the sum of every saved rank's error (the others
        none), every rank the state every saved rank held alike (row 0): for a linear
        compressor the errors' sum is all its contract keeps (docs/compression.md)."""
        state = {k: v[0].clone() for k, v in rows.items() if not k.startswith("error/")}
        if rank == 0:
            state.update({k: v.sum(dim=0) for k, v in rows.items() if k.startswith("error/")})
        self.load_state(state)
        # the checkpoint's errors are all there is: no copy held from before it is taken over
        self.copies, self.copy_of, self._members = {}, None, set()
        self._begun = None  # of the checkpoint's step: not counted here
        self.save()


def _fit(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """``tensor`` cut or padded with zeros to ``numel`` elements (a bucket's padding changed)."""
    if tensor.numel() == numel:
        return tensor
    if tensor.numel() > numel:
        return tensor[:numel].clone()
    return torch.cat([tensor, tensor.new_zeros(numel - tensor.numel())])


def rewinds_to(holdings: list[dict[str, Any]], step: int) -> bool:
    """Whether every survivor's errors can go back to ``step`` steps (``ErrorFeedback.rewind``)."""
    return all(not h or not h["errors"] or not h["steps"] or step in h["steps"] for h in holdings)


def lost_errors(holdings: list[dict[str, Any]]) -> int:
    """How many of the last generation's workers left with their error and no survivor holds
    its copy, from the survivors' ``ErrorFeedback.holdings`` (0 where none holds errors)."""
    held = [h for h in holdings if h]
    if not any(h["errors"] for h in held):
        return 0
    members = set().union(*(h["members"] for h in held))
    return len(members - {h["token"] for h in held} - {h["copy_of"] for h in held})
