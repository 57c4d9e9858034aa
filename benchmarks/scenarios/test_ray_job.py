"""Jobs submitted with the real ``ray job submit`` CLI to a Ray cluster that this module
starts (``ray start --head --block``, its own temp dir and ports, token auth on) and stops
itself: the main job, and a job whose driver is killed and which is submitted again. A
long scenario (``python3 dev.py test benchmarks/scenarios``), out of the suite to keep it
within its time."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.procs import alive, cmdline, descendants
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import PacedLoss, paced_task

pytestmark = pytest.mark.ray  # it starts Ray in a subprocess

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOL = 2e-5  # SGD on the MLP over 30 steps: float32 reduction order only (as in test_node_loss);
# measured 1.6e-07 (one scenario run on 2026-12-04, python -m tests.noise): 120x margin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_leftovers(marker: str) -> None:
    """SIGKILL any process whose command line names this test's own temp dir."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_for_job(address: str, job_id: str, env: dict, timeout_s: float, written: Path | None = None) -> str:
    """Poll ``ray job status`` until the job ends; its terminal status in upper case.
    ``written``: a file the job writes near its end; until it exists, the status is asked
    only every 5 s (each ``ray job status`` is a process that imports Ray, on the cores
    the job trains on)."""
    deadline, asked = time.monotonic() + timeout_s, -math.inf
    while time.monotonic() < deadline:
        if written is not None and not written.exists() and time.monotonic() - asked < 5:
            time.sleep(0.1)
            continue
        asked = time.monotonic()
        status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", address, job_id], env=env,
                                capture_output=True, text=True, timeout=60)
        text = (status.stdout + status.stderr).upper()
        for final in ("SUCCEEDED", "FAILED", "STOPPED"):
            if final in text:
                return final
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end within {timeout_s} s")


@dataclasses.dataclass
class JobCluster:
    address: str
    env: dict
    temp_dir: str
    head: subprocess.Popen

    def ray(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ray"), *args], env=env or self.env, capture_output=True, text=True,
                              timeout=timeout)

    def submit(self, job_id: str, entrypoint: list[str], env_vars: dict[str, str] | None = None) -> None:
        """``ray job submit --no-wait``: tailing the logs over the dashboard's websocket
        sometimes drops (close code 1006) while the job runs on, which is not the job's failure.
        ``env_vars`` go into the job's runtime environment (its driver and workers)."""
        runtime_env = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
        deadline = time.monotonic() + 90
        while True:  # the job server answers before its agent is up; Ray says to retry
            job = self.ray("job", "submit", "--address", self.address, "--submission-id", job_id, "--no-wait",
                           "--working-dir", str(ROOT), *runtime_env, "--", *entrypoint)
            if "No available agent to submit job" not in job.stderr + job.stdout or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]

    def logs(self, job_id: str) -> str:
        return self.ray("job", "logs", "--address", self.address, job_id, timeout=60).stdout


