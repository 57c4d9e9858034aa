"""Plain records that cross between the coordinator and the workers (no tensors)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from elastic_dp.faults import Fault


@dataclass(slots=True)
class StepResult:
    """One worker's report of one step."""

    step: int
    rank: int
    generation: int
    committed: bool
    """True when the update was applied: every rank's collectives completed and no rank
    recorded an error (the commit vote)."""
    loss_sum: float = 0.0
    """Sum over this worker's samples of the per-sample mean loss."""
    samples: int = 0
    grad_norm: float | None = None
    lr: float | None = None
    """The first param group's learning rate of the update (None: no update)."""
    loss_finite: bool = True
    """Every loss this worker computed in the step was finite."""
    nonfinite: bool = False
    """Some rank saw a non-finite loss or gradient: no rank applied the update (the step
    committed as a no-op)."""
    stop: bool = False
    """A rank was asked to end the window, and the vote of this step carried the request:
    every rank ends its window after this step."""
    timings: dict[str, float] = field(default_factory=dict)
    step_s: float | None = None
    """In a window: the worker's wall time from the end of its previous step (or the
    window's start) to the end of this one."""
    time: float | None = None
    """In a window: when the step ended on this worker (Unix seconds)."""
    error: BaseException | None = None
    state_bytes: dict[str, int] | None = None
    """The persistent bytes this worker holds (``Strategy.state_bytes``), measured at the
    first step of each generation it commits and sent with every committed step (a step's
    results can be lost with a peer); the driver's ``state_memory`` event is the first step
    of a generation whose every member's figures arrived."""


@dataclass(slots=True)
class WorkerInfo:
    """What a worker reports after building its task."""

    dataset_len: int
    num_params: int
    ready_time: float
    """Wall-clock time at which the worker finished building its task (ready to join)."""
    num_trainable: int = 0
    """Elements of the parameters the optimizer steps (what ``--mode async`` shards)."""
    node_id: str = ""
    """The Ray node the worker runs on."""
    node_ip: str = ""
    """That node's address (the ``mesh`` event's hosts)."""
    pid: int = 0
    """The worker's process on that node (the ``mesh`` event's pids)."""
    device_name: str = ""
    """The GPU's name (``torch.cuda.get_device_name``); empty on a CPU."""
    eval_len: int = 0
    """Samples in the eval set it built (``Task.eval_dataset``; 0 without ``--eval-every``)."""
    buffers: tuple[str, ...] = ()
    """The model's buffers that steps save, restore and agree on (``state.buffers``)."""
    batch_norm: tuple[str, ...] = ()
    """The model's batch-norm modules (``comm.batchnorm``): with ``--batch-stats local`` they
    make the run depend on the worker count."""


@dataclass(frozen=True, slots=True)
class LeaveNotice:
    """Word that a worker is going to leave: its node is draining, it was sent SIGTERM,
    or the user released it. The coordinator lets it go at a step boundary before
    ``deadline`` (``control.membership.pool.WorkerPool.leave_notices`` reads them,
    ``Membership.at_step_boundary`` acts on them)."""

    source: str
    """``drain``, ``signal`` or ``release``."""
    cause: str
    """In words, naming the node, the process or the request."""
    deadline: float | None = None
    """Unix seconds by which the worker is gone; None: no deadline (the next boundary)."""
    issued: float | None = None
    """When a notice in the GCS was written (Unix seconds): a release concerns the workers
    that were ready by then, not their replacements placed on the same node later."""

    def describe(self, now: float) -> str:
        """The cause with the time left."""
        if self.deadline is None:
            return f"{self.cause} (no deadline)"
        return f"{self.cause} (deadline in {self.deadline - now:.1f} s)"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A worker's answer to a heartbeat, from its control thread."""

    count: int
    """Progress of the training thread: a tick per micro-batch's forward and backward."""
    phase: str
    """``idle``, ``compute`` (forward/backward), ``reduce`` (waiting for the gradient
    reduction and the vote) or ``update``."""
    phase_s: float
    """Seconds since the phase began."""
    still_s: float
    """Seconds since ``count`` last moved."""


class Progress:
    """The training thread's progress, read by the control thread (``beat``)."""

    def __init__(self) -> None:
        self.count, self.phase = 0, "idle"
        self._since = self._moved = time.monotonic()

    def enter(self, phase: str) -> None:
        self.tick()
        self.phase, self._since = phase, self._moved

    def tick(self) -> None:
        self.count += 1
        self._moved = time.monotonic()

    def beat(self) -> Heartbeat:
        now = time.monotonic()
        return Heartbeat(self.count, self.phase, now - self._since, now - self._moved)


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """What one rank needs to run a window on its own."""

    window: int
    """The window's number in this run: grants name it (a late grant of an earlier window
    is ignored; one that arrives before its window opened is kept for it)."""
    start: int
    """The first step of the window."""
    until: int
    """Steps before this one may run; more may be granted unless ``final``."""
    final: bool
    sampler: dict[str, int]
    """``seed``, ``global_batch``, ``dataset_len``: each rank computes its own slices."""
    faults: dict[int, Fault] = field(default_factory=dict)
    """This rank's faults, by step."""
    slow: Fault | None = None
    """This rank's straggler fault (``slow``), if any."""
    sizes: tuple[int, ...] | None = None
    """Slice sizes by rank (``--balance``), from ``start`` until a grant changes them;
    None: equal slices."""
