"""A straggler: synchronous with equal slices, with ``--balance``, and asynchronous SGD.

The GPT of jobs.gpt on ``--workers`` CPU workers, rank ``--slow-rank`` slowed
``--factor`` times (``--inject slow``), trained for ``--steps`` steps (updates) from the
same initial weights: sync with equal slices, sync ``--balance``, and ``--mode async`` at
each ``--staleness``. Reported for each: samples/s (median step or update interval after
``--warmup``), the ratio to sync, the mean loss of the last ``--tail`` steps (every run has
then trained the same number of samples); the slices ``--balance`` settled on; async's
staleness histogram and recomputed updates; and the largest difference between the two
sync runs' final parameters (the same batches split differently: float32 order only).

    .venv/bin/python -m benchmarks.bench_straggler --workers 3 --factor 3 --steps 40
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
from safetensors.torch import load_file

from benchmarks.peers import local_ray
from elastic_dp import ClusterConfig, Trainer
from jobs.gpt import TASK


def run(args: argparse.Namespace, out: str, **train) -> dict:
    config = dataclasses.replace(TASK.defaults, steps=args.steps, **train)
    Trainer(TASK, train=config, cluster=ClusterConfig(workers=args.workers), out_dir=out, progress=False,
            inject=[f"slow:rank={args.slow_rank}:factor={args.factor}"]).fit()
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(f"{out}/events.jsonl") as f:
        events = [json.loads(line) for line in f]
    sizes = [e["sizes"] for e in events if e["kind"] == "rebalanced"]
    step_s = statistics.median(r["step_s"] for r in rows[args.warmup:])
    result = {"step_ms": round(1e3 * step_s, 2), "samples_per_s": round(config.global_batch / step_s, 1),
              "tail_loss": round(statistics.mean(r["loss"] for r in rows[-args.tail:] if r["loss"] is not None), 4)}
    if sizes:
        result["slices"] = sizes[-1]
    summary = next((e for e in events if e["kind"] == "async_summary"), None)
    if summary:
        result |= {"staleness": summary["staleness"], "recomputed": summary["recomputed"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps not counted (the balance settles in these)")
    parser.add_argument("--tail", type=int, default=10, help="the last steps whose loss is averaged")
    parser.add_argument("--staleness", default="2,8", help="async runs, one per --max-staleness")
    args = parser.parse_args()
    runs = {}
    with local_ray(num_cpus=2 * args.workers), tempfile.TemporaryDirectory() as tmp:
        runs["sync"] = run(args, f"{tmp}/sync")
        runs["sync_balance"] = run(args, f"{tmp}/balance", balance=True)
        for s in (int(s) for s in args.staleness.split(",") if s):
            runs[f"async_s{s}"] = run(args, f"{tmp}/async{s}", mode="async", max_staleness=s)
        a, b = load_file(f"{tmp}/sync/final.safetensors"), load_file(f"{tmp}/balance/final.safetensors")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    for result in runs.values():
        result["x_sync"] = round(result["samples_per_s"] / runs["sync"]["samples_per_s"], 3)
    print(json.dumps({"date": datetime.date.today().isoformat(), "workers": args.workers,
                      "slow_rank": args.slow_rank, "factor": args.factor, "steps": args.steps,
                      "torch": torch.__version__, "ray": ray.__version__, "runs": runs,
                      "sync_vs_balance_max_param_diff": diff}, indent=1))


if __name__ == "__main__":
    main()
