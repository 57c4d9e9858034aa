"""Calling every member at once and finding failures by the fastest signal.

Signals, whichever comes first: Ray reports a worker's actor dead (its call raises
``RayActorError``); a survivor reports a failed collective (``failed(result)`` says so —
gloo sees a dead peer's socket close within tens of ms) or raises; the deadline passes
(a hung worker is reported by nothing else). On the first signal every worker still in
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
           what: str = "call") -> CallOutcome:
    """Wait for the object refs in ``calls`` (ref -> member) under a deadline.

    ``abort(members)`` is called once, on the first failure signal, with the members whose
    calls are still running. ``failed(member, result)`` describes a failure a member
    reported in its result (None: none). ``what`` names the call in the deadline's cause.
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
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            if aborted:
                break  # the grace period is over: whoever has not answered is hung
            signal(f"{what} deadline of {deadline_s:.1f} s passed (hung worker)")
            continue
        for ref in done:
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
    """Runs one actor method on a group of members; lost members raise ``MembersLost``."""

    def __init__(self, *, deadline_s: float, grace_s: float) -> None:
        self.deadline_s, self.grace_s = deadline_s, grace_s

    def gather(self, calls: dict[object, Any], generation: int,
               failed: Callable[[Any, Any], str | None] = lambda m, r: None, what: str = "call") -> CallOutcome:
        """``gather`` with an abort of ``generation``'s group on the members still running."""
        def abort(members: list[Any]) -> None:
            for m in members:
                m.actor.abort_group.remote(generation)  # control thread; a hung worker never runs it

        return gather(calls, deadline_s=self.deadline_s, grace_s=self.grace_s, abort=abort, failed=failed,
                      what=what)

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
