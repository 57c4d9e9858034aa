"""Finding hung workers in seconds, with the default settings, in two layers.

1. **A frozen process** (SIGSTOP, a machine that stopped answering, native code holding
   the GIL) does not answer a heartbeat sent to the worker's control thread: one missing
   for ``heartbeat_timeout_s`` marks the worker hung.
2. **A training thread that stops making progress** while its process still answers.
   Each worker counts its progress (a tick per micro-batch's forward and backward) and
   reports its phase (``compute``, ``reduce``, ``update``). A worker in ``compute`` whose
   count has not moved for the bound, while a peer has finished its compute and waited in
   ``reduce`` for the bound, is hung. The bound is relative to the run's own pace:
   ``max(stall_floor_s, stall_factor × median step time)``, and ``first_step_s`` before
   the run has a committed step to measure (start-up, the first collectives).

The step deadline (``--step-timeout``) stays the last backstop. A slow worker that keeps
its pace is not hung: its peers wait for it in every step, so the median step time, and
with it the bound, includes its slowness.

In asynchronous SGD (``alone``) no peer waits in a collective: a worker computing a
gradient whose count has not moved for the bound is hung, the bound taken from the
larger of the run's median gradient time and the worker's own (``paces``), so a
straggler that keeps its own pace is not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import ray

from elastic_dp.messages import Heartbeat


@dataclass(frozen=True, slots=True)
class Transport:
    """How the driver waits for its calls' results and takes them: Ray's ``wait`` and
    ``get``. The control plane's benchmark (``benchmarks/bench_control_plane.py``) drives
    the same code with fake members and a transport of its own."""

    wait: Callable[..., tuple[list, list]] = ray.wait
    get: Callable[[Any], Any] = ray.get


RAY = Transport()


@dataclass(frozen=True, slots=True)
class HangBounds:
    """When a worker counts as hung (``ClusterConfig`` sets these from the CLI flags)."""

    heartbeat_timeout_s: float = 5.0
    """A heartbeat unanswered this long: a frozen process (``--heartbeat-timeout``)."""
    stall_floor_s: float = 5.0
    """No progress for at least this long, while peers wait (``--stall-floor``)."""
    stall_factor: float = 4.0
    """... and for this many median step times (``--stall-factor``)."""
    first_step_s: float = 60.0
    """The bound before any step of the run committed (no median yet)."""
    heartbeat_interval_s: float = 1.0
    """How often each worker still in a call is sent a heartbeat."""


class Watchdog:
    """Sends heartbeats to the members of one call and judges their answers."""

    def __init__(self, bounds: HangBounds, typical_step_s: float | None,
                 clock: Callable[[], float] = time.monotonic, *, alone: bool = False,
                 transport: Transport = RAY) -> None:
        self.bounds, self.typical_step_s, self.clock, self.alone = bounds, typical_step_s, clock, alone
        self.transport = transport
        self.paces: dict[Any, float] = {}
        """``alone``: each member's own typical time for the work it is judged in."""
        self._pings: dict[Any, tuple[object, float]] = {}  # member -> (heartbeat ref, sent at)
        self._beats: dict[Any, tuple[Heartbeat, float]] = {}  # member -> (last answer, received at)
        self._next = clock() + bounds.heartbeat_interval_s

    @property
    def stall_bound_s(self) -> float:
        return self.bound_for(None)

    def bound_for(self, member: Any) -> float:
        """How long ``member`` (None: any) may make no progress: relative to the run's pace,
        or its own when that is slower (``paces``)."""
        b = self.bounds
        if self.typical_step_s is None:
            return max(b.stall_floor_s, b.first_step_s)
        return max(b.stall_floor_s, b.stall_factor * max(self.typical_step_s, self.paces.get(member, 0.0)))

    def due_in(self) -> float:
        """Seconds until the next round of heartbeats."""
        return max(0.0, self._next - self.clock())

    def check(self, pending: Iterable[Any]) -> list[tuple[Any, str]]:
        """Members among ``pending`` (still in the call) found hung, with the reason."""
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.bounds.heartbeat_interval_s
        pending = list(pending)
        for member in pending:
            if member not in self._pings:  # one heartbeat out per member at a time
                self._pings[member] = (member.actor.heartbeat.remote(), now)
        self._collect(now, timeout_s=0.05)  # a healthy control thread answers in ms: judge this round's
        hung = []
        for member in pending:
            if member in self._pings:
                silent = now - self._pings[member][1]
                if silent >= self.bounds.heartbeat_timeout_s:
                    hung.append((member, f"{member!r} did not answer heartbeats for {silent:.1f} s (a frozen "
                                         f"process; --heartbeat-timeout {self.bounds.heartbeat_timeout_s:g})"))
        return hung + self._stalled([m for m in pending if all(m is not h for h, _ in hung)], now)

    def _collect(self, now: float, timeout_s: float) -> None:
        refs = [ref for ref, _ in self._pings.values()]
        ready = set(self.transport.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
        for member, (ref, _) in list(self._pings.items()):
            if ref not in ready:
                continue
            del self._pings[member]
            try:
                beat = self.transport.get(ref)
            except ray.exceptions.RayError:
                continue  # a dead worker: its call reports it
            self._beats[member] = (beat, now)

    def _computing(self, pending: list[Any], now: float) -> Iterator[tuple[Any, float]]:
        """(member, seconds its progress stood still) for each of ``pending`` that answered
        this round's heartbeat from its ``compute`` phase (only such an answer is judged)."""
        for member in pending:
            beat, at = self._beats.get(member, (None, 0.0))
            if beat is not None and beat.phase == "compute" and at == now:
                yield member, beat.still_s

    def _stalled(self, pending: list[Any], now: float) -> list[tuple[Any, str]]:
        if self.alone:
            return self._stalled_alone(pending, now)
        bound = self.stall_bound_s
        waited = [beat.phase_s + now - at for m, (beat, at) in self._beats.items()
                  if beat.phase == "reduce" and m in pending]
        if not waited or max(waited) < bound:
            return []
        return [(member, f"{member!r} made no progress for {still:.1f} s while its peers waited "
                         f"{max(waited):.1f} s for it (a hung training thread; bound {bound:.1f} s: "
                         "--stall-floor, --stall-factor)")
                for member, still in self._computing(pending, now) if still >= bound]

    def _stalled_alone(self, pending: list[Any], now: float) -> list[tuple[Any, str]]:
        stalled = []
        for member, still in self._computing(pending, now):
            bound = self.bound_for(member)
            if still >= bound:
                stalled.append((member, f"{member!r} made no progress for {still:.1f} s computing a gradient "
                                        f"(a hung training thread; bound {bound:.1f} s: --stall-floor, "
                                        "--stall-factor)"))
        return stalled
