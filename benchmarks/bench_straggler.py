"""A straggler: synchronous with equal slices, with ``--balance``, and asynchronous SGD.

The GPT of jobs.gpt on ``--workers`` CPU workers, rank ``--slow-rank`` slowed
``--factor`` times (``--inject slow``), trained for ``--steps`` steps (updates) from the
same initial weights: sync with equal slices, sync ``--balance``, and ``--mode async`` at
each ``--staleness``. Reported for each: samples/s (median step or update interval after
``--warmup``), the ratio to sync, the mean loss of the last ``--tail`` steps (every run has
then trained the same number of samples); the slices ``--balance`` settled on; async's
staleness histogram and recomputed updates; sync's loss over the same tail of the steps
it had trained by the wall time each run ended (equal time rather than equal samples);
and the largest difference between the two sync runs' final parameters (the same
batches split differently: float32 order only).

Every run's final parameters are also scored on the same fixed batches (``EVAL_STEPS`` of
the sampler, never trained in a short run), and so are those of a plain single-process
PyTorch loop whose every gradient is ``--reference-staleness`` updates late (computed on
the parameters that many updates back): the cost of staleness itself, without Ray or
parameter servers, to set async's figures against.

    .venv/bin/python -m benchmarks.bench_straggler --workers 3 --factor 3 --steps 40
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import tempfile

import ray
import torch
from safetensors.torch import load_file

from benchmarks.peers import local_ray
from elastic_dp import ClusterConfig, Trainer
from elastic_dp.data import ElasticSampler
from jobs.gpt import TASK
from tests.reference import replay_updates

EVAL_STEPS = range(5000, 5008)


def held_out_loss(state: dict[str, torch.Tensor]) -> float:
    """The mean loss of ``state`` on the batches of sampler steps ``EVAL_STEPS``."""
    model = TASK.model()
    model.load_state_dict(state)
    model.eval()
    dataset = TASK.dataset()
    sampler = ElasticSampler(len(dataset), global_batch=TASK.defaults.global_batch, seed=TASK.defaults.seed)
    with torch.no_grad():
        losses = [float(TASK.loss(model, TASK.collate([dataset[int(i)] for i in sampler.batch(s)])))
                  for s in EVAL_STEPS]
    return round(statistics.mean(losses), 4)


def plain_stale(initial: str, steps: int, staleness: int) -> dict[str, torch.Tensor]:
    """A plain PyTorch loop over steps 0..steps-1 in order, each gradient computed on the
    parameters ``staleness`` updates back (the first ones on the initial parameters): the
    async replay contract's own reference loop, ``tests.reference.replay_updates``, fed
    such a history."""
    config = TASK.defaults
    updates = [{"version": v, "step": v - 1, "base_version": max(0, v - 1 - staleness),
                "lr_scale": config.lr_factor(v - 1)} for v in range(1, steps + 1)]
    return replay_updates(TASK, config, initial, updates)


def run(args: argparse.Namespace, out: str, **train) -> dict:
    config = dataclasses.replace(TASK.defaults, steps=args.steps, **train)
    Trainer(TASK, train=config, cluster=ClusterConfig(workers=args.workers), out_dir=out, progress=False,
            inject=[f"slow:rank={args.slow_rank}:factor={args.factor}"]).fit()
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(f"{out}/events.jsonl") as f:
        events = [json.loads(line) for line in f]
    sizes = [e["sizes"] for e in events if e["kind"] == "rebalanced"]
    step_s = statistics.median(r["step_s"] for r in rows[args.warmup:])
    result = {"step_ms": round(1e3 * step_s, 2), "samples_per_s": round(config.global_batch / step_s, 1),
              "tail_loss": round(statistics.mean(r["loss"] for r in rows[-args.tail:] if r["loss"] is not None), 4)}
    if sizes:
        result["slices"] = sizes[-1]
    # from the first step's end: a first async "step" also spans setting up the shards
    result["_curve"] = [(r["time"] - rows[0]["time"], r["loss"]) for r in rows if r["loss"] is not None]
    result["held_out_loss"] = held_out_loss(load_file(f"{out}/final.safetensors"))
    summary = next((e for e in events if e["kind"] == "async_summary"), None)
    if summary:
        result |= {"staleness": summary["staleness"], "recomputed": summary["recomputed"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps not counted (the balance settles in these)")
    parser.add_argument("--tail", type=int, default=10, help="the last steps whose loss is averaged")
    parser.add_argument("--staleness", default="2,8", help="async runs, one per --max-staleness")
    parser.add_argument("--staleness-lr", default="none", choices=("none", "inverse", "both"),
                        help="async learning rate damping; both: each staleness once undamped, once inverse")
    parser.add_argument("--reference-staleness", default="1,2",
                        help="plain loops with every gradient this many updates late (empty: none)")
    parser.add_argument("--no-balance", action="store_true", help="leave out the --balance run")
    args = parser.parse_args()
    runs = {}
    with local_ray(num_cpus=2 * args.workers), tempfile.TemporaryDirectory() as tmp:
        runs["sync"] = run(args, f"{tmp}/sync")
        if not args.no_balance:
            runs["sync_balance"] = run(args, f"{tmp}/balance", balance=True)
        dampings = ("none", "inverse") if args.staleness_lr == "both" else (args.staleness_lr,)
        for s in (int(s) for s in args.staleness.split(",") if s):
            for damping in dampings:
                name = f"async_s{s}" + ("_inverse" if damping == "inverse" else "")
                runs[name] = run(args, f"{tmp}/{name}", mode="async", max_staleness=s, staleness_lr=damping)
        initial = f"{tmp}/sync/initial.safetensors"
        plain = {f"plain_staleness_{t}": held_out_loss(plain_stale(initial, args.steps, t))
                 for t in (int(t) for t in args.reference_staleness.split(",") if t)}
        diff = None
        if not args.no_balance:
            a, b = load_file(f"{tmp}/sync/final.safetensors"), load_file(f"{tmp}/balance/final.safetensors")
            diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    sync_curve = runs["sync"]["_curve"]
    for result in runs.values():
        result["x_sync"] = round(result["samples_per_s"] / runs["sync"]["samples_per_s"], 3)
        # equal wall time: sync's loss over the tail of steps it had trained when this run ended
        ended = result["_curve"][-1][0]
        done = [loss for t, loss in sync_curve if t <= ended] or [sync_curve[0][1]]
        result["sync_tail_loss_at_same_time"] = round(statistics.mean(done[-args.tail:]), 4)
    for result in runs.values():
        del result["_curve"]
    print(json.dumps({"date": datetime.date.today().isoformat(), "workers": args.workers,
                      "slow_rank": args.slow_rank, "factor": args.factor, "steps": args.steps,
                      "torch": torch.__version__, "ray": ray.__version__, "runs": runs,
                      "plain_loop_held_out_loss": plain, "sync_vs_balance_max_param_diff": diff}, indent=1))


if __name__ == "__main__":
    main()
