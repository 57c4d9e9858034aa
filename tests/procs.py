"""Worker actor processes on this machine, seen from outside the program (/proc); scenario
scripts run in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_scenario_script(module: str, *args: str, timeout_s: float = 240) -> dict:
    """Run ``python -m module args...`` from the repository (a Ray cluster of its own: no
    ``RAY_ADDRESS`` passed on) and return the JSON of its last line of output."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_pids() -> list[int]:
    """PIDs of the processes running an elastic_dp worker actor of this test process's Ray
    cluster (its descendants: the suite's other process has a cluster of its own)."""
    ours = set(descendants(os.getpid()))
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) in ours and b"WorkerActor" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(int(pid))
        except OSError:
            pass
    return sorted(found)


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ('' when it is gone)."""
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """PIDs of every process below ``root`` in the process tree."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and parens
        children.setdefault(parent, []).append(int(pid))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
