"""Membership: who is in the group. The control plane's half that knows nothing of steps.

It owns the worker pool, the elastic policy and the joiners: it places the first
workers, admits ready joiners at step boundaries (the coordinator picks the boundary),
stops lost workers and asks for replacements, and times the wait below MIN. It holds no
tensors and does not call the workers; a ``Pool`` is anything with the methods below
(``WorkerPool`` on Ray, a fake in the unit tests), and members are opaque objects.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Protocol, Sequence

from elastic_dp.control.membership.policy import POLICIES, Action, MembershipDecision, Policy
from elastic_dp.errors import ConfigError, PlacementError

logger = logging.getLogger(__name__)


class Pool(Protocol):
    """Starts and stops workers; ``elastic_dp.control.membership.pool.WorkerPool`` on Ray."""

    pending: list
    """Requested workers that are not ready yet."""

    def start(self, count: int) -> None:
        """Request ``count`` more workers."""

    def poll(self) -> list:
        """The requested workers that became ready since the last call."""

    def wait_ready(self, count: int, timeout_s: float) -> list:
        """Block until ``count`` workers became ready or ``timeout_s`` passed; return them."""

    def placed_but_starting(self) -> int:
        """Workers placed on the cluster whose task is still being built."""

    def stop(self, member) -> None:
        """Stop ``member`` and release its resources."""

    def stop_all(self) -> None:
        """Stop every worker the pool started."""

    def request_capacity(self, count: int) -> None:
        """Ask the cluster's autoscaler for room for ``count`` workers (0: withdraw)."""

    def placement_error(self, wanted: int, timeout_s: float, ready: int) -> PlacementError:
        """The error for ``wanted`` workers not placed within ``timeout_s``."""

    def leave_notices(self, members: list) -> dict:
        """The ``LeaveNotice``s that concern ``members`` now (their node drains, SIGTERM, a release)."""

    def gone(self, workers: list) -> list:
        """Those of ``workers`` (ready, not in the group) found dead since the last call."""


