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

from typing import Any, Callable, Protocol

from elastic_dp.durable.checkpoint import Checkpoint
from elastic_dp.faults import Fault
from elastic_dp.messages import StepResult
from elastic_dp.modes.base import Failure, Recovery, RecoveryResult, classify
from elastic_dp.modes.calls import raise_for
from elastic_dp.modes.sync.generations import Generations
from elastic_dp.settings import implementation
from elastic_dp.state.zero.settings import Stage


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


class ReplicatedLayout:
    """ZeRO stage 0: every member holds the whole state.

    After a failure each survivor holds the state before the failed step, or after it if
    the step committed there (it died after the vote). The newest one is copied, through
    Ray's object store, to every member that does not hold it (joiners have no optimizer
    state to receive a broadcast into); the group is formed after the copy. A failure in
    the middle leaves each member with a state this layout knows, so the next attempt
    starts from what is then the newest.
    """

    def __init__(self, generations: Generations, sampler_state: Callable[[], dict[str, int]]) -> None:
        self.gens = generations
        self.sampler_state = sampler_state
        self.at: dict[Any, int] = {}
        """The state step each member holds (members without state are absent)."""

    def started(self, step: int) -> None:
        self.at = {m: step for m in self.gens.members}

    def stepped(self, step: int, results: dict[Any, StepResult]) -> None:
        for member, result in results.items():
            self.at[member] = step + 1 if result.committed else step

    def reform(self, members: list[Any], failure: Failure, faults: dict[int, Fault]) -> RecoveryResult:
        holders = [m for m in failure.survivors if m in self.at]
        if not holders:
            return RecoveryResult(Recovery.STATE_LOST, reason="no surviving worker holds the training state")
        source = max(holders, key=self.at.__getitem__)  # the first of the newest, in rank order
        step = self.at[source]
        self._spread(members, source, faults)
        return RecoveryResult(classify(failure, step), step)

    def resize(self, members: list[Any]) -> None:
        self._spread(members, self.gens.members[0], {})

    def _spread(self, members: list[Any], source: Any, faults: dict[int, Fault]) -> None:
        step = self.at[source]
        needs = [m for m in members if self.at.get(m) != step]
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


def make_layout(stage: Stage, generations: Generations, sampler_state: Callable[[], dict[str, int]]) -> StateLayout:
    """The layout ``stage``'s part names (``Stage.layout``)."""
    return implementation(stage.layout)(generations, sampler_state)
