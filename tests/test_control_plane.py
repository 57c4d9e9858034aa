"""The control plane's benchmark keeps driving the real code: the coordinator decides every
failure and join of a 32-member run, the re-cut plan covers every old chunk, and a real
SyncMode's window commits every step of 32 fake members (what is measured, not how fast)."""

from __future__ import annotations

from benchmarks.bench_control_plane import bench_decisions, bench_plan, bench_window, measure


def test_every_failure_and_every_replacement_s_join_is_decided():
    assert len(bench_decisions(32, changes=4)) == 8  # 4 losses, and the 4 replacements' joins


def test_the_plan_and_the_window_run_on_the_real_code():
    plans, ranks = bench_plan(32, repeats=3)  # asserts the plan's step and the new rank order
    assert len(plans) == len(ranks) == 3
    assert bench_window(32, steps=6) > 0  # asserts every step committed and was recorded
    result = measure(16, changes=2, steps=4)
    assert set(result) == {"members", "decide_ms", "decisions", "reshard_plan_ms", "rank_plan_ms", "reports_per_s"}
