"""The parameter-server round trip: what an asynchronous update costs besides its compute.

The tiny MLP of benchmarks.tasks (a step of a few hundred microseconds; ``--task gpt``:
the GPT job, whose pulls and pushes carry 3.4 MB each) trained for
``--steps`` steps by one worker, synchronously (its window of steps) and with
``--mode async`` (a lease, a pull from every shard, the gradient, an ``apply`` on every
shard, and a snapshot every ``--snapshot-every`` versions), one after the other in
``--rounds`` alternating rounds. Reported: the median step time of sync, the median
interval between async updates, and their difference: the per-update overhead.

    .venv/bin/python -m benchmarks.bench_async --rounds 3 --steps 300
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import tempfile

import ray
import torch

from benchmarks.peers import local_ray
from benchmarks.tasks import TINY_MLP_TASK
from elastic_dp import ClusterConfig, Trainer
from jobs.gpt import TASK as GPT_TASK

TASKS = {"mlp": TINY_MLP_TASK, "gpt": GPT_TASK}


def median_step_ms(out: str, warmup: int) -> float:
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return 1e3 * statistics.median(r["step_s"] for r in rows[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--ps-shards", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--task", choices=sorted(TASKS), default="mlp",
                        help="gpt: the GPT job (3.4 MB of parameters pulled and of gradient pushed per update)")
    args = parser.parse_args()
    task = TASKS[args.task]
    sync, asynchronous = [], []
    with local_ray(num_cpus=2), tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode, times in (("sync", sync), ("async", asynchronous)):
                out = f"{tmp}/{mode}{round_}"
                # the parameter servers' settings: sync (ZeRO 0) has neither the servers nor a peer copy
                servers = {"ps_shards": args.ps_shards, "snapshot_every": args.snapshot_every} if mode == "async" else {}
                config = dataclasses.replace(task.defaults, steps=args.steps, mode=mode, **servers)
                Trainer(task, train=config, cluster=ClusterConfig(workers=1), out_dir=out,
                        progress=False).fit()
                times.append(median_step_ms(out, args.warmup))
            print(f"round {round_}: sync step {sync[-1]:.2f} ms, async update {asynchronous[-1]:.2f} ms", flush=True)
    a, s = statistics.median(asynchronous), statistics.median(sync)
    print(json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "ray": ray.__version__,
                      "task": args.task, "steps": args.steps, "ps_shards": args.ps_shards, "snapshot_every": args.snapshot_every,
                      "sync_step_ms": round(s, 3), "async_update_ms": round(a, 3),
                      "overhead_ms": round(a - s, 3), "ratio": round(a / s, 2)}, indent=1))


if __name__ == "__main__":
    main()
