"""A worker process keeps freed memory for its next step (elastic_dp.malloc), in fresh
processes: the allocator's settings last for the life of a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_STEPS = """
import json, resource, sys, threading
import torch
from elastic_dp.malloc import keep_freed_memory
from jobs.gpt import TASK

torch.set_num_threads(1)
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
out = {}
if sys.argv[2:] == ["--no-steps"]:
    print(json.dumps({"kept": kept}))
    sys.exit(0)

def train():  # on a thread of its own, as a worker actor's training thread
    torch.manual_seed(0)
    model, dataset = TASK.model(), TASK.dataset()
    optimizer = TASK.optimizer(model)
    batch = TASK.collate([dataset[i] for i in range(16)])
    for step in range(13):
        if step == 3:  # warm: what the first steps allocate for good is in place
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        optimizer.zero_grad()
        TASK.loss(model, batch).backward()
        optimizer.step()
    out["faults_per_step"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

thread = threading.Thread(target=train)
thread.start()
thread.join()
print(json.dumps({"kept": kept, **out}))
"""


def _start(*args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _STEPS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_a_worker_process_reuses_the_memory_its_last_step_freed():
    default, kept = _start("default"), _start("keep")  # side by side: each counts its own faults
    default, kept = _result(default), _result(kept)
    assert kept["kept"] is True
    # each page the step touches anew is a fault: with glibc's defaults 150 to 2,000 per GPT step
    # (its thresholds adapt to what is freed first, which varies from run to run)
    assert default["faults_per_step"] > 50, default
    assert kept["faults_per_step"] < default["faults_per_step"] / 4, (kept, default)  # measured: 6x to 4000x


def test_the_users_own_allocator_settings_win():
    mine, off = (_start("keep", "--no-steps", MALLOC_TRIM_THRESHOLD_="131072"),
                 _start("keep", "--no-steps", ELASTIC_DP_KEEP_FREED_MEMORY="0"))
    assert _result(mine)["kept"] is False
    assert _result(off)["kept"] is False
