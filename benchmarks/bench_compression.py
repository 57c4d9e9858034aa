"""``--compress powersgd`` on the GPT job against no compression and against torch DDP with
its own PowerSGD hook at the same rank, in the same run.

Each variant trains jobs.gpt for ``--steps`` sampler steps (the same batches) on
``--workers`` workers: elastic_dp uncompressed, and with ``--compress
powersgd:rank=R:start=S`` for each R of ``--ranks``; DDP (``--workers`` processes of its
own, gloo, each looping over its slice of the same steps with the job's learning-rate
rule and clipping) with ``powerSGD_hook`` at each R. Reported for each:

- the held-out loss of its final weights at equal samples (``bench_diloco.held_out_loss``:
  the first ``--eval-batches`` global batches of the eval set, one plain loop);
- the elements each worker puts into collectives per step, as bytes (fp32): uncompressed the
  gradient's all-reduce; PowerSGD the all-reduces of ``P``, ``Q`` and the uncompressed
  tensors (as torch's hook, which it is set against), and elastic_dp's copy of each rank's
  error to its near neighbour (``copy_bytes``: inside a host on a real cluster); counted
  from the buckets' plan (``PowerSGD.bind``), the same for both;
- samples/s over the run (elastic_dp: the driver's wall clock, start-up excluded; DDP: its
  rank 0's loop).

    .venv/bin/python -m benchmarks.bench_compression --workers 2 --steps 200 --ranks 1,2,4 [--int8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from benchmarks.bench_diloco import held_out_loss
from benchmarks.peers import local_ray
from elastic_dp import ClusterConfig, ElasticSampler, Trainer
from elastic_dp.comm.compression import Int8Spec, PowerSGDSpec, wire_bytes_per_step
from jobs.gpt import TASK


def wire_bytes(spec: PowerSGDSpec | None, config) -> tuple[int, int]:
    """Bytes a worker puts into its all-reduces per compressed step, and those it copies to its neighbour."""
    params = [p for p in TASK.model().parameters() if p.requires_grad]
    if spec is None:
        return 4 * sum(p.numel() for p in params), 0
    return wire_bytes_per_step(params, spec, config.buckets)


def ours(args: argparse.Namespace, spec: PowerSGDSpec | None) -> dict:
    name = "none" if spec is None else spec.describe().split(":")[0] + (f"_rank{spec.rank}" if hasattr(spec, "rank")
                                                                          else "")
    out = Path(tempfile.mkdtemp(prefix=f"edp-compression-{name}-", dir="/tmp"))
    config = dataclasses.replace(TASK.defaults, steps=args.steps, compress=None if spec is None else spec.describe())
    summary = Trainer(TASK, train=config, cluster=ClusterConfig(workers=args.workers), out_dir=str(out),
                      progress=False).fit()
    reduced, copied = wire_bytes(spec, config)
    row = {"variant": f"elastic_dp_{name}", "held_out_loss": round(held_out_loss(load_file(out / "final.safetensors"),
                                                                                 args.eval_batches), 4),
           "bytes_per_step": reduced, "copy_bytes": copied * (args.workers > 1),
           "samples_per_s": round(summary.samples / summary.seconds, 1), "initial": str(out / "initial.safetensors")}
    print(json.dumps(row), flush=True)
    return row


def _ddp_rank(rank: int, world: int, store: str, initial: str, out: str, spec: PowerSGDSpec, steps: int,
              timing: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    config = TASK.defaults
    model = TASK.model()
    model.load_state_dict(load_file(initial))
    ddp = DDP(model)
    ddp.register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank=spec.rank,
                                         start_powerSGD_iter=spec.start, min_compression_rate=spec.min_ratio,
                                         random_seed=config.seed), powerSGD_hook)
    dataset, optimizer = TASK.dataset(), TASK.optimizer(model)
    base = [g["lr"] for g in optimizer.param_groups]
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    begun = time.perf_counter()
    for step in range(steps):
        mine = np.array_split(sampler.batch(step), world)[rank]
        optimizer.zero_grad()
        TASK.loss(ddp, TASK.collate([dataset[int(i)] for i in mine])).backward()
        if config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * config.lr_factor(step)
        optimizer.step()
    if rank == 0:
        Path(timing).write_text(str(time.perf_counter() - begun))
        save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    dist.destroy_process_group()
    os._exit(0)  # DDP's reducer may hang in its destructor (tests/test_ddp_reference.py)


def ddp(args: argparse.Namespace, spec: PowerSGDSpec, initial: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"edp-ddp-powersgd{spec.rank}-", dir="/tmp"))
    out, timing = str(work / "final.safetensors"), str(work / "seconds")
    mp.start_processes(_ddp_rank, args=(args.workers, str(work / "store"), initial, out, spec, args.steps, timing),
                       nprocs=args.workers, start_method="spawn")
    seconds = float(Path(timing).read_text())
    reduced, _ = wire_bytes(spec, TASK.defaults)
    row = {"variant": f"ddp_powersgd_rank{spec.rank}",
           "held_out_loss": round(held_out_loss(load_file(out), args.eval_batches), 4),
           "bytes_per_step": reduced, "copy_bytes": 0,
           "samples_per_s": round(args.steps * TASK.defaults.global_batch / seconds, 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--start", type=int, default=10, help="uncompressed steps first (--compress ...:start=S)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--int8", action="store_true", help="also --compress int8 (no DDP peer: torch has no hook)")
    args = parser.parse_args()
    specs = [PowerSGDSpec(rank=int(r), start=args.start) for r in args.ranks.split(",")]
    with local_ray(num_cpus=max(4, args.workers + 2)):
        rows = [ours(args, None)] + [ours(args, spec) for spec in specs]
        if args.int8:
            rows.append(ours(args, Int8Spec()))
    initial = rows[0].pop("initial")  # every run starts from the same weights (the job's seed)
    for row in rows:
        row.pop("initial", None)
    rows += [ddp(args, spec, initial) for spec in specs]
    plain = rows[0]
    for row in rows:
        row["bytes_vs_none"] = round(row["bytes_per_step"] / plain["bytes_per_step"], 4)
        row["loss_vs_none"] = round(row["held_out_loss"] / plain["held_out_loss"], 4)
    print(json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "ray": ray.__version__,
                      "workers": args.workers, "steps": args.steps, "start": args.start, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
