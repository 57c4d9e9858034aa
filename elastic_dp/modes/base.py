"""What the coordinator needs from a training mode, and the records they exchange.

A training mode is how a run trains: synchronous data parallelism (``modes.sync``) today,
asynchronous parameter servers next. It is chosen once from the configuration
(``modes.make_mode``); the coordinator drives any mode through the same calls and never
branches on which one it has. A call that loses workers raises ``MembersLost``; the
coordinator turns it into a ``Failure``, asks membership what to do, and hands the
decision back to the mode (``reform`` or ``restore``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


class MembersLost(Exception):
    """Workers died or hung during a mode's call (a step, a re-formation, a save).

    Not an error of the run: the coordinator recovers from it. ``group`` is the list of
    members the call was made on, in rank order.
    """

    def __init__(self, group: Sequence[Any], lost: Sequence[Any], cause: str, detect_s: float = 0.0,
                 step: int | None = None, reports: dict[Any, Any] | None = None) -> None:
        super().__init__(cause)
        self.group, self.lost = list(group), list(dict.fromkeys(lost))  # a member may have had two calls
        self.cause, self.detect_s = cause, detect_s
        self.step = step
        """The step the loss interrupted, when it came in a window of steps (the ones before
        it committed); None: the coordinator's current step."""
        self.reports = dict(reports or {})
        """The survivors' reports of that step, by member (a window's)."""

    @property
    def survivors(self) -> list[Any]:
        return [m for m in self.group if m not in self.lost]

    @property
    def lost_ranks(self) -> list[int]:
        return sorted(self.group.index(m) for m in self.lost if m in self.group)


@dataclass(slots=True)
class Failure:
    """The failure being recovered from. Workers lost while re-forming are failures of the
    same recovery: they update ``survivors``, ``lost`` and ``attempts``; the rest stays the
    first failure's (``step`` and ``in_flight`` say which state the run must get back to)."""

    step: int
    """Committed steps when it happened: the state every member held before it."""
    in_flight: bool
    """Whether step ``step`` was being trained (it may have committed on some members)."""
    survivors: list[Any]
    """The rest of the group that was running or forming last, in rank order."""
    lost: list[Any]
    """Every member lost in this recovery."""
    lost_ranks: list[int]
    """The first failure's lost ranks, in the generation that was training."""
    cause: str
    """The first failure signal, in words."""
    detect_s: float = 0.0
    during: str = "step"
    """What the run was doing: the coordinator state the first failure happened in."""
    attempts: int = 1
    """Failures in this recovery (2 or more: workers were lost while re-forming)."""
    waited: bool = False
    """Whether the run has waited below MIN in this recovery."""
    leave: dict[str, Any] | None = None
    """The lost members were stopped before their leave deadline (the leave could not wait
    for a step boundary): the event's ``leave: aborted`` and how long before the deadline
    they were stopped; None: they failed."""


class Recovery(enum.Enum):
    """What a re-formation made of the interrupted run."""

    COMMITTED = "committed"
    """Nothing committed was lost: the interrupted step (if one was in flight) had
    committed, the run continues after it."""
    RERUN = "rerun"
    """The step in flight had not committed: it is re-run on the same samples."""
    ROLLED_BACK = "rolled_back"
    """The state is from an earlier step (a ZeRO snapshot): the steps since are replayed."""
    STATE_LOST = "state_lost"
    """No copy of some state survived: only the durable checkpoint can restore the run."""


@dataclass(frozen=True, slots=True)
class RecoveryResult:
    outcome: Recovery
    step: int = 0
    """The next step to run (the state step the new generation holds)."""
    reason: str = ""
    """Why, for STATE_LOST (which workers took the last copy with them)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Mode-specific fields for the membership_changed event (ZeRO: ``restored_step``)."""


def classify(failure: Failure, state_step: int) -> Recovery:
    """COMMITTED, RERUN or ROLLED_BACK for a new generation that holds ``state_step``."""
    if state_step == failure.step + failure.in_flight:
        return Recovery.COMMITTED
    if failure.in_flight and state_step == failure.step:
        return Recovery.RERUN
    return Recovery.ROLLED_BACK


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    """A save that ended: committed (``url``) or abandoned (``error``)."""

    step: int
    url: str | None
    stall_s: float
    """How long training waited for it (the copy into host memory; the whole save when
    it is synchronous)."""
    save_s: float
    """From the start of the save to its commit."""
    bytes: int
    error: str | None = None


class TrainingMode(Protocol):
    """How a run trains. Every call that involves workers may raise ``MembersLost``."""

    generation: int
    """The current generation (reported in events)."""
    members: list[Any]
    """The current generation's members, in rank order."""

    def start(self, members: Sequence[Any], resume: Any | None) -> int:
        """Start ``members`` from the checkpoint ``resume`` or from rank 0's fresh model;
        write the initial weights; return the first step to run."""

    def advance(self, step: int, limit: int | None = None, keep_going: Callable[[], bool] = lambda: True,
                wake: Callable[[], list] = list) -> int:
        """Train from step ``step``, up to ``limit`` or an earlier step boundary once
        ``keep_going()`` says no; return the committed steps afterwards. ``wake()``: object
        refs whose completion may change ``keep_going``'s answer (a worker starting), to
        wait on beside the workers' calls. A loss of members raises ``MembersLost``
        naming the step it interrupted."""

    def resize(self, members: Sequence[Any]) -> None:
        """Between steps: continue on ``members`` (the current ones, plus joiners)."""

    def reform(self, members: Sequence[Any], failure: Failure) -> RecoveryResult:
        """After ``failure``: continue on ``members`` from the newest state that survived."""

    def restore(self, members: Sequence[Any], checkpoint: Any) -> None:
        """Restart ``members`` from the durable ``checkpoint``."""

    def save(self, store: Any, step: int) -> None:
        """Start a durable checkpoint of the state after ``step`` committed steps (the
        members' parts may be written in the background)."""

    def settle_saves(self, wait: bool = False) -> list[Any]:
        """The saves that ended since the last call (``SaveOutcome``: committed, with its
        location, or abandoned, with the reason); ``wait``: wait for the one in flight."""

    def evaluate(self, step: int) -> tuple[float, int]:
        """The mean of the task's loss over the eval set (``Task.eval_dataset``, its first
        ``--eval-batches`` global batches) with the parameters after ``step`` committed
        steps, and the samples it covered; the set is split over the members."""

    def finish(self) -> None:
        """Write the final weights (and the task's sample) once the last step committed."""

    def close(self) -> None:
        """Stop the mode's own actors, if it has any (the coordinator stops the workers)."""

    def standby(self, workers: Sequence[Any]) -> None:
        """Between steps: ``workers`` are ready beside the group, not members (the membership
        policy keeps them), as of now; a mode may keep them in step with the state (the
        synchronous mode at stage 0 copies it to them, ``--spare-copy-every``). Told
        whenever the set changes."""

    def state_copies(self) -> dict[Any, int]:
        """Workers standing by that hold a whole copy of the state, and the step of each: where
        every member is lost, the state that survived (none: the checkpoint's)."""
