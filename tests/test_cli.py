"""The main job end to end, in the form a Ray job entrypoint uses (``python -m jobs.gpt``),
on an embedded local Ray that the command starts and stops itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
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
    events = (tmp_path / "out" / "events.jsonl").read_text()  # what the run saw, where the summary misses it
    assert "the injected fault kill:step=3:rank=1" in proc.stdout, (proc.stdout, events)  # the summary names it


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


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _sigint_as_in_a_terminal() -> None:
    """A suite started in the background (``&`` without job control) runs with SIGINT
    ignored, which its children inherit, and Python then never raises KeyboardInterrupt;
    the command under test gets SIGINT as it does in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("after", ["starting an embedded local Ray", "workers; model has", "event checkpoint_saved"],
                         ids=["in-ray-init", "formed", "mid-run"])
def test_ctrl_c_ends_the_run_in_one_line_with_exit_130_and_leaves_nothing_behind(tmp_path, after):
    """SIGINT to the command's process group (what Ctrl-C in a terminal sends), once its log
    shows it is starting Ray, has formed the group, or has saved a checkpoint: exit 130, one
    line that says where the run stopped and how to go on, no traceback, every process it
    started ended, no checkpoint without its manifest, no final weights."""
    from tests.procs import descendants

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_dp.cli", "train", "jobs.gpt", "--steps", "400",
                             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--out", str(out),
                             "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=_sigint_as_in_a_terminal)
    seen = []
    for line in proc.stderr:  # its log, until the moment to interrupt it
        seen.append(line)
        if after in line:
            break
    started = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    rest, stderr = proc.communicate(timeout=120)
    said = [line for line in stderr.splitlines() if line.startswith("elastic-dp:") or "Traceback" in line]
    assert proc.returncode == 130, "".join(seen[-5:]) + stderr[-3000:]
    assert len(said) == 1 and said[0].startswith("elastic-dp: interrupted "), said
    if after == "event checkpoint_saved":
        assert re.match(r"elastic-dp: interrupted after \d+ committed steps of 400; the latest checkpoint is of step "
                        r"\d+, .*: go on from it with --resume$", said[0]), said
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if _alive(pid)], [open(f"/proc/{p}/cmdline").read() for p in started if _alive(p)]
    assert all((d / "manifest.json").exists() for d in ckpt.iterdir()) if ckpt.exists() else True
    assert not (out / "final.safetensors").exists()


def test_ctrl_c_while_the_command_loads_torch_and_ray_ends_in_one_line_with_exit_130(tmp_path):
    """SIGINT to the installed ``elastic-dp`` command 0.3 s after its exec, while it imports
    torch and Ray (a bare ``import torch, ray`` takes 1.3 s here, warm): exit 130 and the one line, no traceback, nothing written."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = tmp_path / "out"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "elastic-dp"), "train", "jobs.gpt", "--steps", "3",
                             "--out", str(out), "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_sigint_as_in_a_terminal)
    # counted from the exec: a SIGINT between the fork and preexec_fn meets pytest's handler,
    # which only sets a flag the exec drops, and the run then trained (once on a loaded clone)
    cmdline, deadline = Path(f"/proc/{proc.pid}/cmdline"), time.monotonic() + 30
    ours = Path("/proc/self/cmdline").read_bytes()  # the child's until its exec
    while cmdline.read_bytes() == ours and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.splitlines() == ["elastic-dp: interrupted before the run started: nothing was trained or written"]
    assert stdout == "" and not out.exists()
