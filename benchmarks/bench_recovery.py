"""Recovery from a worker crash: elastic_dp against Ray Train v2's TorchTrainer, in one run.

Both train the GPT of jobs/gpt.py on 2 CPU workers (global batch 32, no micro-batching)
for ``--steps`` steps with a durable checkpoint every ``--every`` steps, and rank 1 is
SIGKILLed at the start of step ``--crash-step``. Measured for each:

- to the next commit: wall time from the commit of the last step before the kill to the
  next commit of any step (it includes one step's compute; the median step time is given
  alongside);
- to the crash step's commit: from the same point to the commit of the step that was
  interrupted, i.e. until the run makes new progress;
- steps lost: committed steps that had to be trained again;
- for elastic_dp, how long its replacement worker took from being built to the commit of
  its first step (target: within one step).

elastic_dp re-forms its group in place over the survivor (and a replacement when ready);
Ray Train restarts every worker from the latest checkpoint.

Hang detection (elastic_dp only, default settings): how long until a SIGSTOPped worker,
and a worker whose training thread blocks forever in its forward, are found.

Warm spares (``--only spares``): the GPT job on 2 workers at ZeRO stages 0, 2 and 3, with
``--spares 1`` and without; rank 1's process is SIGKILLed from outside the program (this
driver, by the pid the ``mesh`` event gives) once step ``--crash-step`` - 1 has committed.
Measured: from the kill to the first commit at full size (2 workers) and to the first
commit at all, steps lost beyond the interrupted one, and what the spare cost while it
stood by (its process's CPU seconds per step, from /proc; it takes part in no collective).
At stage 0 the spare is also run with a copy of the state every step and never
(``--spare-copy-every 1`` and ``0``; the default run copies every 10): the members' median
step time before the kill and the spare's CPU say what keeping it in step costs. Ray Train
v2 in the same run, as in the crash part: its group restarts at full size from its
checkpoint (``--every``).

    .venv/bin/python -m benchmarks.bench_recovery --steps 30 --every 8 --crash-step 20 [--only crash|hang|spares]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray

from benchmarks.peers import BlockOnce, ray_train_loop
from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from jobs.gpt import TASK


def _recovery(entries: list[tuple[int, float]], crash_step: int) -> dict:
    """Figures from the commits ``(step, time)`` in the order they happened (a restarted
    run commits some steps twice)."""
    last = next(i for i, (step, _) in enumerate(entries) if step == crash_step - 1)  # before the kill
    before = entries[last][1]
    next_step, next_time = entries[last + 1]
    progress = next(t for s, t in entries[last + 1:] if s == crash_step)
    gaps = [b[1] - a[1] for a, b in zip(entries, entries[1:]) if b[0] == a[0] + 1 and b[0] != crash_step]
    return {"to_next_commit_s": next_time - before, "to_crash_step_commit_s": progress - before,
            "steps_lost": crash_step - next_step, "median_step_s": statistics.median(gaps)}


def bench_elastic_dp(args: argparse.Namespace, work: Path) -> dict:
    config = dataclasses.replace(TASK.defaults, steps=args.steps, micro_batch=None, warmup_steps=0)
    Trainer(TASK, train=config, cluster=ClusterConfig(workers=2, min_workers=1),
            checkpoint=CheckpointConfig(dir=str(work / "edp-ckpt"), every=args.every),
            out_dir=str(work / "edp"), progress=False,
            inject=[f"kill:step={args.crash_step}:rank=1"]).fit()
    metrics = [json.loads(line) for line in (work / "edp" / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (work / "edp" / "events.jsonl").read_text().splitlines()]
    change = next(e for e in events if e["kind"] == "membership_changed")
    figures = {**_recovery([(m["step"], m["time"]) for m in metrics], args.crash_step),
               "detect_s": change["detect_s"], "reform_s": change["reform_s"]}
    join = next((e for e in events if e["kind"] == "membership_changed" and e.get("joined")), None)
    if join is not None:  # the replacement: from built to its first committed step
        ready = join["time"] - join["ready_to_join_s"]
        first = min(m["time"] for m in metrics if m["time"] > join["time"])
        figures["replacement_ready_to_first_commit_s"] = first - ready
    return figures


def bench_hangs(args: argparse.Namespace, work: Path) -> dict:
    """Detection of a hung worker with the default settings (step deadline 600 s): rank 1
    SIGSTOPped at step ``--crash-step`` (a frozen process), and a training thread that
    blocks forever in one worker's forward (it keeps answering heartbeats)."""
    config = dataclasses.replace(TASK.defaults, steps=args.steps, micro_batch=None, warmup_steps=0)
    figures = {}
    cases = {"frozen_process": (TASK, [f"hang:step={args.crash_step}:rank=1"]),
             "stalled_thread": (dataclasses.replace(TASK, loss=BlockOnce(TASK.loss, args.crash_step,
                                                                         str(work / "blocked"))), [])}
    for name, (task, inject) in cases.items():
        out = work / f"edp-{name}"
        Trainer(task, train=config, cluster=ClusterConfig(workers=2, min_workers=1), out_dir=str(out),
                progress=False, inject=inject).fit()
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        change = next(e for e in events if e["kind"] == "membership_changed")
        figures[name] = {"detect_s": change["detect_s"], "reform_s": change["reform_s"],
                         "cause": change["cause"]}
    return figures


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_pids() -> set[int]:
    """This driver's elastic_dp worker processes (descendants running a WorkerActor)."""
    from tests.procs import worker_pids

    return set(worker_pids())


