"""Calling every member at once and finding failures by the fastest signal.

Signals, whichever comes first: Ray reports a worker's actor dead (its call raises
``RayActorError``); a survivor reports a failed collective (``failed(result)`` says so —
gloo sees a dead peer's socket close within tens of ms) or raises; the watchdog finds a
worker hung (``.watchdog``: missed heartbeats, or no progress while its peers wait); the
deadline passes (the last backstop). On the first signal every worker still in
the call is told to abort its group from its control thread, which releases a rank
blocked in a collective or in the rendezvous of a forming group; a worker that does not
come back within the grace period is hung, and is reported lost along with the dead ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from elastic_dp.modes.base import MembersLost
from elastic_dp.modes.watchdog import RAY, HangBounds, Transport, Watchdog

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CallOutcome:
    """What came back from one call on every member."""

    results: dict[Any, Any] = field(default_factory=dict)
    errors: dict[Any, BaseException] = field(default_factory=dict)
    """Members whose call raised (an aborted rendezvous, or a bug: not a lost worker)."""
    lost: list[Any] = field(default_factory=list)
    """Members that died or hung (they will be stopped)."""
    cause: str | None = None
    """The first failure signal, in words."""
    detect_s: float | None = None
    """Seconds from the call to the first failure signal."""


class Waiting:
    """Calls in flight on members (``pending``: ref or stream -> member) under a deadline,
    watched by ``watchdog``; on the first failure signal every member still in a call is
    aborted (``abort``) and the deadline becomes the grace period. ``gather`` waits for
    one result per member; a window of steps (``modes.sync.window``) for a stream each.
    ``detect`` measures the first signal (default: seconds since the wait began).
    ``wake()``: refs that end a wait early too (none of them is returned as ready);
    ``poll_s``: the longest one wait lasts (None: until the deadline or the next heartbeat)."""

    def __init__(self, pending: dict[object, Any], *, deadline_s: float, grace_s: float,
                 abort: Callable[[list[Any]], None], watchdog: Watchdog | None = None, what: str = "call",
                 detect: Callable[[], float] | None = None, wake: Callable[[], list] = list,
                 transport: Transport = RAY, poll_s: float | None = None) -> None:
        self.pending, self.outcome = dict(pending), CallOutcome()
        self.poll_s = poll_s
        self.transport = transport
        self.wake = wake
        self.deadline_s, self.grace_s, self.abort, self.watchdog, self.what = deadline_s, grace_s, abort, watchdog, what
        start = time.monotonic()
        self.detect = detect or (lambda: time.monotonic() - start)
        self.deadline = start + deadline_s
        self.aborted = False

    def signal(self, cause: str) -> None:
        if self.outcome.cause is None:
            self.outcome.cause, self.outcome.detect_s = cause, self.detect()
        if not self.aborted and self.pending:
            self.abort(list(self.pending.values()))
            self.aborted = True
            self.deadline = time.monotonic() + self.grace_s

    def renew(self) -> None:
        """Progress was made: the deadline starts again (not once aborted: the grace stands)."""
        if not self.aborted:
            self.deadline = time.monotonic() + self.deadline_s

    def ready(self) -> list[object] | None:
        """Wait until the next heartbeat round or a ready call; the ready ones (maybe none),
        or None when the grace period after an abort is over."""
        wait_s = max(0.0, self.deadline - time.monotonic())
        if self.poll_s is not None:
            wait_s = min(wait_s, self.poll_s)
        watchdog = self.watchdog
        refs = list(self.pending) + self.wake()
        # every call ready now, in one look (a wait costs as much as it has refs: taking one
        # ready call per wait made a window of N members cost N^2 a step); else the first
        done, _ = self.transport.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        if not done:
            done, _ = self.transport.wait(refs, num_returns=1,
                                          timeout=min(wait_s, watchdog.due_in()) if watchdog else wait_s)
        for member, why in watchdog.check(set(self.pending.values())) if watchdog else ():
            for key in [k for k, m in self.pending.items() if m is member]:
                del self.pending[key]
            self.outcome.lost.append(member)
            self.signal(why)
        if done or time.monotonic() < self.deadline:
            return [key for key in done if key in self.pending]  # not one found hung meanwhile
        if self.aborted:
            return None  # whoever has not answered is hung
        self.signal(f"{self.what} deadline of {self.deadline_s:.1f} s passed (hung worker)")
        return []

    def take(self, key: object, fetch: Callable[[object], Any] | None = None) -> tuple[bool, Any]:
        """``(True, fetch(key))`` (default: the transport's ``get``), or ``(False, None)``
        when the member died or its call raised (recorded, signalled, and no longer pending)."""
        member = self.pending[key]
        try:
            return True, (fetch or self.transport.get)(key)
        except ray.exceptions.RayActorError:
            del self.pending[key]
            self.outcome.lost.append(member)
            self.signal(f"{member!r} died")
        except ray.exceptions.RayTaskError as exc:
            del self.pending[key]
            self.outcome.errors[member] = exc.as_instanceof_cause()
            self.signal(f"{member!r} raised {type(exc.cause).__name__}")
        return False, None

    def give_up(self) -> CallOutcome:
        """The members still pending are hung; the outcome."""
        for member in self.pending.values():
            logger.warning("%r did not answer within the grace period after the abort: treating it as hung", member)
            self.outcome.lost.append(member)
        self.pending = {}
        return self.outcome


def gather(calls: dict[object, Any], *, deadline_s: float, grace_s: float,
           abort: Callable[[list[Any]], None], failed: Callable[[Any, Any], str | None] = lambda m, r: None,
           what: str = "call", watchdog: Watchdog | None = None, transport: Transport = RAY) -> CallOutcome:
    """Wait for the object refs in ``calls`` (ref -> member) under a deadline.

    ``abort(members)`` is called once, on the first failure signal, with the members whose
    calls are still running. ``failed(member, result)`` describes a failure a member
    reported in its result (None: none). ``what`` names the call in the deadline's cause.
    ``watchdog`` finds hung members before the deadline (they are lost at once).
    """
    waiting = Waiting(calls, deadline_s=deadline_s, grace_s=grace_s, abort=abort, watchdog=watchdog, what=what,
                      transport=transport)
    while waiting.pending:
        ready = waiting.ready()
        if ready is None:
            break
        for ref in ready:
            ok, result = waiting.take(ref)
            if not ok:
                continue
            member = waiting.pending.pop(ref)
            waiting.outcome.results[member] = result
            reported = failed(member, result)
            if reported:
                waiting.signal(reported)
    return waiting.give_up()


class Calls:
    """Runs one actor method on a group of members; lost members raise ``MembersLost``.

    Every call is watched (``Watchdog``) with ``bounds``; ``typical_step_s`` (the run's
    median step time so far, None before the first) scales the bound on stalled progress.
    """

    def __init__(self, *, deadline_s: float, grace_s: float, bounds: HangBounds | None = None,
                 transport: Transport = RAY) -> None:
        self.deadline_s, self.grace_s = deadline_s, grace_s
        self.bounds = bounds or HangBounds()
        self.transport = transport
        """How results are waited for and taken (Ray's, but in the control plane's benchmark)."""
        self.typical_step_s: float | None = None

    def gather(self, calls: dict[object, Any], generation: int,
               failed: Callable[[Any, Any], str | None] = lambda m, r: None, what: str = "call") -> CallOutcome:
        """``gather`` with an abort of ``generation``'s group on the members still running."""
        def abort(members: list[Any]) -> None:
            for m in members:
                m.actor.abort_group.remote(generation)  # control thread; a hung worker never runs it

        return gather(calls, deadline_s=self.deadline_s, grace_s=self.grace_s, abort=abort, failed=failed,
                      what=what, watchdog=Watchdog(self.bounds, self.typical_step_s, transport=self.transport),
                      transport=self.transport)

    def run(self, group: list[Any], calls: dict[object, Any], generation: int) -> dict[Any, Any]:
        """Every member's result, or ``raise_for``'s exception."""
        outcome = self.gather(calls, generation)
        raise_for(group, outcome)
        return outcome.results


def raise_for(group: list[Any], outcome: CallOutcome) -> None:
    """``MembersLost`` when a member died or hung (``group``: the call's members in rank
    order, for the lost ranks); an error raised with nobody lost is the run's error."""
    if outcome.lost:
        raise MembersLost(group, outcome.lost, outcome.cause, outcome.detect_s or 0.0)
    if outcome.errors:
        raise next(iter(outcome.errors.values()))
