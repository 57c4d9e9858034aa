"""Run in its own process by benchmarks/scenarios/test_node_loss.py: a two-node Ray cluster on this
machine (ray.cluster_utils.Cluster); the second node is removed while training runs.
Prints one JSON line with what the test checks.

    python -m tests.scripts.node_loss OUT replicated   one worker per node, stage 0
    python -m tests.scripts.node_loss OUT zero         two workers per node, ZeRO-2
    python -m tests.scripts.node_loss OUT zero3        the same at ZeRO-3 (the MLP's layers its units)

In the zero scenarios the second node joins after the run has started on the first
node's two workers, so the workers become ready node by node (A A B B), and the rank
order keeps them so: only the snapshot ring (0 2 1 3, ``comm.mesh.Mesh.ring``) keeps each
peer snapshot on the other node. It is also
how an autoscaler grows a run: the run asks for room for MAX workers
(``request_resources``; this local cluster has no autoscaler, so the request is read
back from where Ray keeps it), starts on the MIN that fit, and the workers placed on the
new node join at a step boundary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from tests.reference import max_abs_diff, replay
from tests.scripts.scenario import autoscaler_request, lines, local_cluster, training, wait_for
from tests.tasks import TINY_GPT_TASK, PacedLoss, mlp_units, paced_task

# replicated: micro-batches of 1 make each step ~10x slower, so the node (removed after
# step 5) is gone well before the end; more steps instead would let AdamW amplify float32
# reduction noise past the tolerance (measured: 2e-3 after 200 uninterrupted steps).
# zero: the SGD task, paced by a sleep in its loss, for the same reason; once the node is
# gone and the survivors trained a step as the new group, the rest runs unpaced (FAST).
# Paced, the 60 steps last 18 s (micro-batches of 1: 0.3 s a step per micro-batch at
# least): time for the second node's workers to start and join on a loaded machine (at
# 0.05 s the run could end first when the suite's other process took the CPU).
FAST = Path(tempfile.gettempdir()) / f"edp-node-loss-fast-{os.getpid()}"
SCENARIOS = {
    "replicated": dict(task=TINY_GPT_TASK, steps=40, micro_batch=1, per_node=1, zero=0),
    "zero": dict(task=paced_task(PacedLoss(seconds=0.3, until=str(FAST))), steps=60, micro_batch=1, per_node=2,
                 zero=2),
    "zero3": dict(task=dataclasses.replace(paced_task(PacedLoss(seconds=0.3, until=str(FAST))), shard_units=mlp_units),
                  steps=60, micro_batch=1, per_node=2, zero=3),
}


def main(out: Path, scenario: str) -> None:
    s = SCENARIOS[scenario]
    cluster = local_cluster(s["per_node"])
    late = scenario in ("zero", "zero3")
    second = None if late else cluster.add_node(num_cpus=s["per_node"])
    task = s["task"]
    config = dataclasses.replace(task.defaults, steps=s["steps"], micro_batch=s["micro_batch"], zero=s["zero"])
    removed_at, requests = [], {}

    def fit():  # a checkpoint to fall back to, so that a fallback would show (and not fail the run)
        Trainer(task, train=config, cluster=ClusterConfig(workers=2 * s["per_node"], min_workers=s["per_node"]),
                checkpoint=CheckpointConfig(dir=str(out / "ckpt"), every=4), out_dir=str(out), progress=False).fit()

    with training(fit, cluster, FAST) as thread:
        metrics = out / "metrics.jsonl"
        if late:  # the second node's workers join the running group, then it goes
            wait_for(metrics, lambda ms: len(ms) >= 2)
            requests["running"] = autoscaler_request()
            second = cluster.add_node(num_cpus=s["per_node"])
            wait_for(metrics, lambda ms: sum(m["world_size"] == 2 * s["per_node"] for m in ms) >= 3)
        else:
            wait_for(metrics, lambda ms: len(ms) >= 5)
        removed_at.append(len(lines(metrics)))
        cluster.remove_node(second, allow_graceful=False)
        if late:  # the loss is handled once a step of 2 workers follows the 4-worker ones
            wait_for(metrics, lambda ms: ms and ms[-1]["world_size"] == s["per_node"]
                     and any(m["world_size"] == 2 * s["per_node"] for m in ms))
            FAST.touch()
        thread.join()
        requests["ended"] = autoscaler_request()
    unpaced = dataclasses.replace(task, loss=PacedLoss()) if late else task
    expected = replay(unpaced, config, str(out / "initial.safetensors"))
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"diff": max_abs_diff(load_file(out / "final.safetensors"), expected),
                      "removed_after_steps": removed_at[0], "events": events, "requests": requests,
                      "steps": [m["step"] for m in metrics], "world_sizes": [m["world_size"] for m in metrics]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "replicated")
