"""ZeRO stages against stage 0 and against the plan, on one local Ray cluster.

1. Memory: for stages 0/1/2 at N = 1..4 workers, each worker reports the bytes it holds
   for parameters, gradients and optimizer state after a few steps (``state_bytes``);
   compared with ``elastic-dp plan`` (fp32 parameters with AdamW, the jobs.gpt model).
2. Step time: stages 0, 1 and 2 (snapshots every step), stage 2 with snapshots every
   10 steps, and stage 2 with its snapshots sent over the group as between hosts
   (``ELASTIC_DP_SHARED_SNAPSHOTS=0`` in its workers; the others share memory, as workers
   on one host do), on the same model, worker count and batches — and, as the peer, torch DDP
   against DDP with torch's ZeroRedundancyOptimizer (its ZeRO stage 1) — all alternating
   in rounds of ``--steps-per-round`` so machine noise hits all alike; round 0 is
   warm-up. Reported: median step time of each, ratios to stage 0 (with a 95% bootstrap
   interval of the median per-round ratio: benchmarks.stats), and torch's own ZeRO-1 /
   DDP ratio.
   Also each variant's phases (per step the largest over ranks; medians of the counted steps):
   forward and backward, the forward's wait for the parameter all-gathers, the wait for
   the gradient reduction, the update, the snapshot;
   and the CPU per step its round took, from ``/proc`` (``benchmarks.thread_cpu``): the
   workers' training threads, gloo's threads, the snapshot thread, the rest, the driver.
3. Peer snapshots: bytes each worker holds and sends per snapshot (fp32 masters are not
   sent: docs/zero.md), and the time per step spent snapshotting (max over ranks, as the
   step waits for it) at k = 1 and k = 10.
4. The sharded stages' collectives on the GPT's parameter count, on one gloo group of
   ``--workers`` actors: gloo's own reduce-scatter and all-gather against elastic_dp's,
   which run them as all-to-alls (docs/zero.md); interleaved, the slowest rank counts.

    .venv/bin/python -m benchmarks.bench_zero --workers 2 --rounds 7 --steps-per-round 20
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import statistics
import time

import ray
import torch
import torch.distributed as dist

from benchmarks import thread_cpu
from benchmarks.peers import DDPWorker, ShardedCollectivesWorker, local_ray, remote
from benchmarks.stats import round_ratio_interval
from elastic_dp import CheckpointConfig, ClusterConfig, ElasticSampler
from elastic_dp.api import build_coordinator
from elastic_dp.observe.capacity import MemoryPlan
from elastic_dp.observe.metrics import RunRecorder
from elastic_dp.state.zero import shm
from jobs.gpt import TASK


class _Capture(RunRecorder):
    """Keeps each step's record instead of writing it."""

    def __init__(self) -> None:
        super().__init__(None, total_steps=10**9, progress=False)
        self.rows: list[dict] = []

    def step(self, **record) -> None:
        super().step(**record)
        self.rows.append(record)


class _Run:
    """One elastic_dp run, advanced a few steps at a time."""

    def __init__(self, workers: int, **train) -> None:
        self.recorder = _Capture()
        config = dataclasses.replace(TASK.defaults, steps=10**9, **train)  # advanced with run_steps
        self.coordinator = build_coordinator(TASK, config, ClusterConfig(workers=workers), CheckpointConfig(),
                                             self.recorder)
        self.coordinator.run_until(0)  # placed, formed, started

    @property
    def members(self) -> list:
        return self.coordinator.membership.members

    def run_steps(self, count: int) -> None:
        self.coordinator.run_until(self.coordinator.step + count)

    def close(self) -> None:
        self.coordinator.close()


def _coordinator(workers: int, env: dict[str, str] | None = None, **train) -> tuple[_Run, _Capture]:
    """A run advanced to its start; ``env``: set in its workers' environment before any step."""
    run = _Run(workers, **train)
    for name, value in (env or {}).items():
        ray.get([m.actor.__ray_call__.remote(_setenv, name, value) for m in run.members])
    return run, run.recorder


