"""Workers run windows of steps on their own (elastic_dp.modes.sync.grants, modes/sync/window.py): a kill
(with the next batch being prepared), a hang and a join that land in the middle of a
window, at stage 0 and under ZeRO-2, end where the plain PyTorch replay ends; prepared
batches (prefetch forced on, as on a GPU) never train a stale slice after the membership
changed."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter

import numpy as np
import pytest
from safetensors.torch import load_file

from elastic_dp import ClusterConfig, ElasticSampler, Trainer
from elastic_dp.modes.sync.window import MIN_LOOKAHEAD
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import PacedLoss, paced_task

TOL = 2e-5  # SGD on the MLP: float32 reduction order only (as in test_hangs)
# worst measured 8.6e-07 (4 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 23x margin
STEPS = 24
JOIN_STEPS = 80  # a replacement's start may take seconds on a loaded machine (see the test)


def _run(out, inject, *, zero=0, record=None, workers=2, min_workers=1, seconds=0.01, balance=False, steps=STEPS,
         until=None, **cluster):
    task = paced_task(PacedLoss(seconds=seconds, record=record, until=until))
    config = dataclasses.replace(task.defaults, steps=steps, zero=zero, prefetch=True, balance=balance)
    Trainer(task, train=config, cluster=ClusterConfig(workers=workers, min_workers=min_workers, **cluster),
            out_dir=str(out), progress=False, inject=inject).fit()
    unpaced = dataclasses.replace(task, loss=PacedLoss())
    diff = max_abs_diff(load_file(out / "final.safetensors"), replay(unpaced, config, str(out / "initial.safetensors")))
    return diff, _lines(out / "events.jsonl"), _lines(out / "metrics.jsonl")


def _lines(path) -> list[dict]:
    return read_lines(path) if path.exists() else []  # not written yet


def _touch_once(path, events, happened) -> threading.Thread:
    """A thread that creates ``path`` once an event of ``events`` satisfies ``happened``."""
    def watch():
        while not path.exists():
            try:
                if any(happened(e) for e in _lines(events)):
                    path.touch()
            except ValueError:  # a line being written
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("zero", [0])  # under ZeRO-2: tests/test_zero_elastic.py's kills and joins
def test_a_kill_and_the_replacements_join_mid_window_end_on_the_replay(ray_cluster, tmp_path, zero):
    """One window runs from step 0 to the end: the kill (step 5) and the join of the
    replacement, at whatever step it is ready, both land inside a window. Rank 1 dies in
    step 5's forward with step 6's batch being collated beside it; rank 0 drops its own
    prepared batch of step 6 and collates it afresh for the new group.

    The steps are paced until the replacement joined (however long its start takes: up to
    ~70 steps of 0.2 s), then run at full speed."""
    fast = tmp_path / "fast"
    watcher = _touch_once(fast, tmp_path / "events.jsonl", lambda e: e["kind"] == "membership_changed"
                          and e.get("joined"))
    try:
        diff, events, metrics = _run(tmp_path, ["kill:step=5:rank=1"], zero=zero, seconds=0.04, steps=JOIN_STEPS,
                                     until=str(fast))
    finally:
        fast.touch()  # ends the watcher, joined or not
        watcher.join()
    assert diff < TOL
    changes = [e for e in events if e["kind"] == "membership_changed"]
    lost = next(e for e in changes if e["lost"])
    joined = next(e for e in changes if e.get("joined"))
    assert lost["lost_ranks"] == [1]
    if zero and lost["step"] == 4:
        # rank 1's snapshot of its chunk after step 4 was still on its way to rank 0 when
        # it died (snapshots travel while the next step trains): back to the one before
        assert lost["steps_rerun"] == 2 and [m["step"] for m in metrics][:7] == [0, 1, 2, 3, 4, 4, 5]
    else:
        assert lost["step"] == 5 and lost["steps_rerun"] == 1
        assert [m["step"] for m in metrics] == list(range(JOIN_STEPS))
    assert 5 < joined["step"] < JOIN_STEPS and joined["world_size"] == 2
    assert {m["world_size"] for m in metrics} == {1, 2}


def test_a_hang_in_a_window_is_found_and_the_run_ends_on_the_replay(ray_cluster, tmp_path):
    # frozen in its forward: with the vote in the last bucket, a rank frozen once its buckets
    # left may have let the others commit the step (they then go on from the next one)
    diff, events, metrics = _run(tmp_path, ["hang:step=7:rank=0:phase=forward"], heartbeat_timeout_s=2.0)
    assert diff < TOL
    change = next(e for e in events if e["kind"] == "membership_changed")
    assert change["step"] == 7 and change["lost_ranks"] == [0] and "heartbeats" in change["cause"]
    assert [m["step"] for m in metrics] == list(range(STEPS))


def test_after_a_resize_no_prepared_slice_of_the_old_membership_is_trained(ray_cluster, tmp_path):
    """Workers join mid-window (1 -> 3) with prefetch on: every sample of every step is
    trained exactly once by the workers together, so no slice prepared for the old split
    was used after the split changed."""
    record = tmp_path / "trained"
    record.mkdir()
    diff, events, metrics = _run(tmp_path / "out", ["join:step=5", "join:step=11"], record=str(record),
                                 workers=3, min_workers=1)
    assert diff < TOL
    assert [m["world_size"] for m in metrics][::STEPS - 1] == [1, 3]
    assert _trained(record) == _expected()  # nothing trained twice, nothing missed
    assert MIN_LOOKAHEAD < STEPS and np.all(np.diff([m["step"] for m in metrics]) == 1)


def _trained(record) -> Counter:
    return Counter(int(i) for f in record.iterdir() for line in f.read_text().splitlines() for i in line.split())


def _expected() -> Counter:
    task = paced_task(PacedLoss())
    sampler = ElasticSampler(len(task.dataset()), global_batch=task.defaults.global_batch, seed=task.defaults.seed)
    return Counter(int(i) for s in range(STEPS) for i in sampler.batch(s))


def test_balance_gives_a_straggler_fewer_samples_and_ends_on_the_replay(ray_cluster, tmp_path):
    """--balance with rank 1 slowed 4x (--inject slow): the slices follow the measured
    speeds, changing inside the window (prefetch on: slices prepared for the old sizes are
    dropped), every sample of every step is trained exactly once, and the parameters are
    the replay's, as with equal slices."""
    record = tmp_path / "trained"
    record.mkdir()
    diff, events, metrics = _run(tmp_path / "out", ["slow:rank=1:factor=4"], record=str(record), balance=True)
    assert diff < TOL
    sizes = [(e["step"], e["sizes"]) for e in events if e["kind"] == "rebalanced"]
    assert sizes and 0 < sizes[0][0] < STEPS  # changed mid-run, once rank 1 was measured slower
    step, (fast, slow) = sizes[-1]
    assert fast + slow == 10 and slow < fast
    assert _trained(record) == _expected()
    assert [m["step"] for m in metrics] == list(range(STEPS))


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_wait_on_the_workers_calls_wakes_when_a_starting_worker_moves_on(ray_cluster):
    """A window waits on its members' streams and on ``wake()``'s refs (the starting
    workers' placement and set-up): one of those finishing ends the wait at once, so the
    coordinator asks ``keep_going`` then, not at the next report or heartbeat; it is never
    taken for a member's result."""
    import ray

    from elastic_dp.modes.calls import Waiting

    sleep = ray.remote(num_cpus=0)(_sleep)
    call, starting = sleep.remote(20.0), sleep.remote(0.2)
    waiting = Waiting({call: "worker-0"}, deadline_s=60.0, grace_s=1.0, abort=lambda members: None,
                      wake=lambda: [starting])
    began = time.monotonic()
    # not the 20 s call, nor the deadline: the 0.2 s task's worker may take seconds to start
    # on a machine the suite's other process keeps busy (10.6 s seen)
    assert waiting.ready() == [] and time.monotonic() - began < 18.0
    assert waiting.pending == {call: "worker-0"} and waiting.outcome.cause is None
    ray.cancel(call, force=True)
