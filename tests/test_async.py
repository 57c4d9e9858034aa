"""Asynchronous SGD (``--mode async``): the ledger's leases and staleness rule on their own,
then runs on the local Ray cluster checked against plain PyTorch: staleness 0 equals the
synchronous replay at any worker count, and a run with stale updates, a straggler and a
kill ends where a plain loop that replays ``updates.jsonl`` ends, every step applied once."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from elastic_dp import ConfigError
from elastic_dp.data import ElasticSampler
from elastic_dp.modes.asyncsgd.ledger import Ledger, copy_plan
from elastic_dp.observe.report import plot_staleness, read_run
from tests.reference import max_abs_diff, replay, replay_updates
from tests.runs import fit
from tests.tasks import TINY_GPT_TASK, PacedLoss, paced_task

TOL = 2e-5  # float32 summation order (micro-batches against one full batch)
# worst measured 1.1e-06 (3 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 18x margin


def _ledger(staleness: int, lr: str = "none") -> Ledger:
    return Ledger(0, max_staleness=staleness, staleness_lr=lr, lr_factor=lambda i: 1.0 if i >= 1 else 0.5)  # warmup: update 0 at half


def test_steps_are_leased_in_order_and_a_dead_workers_step_first_again():
    ledger = _ledger(4)
    assert [ledger.lease(w) for w in "abc"] == [0, 1, 2]
    assert ledger.release("b") == 1
    assert ledger.lease("d") == 1 and ledger.lease("e") == 3


def test_an_update_staler_than_the_bound_is_refused_and_its_step_kept():
    ledger = _ledger(1, "inverse")
    for w in "abc":
        ledger.lease(w)  # all on version 0
    first = ledger.settle("b", 0)
    assert (first.version, first.step, first.staleness, first.lr_scale) == (1, 1, 0, 0.5)  # warmup only
    second = ledger.settle("a", 0)
    assert (second.version, second.step, second.staleness, second.lr_scale) == (2, 0, 1, 0.5)  # 1.0 / (1 + 1)
    assert ledger.settle("c", 0) is None  # staleness 2 > 1: computed again, on version 2
    assert ledger.recomputed == 1 and ledger.leased == {"c": 2}
    third = ledger.settle("c", 2)
    assert (third.version, third.step, third.base_version, third.staleness) == (3, 2, 2, 0)
    assert ledger.staleness == Counter({0: 2, 1: 1}) and ledger.idle


def test_staleness_0_leases_one_step_at_a_time():
    ledger = _ledger(0)
    assert ledger.may_lease(5)
    ledger.lease("a")
    assert not ledger.may_lease(5)
    ledger.settle("a", 0)
    assert ledger.may_lease(5) and not ledger.may_lease(1)


def test_a_roll_back_leases_the_undone_steps_and_those_out_again():
    ledger = _ledger(4)
    for w in "abcd":
        ledger.lease(w)
    for w in "bad":
        ledger.settle(w, 0)  # versions 1..3 from steps 1, 0, 3
    assert ledger.staleness == Counter({0: 1, 1: 1, 2: 1})
    assert ledger.roll_back(1) == [0, 3, 2]  # undone: versions 2, 3; out: c's step 2
    assert (ledger.version, ledger.leased, ledger.again) == (1, {}, [0, 2, 3])
    assert ledger.staleness == Counter({0: 1})  # the undone updates leave the histogram
    assert [ledger.lease(w) for w in "xyzw"] == [0, 2, 3, 4]


def test_the_newest_version_every_shard_still_holds_is_chosen():
    keeper_of = {0: 1, 1: 2, 2: 0}.__getitem__  # shard i's copies are kept by shard i + 1
    own = {0: [4, 6], 1: [4, 6], 2: [4, 6]}
    kept = {1: {0: [4, 6]}, 2: {1: [4, 6]}, 0: {2: [4, 6]}}
    # shard 1 lost after the copy of 6 reached its keeper, shard 2
    assert copy_plan(3, {0, 2}, {0: own[0], 2: own[2]}, {0: kept[0], 2: kept[2]}, keeper_of) == (
        6, [("own", 0), ("kept", 2), ("own", 2)])
    # ... and before it did: back to 4
    assert copy_plan(3, {0, 2}, {0: own[0], 2: own[2]}, {0: kept[0], 2: {1: [2, 4]}}, keeper_of)[0] == 4
    # shards 1 and 2 lost together: shard 1's copy went with its keeper
    assert copy_plan(3, {0}, {0: own[0]}, {0: kept[0]}, keeper_of) is None
    assert copy_plan(1, set(), {}, {}, lambda i: "keeper") is None  # no copy yet


def _train(tmp_path, task, *, workers, inject=(), cluster=None, checkpoint=None, **train):
    run = fit(task, tmp_path, workers=workers, min_workers=1, inject=inject, cluster=cluster, checkpoint=checkpoint,
              mode="async", **train)
    return run.summary, run.config, run.lines("updates"), run.events


def test_staleness_0_equals_the_synchronous_replay(ray_cluster, tmp_path):
    """Updates are then applied in step order, each on the version before it, at 2 workers
    (one worker: benchmarks/scenarios/test_async_scenarios.py); with a cosine schedule,
    each at its step's rate."""
    summary, config, updates, _ = _train(tmp_path, TINY_GPT_TASK, workers=2, max_staleness=0, lr_schedule="cosine",
                                         decay_steps=5, min_lr_ratio=0.2)
    assert [(u["version"], u["step"], u["base_version"], u["staleness"]) for u in updates] == [
        (v + 1, v, v, 0) for v in range(config.steps)]
    assert [u["lr_scale"] for u in updates] == pytest.approx([config.lr_factor(v) for v in range(config.steps)])
    assert updates[-1]["lr_scale"] == pytest.approx(0.2)  # decayed to the floor
    expected = replay(TINY_GPT_TASK, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(load_file(tmp_path / "final.safetensors"), expected) < TOL
    assert summary.steps == config.steps


def test_stale_updates_a_straggler_a_join_and_a_kill_replay_from_updates_jsonl(ray_cluster, tmp_path):
    """Up to 3 workers, staleness up to 4: 2 start, rank 1 slowed 3x; a third joins at
    step 4 (rank 2) and is killed in its first step from step 8 on; rank 0 is frozen
    (SIGSTOP) in its first from step 14 on and found by its missed heartbeats. A plain
    loop replaying updates.jsonl lands on final.safetensors, and every step 0..U-1 has
    exactly one applied update. SGD with momentum over 24 updates: the bound is float32
    order, as in the synchronous tests on this task."""
    task = paced_task(PacedLoss(seconds=0.01))
    summary, config, updates, events = _train(
        tmp_path, task, workers=3, steps=24, max_staleness=4, staleness_lr="inverse",
        inject=["slow:rank=1:factor=3", "join:step=4", "kill:step=8:rank=2", "hang:step=14:rank=0"],
        cluster={"heartbeat_timeout_s": 1.5})
    final = {u["version"]: u for u in updates}
    assert sorted(final) == list(range(1, 25))
    assert Counter(u["step"] for u in final.values()) == Counter(range(24))  # each step applied once
    assert max(u["staleness"] for u in final.values()) <= 4
    assert any(u["staleness"] > 0 for u in final.values())  # it did run asynchronously
    for u in final.values():
        assert u["staleness"] == u["version"] - 1 - u["base_version"]
    lost = [e for e in events if e["kind"] == "membership_changed" and e["lost"]]
    assert len(lost) == 2 and "heartbeats" in lost[1]["cause"]
    joined = next(e for e in events if e["kind"] == "membership_changed" and e["joined"])
    assert joined["step"] == 4 and joined["world_size"] == 3  # 2 started; the third joined, no re-formation
    assert {0, 1, 2} <= {u["worker"] for u in updates}  # the joiner's (worker 2) applied too; and the
    # kill's replacement's, if it was built before the last update
    histogram = Counter(u["staleness"] for u in final.values())
    assert summary.staleness == histogram
    assert "staleness    " + ", ".join(f"{k}: {n}" for k, n in sorted(histogram.items())) in summary.render()
    bars = plot_staleness(read_run(tmp_path)).axes[0].patches  # the report's plot, from updates.jsonl
    assert {round(b.get_x() + b.get_width() / 2): b.get_height() for b in bars} == histogram
    unpaced = dataclasses.replace(task, loss=PacedLoss())
    expected = replay_updates(unpaced, config, str(tmp_path / "initial.safetensors"), list(final.values()))
    assert max_abs_diff(load_file(tmp_path / "final.safetensors"), expected) < TOL


def test_a_training_thread_blocked_in_a_gradient_is_found_by_its_stalled_progress(ray_cluster, tmp_path):
    """The worker that meets a sample of step 3 blocks in its forward for good, its process
    still answering heartbeats. Nobody waits for it in a collective, but its progress
    count stands still: with a 1.5 s floor it is replaced and its step leased again, and
    the run ends on the replay of updates.jsonl."""
    sampler = ElasticSampler(96, global_batch=10, seed=3)  # the paced task's dataset and seed
    task = paced_task(PacedLoss(seconds=0.01, block=int(sampler.batch(3)[0]), marker=str(tmp_path / "blocked")))
    _, config, updates, events = _train(tmp_path / "out", task, workers=2, steps=8, max_staleness=2,
                                        cluster={"stall_floor_s": 1.5})
    assert (tmp_path / "blocked").exists()
    lost = [e for e in events if e["kind"] == "membership_changed" and e["lost"]]
    assert len(lost) == 1 and "made no progress" in lost[0]["cause"] and "bound 1.5 s" in lost[0]["cause"]
    assert _replayed(tmp_path / "out", dataclasses.replace(task, loss=PacedLoss()), config, updates) < TOL


def test_async_input_errors_name_the_setting(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"TrainConfig\.ps_shards=100000 is more than the model's"):
        _train(tmp_path / "a", TINY_GPT_TASK, workers=1, ps_shards=100_000)
    lbfgs = dataclasses.replace(TINY_GPT_TASK, optimizer=lambda m: torch.optim.LBFGS(m.parameters()))
    with pytest.raises(ConfigError, match=r"TrainConfig\.mode='async' shards optimizer state element by element.*TrainConfig\.mode='sync'"):
        _train(tmp_path / "b", lbfgs, workers=1)
    assert not (tmp_path / "a" / "initial.safetensors").exists()
    assert not (tmp_path / "b" / "initial.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the refusal needs a cluster "
                                                      "without one (tests/test_cuda.py runs shards on it)")
def test_parameter_servers_on_a_gpu_are_refused_on_a_cluster_without_one(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"TrainConfig\.ps_device='cuda' puts the parameter servers on a GPU.*TrainConfig\.ps_device='cpu'"):
        _train(tmp_path, TINY_GPT_TASK, workers=1, ps_device="cuda")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _replayed(tmp_path, task, config, updates):
    final = {u["version"]: u for u in updates}  # a later line of a version replaces an undone one
    assert sorted(final) == list(range(1, config.steps + 1))
    assert Counter(u["step"] for u in final.values()) == Counter(range(config.steps))  # each step once
    expected = replay_updates(task, config, str(tmp_path / "initial.safetensors"), list(final.values()))
    return max_abs_diff(load_file(tmp_path / "final.safetensors"), expected)