def _setenv(_actor, name: str, value: str) -> None:
    os.environ[name] = value


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


class _TorchPeer:
    """torch DDP, or DDP with ZeroRedundancyOptimizer, each rank looping over its own steps."""

    def __init__(self, workers: int, zero: bool) -> None:
        store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False)
        self.store = store  # kept alive: the workers rendezvous on it
        self.workers = [remote(DDPWorker).remote(ray.util.get_node_ip_address(), store.port, r, workers, zero)
                        for r in range(workers)]
        dataset_len = len(TASK.dataset())
        self.sampler = ElasticSampler(dataset_len, global_batch=TASK.defaults.global_batch, seed=TASK.defaults.seed)
        self.step = 0

    def run_steps(self, count: int) -> None:
        """Each rank loops over its own ``count`` steps (torchrun-style), no driver in between."""
        ray.get([w.run.remote(self.step, count) for w in self.workers])
        self.step += count

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)


def bench_step_time(args: argparse.Namespace) -> dict:
    variants = {"zero0": {"zero": 0}, "zero1": {"zero": 1}, "zero2": {"zero": 2},
                "zero2_k10": {"zero": 2, "snapshot_every": 10},
                "zero2_sent": {"zero": 2, "env": {shm.ENV: "0"}}}  # not in shared memory
    runs = {name: _coordinator(args.workers, **train) for name, train in variants.items()}
    # the peers: torch's own ZeRO stage 1 against torch DDP, on the same machine and batches
    peers = {"torch_ddp": _TorchPeer(args.workers, zero=False), "torch_zero_ro": _TorchPeer(args.workers, zero=True)}
    times: dict[str, list[float]] = {name: [] for name in [*variants, *peers]}
    cpu: dict[str, list[dict]] = {name: [] for name in [*variants, *peers]}  # per counted round
    phases: dict[str, dict[str, float]] = {}
    try:
        for round_ in range(args.rounds):
            line = []
            order = [*runs.items(), *((n, (p, None)) for n, p in peers.items())]
            for name, (coordinator, _) in order if round_ % 2 == 0 else order[::-1]:  # no fixed neighbours
                before, start = thread_cpu.reading(), time.perf_counter()
                coordinator.run_steps(args.steps_per_round)
                seconds = (time.perf_counter() - start) / args.steps_per_round
                if round_ > 0:
                    times[name].append(seconds)
                    cpu[name].append(thread_cpu.spent(before, thread_cpu.reading()))
                line.append(f"{name} {seconds * 1e3:.1f}")
            print(f"round {round_}: " + ", ".join(line) + " ms/step" + ("  (warm-up)" if round_ == 0 else ""),
                  flush=True)
        for name, (_, recorder) in runs.items():
            counted = recorder.rows[args.steps_per_round:]
            phases[name] = {key: round(1e3 * statistics.median(r["timings"].get(key, 0.0) for r in counted), 2)
                            for key in ("compute_s", "parameter_wait_s", "reduce_wait_s", "optimizer_s",
                                        "snapshot_s")}
        snapshot = {}
        for name in ("zero1", "zero2", "zero2_k10", "zero2_sent"):
            coordinator, recorder = runs[name]
            counted = recorder.rows[args.steps_per_round:]  # after the warm-up round
            held = ray.get(coordinator.members[0].actor.chunk_holdings.remote())
            k = variants[name].get("snapshot_every", 1)
            snapshot[name] = {"k": k, "bytes_per_snapshot": held["snapshot_bytes"],
                              "bytes_sent_per_snapshot": held["snapshot_sent_bytes"],
                              "bytes_sent_per_step": held["snapshot_sent_bytes"] / k,
                              "ms_per_step": 1e3 * statistics.mean(r["timings"]["snapshot_s"] for r in counted),
                              "ms_per_snapshot": 1e3 * statistics.mean(  # none in rounds shorter than k
                                  [r["timings"]["snapshot_s"] for r in counted if (r["step"] + 1) % k == 0] or [0.0])}
    finally:
        for coordinator, _ in runs.values():
            coordinator.close()
        for peer in peers.values():
            peer.close()
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"median_ms": {k: round(v * 1e3, 2) for k, v in median.items()},
            "ratio_to_zero0": {k: round(v / median["zero0"], 3) for k, v in median.items() if k in variants},
            "median_round_ratio_to_zero0": {
                k: round(statistics.median(a / b for a, b in zip(times[k], times["zero0"])), 3) for k in variants},
            "median_round_ratio_ci95": {k: round_ratio_interval(times[k], times["zero0"]) for k in variants},
            "torch_zero_ro_over_torch_ddp": round(median["torch_zero_ro"] / median["torch_ddp"], 3),
            "torch_median_round_ratio": round(statistics.median(
                a / b for a, b in zip(times["torch_zero_ro"], times["torch_ddp"])), 3),
            "phases_ms": phases, "snapshots": snapshot,
            "cpu_ms_per_step": {name: _worker_cpu(rounds, args.steps_per_round) for name, rounds in cpu.items()}}


