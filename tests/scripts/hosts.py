"""Run in host 0 of a testbed (benchmarks/hosts.py) by benchmarks/scenarios/test_hosts.py:
the GPT job on the testbed's Ray cluster, the driver on the head's host as on a real
cluster; the test acts on the hosts (kills one, cuts its link) from outside while it trains,
reading ``OUT/metrics.jsonl``. Prints one JSON line: the distance of the final parameters from
the one-process replay of the same batches, the steps and world sizes, the events.

    python -m tests.scripts.hosts OUT SCENARIO [all_reduce=flat|hierarchical] [zero=N] [shard_scope=all|host]
        [steps=N] [task=tiny|gpt] [pace=S]

    task: the tiny GPT (default; micro-batches of 1) or jobs.gpt's (3.3 MB of gradients, its own batches)
    pace: seconds slept per micro-batch while paced (default 0.2)

    steady     4 workers (2 a host), unpaced
    kill_join  3 to 4 workers: rank 1 killed at step 6 (--inject), a worker joins at step 12
    host_lost  2 to 4 workers, paced until OUT/fast exists: the test kills a host or cuts its link
    kill_middle  6 workers (3 hosts of 2): rank 2, the first of the middle host's, killed at step 3;
               its replacement joins where its slot was freed, on that host
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from jobs import gpt
from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.tasks import TINY_GPT_TASK, PacedGPTLoss

SCENARIOS = {
    "steady": dict(workers=4, min_workers=4, paced=False, inject=()),
    "kill_join": dict(workers=4, min_workers=3, paced=True, inject=("kill:step=6:rank=1", "join:step=12")),
    "host_lost": dict(workers=4, min_workers=2, paced=True, inject=()),
    "kill_middle": dict(workers=6, min_workers=5, paced=True, inject=("kill:step=3:rank=2",)),
}


def main(out: Path, scenario: str, options: dict[str, str]) -> None:
    s = SCENARIOS[scenario]
    plain = gpt.TASK if options.get("task") == "gpt" else TINY_GPT_TASK
    task = plain
    if s["paced"]:
        task = dataclasses.replace(task, loss=PacedGPTLoss(seconds=float(options.get("pace", 0.2)),
                                                                  until=str(out / "fast")))
    train = {"zero": int(options.get("zero", 0)), "steps": int(options.get("steps", 24))}
    for name in ("all_reduce", "shard_scope"):
        if name in options:
            train[name] = options[name]
    if plain is TINY_GPT_TASK:
        train["micro_batch"] = 1
    run = fit(task, out, workers=s["workers"], min_workers=s["min_workers"], inject=s["inject"], **train)
    expected = replay(plain, run.config, str(out / "initial.safetensors"))
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"diff": max_abs_diff(load_file(out / "final.safetensors"), expected), "events": events,
                      "steps": [m["step"] for m in metrics], "world_sizes": [m["world_size"] for m in metrics]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:]))
