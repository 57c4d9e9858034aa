"""ZeRO stages against stage 0 and against the plan, on one local Ray cluster.

1. Memory: for stages 0/1/2 at N = 1..4 workers, each worker reports the bytes it holds
   for parameters, gradients and optimizer state after a few steps (``state_bytes``);
   compared with ``elastic-dp plan`` (fp32 parameters with AdamW, the jobs.gpt model).
2. Step time: stages 0, 1 and 2 (snapshots every step), and stage 2 with snapshots every
   10 steps, on the same model, worker count and batches, alternating in rounds of
   ``--steps-per-round`` so machine noise hits all alike; round 0 is warm-up. Reported:
   median step time of each and ratios to stage 0.
3. Peer snapshots: bytes each worker sends per snapshot, and the time per step spent
   snapshotting (max over ranks, as the step waits for it) at k = 1 and k = 10.

    .venv/bin/python -m benchmarks.bench_zero --workers 2 --rounds 7 --steps-per-round 20
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import statistics
import tempfile
import time

import ray
import torch

from elastic_dp import CheckpointConfig, ClusterConfig
from elastic_dp.coordinator import Coordinator
from elastic_dp.metrics import RunRecorder
from elastic_dp.plan import MemoryPlan
from jobs.gpt import TASK


class _Capture(RunRecorder):
    """Keeps each step's record instead of writing it."""

    def __init__(self) -> None:
        super().__init__(None, total_steps=10**9, progress=False)
        self.rows: list[dict] = []

    def step(self, **record) -> None:
        super().step(**record)
        self.rows.append(record)


def _coordinator(workers: int, **train) -> tuple[Coordinator, _Capture]:
    recorder = _Capture()
    config = dataclasses.replace(TASK.defaults, **train)
    coordinator = Coordinator(TASK, config, ClusterConfig(workers=workers), CheckpointConfig(), recorder)
    coordinator.start()
    return coordinator, recorder


def bench_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for workers in range(1, args.max_workers + 1):
        for zero in (0, 1, 2):
            coordinator, _ = _coordinator(workers, zero=zero)
            try:
                coordinator.run_steps(2)
                measured = ray.get([m.actor.state_bytes.remote() for m in coordinator.members])
                params = ray.get(coordinator.members[0].actor.state_bytes.remote())["parameters"] / 4
            finally:
                coordinator.close()
            plan = MemoryPlan(params=params, workers=workers, zero=zero, precision="fp32",
                              optimizer="adamw").per_worker_bytes()
            worst = {k: max(m[k] for m in measured) for k in ("parameters", "gradients", "optimizer_state")}
            row = {"workers": workers, "zero": zero, **{f"{k}_MiB": round(v / 2**20, 3) for k, v in worst.items()},
                   **{f"{k}_vs_plan": round(v / plan[k], 4) for k, v in worst.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def bench_step_time(args: argparse.Namespace) -> dict:
    variants = {"zero0": {"zero": 0}, "zero1": {"zero": 1}, "zero2": {"zero": 2},
                "zero2_k10": {"zero": 2, "snapshot_every": 10}}
    runs = {name: _coordinator(args.workers, **train) for name, train in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_ in range(args.rounds):
            line = []
            for name, (coordinator, _) in runs.items():
                start = time.perf_counter()
                coordinator.run_steps(args.steps_per_round)
                seconds = (time.perf_counter() - start) / args.steps_per_round
                if round_ > 0:
                    times[name].append(seconds)
                line.append(f"{name} {seconds * 1e3:.1f}")
            print(f"round {round_}: " + ", ".join(line) + " ms/step" + ("  (warm-up)" if round_ == 0 else ""),
                  flush=True)
        snapshot = {}
        for name in ("zero1", "zero2", "zero2_k10"):
            coordinator, recorder = runs[name]
            counted = recorder.rows[args.steps_per_round:]  # after the warm-up round
            held = ray.get(coordinator.members[0].actor.shard_holdings.remote())
            k = variants[name].get("snapshot_every", 1)
            snapshot[name] = {"k": k, "bytes_per_snapshot": held["snapshot_bytes"],
                              "bytes_per_step": held["snapshot_bytes"] / k,
                              "ms_per_step": 1e3 * statistics.mean(r["timings"]["snapshot_s"] for r in counted),
                              "ms_per_snapshot": 1e3 * statistics.mean(
                                  r["timings"]["snapshot_s"] for r in counted if (r["step"] + 1) % k == 0)}
    finally:
        for coordinator, _ in runs.values():
            coordinator.close()
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"median_ms": {k: round(v * 1e3, 2) for k, v in median.items()},
            "ratio_to_zero0": {k: round(v / median["zero0"], 3) for k, v in median.items()},
            "median_round_ratio_to_zero0": {
                k: round(statistics.median(a / b for a, b in zip(times[k], times["zero0"])), 3) for k in times},
            "snapshots": snapshot}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers for the step-time comparison")
    parser.add_argument("--max-workers", type=int, default=4, help="memory is measured at 1..this many workers")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=20)
    args = parser.parse_args()
    temp_dir = tempfile.mkdtemp(prefix="edp-bench-", dir="/tmp")
    ray.init(address="local", num_cpus=max(4 * args.workers, args.max_workers), include_dashboard=False,
             _temp_dir=temp_dir, log_to_driver=False)
    try:
        result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "ray": ray.__version__,
                  "memory": bench_memory(args), "workers": args.workers, "step_time": bench_step_time(args)}
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
