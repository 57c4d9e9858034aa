"""Checkpoints are world-size independent: saved at N workers, resumed at M."""

from __future__ import annotations

import dataclasses
import json
import shutil

from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import TINY_GPT_TASK

TOL = 2e-5  # float32 reduction order, as in test_sync_equivalence


def _fit(workers, out, *, steps, ckpt_dir=None, every=0, resume=False, zero=0):
    config = dataclasses.replace(TINY_GPT_TASK.defaults, steps=steps, zero=zero)
    checkpoint = CheckpointConfig(dir=str(ckpt_dir) if ckpt_dir else None, every=every, resume=resume)
    return Trainer(TINY_GPT_TASK, train=config, cluster=ClusterConfig(workers=workers),
                   checkpoint=checkpoint, out_dir=str(out), progress=False).fit()


def _uninterrupted(out, steps: int):
    """The plain PyTorch replay of ``steps`` steps from the weights the run in ``out`` began with."""
    return replay(TINY_GPT_TASK, dataclasses.replace(TINY_GPT_TASK.defaults, steps=steps),
                  str(out / "initial.safetensors"))


def test_resume_at_other_worker_count_matches_uninterrupted_run(ray_cluster, tmp_path):
    # Save at 3 workers after steps 2 and 4, stop at 4; resume at 2 workers to step 6.
    _fit(3, tmp_path / "first", steps=4, ckpt_dir=tmp_path / "ckpt", every=2)
    assert sorted(p.name[:13] for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]
    summary = _fit(2, tmp_path / "second", steps=6, ckpt_dir=tmp_path / "ckpt", resume=True)

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


def test_zero_checkpoint_saved_at_3_resumes_at_2(ray_cluster, tmp_path):
    """Every rank's shard is joined into one name-keyed checkpoint; it loads at another
    size. (Stage 1 here; tests/test_zero.py loads stage 2's at 2 and 4 on thread ranks.)"""
    zero = 1
    _fit(3, tmp_path / "first", steps=3, ckpt_dir=tmp_path / "ckpt", zero=zero)
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-00000003-*/manifest.json")).read_text())
    assert manifest["world_size"] == 3
    # every rank wrote its own chunk of the optimizer state
    assert sorted(f for f in manifest["files"] if f.startswith("optim-")) == [f"optim-0000{r}.safetensors"
                                                                              for r in range(3)]
    straight = _uninterrupted(tmp_path / "first", 6)
    for workers in (2,):
        ckpt = tmp_path / f"ckpt-{workers}"
        shutil.copytree(tmp_path / "ckpt", ckpt)
        _fit(workers, tmp_path / f"at-{workers}", steps=6, ckpt_dir=ckpt, resume=True, zero=zero)
        resumed = load_file(tmp_path / f"at-{workers}" / "final.safetensors")
        assert max_abs_diff(straight, resumed) < TOL, workers
