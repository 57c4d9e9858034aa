"""Membership policy: when to shrink, grow, wait or give up. Pure decisions, no Ray, no torch.

``Membership`` reports what it sees — which members of the current generation are alive,
which new workers are ready to join, how long it has waited — and the policy returns a
``MembershipDecision``; the coordinator acts on it. Members are opaque ids; the
order of ``MembershipDecision.members`` is the membership's order of the next generation
(survivors keep their relative order, joiners come after); the mode makes the rank order
from it (``comm.mesh.rank_order``).

The policies are registered by name in ``POLICIES``; ``Membership`` builds the one it is
given (``policy=``) from the run's bounds. A policy that asks for more workers than it
admits keeps the rest ready beside the group: the standby workers, which the coordinator
tells the mode of (``TrainingMode.standby``). ``ElasticPolicy``'s ``spares`` are such
workers: asked for beyond MAX, admitted only in place of a member that is lost or leaves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

from elastic_dp.errors import ConfigError


class Action(enum.Enum):
    CONTINUE = "continue"
    """Keep the current generation."""
    REFORM = "reform"
    """Form the next generation over ``members``."""
    WAIT = "wait"
    """Too few workers: wait for capacity to return."""
    RESTORE = "restore"
    """No copy of the state survives: restart ``members`` from the latest durable checkpoint."""
    FAIL = "fail"
    """Give up; ``reason`` says why and what to change."""


@dataclass(frozen=True, slots=True)
class MembershipDecision:
    action: Action
    members: tuple[Hashable, ...] = ()
    reason: str = ""


class Policy(Protocol):
    """What ``Membership`` asks of a policy (built as ``cls(min_workers=, max_workers=,
    wait_timeout_s=, spares=)``)."""

    def wanted(self, current: int, pending: int) -> int:
        """How many more workers to request, given ``current`` members and ``pending`` starts."""

    def after_failure(self, survivors: Sequence[Hashable], joiners: Sequence[Hashable], *,
                      waited_s: float, has_checkpoint: bool) -> MembershipDecision:
        """Members of the current generation failed; ``survivors`` are the rest, in rank order."""

    def at_step_boundary(self, members: Sequence[Hashable], joiners: Sequence[Hashable],
                         leaving: dict[Hashable, str] | None = None) -> MembershipDecision:
        """Between steps: whom to let go and whom to admit."""


@dataclass(frozen=True, slots=True)
class ElasticPolicy:
    """Keep between ``min_workers`` and ``max_workers`` workers; wait up to
    ``wait_timeout_s`` below ``min_workers`` before failing. ``spares`` more are asked for
    and kept ready beside the group (``--spares``): the joiners beyond ``max_workers``,
    which only a loss or a leave makes room for, so that the re-formation that removes a
    member admits a spare in its place and the group keeps its size."""

    min_workers: int
    max_workers: int
    wait_timeout_s: float = 300.0
    spares: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ConfigError(f"--workers MIN:MAX needs 1 <= MIN <= MAX, got "
                              f"{self.min_workers}:{self.max_workers}")
        if self.wait_timeout_s < 0:
            raise ConfigError(f"the wait timeout must be >= 0, got {self.wait_timeout_s} (--min-wait-timeout)")
        if self.spares < 0:
            raise ConfigError(f"spares must be >= 0, got {self.spares} (--spares)")

    def wanted(self, current: int, pending: int) -> int:
        """How many more workers to request, given ``current`` members and ``pending`` starts
        (ready joiners count as pending): up to ``max_workers`` and the spares beside them."""
        return max(0, self.max_workers + self.spares - current - pending)

    def after_failure(self, survivors: Sequence[Hashable], joiners: Sequence[Hashable], *,
                      waited_s: float, has_checkpoint: bool) -> MembershipDecision:
        """Members of the current generation failed; ``survivors`` are the rest, in rank order."""
        if not survivors:
            if not has_checkpoint:
                return MembershipDecision(Action.FAIL, reason=(
                    "every worker failed and there is no durable checkpoint to restart from: "
                    "pass --checkpoint-dir and --checkpoint-every so a run can recover from this"))
            if len(joiners) >= self.min_workers:
                return MembershipDecision(Action.RESTORE, tuple(joiners[:self.max_workers]),
                                          reason="no worker survived; restarting from the latest checkpoint")
            return self._wait_or_fail(0, len(joiners), waited_s)
        return self._reform(survivors, joiners, waited_s)

    def at_step_boundary(self, members: Sequence[Hashable], joiners: Sequence[Hashable],
                         leaving: dict[Hashable, str] | None = None) -> MembershipDecision:
        """Between steps: let the ``leaving`` members go (member -> why) and admit ready
        joiners while below ``max_workers``. A leave that would take the group below
        ``min_workers`` waits (CONTINUE, saying so) until joiners make up for it: the
        failure path takes over if the workers go first."""
        leaving = {m: why for m, why in (leaving or {}).items() if m in members}
        staying = [m for m in members if m not in leaving]
        room = self.max_workers - len(staying)
        admitted = tuple(joiners[:max(0, room)])
        if leaving:
            if len(staying) + len(admitted) < max(1, self.min_workers):
                return MembershipDecision(Action.CONTINUE, tuple(members), reason=(
                    f"{len(leaving)} worker(s) are to leave, and the {len(staying) + len(admitted)} left would be "
                    f"below the minimum of {self.min_workers}: they stay until joiners come or they are gone"))
            why = "; ".join(dict.fromkeys(leaving.values()))
            joining = f", {len(admitted)} joining" if admitted else ""
            return MembershipDecision(Action.REFORM, (*staying, *admitted),
                                      reason=f"{len(leaving)} worker(s) leaving{joining}: {why}")
        if not joiners or room <= 0:
            return MembershipDecision(Action.CONTINUE, tuple(members))
        return MembershipDecision(Action.REFORM, (*members, *admitted),
                                  reason=f"{len(admitted)} worker(s) joining")

    def _reform(self, survivors: Sequence[Hashable], joiners: Sequence[Hashable], waited_s: float) -> MembershipDecision:
        keep = tuple(survivors[:self.max_workers])
        admitted = tuple(joiners[:self.max_workers - len(keep)])
        total = len(keep) + len(admitted)
        if total < self.min_workers:
            return self._wait_or_fail(len(keep), len(admitted), waited_s)
        return MembershipDecision(Action.REFORM, (*keep, *admitted),
                                  reason=f"{len(keep)} survivor(s), {len(admitted)} joiner(s)")

    def _wait_or_fail(self, alive: int, joiners: int, waited_s: float) -> MembershipDecision:
        have = alive + joiners
        if waited_s < self.wait_timeout_s:
            return MembershipDecision(Action.WAIT, reason=(
                f"{have} of the {self.min_workers} workers needed are available; waiting up to "
                f"{self.wait_timeout_s:.0f} s for capacity"))
        return MembershipDecision(Action.FAIL, reason=(
            f"only {have} workers available after waiting {waited_s:.0f} s, below the minimum of "
            f"{self.min_workers}: lower MIN in --workers MIN:MAX, add capacity, or raise --min-wait-timeout"))


POLICIES: dict[str, type] = {"elastic": ElasticPolicy}
"""The membership policies, by name (``Membership(policy=...)``)."""
