"""Losing a node: a two-node Ray cluster on this machine, the node of rank 1 removed
mid-run. The survivor re-forms in place and the run ends at the uninterrupted parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-5  # as in test_sync_equivalence


def test_losing_a_node_reforms_over_the_survivor(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.node_loss", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["diff"] < TOL
    assert report["steps"] == list(range(40))
    changes = [e for e in report["events"] if e["kind"] == "membership_changed"]
    assert changes, f"no membership change; the node was removed after step {report['removed_after_steps']}"
    change = changes[0]
    assert change["lost"] == 1 and change["world_size"] == 1
    assert report["world_sizes"][0] == 2 and report["world_sizes"][-1] == 1
