"""torch FSDP2 on jobs.gpt, started the way its users start it on several hosts: ``torchrun``
on each host, a gloo process group, each block and then the whole model ``fully_shard``-ed,
each rank looping over its own steps with no driver in between. ``--hsdp`` shards on a 2-D
``DeviceMesh`` (``init_device_mesh(..., (H, W), mesh_dim_names=("replicate", "shard"))``: the
parameters sharded over the W ranks of each host and replicated across the H hosts, FSDP2's
HSDP); without it over all H·W ranks. A peer of ``benchmarks/bench_hosts.py`` on the
testbed; each rank trains its contiguous slice of the same sampler steps as elastic_dp
(``ElasticSampler``, global batch 32).

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.213.57.1 \\
        --master-port 29500 -m benchmarks.fsdp2_gpt --hsdp --steps 24 --progress OUT.jsonl

Rank 0 appends one JSON line per step to ``--progress`` (step, wall time, step seconds)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_dp.data import ElasticSampler, split
from jobs.gpt import TASK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--hsdp", action="store_true", help="shard inside each host, replicate across hosts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    shape = (world // per_host, per_host) if args.hsdp else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if args.hsdp else ("shard",))
    torch.manual_seed(TASK.defaults.seed)
    model = TASK.model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = TASK.optimizer(model)
    dataset = TASK.dataset()
    sampler = ElasticSampler(len(dataset), global_batch=TASK.defaults.global_batch, seed=TASK.defaults.seed)
    for step in range(args.steps):
        start = time.perf_counter()
        mine = split(sampler.batch(step), world)[rank]
        batch = TASK.collate([dataset[int(i)] for i in mine])
        optimizer.zero_grad()
        loss = TASK.loss(model, batch)  # FSDP2 averages the gradients over the ranks (the slices are equal)
        loss.backward()
        optimizer.step()
        if rank == 0:
            with open(args.progress, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "step_s": time.perf_counter() - start}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
