"""torch DDP on jobs.gpt, started the way its users start it on several hosts: ``torchrun`` on
each host (``--nnodes H --nproc-per-node W --node-rank i --master-addr <host 0>``), a gloo
process group, each rank looping over its own steps with no driver in between. The peer of
``benchmarks/bench_hosts.py`` on the testbed. Each rank trains its contiguous slice of the
same sampler steps as elastic_dp (``ElasticSampler``, global batch 32).

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.213.57.1 \\
        --master-port 29500 -m benchmarks.ddp_gpt --steps 24 --progress OUT.jsonl [--powersgd R]

``--powersgd R``: torch's own ``powerSGD_hook`` registered on the DDP model (the peer of
``--compress powersgd:rank=R:start=2``).

Rank 0 appends one JSON line per step to ``--progress`` (step, wall time, step seconds)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_dp.data import ElasticSampler, split
from jobs.gpt import TASK


def arguments(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """A peer's command line: ``--steps`` and ``--progress`` (and what ``parser`` adds)."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--progress", required=True)
    return parser.parse_args()


def start() -> tuple[int, int]:
    """One thread of torch's, the gloo process group torchrun describes; (rank, world size)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, progress: str) -> None:
    """Each rank's own loop over its contiguous slice of the sampler's steps (no driver in
    between), rank 0 appending each step's line to ``progress``; then the process ends.
    The peer averages the gradients over the ranks: with equal slices, that is the global
    batch's mean loss, as elastic_dp's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = TASK.dataset()
    sampler = ElasticSampler(len(dataset), global_batch=TASK.defaults.global_batch, seed=TASK.defaults.seed)
    for step in range(steps):
        begun = time.perf_counter()
        mine = split(sampler.batch(step), world)[rank]
        batch = TASK.collate([dataset[int(i)] for i in mine])
        optimizer.zero_grad()
        loss = TASK.loss(model, batch)
        loss.backward()
        optimizer.step()
        if rank == 0:
            with open(progress, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "step_s": time.perf_counter() - begun}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--powersgd", type=int, default=None, metavar="R",
                        help="torch's powerSGD_hook at rank R (after 2 uncompressed steps; as --compress powersgd)")
    args = arguments(parser)
    start()
    torch.manual_seed(TASK.defaults.seed)
    model = DistributedDataParallel(TASK.model(), bucket_cap_mb=25)
    if args.powersgd is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        model.register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd,
                                               start_powerSGD_iter=2, random_seed=TASK.defaults.seed), powerSGD_hook)
    train(model, TASK.optimizer(model.module), args.steps, args.progress)


if __name__ == "__main__":
    main()
