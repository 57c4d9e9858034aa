"""Fakes of the control plane's seams: members, a clock, a worker pool (no Ray, no
tensors). The coordinator's tests and ``benchmarks/bench_control_plane.py`` drive the real
coordinator, membership and policy with them."""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(eq=False)
class FakeMember:
    id: int
    ready_time: float = 0.0

    def __repr__(self) -> str:
        return f"w{self.id}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakePool:
    """Workers become ready on the next poll while fewer than ``capacity`` are alive."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.pending, self.alive, self.stopped, self.requested = capacity, [], [], [], []
        self.slots_go_with_workers = False  # a stopped worker's slot is gone too (a lost node)
        self.notices: dict = {}  # member -> LeaveNotice, reported by leave_notices
        self.dead: list = []  # members that died, reported by gone
        self._ids = itertools.count()

    def start(self, count: int) -> None:
        self.pending += [FakeMember(next(self._ids)) for _ in range(count)]

    def poll(self) -> list:
        ready = []
        while self.pending and len(self.alive) < self.capacity:
            member = self.pending.pop(0)
            self.alive.append(member)
            ready.append(member)
        return ready

    def wait_ready(self, count: int, timeout_s: float) -> list:
        return self.poll()

    def placed_but_starting(self) -> int:
        return 0

    def progress_refs(self) -> list:
        return []

    def stop(self, member) -> None:
        self.stopped.append(member)
        if member in self.alive:
            self.alive.remove(member)
            self.capacity -= self.slots_go_with_workers

    def stop_all(self) -> None:
        for member in list(self.alive):
            self.stop(member)

    def request_capacity(self, count: int) -> None:
        self.requested.append(count)

    def leave_notices(self, members) -> dict:
        return {m: n for m, n in self.notices.items() if m in members}

    def gone(self, workers) -> list:
        """Ready workers the test killed (``die``) while they stood by."""
        return [w for w in workers if w in self.dead]

    def die(self, member) -> None:
        self.dead.append(member)
        if member in self.alive:
            self.alive.remove(member)

    def placement_error(self, wanted, timeout_s, ready):
        raise AssertionError("the fake pool places everyone")
