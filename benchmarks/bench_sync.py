"""Synchronous DP against its peers, side by side in one run on one local Ray cluster.

1. Step time: elastic_dp against torch DistributedDataParallel on the same model, worker
   count, global batch and micro-batch, on two tasks: the GPT of jobs.gpt, and a tiny MLP
   (32 -> 256 -> 1, global batch 64) whose step is so short that what a step costs besides
   its compute shows. DDP runs the way its users run it: each rank a process (a Ray actor
   holding one CPU slot) that loops over its own steps, torchrun-style, called once per
   round; its processes keep freed memory as elastic_dp's workers do (elastic_dp.malloc).
   elastic_dp runs as it always does: its coordinator grants each round's steps as one
   window. The two alternate in rounds of ``--steps-per-round`` steps so that machine
   noise hits both alike, the one that goes first alternating too; the first round is
   warm-up and not counted. Reported per
   task: median step time of each, their ratio (elastic_dp / DDP), the median of the
   per-round ratios (with a 95% bootstrap interval: benchmarks.stats), the difference in
   milliseconds per step, and the CPU time the driver (the coordinator, all its threads)
   spends per step: on a machine whose cores the workers share, it is taken from them. Also each system's CPU per step by process
   (driver, workers, raylet, GCS) and thread (``benchmarks.thread_cpu``), read from
   ``/proc`` around every round: the idle system's actors' figures are measured too.
2. All-reduce bandwidth: elastic_dp's bucketed gradient reduction (copy into buckets,
   all-reduce, copy back) against one raw torch.distributed all_reduce of a flat buffer
   of the same size, on the same gloo group. Reported as bus bandwidth
   ``2 (N-1)/N * bytes / seconds`` and the ratio.

    .venv/bin/python -m benchmarks.bench_sync --workers 2 --rounds 8 --steps-per-round 20
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time

import ray
import torch
import torch.distributed as dist

from benchmarks import thread_cpu
from benchmarks.peers import DDPWorker, ReduceWorker, local_ray, remote
from benchmarks.stats import round_ratio_interval
from benchmarks.tasks import TINY_MLP_TASK
from elastic_dp import CheckpointConfig, ClusterConfig
from elastic_dp.api import build_coordinator
from elastic_dp.observe.metrics import RunRecorder
from jobs.gpt import TASK

TASKS = {"gpt": TASK, "mlp": TINY_MLP_TASK}


def bench_step_time(args: argparse.Namespace, name: str, steps_per_round: int) -> dict:
    task = TASKS[name]
    config = dataclasses.replace(task.defaults, steps=10**9)  # rounds are run with run_until
    coordinator = build_coordinator(task, config, ClusterConfig(workers=args.workers), CheckpointConfig(),
                                    RunRecorder(None, total_steps=10**9, progress=False))
    coordinator.run_until(0)  # placed, formed, started
    store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False)
    ddp = [remote(DDPWorker).remote(ray.util.get_node_ip_address(), store.port, r, args.workers, False, task)
           for r in range(args.workers)]
    ours, theirs, driver_cpu, ddp_step = [], [], [], 0
    cpu_by_system = {"elastic_dp": [], "DDP": []}  # per counted round: kind -> thread -> CPU s per step
    try:
        def run_ours() -> tuple[float, dict]:
            before, start, cpu = thread_cpu.reading(), time.perf_counter(), time.process_time()
            coordinator.run_until(coordinator.step + steps_per_round)
            seconds = (time.perf_counter() - start) / steps_per_round
            driver_cpu.append((time.process_time() - cpu) / steps_per_round)
            return seconds, thread_cpu.spent(before, thread_cpu.reading())

        def run_ddp() -> tuple[float, dict]:
            nonlocal ddp_step
            before, start = thread_cpu.reading(), time.perf_counter()
            ray.get([w.run.remote(ddp_step, steps_per_round) for w in ddp])
            ddp_step += steps_per_round
            return (time.perf_counter() - start) / steps_per_round, thread_cpu.spent(before, thread_cpu.reading())

        for round_ in range(args.rounds):
            if round_ % 2 == 0:  # the order alternates: neither always runs right after the other
                (t_ours, cpu_ours), (t_ddp, cpu_ddp) = run_ours(), run_ddp()
            else:
                (t_ddp, cpu_ddp), (t_ours, cpu_ours) = run_ddp(), run_ours()
            print(f"{name} round {round_}: elastic_dp {t_ours * 1e3:.2f} ms/step, DDP {t_ddp * 1e3:.2f} ms/step"
                  + ("  (warm-up, not counted)" if round_ == 0 else ""), flush=True)
            if round_ > 0:
                ours.append(t_ours)
                theirs.append(t_ddp)
                cpu_by_system["elastic_dp"].append(cpu_ours)
                cpu_by_system["DDP"].append(cpu_ddp)
    finally:
        coordinator.close()
        for w in ddp:
            ray.kill(w)
    return {"steps_per_round": steps_per_round, "elastic_dp_ms": round(1e3 * statistics.median(ours), 3),
            "ddp_ms": round(1e3 * statistics.median(theirs), 3),
            "ratio": round(statistics.median(ours) / statistics.median(theirs), 3),
            "median_round_ratio": round(statistics.median(a / b for a, b in zip(ours, theirs)), 3),
            "median_round_ratio_ci95": round_ratio_interval(ours, theirs),
            "overhead_ms": round(1e3 * (statistics.median(ours) - statistics.median(theirs)), 3),
            "driver_cpu_ms_per_step": round(1e3 * statistics.median(driver_cpu[1:]), 3),
            "cpu_ms_per_step": {system: _cpu_per_step(rounds, steps_per_round)
                                for system, rounds in cpu_by_system.items()},
            "per_round_ratios": [round(a / b, 3) for a, b in zip(ours, theirs)]}


def _cpu_per_step(rounds: list[dict], steps: int) -> dict[str, dict[str, float]]:
    """The counted rounds' CPU per step, by process kind: the total, its threads by name
    (those over 0.05 ms; Python threads that do not name themselves are under their
    actor's or process's name), and each process's busiest thread (a worker's training
    thread; ``thread_cpu.BUSIEST``, not in the total)."""
    out = {}
    for kind in sorted({k for r in rounds for k in r}):
        names = {n for r in rounds for n in r.get(kind, {})}
        per_name = {n: 1e3 * sum(r.get(kind, {}).get(n, 0.0) for r in rounds) / (steps * len(rounds))
                    for n in names}
        out[kind] = {"total": round(sum(v for n, v in per_name.items() if n != thread_cpu.BUSIEST), 2),
                     **{n: round(v, 2) for n, v in sorted(per_name.items(), key=lambda kv: -kv[1]) if v >= 0.05}}
    return out


def bench_allreduce(args: argparse.Namespace) -> dict:
    numel = int(args.allreduce_mb * 2**20 / 4)
    store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False)
    workers = [remote(ReduceWorker).remote(ray.util.get_node_ip_address(), store.port, r, args.workers, numel,
                                   args.bucket_mb) for r in range(args.workers)]
    try:
        bucketed, raw = [], []
        for _ in range(args.rounds):  # interleaved; max over ranks = the collective's time
            bucketed.append(max(ray.get([w.time_bucketed.remote(args.allreduce_iters) for w in workers])))
            raw.append(max(ray.get([w.time_raw.remote(args.allreduce_iters) for w in workers])))
    finally:
        for w in workers:
            ray.kill(w)
    factor = 2 * (args.workers - 1) / args.workers * numel * 4 / 1e9
    t_b, t_r = statistics.median(bucketed[1:]), statistics.median(raw[1:])
    return {"megabytes": args.allreduce_mb, "bucket_mb": args.bucket_mb,
            "bucketed_ms": t_b * 1e3, "raw_ms": t_r * 1e3,
            "bucketed_GBps": factor / t_b, "raw_GBps": factor / t_r, "ratio": t_r / t_b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=20, help="GPT steps per round")
    parser.add_argument("--mlp-steps-per-round", type=int, default=500, help="tiny MLP steps per round")
    parser.add_argument("--tasks", default="gpt,mlp", help="which step-time comparisons to run")
    parser.add_argument("--allreduce-mb", type=float, default=100.0)
    parser.add_argument("--allreduce-iters", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    with local_ray(num_cpus=2 * args.workers):
        result = {"date": datetime.date.today().isoformat(), "workers": args.workers,
                  "torch": torch.__version__, "ray": ray.__version__,
                  "step_time": {name: bench_step_time(args, name, args.mlp_steps_per_round if name == "mlp"
                                                      else args.steps_per_round)
                                for name in args.tasks.split(",")},
                  "allreduce": bench_allreduce(args)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
