"""Long scenarios of ``--mode async`` (moved out of tests/test_async.py to keep the suite
within its time; ``python3 dev.py test benchmarks/scenarios`` runs them): checkpoints
passed between the modes, and a parameter-server shard lost before and after a copy."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import torch
from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import TINY_GPT_TASK, PacedLoss, paced_task
from tests.test_async import TOL, _replayed, _train


def test_one_worker_and_checkpoints_passed_between_the_modes_end_on_the_replay(ray_cluster, tmp_path):
    """Async on one worker (default staleness bound, 2 shards: every update is computed on
    the version before it) saves at step 2, bit for bit where sync on one worker is after
    2 steps; sync at 2 workers resumes it and saves at 4;
    async at staleness 0 resumes that to 6. The run ends on the plain replay of 6 steps."""
    task = TINY_GPT_TASK
    config = dataclasses.replace(task.defaults, steps=6)
    ckpt = tmp_path / "ckpt"

    def fit(out, workers, steps, resume, **train):
        Trainer(task, train=dataclasses.replace(config, steps=steps, **train),
                cluster=ClusterConfig(workers=workers), out_dir=str(tmp_path / out), progress=False,
                checkpoint=CheckpointConfig(dir=str(ckpt), every=2, resume=resume)).fit()

    fit("async", 1, 2, "never", mode="async", ps_shards=2)
    Trainer(task, train=dataclasses.replace(config, steps=2), cluster=ClusterConfig(workers=1),
            out_dir=str(tmp_path / "sync-one"), progress=False).fit()
    one_async, one_sync = (load_file(tmp_path / d / "final.safetensors") for d in ("async", "sync-one"))
    assert all(torch.equal(one_async[k], one_sync[k]) for k in one_sync)  # one worker: async is sync, bit for bit
    manifest = json.loads(next(ckpt.glob("step-00000002-*/manifest.json")).read_text())
    assert sorted(manifest["files"]) == ["model-00000.safetensors", "model-00001.safetensors",
                                         "optim-00000.safetensors", "optim-00001.safetensors"]  # a pair per shard
    fit("sync", 2, 4, "latest")
    fit("async-again", 2, 6, "latest", mode="async", max_staleness=0)
    expected = replay(task, config, str(tmp_path / "async" / "initial.safetensors"))
    assert max_abs_diff(load_file(tmp_path / "async-again" / "final.safetensors"), expected) < TOL
    resumed = read_lines(tmp_path / "async-again" / "updates.jsonl")
    assert [(u["version"], u["step"]) for u in resumed] == [(5, 4), (6, 5)]


def test_a_lost_parameter_server_shard_restores_the_checkpoint_or_rolls_back_to_a_snapshot(ray_cluster, tmp_path):
    """Two shards, copies every 4 versions, a checkpoint every 2 steps. Shard 1 dies as
    it applies update 3, before any copy: the run restores the checkpoint of step 2.
    Shard 0 dies as it applies update 9: the model rolls back to version 8, the newest
    copy both shards still hold (shard 1 its own, shard 0 the copy shard 1 keeps), and
    the updates after it are undone and their steps trained again. The run ends on the
    replay of updates.jsonl, every step applied once."""
    task = paced_task(PacedLoss(seconds=0.005))
    summary, config, updates, events = _train(
        tmp_path, task, workers=2, steps=12, max_staleness=2, ps_shards=2, snapshot_every=4,
        inject=["kill:step=3:rank=1:phase=shard", "kill:step=9:rank=0:phase=shard"],
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2))
    assert next(e for e in events if e["kind"] == "restored_from_checkpoint")["step"] == 2
    restored = next(e for e in events if e["kind"] == "ps_shards_restored")
    assert restored["shards"] == [0] and restored["version"] == 8
    final = {u["version"]: u for u in updates}
    assert summary.staleness == Counter(u["staleness"] for u in final.values())  # undone updates not counted
    assert _replayed(tmp_path, dataclasses.replace(task, loss=PacedLoss()), config, updates) < TOL
