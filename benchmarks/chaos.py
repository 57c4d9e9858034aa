"""A chaos soak: a random schedule of faults, at ZeRO stage 0 and stage 2, against the replay.

From ``--seed`` it draws a schedule of 13 faults and 2 joins over ``--steps`` steps (at
least 60) on up to 4 workers (``--workers 1:4``, two of them held back for the joins):

- injected kills in every phase: forward, allreduce, optimizer, snapshot (stage 2; a
  forward kill at stage 0), checkpoint (rank 0, while a checkpoint is saved);
- a kill during re-formation (``phase=reform``, after another kill in the same step);
- two kills in one step; an injected hang (SIGSTOP); two joins (the two pairs of kills
  come after the first checkpoint: at 2 workers they leave no survivor);
- from outside the program: SIGKILL twice and SIGSTOP once to a random worker process,
  sent once the run has reached the drawn step.

Each run trains an SGD task (the 8->16->16->1 MLP of the tests, SGD with momentum: its
float32 noise stays small over many steps, unlike AdamW's) paced by a short sleep in its
loss, with a durable checkpoint every 6 steps, and its final weights are compared with a
plain PyTorch replay of the same steps. The tolerance is measured in the same run: 10x
the difference between an uninterrupted run at 3 workers and the replay (float32
summation order), and reported beside the difference one skipped step makes.

A re-formation soak follows: up to 3 workers, rank 1 killed every 6 steps (replacements
join when ready), while the resident set size and thread count of the worker that stays
rank 0 are sampled; they must stay flat over at least 20 re-formations.

    .venv/bin/python -m benchmarks.chaos --seed 1 --steps 90
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

from benchmarks.peers import local_ray
from elastic_dp import CheckpointConfig, ClusterConfig, ElasticSampler, Task, TrainConfig, Trainer

EVERY = 6  # checkpoint every 6 steps


class Regression(Dataset):
    def __init__(self, n: int = 4096, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.sin(self.x @ torch.randn(dim, 1, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@dataclasses.dataclass(frozen=True)
class PacedMSE:
    seconds: float = 0.0

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        time.sleep(self.seconds)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def task(seconds: float) -> Task:
    return Task(model=mlp, dataset=Regression, loss=PacedMSE(seconds), optimizer=sgd,
                defaults=TrainConfig(global_batch=16, micro_batch=2, seed=7))


# -- the schedule ----------------------------------------------------------------------
def schedule(seed: int, steps: int, zero: int) -> tuple[list[str], list[tuple[int, str]]]:
    """``--inject`` specs and outside signals ``(step, SIGKILL|SIGSTOP)``, drawn from ``seed``."""
    rng = random.Random(seed)
    gap = (steps - 6) // 13  # distinct steps, spread out: replacements have time to join
    slots = rng.sample(range(4, steps - 2, gap), 12)
    # the two pairs (slots 4 and 5) may leave no survivor at 2 workers: only a checkpoint
    # can restore those, so they come after the first (a late slot takes an early pair's place)
    for i in (4, 5):
        if slots[i] <= EVERY:
            late = max((j for j in range(12) if j not in (4, 5) and slots[j] > EVERY), key=slots.__getitem__)
            slots[i], slots[late] = slots[late], slots[i]
    take = iter(slots)
    # single faults hit rank 0, which exists at any world size; pairs need a rank 1 too
    specs = [f"kill:step={next(take)}:rank=0:phase={p}" for p in ("forward", "allreduce", "optimizer")]
    specs.append(f"kill:step={next(take)}:rank=0:phase={'snapshot' if zero else 'forward'}")
    save = rng.choice([s for s in range(EVERY - 1, steps - 1, EVERY) if s not in slots])
    specs.append(f"kill:step={save}:rank=0:phase=checkpoint")
    s = next(take)
    specs += [f"kill:step={s}:rank=1", f"kill:step={s}:rank=0:phase=reform"]  # a fault while re-forming
    s = next(take)
    specs += [f"kill:step={s}:rank=0", f"kill:step={s}:rank=1:phase=allreduce"]  # two in one step
    specs.append(f"hang:step={next(take)}:rank=0")
    specs += [f"join:step={next(take)}", f"join:step={next(take)}"]
    outside = [(next(take), "SIGKILL"), (next(take), "SIGKILL"), (next(take), "SIGSTOP")]
    return specs, outside


# -- watching worker processes ---------------------------------------------------------
def worker_pids() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            state = open(f"/proc/{pid}/stat").read().split(")")[1].split()[0]
        except OSError:
            continue
        if b"WorkerActor" in cmd and state not in ("T", "Z"):
            found.append(int(pid))
    return sorted(found)


def rss_and_threads(pid: int) -> tuple[int, int] | None:
    try:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    except OSError:
        return None
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])


def _committed(metrics: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=-1) + 1
    except (OSError, ValueError):
        return 0


def send_outside(signals: list[tuple[int, str]], metrics: Path, rng: random.Random, done: threading.Event,
                 sent: list) -> None:
    for step, name in sorted(signals):
        while _committed(metrics) < step and not done.is_set():
            time.sleep(0.01)
        pids = worker_pids()
        if done.is_set() or not pids:
            return
        pid = rng.choice(pids)
        os.kill(pid, getattr(signal, name))
        sent.append({"step": step, "signal": name, "pid": pid})


# -- one run ---------------------------------------------------------------------------
def replay(t: Task, config: TrainConfig, initial: Path, skip: int | None = None) -> dict[str, torch.Tensor]:
    """A plain PyTorch loop over the same batches (``skip``: leave one step out)."""
    model, dataset = t.model(), t.dataset()
    model.load_state_dict(load_file(initial))
    optimizer = t.optimizer(model)
    sampler = ElasticSampler(len(dataset), global_batch=config.global_batch, seed=config.seed)
    for step in range(config.steps):
        if step == skip:
            continue
        x, y = t.collate([dataset[int(i)] for i in sampler.batch(step)])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    return float((flat(a) - flat(b)).norm() / flat(b).norm())


def run(t: Task, config: TrainConfig, out: Path, workers: tuple[int, int], inject: list[str],
        outside: list[tuple[int, str]], seed: int) -> dict:
    done, sent = threading.Event(), []
    thread = threading.Thread(target=send_outside, args=(outside, out / "metrics.jsonl", random.Random(seed),
                                                         done, sent))
    thread.start()
    start = time.monotonic()
    try:
        Trainer(t, train=config, cluster=ClusterConfig(workers=workers[1], min_workers=workers[0]),
                checkpoint=CheckpointConfig(dir=str(out / "ckpt"), every=EVERY, asynchronous=False), out_dir=str(out),
                progress=False, inject=inject).fit()
    finally:
        done.set()
        thread.join()
    seconds = time.monotonic() - start
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    changes = [e for e in events if e["kind"] in ("membership_changed", "restored_from_checkpoint")]
    failures = [e for e in changes if e["lost"]]
    return {"seconds": round(seconds, 1), "events": events, "outside_sent": sent,
            "unfired": [e["fault"] + ": " + e["reason"] for e in events if e["kind"] == "fault_not_fired"],
            "failures_recovered": len(failures), "workers_lost": sum(e["lost"] for e in failures),
            "re_formations": len(changes) + sum(e["kind"] == "reform_interrupted" for e in events),
            "checkpoint_restores": sum(e["kind"] == "restored_from_checkpoint" for e in changes),
            "steps_rerun": sum(e["steps_rerun"] for e in changes),
            "detect_s": sorted(round(e["detect_s"], 3) for e in failures),
            "reform_s": sorted(round(e["reform_s"], 3) for e in changes)}


def chaos(args: argparse.Namespace, work: Path, zero: int) -> dict:
    t = task(args.pace)
    config = dataclasses.replace(t.defaults, steps=args.steps, zero=zero)
    specs, outside = schedule(args.seed + zero, args.steps, zero)
    result = run(t, config, work / f"chaos-{zero}", (1, 4), specs, outside, args.seed)
    final = load_file(work / f"chaos-{zero}" / "final.safetensors")
    initial = work / f"chaos-{zero}" / "initial.safetensors"
    result.update(stage=zero, schedule=specs, outside=outside,
                  faults_injected=len(specs) - 2 + len(outside),  # joins are not faults
                  faults_fired=len(specs) - 2 - len(result["unfired"]) + len(result["outside_sent"]),
                  relative_diff=relative(final, replay(t, config, initial)),
                  one_step_skipped=relative(replay(t, config, initial, skip=args.steps // 2),
                                            replay(t, config, initial)))
    # float32 noise: the same steps uninterrupted at 3 workers against the replay
    calm = run(t, config, work / f"calm-{zero}", (3, 3), [], [], args.seed)
    result["noise"] = relative(load_file(work / f"calm-{zero}" / "final.safetensors"),
                               replay(t, config, work / f"calm-{zero}" / "initial.safetensors"))
    result["tolerance"] = max(10 * result["noise"], 1e-6)
    result["calm_seconds"] = calm["seconds"]
    result["survived"] = result["relative_diff"] < result["tolerance"]
    del result["events"]
    return result


def reformation_soak(args: argparse.Namespace, work: Path, zero: int) -> dict:
    """Rank 1 of up to 3 killed every 6 steps; the worker that stays rank 0 is sampled."""
    t = task(args.pace)
    config = dataclasses.replace(t.defaults, steps=args.soak_steps, zero=zero)
    out = work / f"soak-{zero}"
    samples: dict[int, list[tuple[float, int, int]]] = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for pid in worker_pids():
                got = rss_and_threads(pid)
                if got:
                    samples.setdefault(pid, []).append((time.time(), *got))
            time.sleep(0.25)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        result = run(t, config, out, (1, 3), [f"kill:step={s}:rank=1" for s in range(5, args.soak_steps, 6)],
                     [], args.seed)
    finally:
        done.set()
        thread.join()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    series = max(samples.values(), key=len)  # sampled longest: the worker that stayed rank 0
    reforms = [e["time"] for e in events if e["kind"] == "membership_changed"]
    warm = [s for s in series if s[0] >= reforms[0]] if reforms else series  # after the first re-formation
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    return {"stage": zero, "re_formations_seen": sum(series[0][0] <= t_ <= series[-1][0] for t_ in reforms),
            "rss_mib_first_last_max": [mib(warm[0][1]), mib(warm[-1][1]), mib(max(s[1] for s in warm))],
            "threads_first_last_max": [warm[0][2], warm[-1][2], max(s[2] for s in warm)],
            "seconds": result["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--soak-steps", type=int, default=180)
    parser.add_argument("--pace", type=float, default=0.03, help="seconds of sleep per micro-batch")
    parser.add_argument("--stages", default="0,2")
    args = parser.parse_args()
    if args.steps < 60:
        parser.error("--steps must be at least 60")
    work = Path(tempfile.mkdtemp(prefix="edp-chaos-", dir="/tmp"))
    report = {"seed": args.seed, "steps": args.steps, "chaos": [], "soak": []}
    with local_ray(num_cpus=4):
        for zero in map(int, args.stages.split(",")):
            report["chaos"].append(chaos(args, work, zero))
            print(json.dumps(report["chaos"][-1]), flush=True)
            report["soak"].append(reformation_soak(args, work, zero))
            print(json.dumps(report["soak"][-1]), flush=True)
    print(json.dumps({k: v for k, v in report.items()}, indent=1))
    summary = [{"stage": c["stage"], "survived": c["survived"], "fired": c["faults_fired"],
                "detect_s_median": statistics.median(c["detect_s"]) if c["detect_s"] else None}
               for c in report["chaos"]]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
