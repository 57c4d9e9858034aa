"""Running one step on every member and finding failures by the fastest signal.

Signals, whichever comes first: Ray reports a worker's actor dead (its step call raises
``RayActorError``); a survivor's collective raises (``CollectiveError`` in its result —
gloo sees a dead peer's socket close within tens of ms); the step deadline passes (a hung
worker is reported by nothing else). On the first signal every worker still in the step
is told to abort its group from its control thread, which releases a rank blocked in a
collective; a worker that does not come back within the grace period is hung, and is
reported lost along with the dead ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import ray

from .errors import CollectiveError
from .messages import StepResult
from .pool import Member

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutcome:
    """What came back from one attempt at a step."""

    results: dict[Member, StepResult] = field(default_factory=dict)
    lost: list[Member] = field(default_factory=list)
    """Members that died or hung (they will be stopped)."""
    cause: str | None = None
    """The first failure signal, in words."""
    detect_s: float | None = None
    """Seconds from dispatch to the first failure signal."""

    @property
    def committed_everywhere(self) -> bool:
        return not self.lost and all(r.committed for r in self.results.values())

    @property
    def task_errors(self) -> list[BaseException]:
        """Errors that are not failures of the group (e.g. a bad loss): not recoverable."""
        return [r.error for r in self.results.values()
                if r.error is not None and not isinstance(r.error, CollectiveError)]


def gather(calls: dict[object, Member], *, deadline_s: float, grace_s: float,
           abort: Callable[[list[Member]], None]) -> StepOutcome:
    """Wait for the object refs in ``calls`` (ref -> member) under a deadline.

    ``abort(members)`` is called once, on the first failure signal, with the members whose
    calls are still running.
    """
    start = time.monotonic()
    deadline = start + deadline_s
    outcome = StepOutcome()
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
            signal(f"step deadline of {deadline_s:.1f} s passed (hung worker)")
            continue
        for ref in done:
            member = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError:
                outcome.lost.append(member)
                signal(f"{member!r} died")
                continue
            outcome.results[member] = result
            if isinstance(result.error, CollectiveError):
                signal(f"collective error on {member!r}: {result.error}")
    for member in pending.values():
        logger.warning("%r did not answer within the grace period after the abort: treating it as hung", member)
        outcome.lost.append(member)
    return outcome