@pytest.fixture(scope="module")
def job_cluster():
    """A Ray head started with ``ray start --head --block`` (its own temp dir and ports,
    token auth on), stopped by this module."""
    temp_dir = tempfile.mkdtemp(prefix="edp-job-", dir="/tmp")
    dashboard = _free_port()
    address = f"http://127.0.0.1:{dashboard}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PATH=f"{BIN}{os.pathsep}{env['PATH']}", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(16))
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={_free_port()}",
         # every port of its own: the suite's other cluster holds Ray's default agent ports
         *(f"--{name}-port={_free_port()}" for name in (
             "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent", "metrics-export",
             "ray-client-server", "node-manager", "object-manager")),
         f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
         "--num-cpus=3", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    cluster = JobCluster(address, env, temp_dir, head)
    try:
        deadline = time.monotonic() + 90
        while cluster.ray("job", "list", "--address", address).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(1)
        yield cluster
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its cluster on SIGTERM
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
        time.sleep(1)
        _kill_leftovers(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_gpt_job_under_ray_job_submit_with_token_auth(job_cluster, tmp_path):
    wrong = dict(job_cluster.env, RAY_AUTH_TOKEN=secrets.token_hex(16))
    refused = job_cluster.ray("job", "list", "--address", job_cluster.address, env=wrong, timeout=60)
    assert refused.returncode != 0, "token auth must refuse a wrong token"
    out = tmp_path / "out"
    job_id = f"edp-{secrets.token_hex(4)}"
    job_cluster.submit(job_id, ["python", "-m", "jobs.gpt", "--workers", "2", "--steps", "4", "--global-batch", "8",
                                "--zero", "2", "--no-progress", "--out", str(out)])  # stage 0 runs in test_cli
    status = _wait_for_job(job_cluster.address, job_id, job_cluster.env, timeout_s=200,
                           written=out / "final.safetensors")
    logs = job_cluster.logs(job_id)
    assert status == "SUCCEEDED", f"job ended {status}:\n{logs[-4000:]}"
    assert "elastic_dp run summary" in logs
    metrics = read_lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert (out / "final.safetensors").is_file()


def _run_pids(job_cluster: JobCluster, out: Path) -> tuple[int, list[int]]:
    """The run's driver process and its worker actors' processes (under this head's raylet)."""
    raylet = next(int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                  if "raylet" in cmdline(int(p)) and job_cluster.temp_dir in cmdline(int(p)))
    driver = next(int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                  if "tests.scripts.paced_job" in cmdline(int(p)) and str(out) in cmdline(int(p))
                  and "python" in cmdline(int(p)).split()[0])
    workers = [p for p in descendants(raylet) if cmdline(p).startswith("ray::WorkerActor")]
    return driver, workers


def test_a_resubmitted_job_resumes_where_the_killed_one_stopped(job_cluster, tmp_path):
    """The driver of a running job is SIGKILLed; nothing of the run stays behind; the same
    ``ray job submit`` command again continues from the last checkpoint (``--resume auto``,
    the default with ``--storage``) and ends on the parameters of an uninterrupted run."""
    out, storage, steps = tmp_path / "out", tmp_path / "storage", 30
    command = ["python", "-m", "tests.scripts.paced_job", "--workers", "2", "--steps", str(steps),
               "--storage", str(storage), "--checkpoint-every", "5", "--no-progress", "--out", str(out)]
    fast = {"EDP_PACED_UNTIL": str(tmp_path / "fast")}  # once it exists, the steps are not paced
    first = f"edp-{secrets.token_hex(4)}"
    job_cluster.submit(first, command, fast)
    deadline = time.monotonic() + 120
    while not list(storage.glob("*/step-*/manifest.json")):  # the first checkpoint is committed
        assert time.monotonic() < deadline, job_cluster.logs(first)[-4000:]
        time.sleep(0.05)
    driver, workers = _run_pids(job_cluster, out)
    tree = [driver, *descendants(driver), *workers]
    initial = tmp_path / "initial.safetensors"
    shutil.copy(out / "initial.safetensors", initial)
    os.kill(driver, signal.SIGKILL)
    assert len(workers) == 2
    assert _wait_for_job(job_cluster.address, first, job_cluster.env, timeout_s=60) == "FAILED"
    metrics = read_lines(out / "metrics.jsonl")
    assert len(metrics) < steps, "the run ended before its driver was killed"
    deadline = time.monotonic() + 60
    while [p for p in tree if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [(p, cmdline(p)) for p in tree if alive(p)] == []  # the killed driver left nothing behind
    saved = max(int(m.parent.name[5:13]) for m in storage.glob("*/step-*/manifest.json"))

    second = f"edp-{secrets.token_hex(4)}"
    (tmp_path / "fast").touch()  # the resumed run need not last: nothing is killed in it
    job_cluster.submit(second, command, fast)
    status = _wait_for_job(job_cluster.address, second, job_cluster.env, timeout_s=200,
                           written=out / "final.safetensors")
    assert status == "SUCCEEDED", job_cluster.logs(second)[-4000:]
    events = read_lines(out / "events.jsonl")
    decision = next(e for e in events if e["kind"] == "resume_decision")
    assert decision["resumed"] and decision["step"] == saved
    metrics = read_lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(saved, steps))
    task = paced_task(PacedLoss())  # the same task without the sleeps
    expected = replay(task, dataclasses.replace(task.defaults, steps=steps), str(initial))
    assert max_abs_diff(load_file(out / "final.safetensors"), expected) < TOL
