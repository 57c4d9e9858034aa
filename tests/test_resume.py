"""Checkpoints are world-size independent: saved at N workers, resumed at M."""

from __future__ import annotations

import dataclasses
import json

import pytest
from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.tasks import SCHEDULED_TASK, TINY_GPT_TASK, mlp, sgd_two_groups, warmup_then_exponential

TOL = 2e-5  # float32 reduction order, as in test_sync_equivalence
# worst measured 2.5e-06 (2 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 8x margin


def _fit(workers, out, *, steps, ckpt_dir=None, every=0, resume=False, zero=0):
    checkpoint = CheckpointConfig(dir=str(ckpt_dir) if ckpt_dir else None, every=every, resume=resume)
    return fit(TINY_GPT_TASK, out, workers=workers, checkpoint=checkpoint, steps=steps, zero=zero).summary


def _uninterrupted(out, steps: int):
    """The plain PyTorch replay of ``steps`` steps from the weights the run in ``out`` began with."""
    return replay(TINY_GPT_TASK, dataclasses.replace(TINY_GPT_TASK.defaults, steps=steps),
                  str(out / "initial.safetensors"))


def test_resume_at_other_worker_count_matches_uninterrupted_run(ray_cluster, tmp_path):
    """ZeRO-1 at 3 workers saves after steps 2 and 4, every rank its own chunk of the
    optimizer state, and stops at 4; resumed at 2 workers (each chunk re-cut from the
    name-keyed checkpoint) to step 6, it ends on the uninterrupted replay. (Stage 2's
    parts load at 2 and 4 on thread ranks in tests/test_zero.py; a stage-1 checkpoint at
    stage 0 in tests/test_s3.py.)"""
    _fit(3, tmp_path / "first", steps=4, ckpt_dir=tmp_path / "ckpt", every=2, zero=1)
    assert sorted(p.name[:13] for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-00000004-*/manifest.json")).read_text())
    assert manifest["world_size"] == 3
    assert sorted(f for f in manifest["files"] if f.startswith("optim-")) == [f"optim-0000{r}.safetensors"
                                                                              for r in range(3)]
    summary = _fit(2, tmp_path / "second", steps=6, ckpt_dir=tmp_path / "ckpt", resume=True, zero=1)

    straight = _uninterrupted(tmp_path / "first", 6)
    resumed = load_file(tmp_path / "second" / "final.safetensors")
    assert max_abs_diff(straight, resumed) < TOL
    # the resumed run trained only the missing steps, from the checkpoint's weights
    assert summary.steps == 2 and summary.samples == 2 * TINY_GPT_TASK.defaults.global_batch
    first_final = load_file(tmp_path / "first" / "final.safetensors")
    assert max_abs_diff(first_final, load_file(tmp_path / "second" / "initial.safetensors")) == 0.0
    events = read_lines(tmp_path / "second" / "events.jsonl")
    resumed_event = next(e for e in events if e["kind"] == "resumed")
    assert resumed_event["step"] == 4 and resumed_event["saved_world_size"] == 3
    assert resumed_event["world_size"] == 2
    metrics = read_lines(tmp_path / "second" / "metrics.jsonl")
    assert [m["generation"] for m in metrics] == [0, 0]  # resumed into generation 0, formed once
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-00000006-*/manifest.json")).read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == 2


def test_a_torch_scheduler_across_a_kill_a_join_and_a_resume_ends_on_the_plain_loop(ray_cluster, tmp_path):
    """A chained torch scheduler (warmup, then x0.8 a step): 2 workers, rank 1 killed in
    step 2, one more joining at step 4, checkpoints every 3 steps, stopped after 6; resumed
    at 2 workers to step 10. A plain loop steps the scheduler after each of the 10 steps."""
    task = SCHEDULED_TASK
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=3)
    Trainer(task, train=dataclasses.replace(task.defaults, steps=6), cluster=ClusterConfig(workers=3, min_workers=1),
            checkpoint=ckpt, out_dir=str(tmp_path / "first"), progress=False,
            inject=["kill:step=2:rank=1", "join:step=4"]).fit()
    changes = [e for e in read_lines(tmp_path / "first" / "events.jsonl") if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-00000006-*/manifest.json")).read_text())
    assert manifest["optimizer"]["scheduler"]["last_epoch"] == 6
    Trainer(task, train=dataclasses.replace(task.defaults, steps=10), cluster=ClusterConfig(workers=2),
            checkpoint=dataclasses.replace(ckpt, resume="latest"), out_dir=str(tmp_path / "second"),
            progress=False).fit()
    config = dataclasses.replace(task.defaults, steps=10)
    expected = replay(task, config, str(tmp_path / "first" / "initial.safetensors"), scheduler=warmup_then_exponential)
    assert max_abs_diff(load_file(tmp_path / "second" / "final.safetensors"), expected) < TOL
    optimizer = sgd_two_groups(mlp())
    loop, rates = warmup_then_exponential(optimizer), []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        loop.step()
    logged = {m["step"]: m["lr"] for d in ("first", "second") for m in read_lines(tmp_path / d / "metrics.jsonl")}
    assert [logged[s] for s in range(10)] == [pytest.approx(r) for r in rates]
