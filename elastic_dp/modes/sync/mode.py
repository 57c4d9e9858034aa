"""Synchronous data parallelism: every member trains a slice of each step's global batch.

For step ``s`` the mode takes the sampler's global batch, splits it into contiguous
slices over the current ranks, and the step counts when every member reports it
committed (docs/design.md: fixed global batch, atomic steps). A member lost in a step raises ``MembersLost``; once
the coordinator has decided who continues, the layout (``.layouts``) carries the state
over to the next generation and says which step comes next (exactly-once). The mode
never touches a tensor: state moves between workers, checkpoints and the output as
opaque objects. The start, the record of a step, evaluation, saves and weights are the
collective run's (``modes.collective``), which DiLoCo holds too.
"""

from __future__ import annotations

from typing import Any, Callable

from elastic_dp.messages import StepResult
from elastic_dp.modes.base import Failure, MembersLost, Recovery, RecoveryResult
from elastic_dp.modes.collective import CollectiveRun, OnCollectiveRun
from elastic_dp.modes.context import ModeContext
from elastic_dp.modes.sync.balance import Balancer
from elastic_dp.modes.sync.window import Committed, Window


class SyncMode(OnCollectiveRun):
    """Synchronous SGD over one collective group per generation (``TrainingMode``)."""

    def __init__(self, context: ModeContext) -> None:
        self.train, self.recorder, self.faults = context.train, context.recorder, context.faults
        self.run = CollectiveRun(context)
        self.gens, self.layout = self.run.gens, self.run.layout
        self._last: dict[Any, StepResult] = {}  # the results of the last failed attempt
        self._measured: set[int] = set()  # the generations whose state_memory event is written
        self._windows = 0
        self.balancer = Balancer(self.train.global_batch) if self.train.mode.balance else None
        self._sizes: tuple[int, ...] | None = None  # the last slicing recorded ...
        self._sized: list[Any] = []  # ... and the members it was for
        self._standby: list[Any] = []  # the spares ready beside the group, to copy the state to

    # -- the step --------------------------------------------------------------------------
    def advance(self, step: int, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True,
                wake: Callable[[], list] = list) -> int:
        """Train from step ``step`` on every member in one window (``.window``): up to
        ``limit`` (default: one step), or to an earlier boundary once ``keep_going()``
        says no (asked again whenever a report or one of ``wake()``'s refs comes in).
        Returns the committed steps afterwards; a failure raises ``MembersLost`` naming
        the step it interrupted."""
        self._windows += 1
        limit = self.layout.before_window(step, step + 1 if limit is None else limit, self._standby)
        window = Window(self.gens, self.faults, self.run.sampler_state(), self._windows, step, limit, keep_going,
                        wake, self.slice_sizes)
        steps = window.run()
        try:
            while True:
                self._committed(next(steps))
        except StopIteration as end:
            return end.value
        except MembersLost as lost:
            if lost.step is not None:  # the window's: the survivors' reports of the step it interrupted
                self.layout.stepped(lost.step, lost.reports)
                self._last = lost.reports  # a recovery may find that the step committed
            raise

    def _committed(self, committed: Committed) -> None:
        """A step of the window committed on every member: the layout, the record, the balancer."""
        self.layout.stepped(committed.step, committed.results)
        self.run.record(committed.step, list(committed.results.values()))
        measured = sorted((r for r in committed.results.values() if r.state_bytes is not None), key=lambda r: r.rank)
        if measured and measured[0].generation not in self._measured and len(measured) == len(committed.results):
            self._measured.add(measured[0].generation)  # the generation's first commit: what each rank holds
            self.recorder.event("state_memory", generation=measured[0].generation, ranks=[
                {"rank": r.rank, "parameters": r.state_bytes["parameters"], "gradients": r.state_bytes["gradients"],
                 "optimizer": r.state_bytes["optimizer_state"], "snapshots": r.state_bytes.get("snapshots", 0)}
                for r in measured])
        if self.balancer is not None and committed.whole:
            self.balancer.observe(committed.results)

    def slice_sizes(self, members: list[Any], step: int) -> tuple[int, ...] | None:
        """The slice sizes of ``members`` (rank order) from ``step`` on (``--balance``;
        None: equal slices); a change is recorded as a ``rebalanced`` event."""
        if self.balancer is None:
            return None
        sizes = self.balancer.sizes(members, self._sizes if members == self._sized else None)
        if sizes is not None and sizes != self._sizes:
            self.recorder.event("rebalanced", step=step, sizes=list(sizes), world_size=len(members))
        self._sizes, self._sized = sizes, list(members)
        return sizes

    # -- membership changes ----------------------------------------------------------------
    def standby(self, workers: list[Any]) -> None:
        self._standby = list(workers)  # kept in step by the layout (stage 0: --spare-copy-every)

    # a joiner takes a place that was left (a promoted spare, the lost rank's): the state
    # comes from any holder (ZeRO's survivors keep their chunks and their snapshots' ring)
    def resize(self, members: list[Any]) -> None:
        self.layout.resize(self.run.rank_order(members, keep_places=True))

    def reform(self, members: list[Any], failure: Failure) -> RecoveryResult:
        members = self.run.rank_order(members, keep_places=True)
        faults = self.faults.take_reform(failure.step, len(members)) if failure.in_flight else {}
        try:
            result = self.layout.reform(members, failure, faults)
        except MembersLost as lost:
            self.faults.put_back(f for rank, f in faults.items() if members[rank] not in lost.lost)
            raise
        self.faults.put_back(faults.values())  # none fired: every rank joined
        if result.outcome is Recovery.COMMITTED and failure.in_flight:
            results = [r for r in self._last.values() if r.committed] or [r for r in self._last.values()
                                                                           if r.samples]
            self.run.record(failure.step, results)
        return result
