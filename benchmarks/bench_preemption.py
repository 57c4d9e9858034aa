"""A preemption notice: elastic_dp against Ray Train v2's preemption handling, in one run.

Both train the GPT of jobs/gpt.py (global batch 32, no micro-batching) on a two-node Ray
cluster on this machine (``ray.cluster_utils.Cluster``, one CPU slot a node, one worker
a node), elastic between 1 and 2 workers, with a durable checkpoint every ``--every``
steps. Once step ``--notice-step`` has committed, the second node is drained through
Ray's drain API (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds``'s call) with a ``--deadline`` second deadline, and removed
at the deadline, as a preempted node goes. Each trainer runs on a fresh cluster.

- elastic_dp (``--workers 1:2``) takes the notice as a planned leave: the step in flight
  commits and the group re-forms without the node's worker while it is alive.
- Ray Train v2 (2.60) as its documentation of ``ray.train.get_preemption_info`` says:
  every rank asks after each step; at the first notice rank 0 reports a just-in-time
  checkpoint and training goes on; at the deadline the controller restarts the workers
  (``ScalingConfig(num_workers=(1, 2))``: as many as fit) from the latest checkpoint.
  Its watcher polls the drains every 5 s (its default).

Measured for each, from the commits ``(step, time, world size)``:

- notice → next commit: to the first commit after the notice (any group);
- notice → first commit without the node: to the first commit of a group that no longer
  has the drained node's worker. It holds one step of that group, so the target for
  elastic_dp, at most one step + 0.5 s, is ``target_s``: that group's median step + 0.5 s;
- steps re-run: commits of a step that had already committed;
- samples/s over the minute around the notice: the samples of the steps committed from
  ``--before`` s before the notice to ``60 - before`` s after it that were never trained
  again, over 60 s (the default window, 15 s before to 45 s after, holds the 30 s deadline
  and what follows it: a minute centred on the notice would end at the deadline, where
  Ray Train's restart begins), with the rates before the notice and after the leave.

With ``--rounds R`` each trainer runs R times (alternating), and the medians of the
figures are given beside the rounds'.

    .venv/bin/python -m benchmarks.bench_preemption --steps 400 --notice-step 130 --deadline 30 [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.peers import ray_train_preemption_loop
from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from jobs.gpt import TASK
from tests.scripts.scenario import drain_node, lines, local_cluster, training

WINDOW_S = 60.0

Commits = list[tuple[int, float, int]]
"""``(step, time, world size)`` of every commit, in the order they happened."""


def figures(commits: Commits, notice: float, before_s: float) -> dict:
    """The measures above from ``commits`` and the time of the notice."""
    start, end = notice - before_s, notice + WINDOW_S - before_s
    if not commits or commits[0][1] > start or commits[-1][1] < end:
        raise SystemExit(f"the commits ({commits[0][1] - notice if commits else None:+.1f} s to "
                         f"{commits[-1][1] - notice if commits else None:+.1f} s around the notice) do not "
                         f"cover the window ({-before_s:+.0f} s to {WINDOW_S - before_s:+.0f} s): "
                         "raise --steps or --notice-step")
    world = commits[0][2]
    after = [c for c in commits if c[1] > notice]
    without = next(c for c in after if c[2] < world)
    last = {step: i for i, (step, _, _) in enumerate(commits)}  # the index of each step's last commit
    kept = [t for i, (step, t, _) in enumerate(commits) if last[step] == i]
    batch = TASK.defaults.global_batch

    def rate(since: float, until: float) -> float:
        return sum(since <= t < until for t in kept) * batch / (until - since)

    def step_s(since: float, until: float) -> float:
        return statistics.median(b[1] - a[1] for a, b in zip(commits, commits[1:])
                                 if b[0] == a[0] + 1 and since < a[1] and b[1] < until)

    after_step_s = step_s(without[1], math.inf)
    return {"notice_to_next_commit_s": after[0][1] - notice,
            "notice_to_first_commit_without_node_s": without[1] - notice,
            "target_s": after_step_s + 0.5,
            "step_s_before_notice": step_s(start, notice),
            "step_s_after_leave": after_step_s,
            "steps_rerun": len(commits) - len(last),
            "samples_per_s_window": rate(start, end),
            "samples_per_s_before_notice": rate(start, notice),
            "samples_per_s_after_leave": rate(without[1], end) if without[1] < end else None}


def _on_two_nodes(work: Path, fit: Callable[[], object], commits: Callable[[], Commits],
                  args: argparse.Namespace) -> tuple[Commits, float]:
    """``fit`` on a fresh two-node cluster, the second node drained once ``--notice-step``
    committed and removed at the deadline; the commits and the notice's time."""
    cluster = local_cluster(1)
    second = cluster.add_node(num_cpus=1)
    with training(fit, cluster, work / "unused") as thread:
        while not any(step >= args.notice_step for step, _, _ in commits()):
            if not thread.is_alive():
                raise SystemExit("the run ended before the notice")
            time.sleep(0.01)
        notice = time.time()
        drain_node(second.node_id, args.deadline, reason="bench_preemption")
        time.sleep(max(0.0, notice + args.deadline - time.time()))
        try:
            cluster.remove_node(second, allow_graceful=False)
        except Exception:  # noqa: BLE001 — Ray ended the drained node itself once it was idle
            pass
    return commits(), notice


