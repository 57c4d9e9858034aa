"""The coordinator: the state machine that drives a run.

``run()`` repeats one iteration until a terminal state; each iteration calls the handler
of the current state, which acts and returns the next state with its reason::

    STARTING -> RUNNING -> FINISHING -> FINISHED
                RUNNING <-> SAVING                      (a checkpoint is due)
                RUNNING <-> EVALUATING                  (an evaluation is due: --eval-every)
                RUNNING  -> RESIZING -> RUNNING         (joiners admitted at a step boundary)
    (a member lost) -> RECOVERING -> REFORMING -> RUNNING
                       RECOVERING <-> WAITING           (below MIN: wait for capacity)
                       RECOVERING -> RESTORING -> RUNNING   (no copy of the state survived)
                       REFORMING  -> RESTORING          (a ZeRO chunk and its snapshot were lost)
    (any) -> FAILED

It asks ``Membership`` who is in the group and delegates how to train to the training
mode: a mode call that loses workers raises ``MembersLost``, which from any state leads
to RECOVERING. A loss while re-forming or restoring is one more failure of the same
recovery: membership decides again and the mode re-forms from what survived. The
coordinator holds no tensors and imports neither Ray nor torch; it can be driven with
a fake mode and a fake pool (tests/test_coordinator.py).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from elastic_dp.config import CheckpointConfig, TrainConfig
from elastic_dp.control.membership import Action, Membership, MembershipDecision
from elastic_dp.data import check_resumable, check_same_run
from elastic_dp.errors import Interrupted, MembershipError
from elastic_dp.faults import FaultPlan
from elastic_dp.modes.base import Failure, MembersLost, Recovery, RecoveryResult, TrainingMode
from elastic_dp.observe.metrics import RunRecorder, RunSummary

logger = logging.getLogger(__name__)

LEAVE_MARGIN_S = 2.0
"""A planned leave waits for the step in flight to commit unless its deadline is nearer than
this: then the step is aborted (and re-run over the rest) so that the leavers are stopped
before their node goes. It covers the abort, and the re-formation of a leave that came
just before it."""


class RunState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    SAVING = "saving"
    EVALUATING = "evaluating"
    RESIZING = "resizing"
    RECOVERING = "recovering"
    WAITING = "waiting"
    REFORMING = "reforming"
    RESTORING = "restoring"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED)


@dataclass(frozen=True, slots=True)
class Transition:
    """The state the run moved to, and why."""

    state: RunState
    reason: str = ""


class Coordinator:
    """Drives one run from placement to the last committed step, through failures and joins.

    ``store`` is the durable checkpoint store (None: no checkpoints); ``checkpoint`` says
    when to save and whether to resume; ``train.steps`` is where the run ends. ``sleep``
    and ``poll_s`` pace the wait below MIN (membership's clock times it).
    """

    def __init__(self, mode: TrainingMode, membership: Membership, *, train: TrainConfig, recorder: RunRecorder,
                 faults: FaultPlan, store: Any | None = None, checkpoint: CheckpointConfig | None = None,
                 settings: dict[str, Any] | None = None, sleep: Callable[[float], None] = time.sleep,
                 poll_s: float = 0.2) -> None:
        self.mode, self.membership, self.train, self.steps = mode, membership, train, train.steps
        self.recorder, self.faults, self.store = recorder, faults, store
        self.ckpt_cfg = checkpoint or CheckpointConfig()
        self.settings = settings or {}
        """What makes this run this run (``config.run_settings``): a checkpoint resumed by
        ``--resume auto`` must have been saved with the same."""
        self.sleep, self.poll_s = sleep, poll_s
        self.state = RunState.STARTING
        self.history: list[Transition] = [Transition(RunState.STARTING)]
        self.step = 0
        self.save_due = False
        self._saved_step: int | None = None
        self.eval_due = False
        self._evaluated_step: int | None = None
        """The step after which the last evaluation ran (None: none yet)."""
        self._decision_event: dict | None = None
        self._pause_at: int | None = None  # run_until's step
        """The step of the last checkpoint committed or in flight (None: none)."""
        self.failure: Failure | None = None
        self.decision: MembershipDecision | None = None
        self._recovery_started = 0.0
        self._checkpoint_exists = False
        self._forced: dict[Any, Any] = {}
        """Members stopped before their leave deadline (member -> (``LeaveNotice``, when)): their
        loss is that leave."""
        self._standby: list = []  # the standby workers the mode was last told of
        self._closed = False
        self._handlers: dict[RunState, Callable[[], Transition]] = {
            RunState.STARTING: self._starting, RunState.RUNNING: self._running, RunState.SAVING: self._saving,
            RunState.EVALUATING: self._evaluating,
            RunState.RESIZING: self._resizing, RunState.RECOVERING: self._recovering,
            RunState.WAITING: self._waiting, RunState.REFORMING: self._reforming,
            RunState.RESTORING: self._restoring, RunState.FINISHING: self._finishing}

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Iterate until FINISHED (return the summary) or FAILED (raise the error). Ctrl-C
        (``KeyboardInterrupt``) stops the workers and raises ``Interrupted``, saying where the
        run stopped and how to go on; a checkpoint it was saving is deleted, not left half-written."""
        try:
            while not self.state.is_terminal:
                self.iterate()
            return self.recorder.finish()
        except KeyboardInterrupt:
            self.close()
            raise self._interrupted() from None
        finally:
            self.close()

    def _interrupted(self) -> Interrupted:
        where = f"after {self.step} committed step{'s' * (self.step != 1)} of {self.steps}"
        if self.store is None:
            return Interrupted(f"interrupted {where}; no checkpoint is kept (--checkpoint-dir and --checkpoint-every "
                               "keep one to go on from)")
        for name in self.store.discard_uncommitted():
            logger.info("deleted %s: a checkpoint the interrupt cut short", self.store.storage.url(name))
        latest = self.store.latest()
        if latest is None:
            return Interrupted(f"interrupted {where}; no checkpoint had been saved in {self.store.url}")
        again = ("run it again to go on from it (--storage resumes by itself)" if self.ckpt_cfg.resume == "auto"
                 else "go on from it with --resume")
        return Interrupted(f"interrupted {where}; the latest checkpoint is of step {latest.step}, {latest.url}: "
                           f"{again}")

    def iterate(self) -> None:
        """Run the current state's handler once and move to the state it returns."""
        try:
            try:
                transition = self._handlers[self.state]()
            except MembersLost as lost:
                transition = self._lost(lost)
        except BaseException as exc:
            self._move(Transition(RunState.FAILED, f"{type(exc).__name__}: {exc}"))
            raise
        self._move(transition)

    def run_until(self, step: int) -> None:
        """Iterate until ``step`` steps have committed (or the run ended). For benchmarks."""
        self._pause_at = step  # a window of steps ends there
        try:
            while not self.state.is_terminal and (self.step < step or self.state is not RunState.RUNNING):
                self.iterate()
        finally:
            self._pause_at = None

    def close(self) -> None:
        """Stop every worker (killing the actors releases their process groups with them),
        and whatever actors the mode has of its own (once)."""
        if self._closed:
            return
        self._closed = True
        self.mode.close()
        self.membership.close()

    def _move(self, transition: Transition) -> None:
        if transition.state is not self.state:
            logger.debug("coordinator: %s -> %s (%s)", self.state.value, transition.state.value, transition.reason)
            self.history.append(transition)
        self.state = transition.state
        if self.state.is_terminal:
            for fault, why in self.faults.unfired():
                self.recorder.event("fault_not_fired", fault=str(fault), reason=why)

    # -- states ----------------------------------------------------------------------------
    def _starting(self) -> Transition:
        resume = None
        if self.store is not None:
            resume = self._checkpoint_to_resume()  # verified before anything starts or is written
            self.store.check_writable()  # (after: a --resume with nothing to resume creates no directory)
        members = self.membership.place()
        try:
            self.step = self.mode.start(members, resume)
        except MembersLost as lost:
            raise MembershipError(f"a worker failed while the run was starting ({lost.cause}); start it "
                                  "again") from None
        self.membership.admit(members)
        if self._decision_event is not None:  # recorded once the checkpoint has loaded: a refused one writes nothing
            self.recorder.event("resume_decision", **self._decision_event)
        self.recorder.start(self.step)
        self._saved_step = resume.step if resume is not None else None
        return Transition(RunState.RUNNING, f"generation {self.mode.generation} formed at step {self.step}")

    def _checkpoint_to_resume(self) -> Any | None:
        """The checkpoint this run continues from, by ``--resume``: never, the latest
        (which must exist), or ``auto`` (the latest of this run's, if there is one)."""
        how = self.ckpt_cfg.resume
        if how == "never":
            return None
        found = self.store.load() if how == "latest" else self.store.latest()
        if found is not None:
            check_resumable(found.sampler, self.train)
            if how == "auto":
                check_same_run(found.manifest.get("settings", {}), self.settings, found.url)
        if how == "auto":
            if found is None:
                logger.info("--resume auto: no checkpoint of this run in %s: starting fresh", self.store.url)
            else:
                logger.info("--resume auto: continuing from %s (step %d)", found.url, found.step)
            self._decision_event = dict(resumed=found is not None, storage=self.store.url,
                                        step=found.step if found else 0, checkpoint=found.url if found else None)
        return found

    def _running(self) -> Transition:
        self._settle_saves()
        if self.eval_due or (self.step >= self.steps and self.train.eval_every and self.steps
                             and self._evaluated_step != self.step):
            return Transition(RunState.EVALUATING, f"evaluation due after step {self.step}")
        if self.save_due:
            return Transition(RunState.SAVING, f"checkpoint due after step {self.step}")
        if self.step >= self.steps:
            if self.store is not None and self._saved_step != self.step:
                return Transition(RunState.SAVING, "final checkpoint")
            return Transition(RunState.FINISHING, f"{self.step} steps committed")
        joins = self.faults.joins_due(self.step)
        if joins:  # an injected join happens at its step: wait for the worker to be ready
            self.membership.grow(joins)
        decision = self.membership.at_step_boundary()
        if decision.action is Action.REFORM:
            self.decision = decision
            return Transition(RunState.RESIZING, decision.reason)
        standby = self.membership.standby
        if standby != self._standby:  # the policy keeps other workers ready beside the group now
            self._standby = standby
            self.mode.standby(list(standby))
        self.step = self.mode.advance(self.step, self._window_limit(), self._keep_going, self.membership.arrivals)
        self.save_due, self.eval_due = self._due(self.step), self._eval_due(self.step)
        return Transition(RunState.RUNNING)

    def _window_limit(self) -> int:
        """Where the next window of steps must end at the latest: the last step, the next
        checkpoint, the next injected join."""
        limit = self.steps if self._pause_at is None else min(self.steps, max(self._pause_at, self.step + 1))
        every = self.ckpt_cfg.every
        if self.store is not None and every:
            limit = min(limit, (self.step // every + 1) * every)
        if self.train.eval_every:
            limit = min(limit, (self.step // self.train.eval_every + 1) * self.train.eval_every)
        join = self.faults.next_join(self.step)
        return min(limit, join) if join is not None else limit

    def _keep_going(self) -> bool:
        """Between two steps of a window (and at each wake-up in one): no worker is waiting
        to join or to leave. A leave whose deadline is too near for the window to reach its
        next boundary is forced now (``_force_out``)."""
        decision = self.membership.at_step_boundary()
        self._force_out()
        return decision.action is Action.CONTINUE

    def _force_out(self) -> None:
        """Members whose leave deadline is under ``LEAVE_MARGIN_S`` away are stopped now:
        the step in flight fails over them and is re-run on the same samples, before their
        node goes (``_lost`` names the notice as the cause)."""
        for member, notice in self.membership.overdue(LEAVE_MARGIN_S).items():
            if member not in self._forced:
                now = time.time()
                logger.warning("%r: %s: too near for a step boundary, aborting the step in flight", member,
                               notice.describe(now))
                self._forced[member] = (notice, now)
                self.membership.force_out(member)

    def _evaluating(self) -> Transition:
        """Evaluate with the parameters after ``step`` committed steps. A loss of workers
        here re-runs the evaluation once the group re-formed, never a training step."""
        loss, samples = self.mode.evaluate(self.step)
        self.recorder.evaluation(self.step - 1, loss, samples)
        self.eval_due, self._evaluated_step = False, self.step
        return Transition(RunState.RUNNING, f"evaluated after step {self.step}: loss {loss:.4f} over {samples}")

    def _saving(self) -> Transition:
        self.mode.save(self.store, self.step)
        self.save_due, self._saved_step = False, self.step
        self._settle_saves()
        if self.step >= self.steps:
            return Transition(RunState.FINISHING, f"checkpoint of the last step {self.step} started")
        return Transition(RunState.RUNNING, f"checkpoint of step {self.step} started")

    def _settle_saves(self, wait: bool = False) -> None:
        """Record the saves that ended; one abandoned (a member lost while writing its part)
        is started again if no step has committed since."""
        for save in self.mode.settle_saves(wait):
            if save.error is None:
                self.recorder.event("checkpoint_saved", step=save.step, path=save.url, stall_s=save.stall_s,
                                    save_s=save.save_s, bytes=save.bytes)
                continue
            self.recorder.event("checkpoint_abandoned", step=save.step, reason=save.error)
            if save.step == self.step and self._saved_step == self.step:
                self._saved_step, self.save_due = None, True

    def _resizing(self) -> Transition:
        start = time.monotonic()
        members = list(self.decision.members)
        ranked = list(self.mode.members)  # the generation in rank order (membership's is the policy's)
        before, after = set(ranked), set(members)  # a list's `in` made this N^2 at 1,024 members
        joined = [m for m in members if m not in before]
        left_ranks = [r for r, m in enumerate(ranked) if m not in after]
        left = [ranked[r] for r in left_ranks]
        promoted = self.membership.promoted(members)
        self.mode.resize(members)
        self.membership.admit(members)
        self.membership.release(left)  # let go after the state they held moved to the new generation
        extra: dict[str, Any] = {}
        if joined:
            extra["ready_to_join_s"] = round(time.time() - min(m.ready_time for m in joined), 4)
        if left:
            extra.update(left=len(left), left_ranks=left_ranks, leave="at_boundary", restored_step=self.step)
        self.recorder.event("membership_changed", step=self.step, cause=self.decision.reason,
                            generation=self.mode.generation,
                            world_size=len(members), joined=len(joined), promoted=len(promoted), lost=0,
                            reform_s=round(time.monotonic() - start, 4), steps_rerun=0, **extra)
        return Transition(RunState.RUNNING, f"generation {self.mode.generation} formed over {len(members)}")

    def _recovering(self) -> Transition:
        survivors = self.failure.survivors or self._copy_holders()
        decision = self.membership.after_failure(survivors, has_checkpoint=self._checkpoint_exists)
        if decision.action is Action.FAIL:
            raise MembershipError(decision.reason)
        if decision.action is Action.WAIT:
            if not self.failure.waited:
                logger.warning("gen %d step %d: %s", self.mode.generation, self.step, decision.reason)
                self.failure.waited = True
            return Transition(RunState.WAITING, decision.reason)
        self.decision = decision
        if decision.action is Action.RESTORE:
            return Transition(RunState.RESTORING, decision.reason)
        return Transition(RunState.REFORMING, decision.reason)

    def _copy_holders(self) -> list:
        """Where every member was lost: the spares that hold a copy of the state
        (``TrainingMode.state_copies``), newest first, unless the checkpoint is newer. The
        policy keeps them as it keeps survivors, and the mode goes back to their state."""
        copies = {w: step for w, step in self.mode.state_copies().items() if w in self.membership.joiners}
        if not copies:
            return []
        latest = self.store.latest() if self.store is not None else None
        if latest is not None and latest.step > max(copies.values()):
            return []
        return sorted(copies, key=lambda w: -copies[w])

    def _waiting(self) -> Transition:
        self.sleep(self.poll_s)
        return Transition(RunState.RECOVERING, "looking for capacity again")

    def _reforming(self) -> Transition:
        members = list(self.decision.members)
        promoted = self.membership.promoted(members)
        result = self.mode.reform(members, self.failure)
        if result.outcome is Recovery.STATE_LOST:
            if self.store is not None and not self._checkpoint_exists:  # a save may be committing now
                self._settle_saves(wait=True)
                self._checkpoint_exists = self.store.latest() is not None
            if not self._checkpoint_exists:
                raise MembershipError(f"{result.reason}, and there is no durable checkpoint: pass "
                                      "--checkpoint-dir and --checkpoint-every so a run can recover from this")
            logger.warning("gen %d step %d: %s: restarting from the latest checkpoint", self.mode.generation,
                           self.failure.step, result.reason)
            self.decision = MembershipDecision(Action.RESTORE, tuple(members), result.reason)
            return Transition(RunState.RESTORING, result.reason)
        self.membership.admit(members)
        survivors = set(self.failure.survivors)
        self._event_changed("membership_changed", result, step=result.step, **result.details,
                            joined=sum(m not in survivors for m in members), promoted=len(promoted))
        self._go_to(result.step)
        return Transition(RunState.RUNNING, f"{result.outcome.value}: step {result.step} is next")

    def _restoring(self) -> Transition:
        self._settle_saves(wait=True)
        checkpoint = self.store.load()
        members = list(self.decision.members)
        self.mode.restore(members, checkpoint)
        self.membership.admit(members)
        self._event_changed("restored_from_checkpoint", RecoveryResult(Recovery.ROLLED_BACK, checkpoint.step),
                            step=checkpoint.step, checkpoint=checkpoint.url)
        self._go_to(checkpoint.step)
        self._saved_step = checkpoint.step
        return Transition(RunState.RUNNING, f"restored the checkpoint of step {checkpoint.step}")

    def _finishing(self) -> Transition:
        self._settle_saves(wait=True)  # the last checkpoint is committed before the run ends
        if self.store is not None and self._saved_step != self.step:
            return Transition(RunState.SAVING, "the final checkpoint was abandoned: saving it again")
        self.mode.finish()
        return Transition(RunState.FINISHED, f"{self.step} steps")

    # -- failures --------------------------------------------------------------------------
    def _lost(self, lost: MembersLost) -> Transition:
        """Workers were lost in the current state: the failure to recover from."""
        if self.state in (RunState.REFORMING, RunState.RESTORING):  # one more failure of this recovery
            self.failure.survivors = lost.survivors
            self.failure.lost += lost.lost
            self.failure.attempts += 1
            self.recorder.event("reform_interrupted", cause=lost.cause, during=self.state.value,
                                generation=self.mode.generation, lost=len(lost.lost), lost_ranks=lost.lost_ranks,
                                detect_s=round(lost.detect_s, 4))
        else:
            if lost.step is not None:  # a window committed the steps before this one
                self.step = lost.step
            cause, leave = lost.cause, None
            injected = self.faults.explain(self.step, lost.lost_ranks)
            if injected is not None:  # the loss was asked for: say so first (the summary's line is cut short)
                cause = f"the injected fault {injected} (--inject), found by: {cause}"
            forced = [self._forced[m] for m in lost.lost if m in self._forced]
            if forced:
                notice, at = forced[0]
                cause = f"{notice.describe(at)}: too near for a step boundary; the step in flight was aborted"
                leave = {"leave": "aborted", "stopped_before_deadline_s": round(notice.deadline - at, 4)}
            self.failure = Failure(step=self.step, in_flight=self.state is RunState.RUNNING,
                                   survivors=lost.survivors, lost=lost.lost, lost_ranks=lost.lost_ranks,
                                   cause=cause, detect_s=lost.detect_s, during=self.state.value, leave=leave)
            self._recovery_started = time.monotonic()
        self.membership.lose(lost.lost)
        for member in lost.lost:
            self._forced.pop(member, None)
        self._checkpoint_exists = self.store is not None and self.store.latest() is not None
        logger.warning("gen %d step %d (%s): %s; lost ranks %s", self.mode.generation, self.step,
                       self.state.value, lost.cause, lost.lost_ranks)
        return Transition(RunState.RECOVERING, lost.cause)

    def _go_to(self, step: int) -> None:
        """Continue at ``step``: after a step that counted, or back at an earlier one whose
        steps from there on are trained (and recorded) again."""
        if step < self.step:
            self.recorder.rewind(step)
            self.save_due = self.eval_due = False
        elif step > self.step:
            self.save_due, self.eval_due = self._due(step), self._eval_due(step)
        self.step, self.failure = step, None

    def _due(self, step: int) -> bool:
        """A checkpoint is due once ``step`` steps have committed."""
        every = self.ckpt_cfg.every
        return self.store is not None and bool(every) and step % every == 0

    def _eval_due(self, step: int) -> bool:
        """An evaluation is due once ``step`` steps have committed (the last: ``_running``)."""
        every = self.train.eval_every
        return bool(every) and step > 0 and step % every == 0 and self._evaluated_step != step

    def _event_changed(self, kind: str, result: RecoveryResult, **extra: Any) -> None:
        f = self.failure
        self.recorder.event(kind, **extra, cause=f.cause, decision=self.decision.reason,
                            generation=self.mode.generation, world_size=len(self.decision.members),
                            lost=len(f.lost), lost_ranks=f.lost_ranks, detect_s=round(f.detect_s, 4),
                            reform_s=round(time.monotonic() - self._recovery_started, 4),
                            steps_rerun=f.step + f.in_flight - result.step, attempts=f.attempts,
                            **(f.leave or {}))
