"""The main job end to end, in the form a Ray job entrypoint uses (``python -m jobs.gpt``),
on an embedded local Ray that the command starts and stops itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from jobs.gpt import build_model
from tests.records import read_lines

pytestmark = pytest.mark.ray  # it starts Ray in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def test_standard_output_is_the_summary_alone_through_a_kill(tmp_path):
    """A worker killed mid-run makes Ray's raylet print its note (\"A worker died or was killed
    ... OOM killer ...\") on the driver's stdout: it goes to stderr, and stdout is the summary,
    from its first line; no worker says it was sent SIGTERM as the run ends."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_dp.cli", "train", "jobs.gpt", "--workers", "1:2", "--steps", "6",
         "--out", str(tmp_path / "out"), "--no-progress", "--inject", "kill:step=3:rank=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("elastic_dp run summary\n"), proc.stdout[:2000]
    assert "raylet" not in proc.stdout and "A worker died" not in proc.stdout, proc.stdout
    assert "SIGTERM" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "the injected fault kill:step=3:rank=1" in proc.stdout  # the summary's event names it


def test_gpt_job_writes_weights_metrics_events_and_summary(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.gpt", "--workers", "2", "--steps", "6", "--global-batch", "8",
         "--micro-batch", "2", "--out", str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
         "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "elastic_dp run summary" in proc.stdout and "sample" in proc.stdout

    keys = set(build_model().state_dict())
    for name in ("initial", "final"):
        assert set(load_file(out / f"{name}.safetensors")) == keys
    metrics = read_lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(6))
    assert all(m["world_size"] == 2 and m["generation"] == 0 and m["samples"] == 8 for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    events = read_lines(out / "events.jsonl")
    assert [e["kind"] for e in events] == ["mesh", "group_formed", "state_memory", "checkpoint_saved",
                                           "checkpoint_saved"]
    assert events[0]["generation"] == 0 and len(events[0]["hosts"]) == 2  # one address a rank, on this machine
    params = 4 * sum(p.numel() for p in build_model().parameters())  # fp32, replicated at stage 0
    memory = events[2]
    assert [(r["rank"], r["parameters"]) for r in memory["ranks"]] == [(0, params), (1, params)]
    tensors = len(list(build_model().parameters()))  # AdamW: two moments, and a step count per tensor
    assert all(r["gradients"] == params and 2 * params < r["optimizer"] <= 2 * params + 8 * tensors
               for r in memory["ranks"]), memory
    assert all(isinstance(e["time"], float) for e in events)
    assert sorted(p.name[:13] for p in ckpt.iterdir()) == ["step-00000003", "step-00000006"]
