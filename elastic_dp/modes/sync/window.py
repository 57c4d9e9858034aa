"""A window of steps, seen from the coordinator: no call and no wait per step.

The coordinator starts every member's ``run_window`` (a Ray streaming call: the
``StepResult``s of committed steps stream back, a few at a time) with the first steps
granted (``LOOKAHEAD_S`` of them), and grants more as the committed steps come in, so the
workers never wait for it. It stops granting at ``limit`` (the last step, a checkpoint, an
injected join). When ``keep_going`` says no (a worker is ready to join) it asks every
member to stop: the first commit vote to leave after the request carries it to every
rank (the step in flight's, if its last bucket has not left), and all end the window
after that step (``modes.sync.grants.Grants.stopping``), or at the end of the grant if
they reach it first. A failure in step ``s`` stops the window there: the others are
aborted as after a failed step call, and ``MembersLost`` names ``s``, the step the
recovery starts from.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Generator

from elastic_dp.errors import CollectiveError
from elastic_dp.faults import STEP_PHASES, FaultPlan
from elastic_dp.messages import StepResult, WindowPlan
from elastic_dp.modes.base import MembersLost
from elastic_dp.modes.calls import Waiting
from elastic_dp.modes.sync.generations import Generations
from elastic_dp.modes.watchdog import Watchdog

LOOKAHEAD_S = 2.0
"""How far ahead steps are granted, in the run's typical step time: enough that reports
(every ``modes.sync.program.REPORT_INTERVAL_S``, 0.5 s) and the next grant arrive before the workers
run out; the grant is extended when less than half of it remains. Between
``MIN_LOOKAHEAD`` and ``MAX_LOOKAHEAD`` steps. A long grant does not delay a join: the
window is stopped through the vote, at most one step after the request reaches a worker."""
MIN_LOOKAHEAD, MAX_LOOKAHEAD = 8, 4096
NOTICE_WAKE_S = 0.25
"""The window asks ``keep_going`` at least this often (a leave notice is read from the GCS
then, ``worker.leave.NOTICE_POLL_S``): a notice that comes while the step
before the last bucket computes is carried by that step's vote."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Committed:
    """A step every member committed, as the window saw it."""

    step: int
    results: dict[Any, StepResult]
    """The members' reports, by member."""
    whole: bool
    """Every member's report came (False: a member was lost after the step committed
    everywhere, and its report with it)."""


