"""``--compress powersgd`` through a planned leave on a Ray cluster: a worker sent SIGTERM
(what a container runtime sends before it stops a pod) leaves at the next step boundary,
and the rank that holds the copy of its error takes the error over (docs/compression.md), so
the run ends on the replay of the contract, which knows nothing of the membership. A long
scenario (``python3 dev.py test benchmarks/scenarios``, run by ``.ci/run``); the suite keeps
the kills (tests/test_compression_ray.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest

from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.scripts.scenario import lines, wait_for
from tests.tasks import TINY_GPT_TASK, PacedGPTLoss
from tests.test_compression_ray import COMPRESSED_APART, TOL

pytestmark = pytest.mark.ray


def test_a_planned_leave_hands_its_error_over_and_the_run_ends_on_the_contract(ray_cluster, tmp_path):
    """PowerSGD rank 2 at stage 0, 3 workers (MIN 2): once 4 steps have committed, rank 1's
    process is sent SIGTERM. It leaves at the next boundary: nothing lost or re-run, every
    step trained once, and the parameters end on the contract's replay, far from the
    uncompressed run's; a replacement may join afterwards (MAX is 3). The steps are paced
    (0.2 s a micro-batch) so that the run is still training when the notice comes; the
    replay's loss is the plain one."""
    steps = 16
    task = dataclasses.replace(TINY_GPT_TASK, loss=PacedGPTLoss(seconds=0.2, until=str(tmp_path / "never")))
    noticed: dict[str, int] = {}

    def notice() -> None:
        metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
        if len(wait_for(metrics, lambda ms: len(ms) >= 4, timeout_s=120)) >= 4:
            noticed["pid"] = next(e for e in lines(events) if e["kind"] == "mesh")["pids"][1]
            os.kill(noticed["pid"], signal.SIGTERM)

    thread = threading.Thread(target=notice, daemon=True)
    thread.start()
    run = fit(task, tmp_path, workers=3, min_workers=2, steps=steps, compress="powersgd:rank=2:start=2")
    thread.join(timeout=10)
    assert "pid" in noticed, "the run ended before 4 steps were seen: no notice was sent"
    initial = str(tmp_path / "initial.safetensors")
    expected = replay(TINY_GPT_TASK, run.config, initial)
    uncompressed = replay(TINY_GPT_TASK, dataclasses.replace(run.config, compress=None), initial)
    on, apart = max_abs_diff(run.weights(), expected), max_abs_diff(run.weights(), uncompressed)
    print(f"PowerSGD through a leave: {on:.2g} from the contract's replay, {apart:.2g} from the uncompressed one")
    assert on < TOL  # measured 5.0e-6 (one run, 2026-12-06): 4x margin
    assert apart > COMPRESSED_APART
    left = next(c for c in run.changes() if c.get("left"))
    assert (left["left"], left["lost"], left["left_ranks"], left["steps_rerun"]) == (1, 0, [1], 0), left
    assert left["leave"] == "at_boundary"
    assert [m["step"] for m in run.lines("metrics")] == list(range(steps))
    assert 2 in {m["world_size"] for m in run.lines("metrics")}
