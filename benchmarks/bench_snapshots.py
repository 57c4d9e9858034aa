"""What a ZeRO peer snapshot every step costs, in shared memory or sent, without Ray.

``bench_zero`` measures the stages through the whole system; its rounds move by several
percent on a shared machine, and the snapshot's cost is of that size. This measures the
data path alone, as torchrun would run it: ``--workers`` plain processes (no Ray, no
coordinator), each holding one ``Replica`` per variant on its own gloo group, which
train the GPT of jobs.gpt on the same batches in alternating rounds (the order reversed
every other round). Variants: stage 0; stages 1 and 2 with a snapshot every step, in
shared memory (the processes share this host) and sent over the group
(``ELASTIC_DP_SHARED_SNAPSHOTS=0`` while that variant's snapshots are agreed). Reported
per variant: the median step time (the slower rank's per round), the median per-round
ratio to stage 0 with its 95% bootstrap interval (benchmarks.stats), and the CPU both
processes spent per step, against stage 0's in the same round.

    .venv/bin/python -m benchmarks.bench_snapshots --rounds 31 --steps-per-round 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.stats import round_ratio_interval

VARIANTS = {"zero0": (0, "1"), "zero1_shared": (1, "1"), "zero1_sent": (1, "0"),
            "zero2_shared": (2, "1"), "zero2_sent": (2, "0")}
"""name -> (ZeRO stage, ELASTIC_DP_SHARED_SNAPSHOTS)"""


def _rank(rank: int, world: int, port: int, rounds: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    from elastic_dp.comm.group import CollectiveGroup
    from elastic_dp.data import ElasticSampler, rank_slice
    from elastic_dp.malloc import keep_freed_memory
    from elastic_dp.modes.sync.program import SyncProgram
    from elastic_dp.state.zero import shm
    from elastic_dp.worker.replica import Replica
    from jobs.gpt import TASK

    keep_freed_memory()  # as a worker actor does

    replicas = {}
    for generation, (name, (zero, _)) in enumerate(VARIANTS.items()):  # one group each
        config = dataclasses.replace(TASK.defaults, steps=10**9, zero=zero,
                                     **({"snapshot_every": 1} if zero else {}))  # stage 0 keeps no peer copy
        group = CollectiveGroup(backend="gloo", timeout_s=120)
        group.configure("127.0.0.1", port, generation=generation, rank=rank, world_size=world)
        replicas[name] = Replica(TASK, config, torch.device("cpu"), group)
        replicas[name].broadcast_state(0)
    programs = {name: SyncProgram(replica) for name, replica in replicas.items()}
    sampler = ElasticSampler(len(replicas["zero0"].dataset), global_batch=TASK.defaults.global_batch,
                             seed=TASK.defaults.seed)
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    step = dict.fromkeys(VARIANTS, 0)
    for round_ in range(rounds):
        for name in list(VARIANTS)[::1 if round_ % 2 == 0 else -1]:
            os.environ[shm.ENV] = VARIANTS[name][1]  # read when the neighbours agree (its first snapshots)
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                result = programs[name].step(step[name], rank_slice(sampler.batch(step[name]), world, rank, None))
                assert result.committed, result.error
                step[name] += 1
            replicas[name].strategy.settle()
            if round_ > 0:  # round 0 is warm-up
                wall[name].append((time.perf_counter() - start) / steps)
                cpu[name].append((time.process_time() - cpu_start) / steps)
    sent = {name: r.strategy.holdings()["snapshot_sent_bytes"] for name, r in replicas.items() if name != "zero0"}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "sent": sent}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps-per-round", type=int, default=20)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.start_processes(_rank, args=(args.workers, store.port, args.rounds, args.steps_per_round, out),
                           nprocs=args.workers, start_method="spawn")
        ranks = []
        for r in range(args.workers):
            with open(f"{out}.{r}.json") as f:
                ranks.append(json.load(f))
    wall = {name: [max(rounds) for rounds in zip(*(d["wall"][name] for d in ranks))] for name in VARIANTS}
    cpu = {name: [sum(rounds) for rounds in zip(*(d["cpu"][name] for d in ranks))] for name in VARIANTS}
    result = {"workers": args.workers, "rounds": args.rounds - 1, "steps_per_round": args.steps_per_round,
              "torch": torch.__version__, "bytes_sent_per_snapshot": ranks[0]["sent"],
              "median_ms": {n: round(1e3 * statistics.median(w), 2) for n, w in wall.items()},
              "median_round_ratio_to_zero0": {
                  n: round(statistics.median(a / b for a, b in zip(w, wall["zero0"])), 3) for n, w in wall.items()},
              "median_round_ratio_ci95": {n: round_ratio_interval(w, wall["zero0"]) for n, w in wall.items()},
              "cpu_ms_per_step": {n: round(1e3 * statistics.median(c), 2) for n, c in cpu.items()},
              "cpu_ms_per_step_over_zero0": {
                  n: round(1e3 * statistics.median(a - b for a, b in zip(c, cpu["zero0"])), 2)
                  for n, c in cpu.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
