"""DiLoCo against synchronous and asynchronous SGD on the GPT job, on one local Ray cluster.

Each variant trains jobs.gpt for ``--steps`` sampler steps (the same batches, the same
samples) on ``--workers`` workers: ``--mode sync``, ``--mode async`` and ``--mode diloco``
at each ``--sync-every`` H of ``--h``. Reported for each:

- the held-out loss of its final weights: the task's loss over the first ``--eval-batches``
  global batches of ``Task.eval_dataset``, computed here by one plain PyTorch loop from
  ``final.safetensors`` (the same evaluation for every mode);
- the bytes that enter the workers' collectives per inner step: for sync the gradient
  all-reduce of every step (the fp32 gradients, 4 bytes a parameter), for DiLoCo the
  outer all-reduce of its ``outer_step`` events spread over their inner steps (async
  exchanges parameters and gradients with its shards instead: its pulls and pushes, 8
  bytes a parameter a step, are reported for reference);
- samples/s over the run (the driver's wall clock, start-up excluded);
- and then, on a slow link (``--inject slowlink:ms=M``: every all-reduce, reduce-scatter
  and all-gather takes at least M ms, ``--slowlink-ms``), samples/s of sync and of DiLoCo
  at the ``--h`` values above 1 over ``--slow-steps`` steps.
- ``--outer-reduces``: DiLoCo at each ``--h`` with its all-reduce in bf16, int8 or int4
  (``--outer-reduce``): held-out loss and the bytes of its ``outer_step`` events beside fp32's.
- Streaming DiLoCo (``--fragments F --fragment-delay τ``, each ``--streaming F:τ``) at the
  ``--h`` values above 1 where F ≤ H: the same figures, and the largest all-reduce of a sync
  (``peak_bytes``: a fragment's, against the whole pseudo-gradient of plain DiLoCo).

    .venv/bin/python -m benchmarks.bench_diloco --workers 2 --steps 200 --h 1,10,50 --streaming 5:1
    .venv/bin/python -m benchmarks.bench_diloco --workers 2 --steps 200 --h 10,50 --outer-reduces bf16,int8,int4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tempfile
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from benchmarks.peers import local_ray
from elastic_dp import ClusterConfig, Trainer
from jobs.gpt import TASK


def held_out_loss(weights: dict[str, torch.Tensor], batches: int) -> float:
    """The task's mean loss over the first ``batches`` global batches of its eval set."""
    model = TASK.model()
    model.load_state_dict(weights)
    model.eval()
    data = TASK.eval_dataset()
    n = min(len(data), batches * TASK.defaults.global_batch)
    total = 0.0
    with torch.no_grad():
        for start in range(0, n, TASK.defaults.global_batch):
            chunk = list(range(start, min(n, start + TASK.defaults.global_batch)))
            total += float(TASK.loss(model, TASK.collate([data[i] for i in chunk]))) * len(chunk)
    return total / n


def run(name: str, args: argparse.Namespace, steps: int | None = None, inject: tuple[str, ...] = (),
        **train) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"edp-diloco-{name}-", dir="/tmp"))
    config = dataclasses.replace(TASK.defaults, steps=steps or args.steps, **train)
    summary = Trainer(TASK, train=config, cluster=ClusterConfig(workers=args.workers), out_dir=str(out),
                      progress=False, inject=list(inject)).fit()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    params = sum(p.numel() for p in TASK.model().parameters())
    outer = [e for e in events if e["kind"] == "outer_step"]
    every_step = (8 if train.get("mode") == "async" else 4) * params  # sync's gradients, async's pull and push
    per_step = sum(e["bytes_sent"] for e in outer) / config.steps if outer else every_step
    row = {"variant": name, "held_out_loss": round(held_out_loss(load_file(out / "final.safetensors"),
                                                                 args.eval_batches), 4),
           "bytes_per_inner_step": int(per_step), "samples_per_s": round(summary.samples / summary.seconds, 1),
           "peak_bytes": max((e["bytes_sent"] for e in outer), default=every_step)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--h", default="1,10,50", help="the --sync-every values of the DiLoCo runs")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--slowlink-ms", type=float, default=50.0)
    parser.add_argument("--slow-steps", type=int, default=100)
    parser.add_argument("--streaming", default="", help="F:τ pairs, comma-separated: Streaming DiLoCo variants")
    parser.add_argument("--outer-reduces", default="", help="bf16, int8, int4 (comma-separated): DiLoCo at each --h "
                        "with its pseudo-gradient all-reduced so, beside fp32 (--outer-reduce)")
    args = parser.parse_args()
    streams = [tuple(int(x) for x in pair.split(":")) for pair in args.streaming.split(",") if pair]
    hs = [int(h) for h in args.h.split(",")]
    streamed = [(h, f, d) for h in hs for f, d in streams if 1 < h and f <= h and d < h // f]
    with local_ray(num_cpus=max(4, args.workers + 2)):
        rows = [run("sync", args), run("async", args, mode="async")]
        rows += [run(f"diloco_h{h}", args, mode="diloco", sync_every=int(h)) for h in args.h.split(",")]
        rows += [run(f"diloco_h{h}_f{f}_d{d}", args, mode="diloco", sync_every=h, fragments=f, fragment_delay=d)
                 for h, f, d in streamed]
        rows += [run(f"diloco_h{h}_{reduce}", args, mode="diloco", sync_every=int(h), outer_reduce=reduce)
                 for h in args.h.split(",") for reduce in args.outer_reduces.split(",") if reduce]
        slow = (f"slowlink:ms={args.slowlink_ms:g}",)
        slowed = [run("sync_slowlink", args, args.slow_steps, slow)]
        slowed += [run(f"diloco_h{h}_slowlink", args, args.slow_steps, slow, mode="diloco", sync_every=int(h))
                   for h in args.h.split(",") if int(h) > 1]
        slowed += [run(f"diloco_h{h}_f{f}_d{d}_slowlink", args, args.slow_steps, slow, mode="diloco", sync_every=h,
                       fragments=f, fragment_delay=d) for h, f, d in streamed]
    sync = next(r for r in rows if r["variant"] == "sync")
    for r in rows:
        r["loss_vs_sync"] = round(r["held_out_loss"] / sync["held_out_loss"], 4)
        r["bytes_vs_sync"] = round(r["bytes_per_inner_step"] / sync["bytes_per_inner_step"], 4)
    for r in slowed:
        r["samples_per_s_vs_sync"] = round(r["samples_per_s"] / slowed[0]["samples_per_s"], 3)
    print(json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "ray": ray.__version__,
                      "workers": args.workers, "steps": args.steps, "rows": rows,
                      "slowlink": {"ms": args.slowlink_ms, "steps": args.slow_steps, "rows": slowed}}, indent=1))


if __name__ == "__main__":
    main()