class Membership:
    """The members of the current generation, the ready joiners, and the pool behind them.

    ``held_back`` workers (injected joins) are not requested at the start: the target
    grows by one for each when ``grow`` is called at its step. ``spares`` more than the
    target are kept ready beside the group (``--spares``). ``policy``: the name of the
    membership policy in ``policy.POLICIES``.
    """

    def __init__(self, pool: Pool, *, min_workers: int, max_workers: int, spares: int = 0, held_back: int = 0,
                 wait_timeout_s: float = 300.0, placement_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 policy: str = "elastic") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"the membership policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy_class = POLICIES[policy]
        self.pool = pool
        self.min_workers, self.max_workers, self.spares = min_workers, max_workers, spares
        self.target = max(min_workers, max_workers - held_back)
        self.wait_timeout_s, self.placement_timeout_s = wait_timeout_s, placement_timeout_s
        self.clock, self.wall = clock, wall  # the wall clock times the notices' deadlines
        self.members: list = []
        """The current generation, in rank order."""
        self.joiners: list = []
        """Ready workers not in the current generation."""
        self._spares: set = set()
        """Joiners that became ready while the members and the joiners before them filled the
        target: the spares, which only a loss or a leave makes room for."""
        self._waiting_since: float | None = None
        self.leaving: dict = {}
        """Members and joiners with a leave notice (``LeaveNotice``), until they are gone."""

    @property
    def policy(self) -> Policy:
        return self.policy_class(min_workers=self.min_workers, max_workers=self.target,
                                 wait_timeout_s=self.wait_timeout_s, spares=self.spares)

    @property
    def standby(self) -> list:
        """Ready workers the policy keeps beside the group (joiners it does not admit)."""
        return [j for j in self.joiners if j not in self.leaving]

    def place(self) -> list:
        """Request the first workers (as many as the policy wants: the target, and any it
        keeps ready beside the group); return the ready ones once MIN are (more if placed,
        up to the target: the rest wait as joiners; the spares placed are waited for too,
        so that they stand by from the first step). The autoscaler is asked for room for
        the target (MAX) and the spares at once, so the nodes for workers that do not fit
        now are started while the run trains on the others."""
        self.pool.request_capacity(self.target + self.spares)
        self.pool.start(self.policy.wanted(0, 0))
        ready = self.pool.wait_ready(self.min_workers, self.placement_timeout_s)
        if len(ready) < self.min_workers:
            raise self.pool.placement_error(self.min_workers, self.placement_timeout_s, len(ready))
        while self.pool.placed_but_starting() and len(ready) < self.target + self.spares:  # placed: nearly ready
            ready += self.pool.wait_ready(1, self.placement_timeout_s)
        self.joiners += ready[self.target:]
        self._spares.update(ready[self.target:])
        return ready[:self.target]

    def _collect(self) -> None:
        """The workers that became ready since the last look join the joiners; those beyond
        the target are spares."""
        for worker in self.pool.poll():
            if len(self.members) + len(self.joiners) >= self.target:
                self._spares.add(worker)
            self.joiners.append(worker)

    def grow(self, count: int) -> None:
        """Injected joins: raise the target by ``count`` and wait until the new workers are ready."""
        self.target = min(self.max_workers, self.target + count)
        self.pool.request_capacity(self.target + self.spares)
        self.pool.start(count)
        self.joiners += self.pool.wait_ready(count, self.placement_timeout_s)

    def at_step_boundary(self) -> MembershipDecision:
        """Between steps: CONTINUE, or REFORM to let members with a leave notice go and to
        admit the joiners that are ready (a joiner with a notice is stopped instead). A
        ready joiner found dead (a spare, say) is replaced; the group does not notice."""
        self._collect()
        dead = self.pool.gone(self.joiners)
        if dead:
            logger.warning("%s: died while standing by; starting another", dead)
            self.lose(dead)
            self._replace()
        for member, notice in self.pool.leave_notices([*self.members, *self.joiners]).items():
            if member not in self.leaving:
                logger.info("%r: leave notice: %s", member, notice.describe(self.wall()))
            self.leaving[member] = notice
        going = [j for j in self.joiners if j in self.leaving]
        if going:
            logger.info("%s: leaving before joining (%s)", going, self.leaving[going[0]].cause)
            self.lose(going)
            self._replace()
        now = self.wall()
        return self.policy.at_step_boundary(self.members, self.joiners, {
            m: n.describe(now) for m, n in self.leaving.items() if m in self.members})

    def promoted(self, members: Sequence[Hashable]) -> list:
        """Those of ``members`` (a decision's next generation) that stood by as spares
        until now: they take the places of members that were lost or left."""
        return [m for m in members if m in self._spares]

    def overdue(self, margin_s: float) -> dict:
        """Members whose leave deadline is less than ``margin_s`` away: no step boundary
        can wait for them (member -> notice)."""
        now = self.wall()
        return {m: n for m, n in self.leaving.items()
                if m in self.members and n.deadline is not None and n.deadline - now < margin_s}

    def force_out(self, member: Hashable) -> None:
        """Stop ``member`` now, ahead of its leave deadline; it stays a member until the
        call it is in fails over it (``lose``)."""
        self.pool.stop(member)

    def release(self, left: Sequence[Hashable]) -> None:
        """Members that left at a step boundary (the new generation formed without them):
        stop them, and ask for workers to take their places."""
        self.lose(left)
        self._replace()

    def _replace(self) -> None:
        self.pool.start(self.policy.wanted(len(self.members), len(self.pool.pending) + len(self.joiners)))

    def arrivals(self) -> list:
        """Object refs done when a starting worker has moved on (``WorkerPool.progress_refs``):
        a mode that waits on them with its workers' calls hears of a joiner at once."""
        return self.pool.progress_refs()

    def lose(self, lost: Sequence[Hashable]) -> None:
        """Stop workers that died or hung; they leave the members and the joiners (the
        workers ready by now are collected first, as the group they stood beside was)."""
        self._collect()
        for member in lost:
            self.pool.stop(member)
        self.members = [m for m in self.members if m not in lost]
        self.joiners = [j for j in self.joiners if j not in lost]
        for member in lost:
            self.leaving.pop(member, None)
            self._spares.discard(member)

    def after_failure(self, survivors: Sequence[Hashable], *, has_checkpoint: bool) -> MembershipDecision:
        """Members failed; ``survivors`` (rank order) are the rest of the group that was
        running or forming. Asks for replacements up to the target, then decides: REFORM,
        RESTORE, WAIT (below MIN; the wait is timed from the first WAIT) or FAIL."""
        self._collect()
        self.lose(self.pool.gone(self.joiners))  # a spare lost with the members is not admitted
        joiners = [j for j in self.joiners if j not in survivors]
        self.pool.start(self.policy.wanted(len(survivors), len(self.pool.pending) + len(joiners)))
        now = self.clock()
        if self._waiting_since is None:
            self._waiting_since = now
        decision = self.policy.after_failure(survivors, joiners, waited_s=now - self._waiting_since,
                                             has_checkpoint=has_checkpoint)
        if decision.action is not Action.WAIT:
            self._waiting_since = None
        return decision

    def admit(self, members: Sequence[Hashable]) -> None:
        """``members`` (rank order) form the new generation; they are no longer joiners."""
        self.members = list(members)
        admitted = set(members)
        self.joiners = [j for j in self.joiners if j not in admitted]
        self._spares -= admitted

    def close(self) -> None:
        """Stop every worker, and withdraw the request for capacity."""
        self.pool.stop_all()
        self.pool.request_capacity(0)
        self.members, self.joiners = [], []
