"""elastic_dp's step against torch DDP's without Ray or a coordinator: the data path alone.

``bench_sync`` runs both systems as a user would, through Ray; on a machine whose cores
the workers share, its rounds move by a few percent, and what moves them cannot be told
apart there. This runs the steps alone, as torchrun would: ``--workers`` plain processes,
each holding an elastic_dp ``Replica`` (the worker's model, step and reducer, on a gloo
group of its own) and its peer, which train the GPT of jobs.gpt on the same batches in
alternating rounds (the order reversed every other round; round 0 is warm-up).

The peer is torch DDP, set up as bench_sync's (``bucket_cap_mb`` the job's 25 MiB, which
in DDP also turns its 1 MiB first bucket off: one all-reduce for the GPT), or with ``--peer replica`` a second
``Replica`` whose first bucket closes at ``--peer-first-bucket-mb``, or whose ZeRO stage
is ``--peer-zero``: an A/B of the bucket layout, or of a sharded stage against stage 0
(``--zero 1 --peer replica --peer-zero 0``). Both run in the same processes, so they share the allocator: each process sets
it as a worker does (elastic_dp.malloc) unless ``--default-malloc``.

Reported: each one's median step time (the slower rank's, per round), the median of the
per-round ratios with its 95% bootstrap interval (benchmarks.stats), and per step, both
processes together: the CPU of the training thread and of gloo's threads, and the minor
page faults.

    .venv/bin/python -m benchmarks.bench_data_path --rounds 31 --steps-per-round 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import thread_cpu
from benchmarks.stats import round_ratio_interval


def _cpu_by_thread() -> dict[str, float]:
    """CPU seconds so far of this process's threads: the main (training) thread, gloo's;
    and the minor page faults so far."""
    threads = thread_cpu.process_threads(os.getpid())
    return {"training_thread": threads[os.getpid()][1],
            "gloo_threads": sum(cpu for name, cpu in threads.values() if "gloo" in name),
            "page_faults": float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    from benchmarks.peers import DDPWorker
    from elastic_dp import ElasticSampler
    from elastic_dp.comm.group import CollectiveGroup
    from elastic_dp.data import rank_slice
    from elastic_dp.malloc import keep_freed_memory
    from elastic_dp.modes.sync.program import SyncProgram
    from elastic_dp.worker.replica import Replica
    from jobs.gpt import TASK

    if not args.default_malloc:
        keep_freed_memory()

    def replica(generation: int, first_bucket_mb: float | None, zero: int) -> SyncProgram:
        config = dataclasses.replace(TASK.defaults, steps=10**9, zero=zero, first_bucket_mb=first_bucket_mb)
        group = CollectiveGroup(backend="gloo", timeout_s=120)
        group.configure("127.0.0.1", port, generation=generation, rank=rank, world_size=world)
        made = Replica(TASK, config, torch.device("cpu"), group)
        made.broadcast_state(0)
        return SyncProgram(made)

    ours = replica(1, args.first_bucket_mb, args.zero)
    if args.peer == "ddp":
        ddp = DDPWorker("127.0.0.1", port, rank, world, keep_memory=not args.default_malloc)
    else:
        peer = replica(2, args.peer_first_bucket_mb, args.zero if args.peer_zero is None else args.peer_zero)
    sampler = ElasticSampler(len(ours.replica.dataset), global_batch=TASK.defaults.global_batch, seed=TASK.defaults.seed)

    def train(which: str, start: int) -> None:
        if which == "peer" and args.peer == "ddp":
            ddp.run(start, args.steps_per_round)
            return
        replica_ = ours if which == "ours" else peer
        for step in range(start, start + args.steps_per_round):
            result = replica_.step(step, rank_slice(sampler.batch(step), world, rank, None))
            assert result.committed, result.error
        replica_.replica.strategy.settle()

    wall: dict[str, list[float]] = {"ours": [], "peer": []}
    spent: dict[str, list[dict[str, float]]] = {"ours": [], "peer": []}
    step = {"ours": 0, "peer": 0}
    for round_ in range(args.rounds):
        for which in ("ours", "peer") if round_ % 2 == 0 else ("peer", "ours"):
            before, start = _cpu_by_thread(), time.perf_counter()
            train(which, step[which])
            seconds = (time.perf_counter() - start) / args.steps_per_round
            after = _cpu_by_thread()
            step[which] += args.steps_per_round
            if round_ > 0:
                wall[which].append(seconds)
                spent[which].append({k: (after[k] - before[k]) / args.steps_per_round for k in after})
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"wall": wall, "spent": spent}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    parser.add_argument("--first-bucket-mb", type=float, default=None,
                        help="elastic_dp's first bucket (default: its own, elastic_dp.config)")
    parser.add_argument("--peer", choices=["ddp", "replica"], default="ddp")
    parser.add_argument("--peer-first-bucket-mb", type=float, default=None, help="with --peer replica")
    parser.add_argument("--peer-zero", type=int, default=None, choices=[0, 1, 2],
                        help="with --peer replica: its ZeRO stage (default: --zero's)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc at its defaults in both (the workers set it)")
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.start_processes(_rank, args=(args.workers, store.port, args, out), nprocs=args.workers,
                           start_method="spawn")
        ranks = []
        for r in range(args.workers):
            with open(f"{out}.{r}.json") as f:
                ranks.append(json.load(f))
    wall = {w: [max(rounds) for rounds in zip(*(d["wall"][w] for d in ranks))] for w in ("ours", "peer")}

    def per_step(which: str, key: str) -> float:  # both processes together, the median over the rounds
        return round(statistics.median(sum(r[key] for r in rounds)
                                       for rounds in zip(*(d["spent"][which] for d in ranks))), 4)

    print(json.dumps({
        "settings": vars(args), "torch": torch.__version__,
        "median_ms": {w: round(1e3 * statistics.median(t), 2) for w, t in wall.items()},
        "median_round_ratio": round(statistics.median(a / b for a, b in zip(wall["ours"], wall["peer"])), 3),
        "median_round_ratio_ci95": round_ratio_interval(wall["ours"], wall["peer"]),
        "per_step": {w: {"training_thread_ms": round(1e3 * per_step(w, "training_thread"), 2),
                         "gloo_threads_ms": round(1e3 * per_step(w, "gloo_threads"), 2),
                         "page_faults": per_step(w, "page_faults")} for w in ("ours", "peer")},
    }, indent=1))


if __name__ == "__main__":
    main()