class Window:
    """Runs steps ``start``..``limit - 1`` (or fewer) on the current generation of
    ``gens``, and tells what happened: ``run`` yields each step as it commits and returns
    the boundary; a failure raises ``MembersLost``, whose ``reports`` are the survivors'
    reports of the step it interrupted. The caller records the steps."""

    def __init__(self, gens: Generations, faults: FaultPlan, sampler: dict[str, int], number: int, start: int,
                 limit: int, keep_going: Callable[[], bool], wake: Callable[[], list] = list,
                 slice_sizes: Callable[[list[Any], int], tuple[int, ...] | None] = lambda members, step: None,
                 ) -> None:
        self.gens, self.faults, self.sampler = gens, faults, sampler
        self.number, self.start, self.limit, self.keep_going = number, start, limit, keep_going
        self.wake, self.slice_sizes = wake, slice_sizes
        self.members = list(gens.members)
        self.granted, self.final = start, False
        self.stopping = False
        """Every member was asked to stop (``keep_going`` said no)."""
        self.stopped = False
        """The window ended by the vote: the last committed step carried the stop."""
        typical = gens.calls.typical_step_s
        self.lookahead = MIN_LOOKAHEAD if not typical else max(MIN_LOOKAHEAD,
                                                                min(MAX_LOOKAHEAD, math.ceil(LOOKAHEAD_S / typical)))
        self.handed: dict[int, dict[int, Any]] = defaultdict(dict)  # step -> rank -> fault
        self.next = start
        """The first step not yet committed by every member."""
        self.sizes = slice_sizes(self.members, start)
        """Slice sizes by rank (``--balance``); None: equal slices."""

    def _grant_to(self, until: int) -> dict[int, dict[int, Any]]:
        """Take the faults of the steps up to ``until``: rank -> step -> fault."""
        by_rank: dict[int, dict[int, Any]] = defaultdict(dict)
        for step in range(self.granted, until):
            for rank, fault in self.faults.take_step(step, len(self.members), STEP_PHASES).items():
                self.handed[step][rank] = fault
                by_rank[rank][step] = fault
        self.granted = until
        return by_rank

    def _extend(self) -> None:
        """After commits: grant ``lookahead`` steps ahead (up to ``limit``: then final)."""
        if self.final or self.granted - self.next >= self.lookahead // 2:
            return
        first, sizes = self.granted, None
        faults = self._grant_to(min(self.limit, self.next + self.lookahead))
        self.final = self.granted >= self.limit
        new = self.slice_sizes(self.members, first)
        if new != self.sizes:  # from the first step of this grant, which no rank has begun
            self.sizes, sizes = new, (first, new)
        for rank, m in enumerate(self.members):
            m.actor.call.remote("grant", self.number, self.granted, self.final, faults.get(rank, {}), sizes)

    def _stop_if_asked(self) -> None:
        """When ``keep_going`` says no: ask every member to stop after its next step (the
        vote makes them agree on which), and grant nothing more."""
        go = self.keep_going()  # asked once stopping too: a leave whose deadline nears is forced there
        if self.stopping or go:
            return
        self.stopping = self.final = True
        for m in self.members:
            m.actor.call.remote("grant", self.number, self.granted, True, {}, None, True)

    def _unrun(self) -> None:
        """The window stopped through the vote before its grant ran out: the steps granted
        after it never ran on any rank; their faults are pending again."""
        for step in sorted(self.handed):
            self.faults.put_back(self.handed.pop(step).values())
        for step in range(self.next, self.granted):
            self.faults.forget_step(step, len(self.members))

    def run(self) -> Generator[Committed, None, int]:
        """Train until the window ends, yielding each step as every member commits it;
        returns the committed steps afterwards."""
        members, generation = self.members, self.gens.generation
        faults = self._grant_to(min(self.limit, self.start + self.lookahead))
        self.final = self.granted >= self.limit
        streams = {m.actor.stream.remote("run_window", WindowPlan(
                       self.number, self.start, self.granted, self.final, self.sampler, faults.get(rank, {}),
                       self.faults.slow.get(rank), self.sizes)): m
                   for rank, m in enumerate(members)}
        calls = self.gens.calls
        reports: dict[int, dict[Any, StepResult]] = defaultdict(dict)
        last_commit = time.time()  # detection is timed from the end of the last step known to commit

        def abort(running: list[Any]) -> None:
            for m in running:
                m.actor.abort_group.remote(generation)  # also ends a wait for a grant

        # detect: the first signal's time (``_detection`` measures it once every report is in);
        # wake: a starting worker's progress, so that keep_going is asked at once
        waiting = Waiting(streams, deadline_s=calls.deadline_s, grace_s=calls.grace_s, abort=abort,
                          watchdog=Watchdog(calls.bounds, calls.typical_step_s, transport=calls.transport),
                          what="step", detect=time.time, wake=lambda: [] if self.stopping else self.wake(),
                          transport=calls.transport, poll_s=NOTICE_WAKE_S)
        while waiting.pending:
            ready = waiting.ready()
            if ready is None:
                break
            for gen in ready:
                member = waiting.pending[gen]
                try:
                    ok, report = waiting.take(gen, lambda g: calls.transport.get(next(g)))
                except StopIteration:
                    del waiting.pending[gen]  # this member's window ended
                    continue
                for result in report if ok else ():
                    reports[result.step][member] = result
                    if not result.committed:
                        waiting.signal(f"collective error on {member!r}: {result.error}"
                                       if isinstance(result.error, CollectiveError) else "the step did not commit")
            while len(reports[self.next]) == len(members) and all(r.committed for r in reports[self.next].values()):
                results = reports.pop(self.next)
                yield Committed(self.next, results, whole=True)
                last_commit = max([last_commit, *(r.time for r in results.values() if r.time)])
                self.faults.put_back(self.handed.pop(self.next, {}).values())  # none fired
                waiting.watchdog.typical_step_s = calls.typical_step_s
                self.stopped = all(r.stop for r in results.values())
                self.next += 1
                if not waiting.aborted:
                    waiting.renew()
            if not waiting.aborted:  # once per wake-up: a stop first, so no slicing is sent for steps never run
                self._stop_if_asked()
                self._extend()
        outcome = waiting.give_up()
        if outcome.cause is None and (self.next == self.granted or self.stopped):
            self._unrun()
            return self.next
        yield from self._failed(reports, outcome.lost, outcome.errors, outcome.cause or "the window ended early",
                                _detection(outcome.detect_s, reports, last_commit))
        raise AssertionError("unreachable: _failed raises")

    def _failed(self, reports, lost, errors, cause: str, detect_s: float) -> Generator[Committed, None, None]:
        """A step failed: yield the steps every survivor committed before it (a step
        commits on no rank before every rank voted, so they committed everywhere; a lost
        worker's reports of them may have died with it), put back the faults that did not
        fire, and raise ``MembersLost`` naming the first step that did not commit."""
        if lost:  # a survivor's raised error may follow from the loss; the recovery goes on
            for member, error in errors.items():
                logger.warning("%r raised while %s were lost: %s", member, lost, error)
        alive = [m for m in self.members if m not in lost]
        while alive and all(m in reports.get(self.next, {}) and reports[self.next][m].committed for m in alive):
            results = {m: r for m, r in reports.pop(self.next).items() if m not in lost}
            yield Committed(self.next, results, whole=len(results) == len(self.members))
            self.faults.put_back(f for rank, f in self.handed.pop(self.next, {}).items()
                                 if self.members[rank] in alive)  # a lost member's fault fired
            self.next += 1
        step = self.next
        results = {m: r for m, r in reports.get(step, {}).items() if m not in lost}
        for s, by_rank in self.handed.items():
            # a survivor's faults did not fire (a fired one loses its worker); nor did a lost
            # worker's from step + 2 on: it may have committed ``step`` alone, the last to leave
            # its all-reduce, and run into step + 1, but no further
            self.faults.put_back(f for rank, f in by_rank.items() if self.members[rank] in alive or s > step + 1)
        for s in range(step + 1, self.granted):
            self.faults.forget_step(s, len(self.members))  # granted, never run
        task_errors = [r.error for r in results.values() if r.error is not None
                       and not isinstance(r.error, CollectiveError)]
        if not lost and (task_errors or errors):
            raise (task_errors or list(errors.values()))[0]  # not recoverable: the task's own error
        raise MembersLost(self.members, lost, cause, detect_s, step=step, reports=results)


def _detection(signalled_at: float | None, reports: dict[int, dict[Any, StepResult]], last_commit: float) -> float:
    """Seconds from the end of the newest step known to have committed (on any rank; the
    survivors' reports of the steps before the failure come in after the signal, so this
    is measured once they are in) to the first failure signal (``signalled_at``, Unix time)."""
    if signalled_at is None:
        return 0.0
    newest = max((r.time for rs in reports.values() for r in rs.values() if r.time and r.committed), default=0.0)
    return max(0.0, signalled_at - max(last_commit, newest))
