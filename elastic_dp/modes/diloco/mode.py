"""DiLoCo and local SGD (``--mode diloco``), driver side: windows of one outer step.

The members' collective group, the start, the record of the steps, the evaluation, the
saves and the weights files are the collective run's (``modes.collective``, which the
synchronous mode holds too; stage 0: every member holds the whole model). A window is one outer
step: the ``sync_every`` inner steps from an outer boundary (the run's last outer step
syncs the ones it has), granted in one call per member (``DiLoCoProgram.window``); its
steps commit together when every member returns from the outer all-reduce. Membership
changes only at outer boundaries: a window that loses a member is re-run whole, from the
state at its start, over the new membership (its samples re-split: exactly-once), and
the windows before it stay committed. A joiner takes θ and the outer optimizer's state
from rank 0 and starts its inner optimizer fresh (docs/diloco.md).
"""

from __future__ import annotations

from typing import Any, Callable

from elastic_dp.durable.checkpoint import Checkpoint
from elastic_dp.faults import STEP_PHASES
from elastic_dp.modes.base import Failure, MembersLost, Recovery, RecoveryResult
from elastic_dp.modes.collective import CollectiveRun, OnCollectiveRun
from elastic_dp.modes.context import ModeContext


class DiLoCoMode(OnCollectiveRun):
    """DiLoCo over one collective group per generation (``TrainingMode``). A restart from a
    checkpoint is the collective run's: every member loads θ and the outer state (and, at the
    saved world size, its own inner state) through its program."""

    def __init__(self, context: ModeContext) -> None:
        context.train.mode.check_run(context.train, context.cluster, context.checkpoint)  # outer boundaries
        self.train, self.recorder, self.faults = context.train, context.recorder, context.faults
        self.run = CollectiveRun(context)
        self.gens = self.run.gens
        self.every = context.train.mode.sync_every

    def start(self, members: list[Any], resume: Checkpoint | None) -> int:
        step = super().start(members, resume)
        self.gens.call_all("call", "sync_from", 0, step)  # θ_0: rank 0's model, which every member now has
        return step

    # -- the windows -------------------------------------------------------------------------
    def advance(self, step: int, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True,
                wake: Callable[[], list] = list) -> int:
        """Whole outer steps from outer boundary ``step``, while ``step < limit`` (each
        window runs to its end: a limit inside one is reached at its end) and
        ``keep_going()``; a loss raises ``MembersLost`` naming the window's start."""
        limit = step + 1 if limit is None else limit
        while step < limit:
            stop = min(step + self.every, self.train.steps)
            step = self._window(step, stop)
            if not keep_going():
                break
        return step

    def _window(self, start: int, stop: int) -> int:
        members = self.members
        taken = {s: self.faults.take_step(s, len(members), STEP_PHASES) for s in range(start, stop)}
        faults = [{s: f[r] for s, f in taken.items() if r in f} for r in range(len(members))]
        calls = {m.actor.call.remote("window", start, stop, self.run.sampler_state(), faults[r]): m
                 for r, m in enumerate(members)}
        try:
            reports = self.gens.run(members, calls)
        except MembersLost as lost:
            self.faults.put_back(f for r, m in enumerate(members) if m not in lost.lost for f in faults[r].values())
            raise MembersLost(lost.group, lost.lost, lost.cause, lost.detect_s, step=start) from None
        seconds = max(r["seconds"] for r in reports.values()) / (stop - start)
        for i, s in enumerate(range(start, stop)):
            results = [reports[m]["steps"][i] for m in members]  # each member's StepResult of inner step s
            for result in results:
                result.step_s = seconds
            self.run.record(s, results)
        for outer in reports[members[0]]["outer"]:  # a fragment's outer step each (one unless streaming)
            self.recorder.event("outer_step", step=outer["step"], generation=self.generation,
                                fragment=outer["fragment"], sent_step=outer["sent_step"], bytes_sent=outer["bytes"],
                                pseudo_gradient_norm=round(outer["pseudo_gradient_norm"], 6))
        return stop

    # -- membership changes, at outer boundaries -----------------------------------------------
    def resize(self, members: list[Any]) -> None:
        step = self._held(self.members)
        self._form(members, step)

    def reform(self, members: list[Any], failure: Failure) -> RecoveryResult:
        """The survivors go back to the outer boundary ``failure.step`` (a window some of
        them completed is undone: it committed nowhere), then the new generation forms and
        takes rank 0's θ and outer state."""
        survivors = [m for m in members if m in failure.survivors]
        self.gens.run(survivors, {m.actor.call.remote("restore", failure.step): m for m in survivors})
        self._form(members, failure.step)
        outcome = Recovery.RERUN if failure.in_flight else Recovery.COMMITTED
        return RecoveryResult(outcome, step=failure.step)

    def _held(self, members: list[Any]) -> int:
        held = set(self.gens.run(members, {m.actor.call.remote("held"): m for m in members}).values())
        if len(held) != 1:
            raise RuntimeError(f"the members hold theta of different steps {sorted(held)} at an outer boundary")
        return held.pop()

    def _form(self, members: list[Any], step: int) -> None:
        """The next generation over ``members``: the ones that held θ first, in their rank
        order (rank 0's θ is sent), then the joiners."""
        kept, before = set(members), set(self.members)
        members = [m for m in self.members if m in kept] + [m for m in members if m not in before]
        self.gens.form(self.run.rank_order(members))
        self.gens.call_all("call", "sync_from", 0, step)
