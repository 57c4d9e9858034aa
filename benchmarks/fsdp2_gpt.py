"""torch FSDP2 on jobs.gpt, started the way its users start it on several hosts: ``torchrun``
on each host, a gloo process group, each block and then the whole model ``fully_shard``-ed,
each rank looping over its own steps with no driver in between. ``--hsdp`` shards on a 2-D
``DeviceMesh`` (``init_device_mesh(..., (H, W), mesh_dim_names=("replicate", "shard"))``: the
parameters sharded over the W ranks of each host and replicated across the H hosts, FSDP2's
HSDP); without it over all H·W ranks. ``--param-dtype bf16``: each ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, the peer of
``--zero 3 --param-dtype bf16`` (bf16 gathers, fp32 reductions and masters). A peer of
``benchmarks/bench_hosts.py`` on the testbed; each rank trains its contiguous slice of the
same sampler steps as elastic_dp (``ElasticSampler``, global batch 32).

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.213.57.1 \\
        --master-port 29500 -m benchmarks.fsdp2_gpt --hsdp --steps 24 --progress OUT.jsonl [--param-dtype bf16]

Rank 0 appends one JSON line per step to ``--progress`` (step, wall time, step seconds); the
loop is ``benchmarks.ddp_gpt.train``'s, the same for both peers."""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from benchmarks.ddp_gpt import arguments, start, train
from jobs.gpt import TASK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hsdp", action="store_true", help="shard inside each host, replicate across hosts")
    parser.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: gather the parameters in bf16, reduce the gradients in fp32")
    args = arguments(parser)
    _, world = start()
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    shape = (world // per_host, per_host) if args.hsdp else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if args.hsdp else ("shard",))
    torch.manual_seed(TASK.defaults.seed)
    model = TASK.model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.param_dtype == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    train(model, TASK.optimizer(model), args.steps, args.progress)


if __name__ == "__main__":
    main()
