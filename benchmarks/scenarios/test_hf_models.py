"""Hugging Face causal LMs built from their configurations (jobs/hf_causal_lm.py, nothing
downloaded): GPT-2 and a tiny Llama (grouped-query attention, rotary positions, a gated MLP)
through a kill and a join, on the plain replay. In the scenarios for the suite's time (about
18 s and 37 s on 2 cores); the suite keeps the refusal and a Mixtral at ZeRO-3
(tests/test_hf_job.py). .ci/run runs them."""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file

from elastic_dp import ClusterConfig, Trainer
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.test_hf_job import TINY, TOL

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_tiny_model_from_its_config_through_a_kill_and_a_join_ends_on_the_replay(ray_cluster, tmp_path, model):
    from jobs.hf_causal_lm import make_task

    task = make_task(model, TINY[model], context=16, lr=3e-3)
    config = dataclasses.replace(task.defaults, steps=6, global_batch=8, micro_batch=4, warmup_steps=2,
                                 decay_steps=6)
    Trainer(task, train=config, cluster=ClusterConfig(workers=3, min_workers=1), out_dir=str(tmp_path),
            progress=False, inject=["kill:step=2:rank=1", "join:step=4"]).fit()
    changes = [e for e in read_lines(tmp_path / "events.jsonl") if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    assert [m["step"] for m in read_lines(tmp_path / "metrics.jsonl")] == list(range(6))
    final = load_file(tmp_path / "final.safetensors")
    expected = replay(task, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(final, expected) < TOL
    assert max_abs_diff(final, load_file(tmp_path / "initial.safetensors")) > 1e-3, "training moved the model"
