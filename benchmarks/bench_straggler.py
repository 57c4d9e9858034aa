"""A straggler in synchronous mode: equal slices against ``--balance``.

The GPT of jobs.gpt on ``--workers`` CPU workers, rank ``--slow-rank`` slowed
``--factor`` times (``--inject slow``), trained for ``--steps`` steps from the same initial
weights twice: with equal slices, and with ``--balance``. Reported: samples/s of each
(after ``--warmup`` steps), their ratio, the slices ``--balance`` settled on, and the
largest difference between the two runs' final parameters (the same batches, split
differently: float32 summation order only).

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


def run(args: argparse.Namespace, balance: bool, out: str) -> dict:
    config = dataclasses.replace(TASK.defaults, steps=args.steps, balance=balance)
    Trainer(TASK, train=config, cluster=ClusterConfig(workers=args.workers), out_dir=out, progress=False,
            inject=[f"slow:rank={args.slow_rank}:factor={args.factor}"]).fit()
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(f"{out}/events.jsonl") as f:
        sizes = [json.loads(line)["sizes"] for line in f if '"rebalanced"' in line]
    step_s = statistics.median(r["step_s"] for r in rows[args.warmup:])
    return {"step_ms": round(1e3 * step_s, 2), "samples_per_s": round(config.global_batch / step_s, 1),
            "slices": sizes[-1] if sizes else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps not counted (the balance settles in these)")
    args = parser.parse_args()
    with local_ray(num_cpus=2 * args.workers), tempfile.TemporaryDirectory() as tmp:
        equal = run(args, False, f"{tmp}/equal")
        balanced = run(args, True, f"{tmp}/balanced")
        a, b = load_file(f"{tmp}/equal/final.safetensors"), load_file(f"{tmp}/balanced/final.safetensors")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(json.dumps({"date": datetime.date.today().isoformat(), "workers": args.workers,
                      "slow_rank": args.slow_rank, "factor": args.factor, "steps": args.steps,
                      "torch": torch.__version__, "ray": ray.__version__, "equal_slices": equal,
                      "balance": balanced, "speedup": round(balanced["samples_per_s"] / equal["samples_per_s"], 3),
                      "max_param_diff": diff}, indent=1))


if __name__ == "__main__":
    main()
