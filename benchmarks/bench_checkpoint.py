"""What a checkpoint costs training: synchronous against background saves, on the GPT job.

Three runs per round, in alternating order, on one local Ray cluster: no checkpoints,
``--sync-checkpoints`` (each rank copies and writes its part on its training thread),
and the default background saves (each rank only copies its part into host memory on
its training thread; its I/O thread serialises, hashes and writes it while the next
steps train). Each run trains ``--steps`` steps and saves every ``--every``; round 0 is
warm-up. Reported, as medians over the rounds:

- stall per save: the time training waited for a save (the ``stall_s`` of each
  ``checkpoint_saved`` event);
- save to commit: from the start of a save to its manifest (``save_s``);
- run time: first to last commit, and its excess over the run without checkpoints,
  per save. In background saves that excess also holds what the uploads took from the
  steps running beside them (here they share 2 CPU cores).

    .venv/bin/python -m benchmarks.bench_checkpoint --rounds 4 --steps 24 --every 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.peers import local_ray
from elastic_dp import CheckpointConfig, ClusterConfig, MetricsConfig, Trainer
from jobs.gpt import TASK

VARIANTS = ("none", "sync", "background")


def _run(variant: str, steps: int, every: int, workers: int, scratch: Path) -> dict:
    out, ckpt = scratch / f"{variant}-out", scratch / f"{variant}-ckpt"
    checkpoint = CheckpointConfig() if variant == "none" else CheckpointConfig(
        dir=str(ckpt), every=every, asynchronous=variant == "background")
    Trainer(TASK, train=dataclasses.replace(TASK.defaults, steps=steps), cluster=ClusterConfig(workers=workers),
            checkpoint=checkpoint, out_dir=str(out), progress=False,
            metrics=MetricsConfig(ray_metrics=False)).fit()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    saves = [e for e in events if e["kind"] == "checkpoint_saved"]
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"run_s": metrics[-1]["time"] - metrics[0]["time"] + metrics[0]["step_s"],
            "step_s": statistics.median(m["step_s"] for m in metrics),
            "stall_s": [s["stall_s"] for s in saves], "save_s": [s["save_s"] for s in saves],
            "bytes": saves[0]["bytes"] if saves else 0, "saves": len(saves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the three runs; round 0 is warm-up")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with local_ray(num_cpus=max(2, args.workers)), tempfile.TemporaryDirectory(prefix="edp-bench-ckpt-") as tmp:
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                result = _run(variant, args.steps, args.every, args.workers, Path(tmp))
                if r:
                    runs[variant].append(result)
                print(f"round {r} {variant:10s} run {result['run_s']:.2f} s, step {result['step_s']:.4f} s, "
                      f"stalls {result['stall_s']}", flush=True)
    base = statistics.median(r["run_s"] for r in runs["none"])
    report = {"date": datetime.date.today().isoformat(), "workers": args.workers, "steps": args.steps,
              "every": args.every, "rounds": args.rounds - 1, "run_s": {}, "stall_per_save_s": {},
              "save_to_commit_s": {}, "excess_per_save_s": {}}
    for variant in VARIANTS:
        report["run_s"][variant] = round(statistics.median(r["run_s"] for r in runs[variant]), 3)
        if variant == "none":
            continue
        saves = runs[variant][0]["saves"]
        for key, field in (("stall_per_save_s", "stall_s"), ("save_to_commit_s", "save_s")):
            report[key][variant] = round(statistics.median(s for r in runs[variant] for s in r[field]), 4)
        report["excess_per_save_s"][variant] = round((report["run_s"][variant] - base) / saves, 4)
        report["checkpoint_bytes"] = runs[variant][0]["bytes"]
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
