"""Where the synchronous mode's training state lives, and how it moves when members change.

A layout is chosen once, the one the ZeRO stage's part names (``make_layout``,
``Stage.layout``). The mode asks it to carry the state over every change of members — a
re-formation after a failure, a resize that admits joiners, a restart from the durable
checkpoint — and to collect the checkpoint's parts. It is given the members in their rank
order, which is decided in one place (``CollectiveRun.rank_order``). ``ReplicatedLayout`` (stage 0) is
here; ``ShardedLayout`` (stages 1 to 3, whose state is cut into chunks alike) is in
``.sharded``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import ray

from elastic_dp.comm.feedback import lost_errors
from elastic_dp.durable.checkpoint import Checkpoint
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult
from elastic_dp.modes.base import Failure, Recovery, RecoveryResult, classify
from elastic_dp.modes.calls import raise_for
from elastic_dp.modes.sync.generations import Generations
from elastic_dp.settings import implementation
from elastic_dp.state.zero.settings import Stage, Stage0

logger = logging.getLogger(__name__)


class StateLayout(Protocol):
    """The synchronous mode's state, seen from the coordinator (no tensors)."""

    def started(self, step: int) -> None:
        """Every member of the current generation holds the state after ``step`` steps."""

    def stepped(self, step: int, results: dict[Any, StepResult]) -> None:
        """An attempt at step ``step`` returned ``results`` (those members are alive)."""

    def reform(self, members: list[Any], failure: Failure, faults: dict[int, Fault]) -> RecoveryResult:
        """Form the next generation over ``members`` with the newest state that survived."""

    def resize(self, members: list[Any]) -> None:
        """Between steps: form the next generation over ``members`` (current ones + joiners)."""

    def load(self, checkpoint: Checkpoint) -> None:
        """Every member of the current generation reads and loads ``checkpoint``."""

    def restore(self, members: list[Any], checkpoint: Checkpoint) -> None:
        """Form the next generation over ``members`` and load ``checkpoint`` into it."""

    def before_window(self, step: int, limit: int, standby: list[Any]) -> int:
        """Before a window from ``step`` (every member holds the state after ``step`` steps),
        with ``standby`` the workers ready beside the group (spares): a layout may copy the
        state to them. Returns where the window must end at the latest (``limit`` or sooner)."""

    def copies(self) -> dict[Any, int]:
        """Workers outside the group that hold a whole copy of the state: the step of each."""


