"""ZeRO stage 3 against stage 2 and against torch's FSDP2, on one local Ray cluster.

1. Step time: elastic_dp at stage 2 and at stage 3 (resharding after each forward, the
   default) and FSDP2 (``benchmarks.peers.FSDP2Worker``: the GPT's blocks and then the
   model ``fully_shard``-ed, each rank looping over its own steps, torchrun-style), the
   same job (jobs.gpt), worker count and batches, alternating in rounds of
   ``--steps-per-round`` so machine noise hits all alike; round 0 is warm-up. Reported:
   the median step time of each, the ratios stage 3 / FSDP2 and stage 3 / stage 2 (with
   95% bootstrap intervals of the median per-round ratio: benchmarks.stats), and stage
   3's phases per step (largest over ranks; medians): forward and backward, the forward's
   and backward's waits for the parameter all-gathers, the gradient reduction's wait, the
   update, the snapshot.
2. Memory per worker at N = 1..``--max-workers``: what each rank holds between steps
   (parameters, gradients, optimizer state; the largest over ranks) at stage 3, against
   ``elastic-dp plan --zero 3`` (fp32 AdamW) and against FSDP2's shards at the same N.

    .venv/bin/python -m benchmarks.bench_zero3 --workers 2 --rounds 9 --steps-per-round 10
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import ray
import torch
import torch.distributed as dist

from benchmarks.bench_zero import _coordinator
from benchmarks.peers import FSDP2Worker, local_ray, remote
from benchmarks.stats import round_ratio_interval
from elastic_dp.observe.capacity import MemoryPlan
from jobs.gpt import TASK

KINDS = ("parameters", "gradients", "optimizer_state")


class _FSDP2:
    """FSDP2 on ``workers`` actors, each rank looping over its own steps."""

    def __init__(self, workers: int) -> None:
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # kept: they rendezvous on it
        self.workers = [remote(FSDP2Worker).remote(host, self.store.port, r, workers) for r in range(workers)]
        self.step = 0

    def run_steps(self, count: int) -> None:
        ray.get([w.run.remote(self.step, count) for w in self.workers])
        self.step += count

    def state_bytes(self) -> list[dict[str, int]]:
        return ray.get([w.state_bytes.remote() for w in self.workers])

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)


def bench_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for workers in range(1, args.max_workers + 1):
        run, _ = _coordinator(workers, zero=3)
        fsdp2 = _FSDP2(workers)
        try:
            run.run_steps(2)
            fsdp2.run_steps(2)
            ours = ray.get([m.actor.state_bytes.remote() for m in run.members])
            theirs = fsdp2.state_bytes()
        finally:
            run.close()
            fsdp2.close()
        params = sum(p.numel() for p in TASK.model().parameters())
        plan = MemoryPlan(params=params, workers=workers, zero=3, precision="fp32", optimizer="adamw").per_worker_bytes()
        worst = {k: max(m[k] for m in ours) for k in KINDS}
        peer = {k: max(m[k] for m in theirs) for k in KINDS}
        row = {"workers": workers, **{f"{k}_MiB": round(v / 2**20, 3) for k, v in worst.items()},
               **{f"{k}_vs_plan": round(v / plan[k], 4) for k, v in worst.items()},
               **{f"{k}_vs_fsdp2": round(v / peer[k], 4) for k, v in worst.items()},
               "total_vs_plan": round(sum(worst.values()) / sum(plan[k] for k in KINDS), 4),
               "total_vs_fsdp2": round(sum(worst.values()) / sum(peer.values()), 4)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_step_time(args: argparse.Namespace) -> dict:
    variants = {"zero2": {"zero": 2}, "zero3": {"zero": 3}}
    runs = {name: _coordinator(args.workers, **train) for name, train in variants.items()}
    fsdp2 = _FSDP2(args.workers)
    order = [*((name, run) for name, (run, _) in runs.items()), ("fsdp2", fsdp2)]
    times: dict[str, list[float]] = {name: [] for name, _ in order}
    try:
        for round_ in range(args.rounds):
            line = []
            for name, runner in order if round_ % 2 == 0 else order[::-1]:  # no fixed neighbours
                start = time.perf_counter()
                runner.run_steps(args.steps_per_round)
                seconds = (time.perf_counter() - start) / args.steps_per_round
                if round_ > 0:
                    times[name].append(seconds)
                line.append(f"{name} {seconds * 1e3:.1f}")
            print(f"round {round_}: " + ", ".join(line) + " ms/step" + ("  (warm-up)" if round_ == 0 else ""),
                  flush=True)
        phases = {}
        for name, (_, recorder) in runs.items():
            counted = recorder.rows[args.steps_per_round:]
            phases[name] = {key: round(1e3 * statistics.median(r["timings"].get(key, 0.0) for r in counted), 2)
                            for key in ("compute_s", "parameter_wait_s", "reduce_wait_s", "optimizer_s",
                                        "snapshot_s")}
    finally:
        for run, _ in runs.values():
            run.close()
        fsdp2.close()
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"median_ms": {k: round(v * 1e3, 2) for k, v in median.items()},
            "zero3_over_fsdp2": round(median["zero3"] / median["fsdp2"], 3),
            "zero3_over_fsdp2_round_median": round(statistics.median(
                a / b for a, b in zip(times["zero3"], times["fsdp2"])), 3),
            "zero3_over_fsdp2_ci95": round_ratio_interval(times["zero3"], times["fsdp2"]),
            "zero3_over_zero2": round(median["zero3"] / median["zero2"], 3),
            "zero3_over_zero2_ci95": round_ratio_interval(times["zero3"], times["zero2"]),
            "phases_ms": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers for the step-time comparison")
    parser.add_argument("--max-workers", type=int, default=4, help="memory is measured at 1..this many workers")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    with local_ray(num_cpus=max(3 * args.workers, 2 * args.max_workers)):
        result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "ray": ray.__version__,
                  "workers": args.workers, "step_time": bench_step_time(args),
                  "memory": [] if args.skip_memory else bench_memory(args)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
