"""Planned leaves on a two-node Ray cluster, the scenarios out of the suite (its time):
SIGTERM to a worker process sent from outside the program, the stage-0 drain, the async
mode's, the ZeRO-3 one, ``elastic-dp release``, and a deadline shorter than one step (the step in flight
is aborted before the deadline and re-run on the same samples). Run with
``python3 dev.py test benchmarks/scenarios``; tests/test_preemption_ray.py holds the ZeRO-2
drain."""

from __future__ import annotations

import pytest

from tests.test_preemption_ray import TOL, check_planned_leave, run_scenario

pytestmark = pytest.mark.ray


def test_a_drain_at_stage_0_lets_the_node_s_worker_go(tmp_path):
    report = run_scenario(tmp_path / "out", "drain0")
    check_planned_leave(report, left=1, cause="drain of node")


def test_a_drain_under_zero3_lets_the_leavers_export_their_parameter_chunks(tmp_path):
    """ZeRO-3, two contiguous ranks of 3 on the drained node: their chunks of the parameters
    themselves (no rank holds them whole between steps) leave with their own export."""
    report = run_scenario(tmp_path / "out", "drain3")
    change = check_planned_leave(report, left=2, cause="drain of node")
    assert sorted(change["left_ranks"]) in ([0, 1], [1, 2])


def test_a_drain_in_diloco_mode_lets_the_worker_go_at_an_outer_boundary(tmp_path):
    """``--mode diloco`` (H = 4): the drained node's worker leaves at the end of the window
    in flight, an outer boundary; the survivor trains on alone, on the replay of the
    contract over that membership."""
    report = run_scenario(tmp_path / "out", "drain_diloco")
    change = check_planned_leave(report, left=1, cause="drain of node")
    assert change["step"] % 4 == 0


def test_a_drain_in_async_mode_lets_the_worker_finish_its_gradient_and_moves_the_shard(tmp_path):
    """The parameter-server shard is on the drained node too: it hands its state to a new
    shard at the quiescent point, and nothing is rebuilt from snapshots. Checked on the
    async replay contract (updates.jsonl): no update lost or applied twice."""
    report = run_scenario(tmp_path / "out", "drain_async")
    check_planned_leave(report, left=1, cause="drain of node")
    summary = next(e for e in report["events"] if e["kind"] == "async_summary")
    assert summary["updates"] == report["planned_steps"]
    moved = {e["shard"]: e for e in report["events"] if e["kind"] == "ps_shard_moved"}
    assert 0 in moved and set(moved) <= {0, "keeper"}  # Ray may have put the keeper there too
    timeline = [(round(e["time"] - report["notice_at"], 2), e["kind"]) for e in report["events"]]
    assert all(e["time"] < report["notice_at"] + report["deadline"] for e in moved.values()), timeline  # in time
    assert not any(e["kind"] == "ps_shards_restored" for e in report["events"])


def test_elastic_dp_release_lets_the_node_s_workers_go_at_the_next_boundary(tmp_path):
    """The maintenance command, run as a user would from another process (no deadline)."""
    report = run_scenario(tmp_path / "out", "release")
    change = check_planned_leave(report, left=1, cause="released by the user (test): node",
                                 draining=False)  # a release is of the workers there: a replacement may come
    assert "(no deadline)" in change["cause"]


def test_a_deadline_shorter_than_the_step_aborts_it_in_time_and_reruns_it(tmp_path):
    report = run_scenario(tmp_path / "out", "short")
    (change,) = report["changes"]
    assert change["leave"] == "aborted" and change["steps_rerun"] == 1 and change["lost"] == 1
    assert 0 < change["stopped_before_deadline_s"] <= 1.0  # the deadline was 1 s: stopped at once
    assert "too near for a step boundary" in change["cause"]
    assert report["diff"] < TOL
    assert sorted(report["steps"]) == list(range(20))


def test_sigterm_to_a_worker_process_lets_it_go_at_the_next_boundary(tmp_path):
    report = run_scenario(tmp_path / "out", "sigterm")
    change = check_planned_leave(report, left=1, cause="SIGTERM to worker process", draining=False)
    assert change["time"] < report["notice_at"] + 20  # within its --leave-grace
