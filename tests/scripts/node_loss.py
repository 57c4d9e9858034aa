"""Run in its own process by tests/test_node_loss.py: a two-node Ray cluster on this
machine (ray.cluster_utils.Cluster); the second node is removed while training runs.
Prints one JSON line with what the test checks.

    python -m tests.scripts.node_loss OUT replicated   one worker per node, stage 0
    python -m tests.scripts.node_loss OUT zero         two workers per node, ZeRO-2
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from tests.reference import max_abs_diff, replay
from tests.tasks import TINY_GPT_TASK, PacedLoss, paced_task

# replicated: micro-batches of 1 make each step ~10x slower, so the node (removed after
# step 5) is gone well before the end; more steps instead would let AdamW amplify float32
# reduction noise past the tolerance (measured: 2e-3 after 200 uninterrupted steps).
# zero: the SGD task, paced by a sleep in its loss, for the same reason.
SCENARIOS = {
    "replicated": dict(task=TINY_GPT_TASK, steps=40, micro_batch=1, per_node=1, zero=0),
    "zero": dict(task=paced_task(PacedLoss(seconds=0.03)), steps=30, micro_batch=1, per_node=2, zero=2),
}


def main(out: Path, scenario: str) -> None:
    s = SCENARIOS[scenario]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": s["per_node"], "include_dashboard": False})
    second = cluster.add_node(num_cpus=s["per_node"])
    ray.init(address=cluster.address, log_to_driver=False)
    task = s["task"]
    config = dataclasses.replace(task.defaults, steps=s["steps"], micro_batch=s["micro_batch"], zero=s["zero"])
    removed_at = []

    def remove_second_node():
        metrics = out / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
            time.sleep(0.01)
        removed_at.append(len(metrics.read_text().splitlines()))
        cluster.remove_node(second, allow_graceful=False)

    thread = threading.Thread(target=remove_second_node)
    thread.start()
    workers = 2 * s["per_node"]
    try:  # a checkpoint to fall back to, so that a fallback would show (and not fail the run)
        Trainer(task, train=config, cluster=ClusterConfig(workers=workers, min_workers=s["per_node"]),
                checkpoint=CheckpointConfig(dir=str(out / "ckpt"), every=4), out_dir=str(out),
                progress=False).fit()
    finally:
        thread.join()
        ray.shutdown()
        cluster.shutdown()
    unpaced = dataclasses.replace(task, loss=PacedLoss()) if scenario == "zero" else task
    expected = replay(unpaced, config, str(out / "initial.safetensors"))
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"diff": max_abs_diff(load_file(out / "final.safetensors"), expected),
                      "removed_after_steps": removed_at[0], "events": events,
                      "steps": [m["step"] for m in metrics], "world_sizes": [m["world_size"] for m in metrics]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "replicated")