def bench_spare(args: argparse.Namespace, work: Path, zero: int, spares: int, copy_every: int | None = None) -> dict:
    """One run: the GPT job at ``zero`` on 2 workers with ``spares`` (at stage 0, a copy of
    the state to them every ``copy_every`` steps: ``--spare-copy-every``, None its default);
    rank 1 SIGKILLed by pid once step ``crash_step`` - 1 committed."""
    out = work / f"spares-{zero}-{spares}-{copy_every}"
    copies = {} if copy_every is None else {"spare_copy_every": copy_every}
    config = dataclasses.replace(TASK.defaults, steps=args.steps, micro_batch=None, warmup_steps=0, zero=zero,
                                 **copies)
    trainer = Trainer(TASK, train=config, cluster=ClusterConfig(workers=2, min_workers=1, spares=spares),
                      out_dir=str(out), progress=False)
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported by the driver thread
            failed.append(exc)

    def wait_for(step: int) -> list[dict]:
        while True:
            metrics = _lines(out / "metrics.jsonl")
            if any(m["step"] == step for m in metrics):
                return metrics
            if not thread.is_alive():
                raise RuntimeError(f"the run ended before step {step}: {failed}")
            time.sleep(0.005)

    thread = threading.Thread(target=fit)
    thread.start()
    half = wait_for(args.crash_step // 2)  # the spare is built by now: its CPU from here to the kill
    mesh = [e for e in _lines(out / "events.jsonl") if e["kind"] == "mesh"][-1]
    standing_by = sorted(_worker_pids() - set(mesh["pids"]))
    cpu_half = {pid: _cpu_s(pid) for pid in standing_by}
    before = wait_for(args.crash_step - 1)
    cpu_before = {pid: _cpu_s(pid) for pid in standing_by}
    killed_at = time.time()
    os.kill(mesh["pids"][1], signal.SIGKILL)
    thread.join()
    if failed:
        raise failed[0]
    metrics = _lines(out / "metrics.jsonl")
    change = next(e for e in _lines(out / "events.jsonl") if e["kind"] == "membership_changed")
    after = [m for m in metrics if m["time"] > killed_at]
    full = next(m for m in after if m["world_size"] == 2)
    steps = [m["step"] for m in metrics]
    figures = {"kill_to_first_commit_s": round(after[0]["time"] - killed_at, 3),
               "kill_to_full_size_commit_s": round(full["time"] - killed_at, 3),
               "steps_trained_short": sum(m["world_size"] < 2 for m in after),
               "steps_lost": max(0, change["steps_rerun"] - 1),  # committed steps trained again
               "steps_rerun": change["steps_rerun"], "promoted": change.get("promoted", 0),
               "detect_s": change["detect_s"], "reform_s": change["reform_s"],
               "median_step_s_before_kill": round(statistics.median(
                   m["step_s"] for m in before if m["step"] >= args.crash_step // 2), 5)}
    if "state_sent" in change:  # stage 0: how many members were sent the state (a spare holding it: none)
        figures["state_sent"] = change["state_sent"]
    assert steps == list(range(args.steps)), steps  # each step committed once
    if standing_by:  # the spare's CPU while it stood by, between the two reads
        spent = sum(cpu_before[p] - cpu_half[p] for p in standing_by)
        seconds = max(m["time"] for m in before) - max(m["time"] for m in half)
        figures["spare_cpu_ms_per_step"] = round(1e3 * spent / (len(before) - len(half)), 3)
        figures["spare_cpu_share_while_training"] = round(spent / seconds, 4)
    return figures


def bench_spares(args: argparse.Namespace, work: Path) -> dict:
    """Each stage with a spare and without; at stage 0 also a copy of the state to the spare
    every step and never (``--spare-copy-every 1`` and ``0``): what keeping it in step costs."""
    result = {f"zero{zero}": {f"spares{k}": bench_spare(args, work, zero, k) for k in (1, 0)} for zero in (0, 2, 3)}
    for every in (1, 0):
        result["zero0"][f"spares1_copy_every{every}"] = bench_spare(args, work, 0, 1, every)
    return result


def bench_ray_train(args: argparse.Namespace, work: Path) -> dict:
    from ray.train import CheckpointConfig as RTCheckpointConfig
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log, marker = work / "rt.log", work / "rt.crashed"  # marker: the crash happens once
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"steps": args.steps, "every": args.every, "crash_step": args.crash_step,
                           "log": str(log), "marker": str(marker)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="bench", storage_path=str(work / "rt-storage"),
                             failure_config=FailureConfig(max_failures=2),
                             checkpoint_config=RTCheckpointConfig(num_to_keep=2)))
    trainer.fit()
    entries = [(int(s), float(t)) for s, t, _ in (line.split() for line in log.read_text().splitlines())]
    return _recovery(entries, args.crash_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--crash-step", type=int, default=20)
    parser.add_argument("--only", choices=["all", "crash", "hang", "spares"], default="all",
                        help="crash: the kill against Ray Train; hang: hang detection (elastic_dp only); spares: "
                             "a kill with and without a warm spare (elastic_dp only)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edp-recovery-", dir="/tmp"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=str(work / "ray"),
             log_to_driver=False)
    result = {"steps": args.steps, "checkpoint_every": args.every, "crash_step": args.crash_step}
    try:
        if args.only in ("all", "crash"):
            result.update(elastic_dp=bench_elastic_dp(args, work), ray_train_v2=bench_ray_train(args, work))
            for key in ("to_next_commit_s", "to_crash_step_commit_s"):
                result[f"ratio_{key}"] = result["ray_train_v2"][key] / result["elastic_dp"][key]
        if args.only in ("all", "hang"):
            result["hangs"] = bench_hangs(args, work)
        if args.only in ("all", "spares"):
            result["spares"] = bench_spares(args, work)
            if args.only == "spares":  # the peer restarts its whole group, at full size, from a checkpoint
                result["ray_train_v2"] = bench_ray_train(args, work)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
