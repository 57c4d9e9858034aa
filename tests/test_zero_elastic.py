"""ZeRO through failures and joins, on a local Ray cluster: every run ends where the
uninterrupted run ends (plain PyTorch replay, tests.reference), whatever membership
changes, snapshot rollbacks or checkpoint fallbacks it went through."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from elastic_dp import CheckpointConfig, ClusterConfig, ConfigError, Trainer
from elastic_dp.state.zero import shm
from tests.procs import alive
from tests.tasks import TINY_GPT_TASK
from tests.test_elastic import run_against_replay

TOL = 2e-5  # float32 reduction order
# worst measured 4.4e-06 (4 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 5x margin


def _run(tmp_path, workers, inject, *, zero, snapshot_every=1, **kw):
    return run_against_replay(tmp_path, workers, inject, **kw,
                              train={"zero": zero, "snapshot_every": snapshot_every, "bucket_mb": 0.02})


def _check_state_memory(events, metrics) -> None:
    """Every generation that trained a step said what each of its ranks holds, once (a
    peer snapshot only where there is a peer): every rank, but one lost before any report
    of its steps in that generation reached the driver (killed right after a commit, the
    report it streamed last lost with the process), which the next failure names."""
    memory = [e for e in events if e["kind"] == "state_memory"]
    assert sorted(e["generation"] for e in memory) == sorted({m["generation"] for m in metrics})
    for e in memory:
        world = next(m["world_size"] for m in metrics if m["generation"] == e["generation"])
        ranks = [r["rank"] for r in e["ranks"]]
        failures = [c for c in events if c["kind"] == "membership_changed" and c["lost"]
                    and c["generation"] > e["generation"]]
        lost_next = set(failures[0]["lost_ranks"]) if failures else set()
        assert ranks == sorted(set(ranks)), ranks
        assert set(range(world)) - set(ranks) <= lost_next, (ranks, world, lost_next)
        assert all(r["parameters"] > 0 and r["optimizer"] > 0 and (r["snapshots"] > 0 or world == 1)
                   for r in e["ranks"])


# Stage 2 only: stage 1's recovery is the same code without the scatter, and the tests
# below (and tests/test_resume.py) run stage 1 through losses and checkpoints.
@pytest.mark.parametrize("zero", [2])
def test_kills_and_joins_under_zero_end_where_the_uninterrupted_run_ends(ray_cluster, tmp_path, zero):
    """Starts with 2 workers (the third is held back for the join); rank 1 is killed in its
    backward at step 1, a worker joins at step 3 (resharded from live chunks), and rank 0 is
    killed while it sends its snapshot after step 4. Lost workers are replaced as they come.
    The workers share this host: their snapshots are in shared memory, which outlives a
    SIGKILLed owner, and whose names are gone once mapped."""
    named = set(os.listdir(shm.DIRECTORY))
    summary, diff, events, metrics = _run(
        tmp_path, 3, ["kill:step=1:rank=1:phase=allreduce", "join:step=3", "kill:step=4:rank=0:phase=snapshot"],
        zero=zero, steps=7, min_workers=1)
    assert diff < TOL
    changes = [e for e in events if e["kind"] == "membership_changed"]
    failures = [c for c in changes if c["lost"]]
    assert [c["lost_ranks"] for c in failures] == [[1], [0]]
    assert any(c["lost"] == 0 and c["joined"] >= 1 for c in changes)  # the join (and replacements)
    # killed in the backward: the step had not committed anywhere; re-run it alone
    assert failures[0]["restored_step"] == 1 and failures[0]["steps_rerun"] == 1
    # killed as it made its snapshot of step 5 (everyone had committed step 4): in shared
    # memory it is whole before the kill, and its neighbour reads it after the owner's death
    assert failures[1]["restored_step"] == 5
    assert summary.steps == 7 and summary.samples == 7 * TINY_GPT_TASK.defaults.global_batch
    _check_state_memory(events, metrics)
    assert [m["step"] for m in metrics][-1] == 6
    # left behind: a segment whose creator is dead (the suite's other process may have
    # segments of live workers of its own)
    assert not [n for n in set(os.listdir(shm.DIRECTORY)) - named
                if n.startswith(shm.PREFIX) and not alive(int(n[len(shm.PREFIX):].split("-")[0]))]


def test_snapshots_every_k_steps_roll_back_and_replay(ray_cluster, tmp_path):
    summary, diff, events, metrics = _run(tmp_path, 2, ["kill:step=5:rank=1"], zero=2, steps=7,
                                          snapshot_every=4, min_workers=1)
    assert diff < TOL
    change = next(e for e in events if e["kind"] == "membership_changed")
    assert change["restored_step"] == 4 and change["steps_rerun"] == 2  # steps 4 and 5 again
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 4, 5, 6]
    assert summary.steps == 7 and summary.samples == 7 * TINY_GPT_TASK.defaults.global_batch
    _check_state_memory(events, metrics)


def test_two_adjacent_workers_lost_fall_back_to_the_durable_checkpoint(ray_cluster, tmp_path):
    # synchronous saves: the dying ranks' uploads of step 2 would race their deaths in step 3
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2, asynchronous=False)
    summary, diff, events, _ = _run(tmp_path / "out", 3, ["kill:step=3:rank=1:phase=allreduce",
                                                          "kill:step=3:rank=2"], zero=1, min_workers=1,
                                    checkpoint=ckpt)
    assert diff < TOL
    restored = next(e for e in events if e["kind"] == "restored_from_checkpoint")
    assert restored["step"] == 2 and restored["lost_ranks"] == [1, 2]
    assert "ZeRO chunk and its peer snapshot" in restored["decision"]
    assert "restored_from_checkpoint" in summary.render()


def test_adjacent_loss_without_a_checkpoint_fails_clearly(ray_cluster, tmp_path):
    with pytest.raises(Exception, match=r"CheckpointConfig\.dir and CheckpointConfig\.every"):
        _run(tmp_path, 3, ["kill:step=1:rank=1:phase=allreduce", "kill:step=1:rank=2"], zero=2, min_workers=1)


def test_a_non_elementwise_optimizer_is_refused_before_training(ray_cluster, tmp_path):
    task = dataclasses.replace(TINY_GPT_TASK, optimizer=lambda m: torch.optim.LBFGS(m.parameters()))
    with pytest.raises(ConfigError, match=r"TrainConfig\.zero=2 shards optimizer state element by element.*LBFGS"):
        Trainer(task, train=dataclasses.replace(TINY_GPT_TASK.defaults, zero=2),
                cluster=ClusterConfig(workers=2), out_dir=str(tmp_path / "out"), progress=False).fit()
    assert not (tmp_path / "out").exists()


def test_a_worker_lost_while_the_group_reforms_under_zero(ray_cluster, tmp_path):
    """Rank 1 dies in its backward at step 2; the survivors export their chunks and rank 1's
    comes from its neighbour's snapshot; while generation 1 forms, its rank 0 dies as it
    joins. The exported chunks are still in the object store: the next attempt re-cuts
    them for the one worker left (and replacements join later)."""
    summary, diff, events, metrics = _run(
        tmp_path, 3, ["kill:step=2:rank=1:phase=allreduce", "kill:step=2:rank=0:phase=reform"], zero=2,
        min_workers=1)
    assert diff < TOL
    assert [e["lost_ranks"] for e in events if e["kind"] == "reform_interrupted"] == [[0]]
    change = next(e for e in events if e["kind"] == "membership_changed")
    assert change["attempts"] == 2 and change["restored_step"] == 2 and change["steps_rerun"] == 1
    assert summary.steps == 6 and [m["step"] for m in metrics] == list(range(6))