def bench_elastic_dp(args: argparse.Namespace, work: Path) -> dict:
    config = dataclasses.replace(TASK.defaults, steps=args.steps, micro_batch=None, warmup_steps=0)
    out = work / "edp"

    def fit() -> None:
        Trainer(TASK, train=config, cluster=ClusterConfig(workers=2, min_workers=1),
                checkpoint=CheckpointConfig(dir=str(work / "edp-ckpt"), every=args.every),
                out_dir=str(out), progress=False).fit()

    def commits() -> Commits:
        return [(m["step"], m["time"], m["world_size"]) for m in lines(out / "metrics.jsonl")]

    entries, notice = _on_two_nodes(work, fit, commits, args)
    change = next(e for e in lines(out / "events.jsonl") if e["kind"] == "membership_changed")
    return {**figures(entries, notice, args.before),
            "event": {k: change.get(k) for k in ("leave", "steps_rerun", "restored_step", "cause")}}


def bench_ray_train(args: argparse.Namespace, work: Path) -> dict:
    from ray.train import CheckpointConfig as RTCheckpointConfig
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log = work / "rt.log"

    def fit() -> None:
        TorchTrainer(
            ray_train_preemption_loop,
            train_loop_config={"steps": args.steps, "every": args.every, "log": str(log)},
            scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="bench", storage_path=str(work / "rt-storage"),
                                 failure_config=FailureConfig(max_failures=2),
                                 checkpoint_config=RTCheckpointConfig(num_to_keep=2))).fit()

    def commits() -> Commits:
        text = log.read_text() if log.exists() else ""
        return [(int(s), float(t), int(w)) for s, t, w in (line.split() for line in text.splitlines())]

    entries, notice = _on_two_nodes(work, fit, commits, args)
    jit = Path(f"{log}.jit")
    saved = [float(line.split()[1]) for line in jit.read_text().splitlines()] if jit.exists() else []
    return {**figures(entries, notice, args.before),
            "notice_to_jit_checkpoint_s": saved[0] - notice if saved else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--notice-step", type=int, default=130, help="drain once this step has committed")
    parser.add_argument("--deadline", type=float, default=30.0, help="the drain's deadline, seconds")
    parser.add_argument("--every", type=int, default=50, help="a durable checkpoint every this many steps")
    parser.add_argument("--before", type=float, default=15.0,
                        help="the minute's window starts this many seconds before the notice")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each trainer")
    parser.add_argument("--only", choices=["all", "elastic_dp", "ray_train"], default="all")
    args = parser.parse_args()
    benches = {"elastic_dp": bench_elastic_dp, "ray_train_v2": bench_ray_train}
    if args.only != "all":
        benches = {k: v for k, v in benches.items() if k.startswith(args.only)}
    result = {k: getattr(args, k) for k in ("steps", "notice_step", "deadline", "every", "before", "rounds")}
    rounds: dict[str, list[dict]] = {name: [] for name in benches}
    for _ in range(args.rounds):
        for name, bench in benches.items():
            work = Path(tempfile.mkdtemp(prefix="edp-preemption-", dir="/tmp"))
            try:
                rounds[name].append(bench(args, work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    for name, runs in rounds.items():
        numbers = [k for k, v in runs[0].items() if k != "event"]
        result[name] = {"median": {k: statistics.median(run[k] for run in runs if run[k] is not None)
                                   for k in numbers if any(run[k] is not None for run in runs)}, "rounds": runs}
    if len(rounds) == 2:
        result["ratio_samples_per_s_window"] = (result["elastic_dp"]["median"]["samples_per_s_window"]
                                                / result["ray_train_v2"]["median"]["samples_per_s_window"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
