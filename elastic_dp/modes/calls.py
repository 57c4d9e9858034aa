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

from .base import MembersLost
from .watchdog import HangBounds, Watchdog

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


def gather(calls: dict[object, Any], *, deadline_s: float, grace_s: float,
           abort: Callable[[list[Any]], None], failed: Callable[[Any, Any], str | None] = lambda m, r: None,
           what: str = "call", watchdog: Watchdog | None = None) -> CallOutcome:
    """Wait for the object refs in ``calls`` (ref -> member) under a deadline.

    ``abort(members)`` is called once, on the first failure signal, with the members whose
    calls are still running. ``failed(member, result)`` describes a failure a member
    reported in its result (None: none). ``what`` names the call in the deadline's cause.
    ``watchdog`` finds hung members before the deadline (they are lost at once).
    """
    start = time.monotonic()
    deadline = start + deadline_s
    outcome = CallOutcome()
    pending = dict(calls)
    aborted = False

    def signal(cause: str) -> None:
        nonlocal aborted, deadline
        if outcome.cause is None:
            outcome.cause, outcome.detect_s = cause, time.monotonic() - start
        if not aborted and pending:
            abort(list(pending.values()))
            aborted = True
            deadline = time.monotonic() + grace_s

    while pending:
        wait_s = max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1,
                           timeout=min(wait_s, watchdog.due_in()) if watchdog else wait_s)
        for member, why in watchdog.check(set(pending.values())) if watchdog else ():
            for ref in [r for r, m in pending.items() if m is member]:
                del pending[ref]
            outcome.lost.append(member)
            signal(why)
        if not done:
            if time.monotonic() < deadline:
                continue
            if aborted:
                break  # the grace period is over: whoever has not answered is hung
            signal(f"{what} deadline of {deadline_s:.1f} s passed (hung worker)")
            continue
        for ref in done:
            if ref not in pending:
                continue  # its member was found hung meanwhile
            member = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError:
                outcome.lost.append(member)
                signal(f"{member!r} died")
                continue
            except ray.exceptions.RayTaskError as exc:
                outcome.errors[member] = exc.as_instanceof_cause()
                signal(f"{member!r} raised {type(exc.cause).__name__}")
                continue
            outcome.results[member] = result
            reported = failed(member, result)
            if reported:
                signal(reported)
    for member in pending.values():
        logger.warning("%r did not answer within the grace period after the abort: treating it as hung", member)
        outcome.lost.append(member)
    return outcome


class Calls:
    """Runs one actor method on a group of members; lost members raise ``MembersLost``.

    Every call is watched (``Watchdog``) with ``bounds``; ``typical_step_s`` (the run's
    median step time so far, None before the first) scales the bound on stalled progress.
    """

    def __init__(self, *, deadline_s: float, grace_s: float, bounds: HangBounds | None = None) -> None:
        self.deadline_s, self.grace_s = deadline_s, grace_s
        self.bounds = bounds or HangBounds()
        self.typical_step_s: float | None = None

    def gather(self, calls: dict[object, Any], generation: int,
               failed: Callable[[Any, Any], str | None] = lambda m, r: None, what: str = "call") -> CallOutcome:
        """``gather`` with an abort of ``generation``'s group on the members still running."""
        def abort(members: list[Any]) -> None:
            for m in members:
                m.actor.abort_group.remote(generation)  # control thread; a hung worker never runs it

        return gather(calls, deadline_s=self.deadline_s, grace_s=self.grace_s, abort=abort, failed=failed,
                      what=what, watchdog=Watchdog(self.bounds, self.typical_step_s))

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