def _worker_cpu(rounds: list[dict], steps: int) -> dict[str, float]:
    """Median over the rounds of the workers' CPU per step (all of them: the other
    variants' idle workers spend next to nothing): in all, the training threads (each
    process's busiest), gloo's threads, the snapshot thread, the rest; and the driver's."""
    def per_step(pick) -> float:
        return round(1e3 * statistics.median(pick(r) for r in rounds) / steps, 2)

    def workers(r: dict) -> collections.Counter:
        merged: collections.Counter = collections.Counter()
        for kind in ("elastic_dp worker", "DDP worker"):
            merged.update(r.get(kind, {}))
        return merged

    def total(r: dict) -> float:
        return sum(v for n, v in workers(r).items() if n != thread_cpu.BUSIEST)

    def gloo(r: dict) -> float:
        return sum(v for n, v in workers(r).items() if "gloo" in n)

    return {"workers": per_step(total), "training_threads": per_step(lambda r: workers(r).get(thread_cpu.BUSIEST, 0.0)),
            "gloo_threads": per_step(gloo), "snapshot_thread": per_step(lambda r: workers(r).get("edp-snapshot", 0.0)),
            "other": per_step(lambda r: total(r) - workers(r).get(thread_cpu.BUSIEST, 0.0) - gloo(r)
                              - workers(r).get("edp-snapshot", 0.0)),
            "driver": per_step(lambda r: sum(v for n, v in r.get("driver", {}).items() if n != thread_cpu.BUSIEST))}


def bench_collectives(args: argparse.Namespace) -> dict:
    numel = sum(p.numel() for p in TASK.model().parameters())
    store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False)
    workers = [remote(ShardedCollectivesWorker).remote(ray.util.get_node_ip_address(), store.port, r, args.workers,
                                                       numel) for r in range(args.workers)]
    ops = ("reduce_scatter", "gloo_reduce_scatter", "all_gather", "gloo_all_gather")
    times: dict[str, list[float]] = {op: [] for op in ops}
    try:
        for round_ in range(args.rounds):
            for op in ops:  # the slowest rank: the collective ends when it does
                seconds = max(ray.get([w.time.remote(op, 40) for w in workers]))
                if round_ > 0:
                    times[op].append(seconds)
    finally:
        for w in workers:
            ray.kill(w)
    median = {op: statistics.median(t) for op, t in times.items()}
    return {"elements": numel, "median_ms": {op: round(1e3 * m, 3) for op, m in median.items()},
            "gloo_over_elastic_dp": {op: round(median[f"gloo_{op}"] / median[op], 2)
                                     for op in ("reduce_scatter", "all_gather")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers for the step-time comparison")
    parser.add_argument("--max-workers", type=int, default=4, help="memory is measured at 1..this many workers")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=20)
    args = parser.parse_args()
    with local_ray(num_cpus=max(7 * args.workers, args.max_workers)):
        result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "ray": ray.__version__,
                  "memory": bench_memory(args), "workers": args.workers,
                  "collectives": bench_collectives(args), "step_time": bench_step_time(args)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