class ReplicatedLayout:
    """ZeRO stage 0: every member holds the whole state.

    After a failure each survivor holds the state before the failed step, or after it if
    the step committed there (it died after the vote). The newest one is copied, through
    Ray's object store, to every member that does not hold it (joiners have no optimizer
    state to receive a broadcast into); the group is formed after the copy. A failure in
    the middle leaves each member with a state this layout knows, so the next attempt
    starts from what is then the newest.

    The spares standing by beside the group (``--spares``) are sent a copy of the state
    every ``--spare-copy-every`` steps, at the start of a window: rank 0 puts its state in
    the object store (the members wait for that alone) and each spare loads it while the
    window trains (one still loading the previous copy loads this one when that ends). A
    spare promoted at the step its copy holds is sent nothing; and where every member is
    lost at once, the spares' copies are the state that survived: the
    newest is spread from its spare and the steps since are re-run (``ROLLED_BACK``).
    """

    def __init__(self, generations: Generations, sampler_state: Callable[[], dict[str, int]],
                 stage: Stage0 | None = None, compressed: bool = False) -> None:
        self.gens = generations
        self.sampler_state = sampler_state
        self.copy_every = stage.spare_copy_every if stage is not None else 0
        self.compressed = compressed
        """The gradients are compressed with error feedback (``--compress``): a re-formation
        asks the survivors whether every lost worker's error has its copy among them."""
        self.at: dict[Any, int] = {}
        """The state step each member holds (members without state are absent)."""
        self._copies: dict[Any, int] = {}  # spare -> the step of the copy it loaded
        self._loading: dict[Any, tuple[Any, int]] = {}  # spare -> (its load_state ref, the copy's step)
        self._next: dict[Any, tuple[Any, int]] = {}
        """spare -> (the state's ref, its step): the newest copy, put while the spare was still
        loading an earlier one; it loads it when that ends (the actor is threaded, so two
        loads at once could end in either order)."""

    def started(self, step: int) -> None:
        self.at = {m: step for m in self.gens.members}

    def stepped(self, step: int, results: dict[Any, StepResult]) -> None:
        for member, result in results.items():
            self.at[member] = step + 1 if result.committed else step

    def reform(self, members: list[Any], failure: Failure, faults: dict[int, Fault]) -> RecoveryResult:
        holders = [m for m in failure.survivors if m in self.at]
        if self.compressed and holders:
            asked = self.gens.run(holders, {m.actor.call.remote("reduction_holdings"): m for m in holders})
            lost = lost_errors(list(asked.values()))
            if lost:
                return RecoveryResult(Recovery.STATE_LOST, reason=(
                    f"the --compress error feedback of {lost} lost worker(s) went with the neighbour that held its "
                    "copy (a host, or two neighbours, lost together)"))
        details: dict[str, Any] = {}
        if not holders and self.compressed:  # a spare's copy holds the model's state, not the members' errors
            return RecoveryResult(Recovery.STATE_LOST, reason=(
                "every worker was lost, and with them the --compress error feedback, which a spare's copy does not "
                "hold"))
        if not holders:  # every member lost: a spare's copy is what survived, if any
            self._settle(wait=True)
            holders = [m for m in members if m in self._copies]
            if not holders:
                return RecoveryResult(Recovery.STATE_LOST, reason="no surviving worker holds the training state")
            self.at.update({m: self._copies[m] for m in holders})
            details["state_from"] = "spare"
        source = max(holders, key=self.at.__getitem__)  # the first of the newest, in rank order
        step = self.at[source]
        sent = self._spread(members, source, faults)
        if details:
            details["restored_step"] = step
        return RecoveryResult(classify(failure, step), step, details={**details, "state_sent": sent})

    def resize(self, members: list[Any]) -> None:
        self._spread(members, self.gens.members[0], {})

    def before_window(self, step: int, limit: int, standby: list[Any]) -> int:
        if not self.copy_every or not standby:
            return limit
        self._settle()
        self._copies = {s: at for s, at in self._copies.items() if s in standby}  # a lost spare's went with it
        if step % self.copy_every == 0:
            behind = [s for s in standby if self._copies.get(s) != step]
            if behind:
                self._copy(step, behind)
        return min(limit, (step // self.copy_every + 1) * self.copy_every)

    def copies(self) -> dict[Any, int]:
        """Asked where every member was lost: the copies in flight are waited for, the
        newest state that survived may be one of them."""
        self._settle(wait=True)
        return dict(self._copies)

    def _copy(self, step: int, spares: list[Any]) -> None:
        """Rank 0's state after ``step`` steps to ``spares``: the members wait until it is in
        the object store; the spares load it in the background (``_settle``), a spare still
        loading an earlier copy once that one ends."""
        source = self.gens.members[0]
        meta, state = source.actor.share_state.remote(step, self.sampler_state())
        self.gens.run(self.gens.members, {meta: source})
        for spare in spares:
            if spare in self._loading:
                self._next[spare] = (state, step)  # replaces a newer copy not started: one waits at most
            else:
                self._load(spare, state, step)

    def _load(self, spare: Any, state: Any, step: int) -> None:
        self._copies.pop(spare, None)  # its copy is being replaced
        self._loading[spare] = (spare.actor.load_state.remote(state), step)

    def _settle(self, wait: bool = False) -> None:
        """Take the spares' loads that finished and start the copies that waited for them
        (``wait``: until none is in flight, a hung spare found as a hung member is); a spare
        whose load failed holds no copy and starts no other (its loss is the membership's
        to find)."""
        while self._loading:
            refs = {ref: spare for spare, (ref, _) in self._loading.items()}
            if wait:
                outcome = self.gens.calls.gather(refs, self.gens.generation, what="a copy of the state to a spare")
                loaded, ended = set(outcome.results), list(refs)
            else:
                ended, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                loaded = set()
                for ref in ended:
                    try:
                        ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - any failure of the spare: no copy
                        logger.info("%r: a copy of the state did not load (%s)", refs[ref], exc)
                    else:
                        loaded.add(refs[ref])
            started = False
            for ref in ended:
                spare = refs[ref]
                _, step = self._loading.pop(spare)
                waiting = self._next.pop(spare, None)
                if spare not in loaded:
                    continue
                self._copies[spare] = step
                if waiting is not None:
                    self._load(spare, *waiting)
                    started = True
            if not (wait and started):
                return

    def _spread(self, members: list[Any], source: Any, faults: dict[int, Fault]) -> int:
        """The state of ``source`` to every member of ``members`` that does not hold it (a
        spare holding a copy of that step is sent nothing), then the next generation formed
        over them. Returns how many were sent it."""
        step = self.at[source]
        if any(spare in members for spare in self._loading):
            self._settle(wait=True)  # a spare promoted while loading a copy: the copy may be this step's
        needs = [m for m in members if self.at.get(m, self._copies.get(m)) != step]
        if needs:
            meta, state = source.actor.share_state.remote(step, self.sampler_state())
            group = members if source in members else [source, *members]  # who survives if it dies
            self.gens.run(group, {meta: source})  # the source is alive until it shared
            loaded = self.gens.calls.gather({m.actor.load_state.remote(state): m for m in needs},
                                            self.gens.generation)
            self.at.update({m: step for m in loaded.results})
            raise_for(members, loaded)
        self.gens.form(members, faults)
        self.at = {m: step for m in members}
        for member in members:  # promoted: a member now, its copy is the state
            self._copies.pop(member, None)
        return len(needs)

    def load(self, checkpoint: Checkpoint) -> None:
        self.at = {}  # members that loaded the checkpoint hold its state; the others, no known one
        members = self.gens.members
        loaded = self.gens.calls.gather({m.actor.load_checkpoint.remote(checkpoint): m for m in members},
                                        self.gens.generation)
        self.at.update({m: checkpoint.step for m in loaded.results})
        raise_for(members, loaded)

    def restore(self, members: list[Any], checkpoint: Checkpoint) -> None:
        self.gens.form(members)
        self.load(checkpoint)


def make_layout(stage: Stage, generations: Generations, sampler_state: Callable[[], dict[str, int]],
                compressed: bool = False) -> StateLayout:
    """The layout ``stage``'s part names (``Stage.layout``); ``compressed``: with ``--compress``."""
    return implementation(stage.layout)(generations, sampler_state, stage, compressed=compressed)
