"""Planned leaves on a two-node Ray cluster on this machine (``tests.scripts.preemption``,
each in its own process): the notice comes the way it comes on a real cluster — Ray's
drain API with a deadline — and the node goes at its deadline. The run lets the workers go at the next step
boundary while they are alive: nothing re-run, nothing restored, no replacement placed
on the draining node, and it ends on the plain replay. SIGTERM, the stage-0 drain, the
async mode, ``elastic-dp release`` and the deadline shorter than a step are in
benchmarks/scenarios/test_preemption.py (the suite's time); tests/test_preemption.py covers
their control-plane logic and the SIGTERM handler."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import run_scenario_script

pytestmark = pytest.mark.ray  # it starts Ray in a subprocess
TOL = 2e-5  # as in test_sync_equivalence: float32 reduction order over 20 SGD steps
# worst measured 1.8e-07 (1 test here, 3 suite runs on 2026-12-04, python -m tests.noise): 111x margin;
# the 7 scenarios of benchmarks/scenarios/test_preemption.py, which use it: 5.7e-07 (one run), 35x


def run_scenario(out: Path, scenario: str) -> dict:
    report = run_scenario_script("tests.scripts.preemption", str(out), scenario)
    changes = [e for e in report["events"] if e["kind"] == "membership_changed"]
    assert changes, f"no membership change after the notice (after step {report['notice_after_steps']})"
    return report | {"changes": changes}


def check_planned_leave(report: dict, left: int, cause: str, draining: bool = True) -> dict:
    """One change, a leave at a step boundary before the deadline; nothing lost, re-run or
    restored; the node's removal afterwards changed nothing; the replay's parameters;
    ``draining``: no replacement was placed on the node (Ray places nothing on a draining one)."""
    (change,) = report["changes"]  # and none when the node went afterwards
    assert change["leave"] == "at_boundary" and change["left"] == left and change["lost"] == 0
    assert change["steps_rerun"] == 0 and change["restored_step"] == change["step"]
    assert cause in change["cause"]
    assert not any(e["kind"] in ("restored_from_checkpoint", "reform_interrupted") for e in report["events"])
    assert report["diff"] < TOL
    assert sorted(report["steps"]) == list(range(report["planned_steps"]))  # each step once
    if draining:
        assert report["workers_on_node_before_deadline"] == 0  # let go, and no replacement placed there
    return change


def test_a_drain_under_zero2_lets_a_chunk_and_its_snapshot_go_from_their_holders(tmp_path):
    """The drained node holds two ranks of 3, contiguous: 0 and 1, or 1 and 2 (the nodes in
    the order of their first worker ready). The snapshot ring puts the larger node's ranks
    at its even places, so one of them keeps the other's peer snapshot, on the same node:
    only the leavers' own export keeps that chunk; a rollback to snapshots could not."""
    report = run_scenario(tmp_path / "out", "drain2")
    change = check_planned_leave(report, left=2, cause="drain of node")
    assert sorted(change["left_ranks"]) in ([0, 1], [1, 2])  # neighbours in the snapshot ring: a chunk and its snapshot
    assert "deadline in" in change["cause"]
    assert change["time"] < report["notice_at"] + 8  # before the deadline
    first_after = min(t for t, w in zip(report["at"], report["world_sizes"]) if w == 1)
    step_s = sorted(b - a for a, b in zip(report["at"], report["at"][1:5]))[1]  # a paced step, before the notice
    assert first_after - report["notice_at"] < 2 * step_s + 0.5  # the step in flight, then the new group's first
    assert report["requested"] == [{"CPU": 1}] * 3  # the autoscaler is still asked for MAX
