"""Planned leaves (a drain of a node, SIGTERM, ``elastic-dp release``), seen from the control
plane with a fake mode and a fake pool, and from the worker's side without Ray. The real
drains and signals on a two-node Ray cluster are in tests/test_preemption_ray.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from elastic_dp.control.coordinator import LEAVE_MARGIN_S, RunState
from elastic_dp.control.membership.policy import Action, ElasticPolicy
from elastic_dp.messages import LeaveNotice
from elastic_dp.modes.base import MembersLost
from elastic_dp.modes.sync.grants import Grants
from elastic_dp.worker.leave import SigtermLeave
from tests.test_coordinator import FakeMode, _run, _states


class NoticeMode(FakeMode):
    """A notice for rank ``rank`` arrives as step ``at`` trains (deadline ``deadline_s`` from
    then, on the wall clock); a member the pool stopped dies in the step it is in."""

    def __init__(self, at: int, rank: int, deadline_s: float | None, source: str = "drain") -> None:
        super().__init__()
        self.at, self.rank, self.deadline_s, self.source = at, rank, deadline_s, source
        self.pool = None

    def advance(self, step, limit=None, keep_going=lambda: True, wake=list):
        limit = step + 1 if limit is None else limit
        while True:
            if step == self.at and self.pool is not None:
                deadline = None if self.deadline_s is None else time.time() + self.deadline_s
                self.pool.notices[self.members[self.rank]] = LeaveNotice(self.source, "drain of node n1", deadline)
                self.at = None
            going = keep_going()
            stopped = [m for m in self.members if m in self.pool.stopped]
            if stopped:  # forced out before the deadline: the step in flight fails over it
                raise MembersLost(self.members, stopped, f"{stopped} died", step=step)
            step += 1
            if step >= limit or not going:
                return step


def _noticed(at: int, rank: int, deadline_s: float | None, **kwargs):
    mode = NoticeMode(at, rank, deadline_s)
    coordinator, pool, clock = _run(mode, **kwargs)
    mode.pool = pool
    return coordinator, pool, mode


def test_a_drain_notice_lets_the_member_go_at_the_next_boundary_and_a_replacement_joins():
    coordinator, pool, mode = _noticed(at=2, rank=1, deadline_s=60.0, workers=3, min_workers=1, steps=6)
    summary = coordinator.run()
    changes = [e for e in summary.events if e["kind"] == "membership_changed"]
    leave, join = changes
    assert leave["left"] == 1 and leave["leave"] == "at_boundary" and leave["steps_rerun"] == 0
    assert leave["lost"] == 0 and leave["world_size"] == 2 and leave["restored_step"] == leave["step"] == 3
    assert "drain of node n1 (deadline in" in leave["cause"] and "1 worker(s) leaving" in leave["cause"]
    assert "ready_to_join_s" not in leave
    assert pool.stopped[0].id == 1  # the leaver, stopped once the group re-formed without it
    assert join["joined"] == 1 and join["world_size"] == 3  # its replacement, requested at the leave
    assert "RECOVERING" not in _states(coordinator)
    assert mode.calls[:2] == [("resize", 2), ("resize", 3)]


def test_a_deadline_nearer_than_the_margin_aborts_the_step_in_flight_and_reruns_it():
    coordinator, pool, _ = _noticed(at=2, rank=0, deadline_s=LEAVE_MARGIN_S / 2, workers=2, min_workers=1, steps=5)
    summary = coordinator.run()
    change = next(e for e in summary.events if e["kind"] == "membership_changed")
    assert change["leave"] == "aborted" and change["steps_rerun"] == 1 and change["step"] == 2
    assert 0 < change["stopped_before_deadline_s"] <= LEAVE_MARGIN_S / 2
    assert "too near for a step boundary; the step in flight was aborted" in change["cause"]
    assert "drain of node n1" in change["cause"]
    assert _states(coordinator)[:4] == ["STARTING", "RUNNING", "RECOVERING", "REFORMING"]


def test_a_leave_that_would_go_below_min_waits_for_a_joiner():
    policy = ElasticPolicy(min_workers=2, max_workers=2)
    stay = policy.at_step_boundary(["a", "b"], [], {"b": "SIGTERM"})
    assert stay.action is Action.CONTINUE and "below the minimum of 2" in stay.reason
    swap = policy.at_step_boundary(["a", "b"], ["c"], {"b": "SIGTERM"})
    assert swap.action is Action.REFORM and swap.members == ("a", "c")
    everyone = ElasticPolicy(min_workers=1, max_workers=2).at_step_boundary(["a"], [], {"a": "drain"})
    assert everyone.action is Action.CONTINUE  # nobody to hand the state to: the failure path remains


def test_a_joiner_on_a_draining_node_is_stopped_before_it_joins():
    coordinator, pool, _ = _run(FakeMode(), workers=2, min_workers=1, steps=3)
    coordinator.iterate()  # STARTING: both placed
    spare = pool.alive[-1]
    coordinator.membership.admit(coordinator.membership.members[:1])
    coordinator.membership.joiners = [spare]
    pool.notices[spare] = LeaveNotice("drain", "drain of node n2", None)
    decision = coordinator.membership.at_step_boundary()
    assert decision.action is Action.CONTINUE and spare in pool.stopped
    assert coordinator.state is RunState.RUNNING


def test_grants_of_a_leaving_worker_stop_every_window():
    grants = Grants()
    assert not grants.stopping()
    grants.leave()
    assert grants.stopping()  # sticky: a window opened after it stops too


def test_sigterm_asks_to_leave_and_exits_after_the_grace_period():
    exits, notices = [], []
    previous = signal.getsignal(signal.SIGTERM)
    leave = SigtermLeave(0.3, notices.append, exit=exits.append)
    try:
        assert leave.installed
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(notices) == 1 and notices[0].source == "signal" and str(os.getpid()) in notices[0].cause
    assert exits == [0] and leave.notice.deadline <= time.time() + 0.05


def test_a_sigterm_once_the_driver_is_stopping_the_worker_ends_it_without_a_notice():
    """The end of a run: the driver says it is stopping the worker (``WorkerActor.end``), and
    the SIGTERM that comes with the stop is no leave notice: nothing is announced or logged,
    the process just ends."""
    exits, notices = [], []
    previous = signal.getsignal(signal.SIGTERM)
    leave = SigtermLeave(5.0, notices.append, exit=exits.append)
    try:
        leave.ending = True
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exits == [0] and notices == [] and leave.notice is None


def test_off_the_main_thread_sigterm_is_left_alone():
    previous = signal.getsignal(signal.SIGTERM)
    made = []
    thread = threading.Thread(target=lambda: made.append(SigtermLeave(1.0, print)))
    thread.start()
    thread.join()
    assert not made[0].installed and signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.parametrize("deadline,expected", [(None, "x (no deadline)"), (110.0, "x (deadline in 10.0 s)")])
def test_a_notice_describes_its_deadline(deadline, expected):
    assert LeaveNotice("drain", "x", deadline).describe(100.0) == expected


@pytest.mark.parametrize("args, expected", [
    ([], "needs the workers to let go: --node NODE_ID or --actor ACTOR_ID"),
    (["--node", "ab12", "--deadline", "0"], "--deadline must be positive seconds, got 0.0"),
    (["--node", "ab12", "--address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
])
def test_elastic_dp_release_refuses_what_it_cannot_do_before_connecting(args, expected, capsys):
    from elastic_dp import cli
    assert cli.main(["release", *args]) == 2
    assert expected in capsys.readouterr().err
