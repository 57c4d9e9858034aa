"""The main job submitted with the real ``ray job submit`` CLI to a Ray cluster that this
test starts (``ray start --head --block``, its own temp dir and ports, token auth on) and
stops itself."""

from __future__ import annotations

import json
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

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


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


def _wait_for_job(address: str, job_id: str, env: dict, timeout_s: float) -> str:
    """Poll ``ray job status`` until the job ends; its terminal status in upper case."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", address, job_id], env=env,
                                capture_output=True, text=True, timeout=60)
        text = (status.stdout + status.stderr).upper()
        for final in ("SUCCEEDED", "FAILED", "STOPPED"):
            if final in text:
                return final
        time.sleep(2)
    raise AssertionError(f"job {job_id} did not end within {timeout_s} s")


def test_gpt_job_under_ray_job_submit_with_token_auth(tmp_path):
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
    try:
        deadline = time.monotonic() + 90
        while subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(1)
        wrong = dict(env, RAY_AUTH_TOKEN=secrets.token_hex(16))
        refused = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=wrong,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0, "token auth must refuse a wrong token"

        out = tmp_path / "out"
        # --no-wait, then poll: tailing the logs over the dashboard's websocket sometimes
        # drops (close code 1006) while the job runs on, which is not the job's failure.
        job_id = f"edp-{secrets.token_hex(4)}"
        submit = [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", job_id,
                  "--no-wait", "--working-dir", str(ROOT), "--",
                  "python", "-m", "jobs.gpt", "--workers", "2", "--steps", "4", "--global-batch", "8",
                  "--zero", "2", "--no-progress", "--out", str(out)]  # stage 0 runs in test_cli
        while True:  # the job server answers before its agent is up; Ray says to retry
            job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120)
            if "No available agent to submit job" not in job.stderr + job.stdout or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
        status = _wait_for_job(address, job_id, env, timeout_s=200)
        logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", address, job_id], env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert status == "SUCCEEDED", f"job ended {status}:\n{logs[-4000:]}"
        assert "elastic_dp run summary" in logs
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [0, 1, 2, 3]
        assert (out / "final.safetensors").is_file()
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its cluster on SIGTERM
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
        time.sleep(1)
        _kill_leftovers(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
