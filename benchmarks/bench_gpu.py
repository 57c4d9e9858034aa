"""The step on a GPU: elastic_dp against plain PyTorch on the same device, and model
FLOPs utilisation at a size that fills it. Needs an NVIDIA GPU (``benchmarks/gpu_check.sh``
runs it after the CUDA tests).

1. GPT job step (jobs.gpt, fp32, global batch 32): elastic_dp with one worker (an NCCL
   group of one, its windows of steps, pinned-memory prefetch) against a plain PyTorch
   loop on the same GPU and batches, the peer a one-GPU user runs. They alternate in
   rounds; round 0 is warm-up. Reported: median ms/step of each and the ratio.
2. Utilisation: ``benchmarks.tasks.FILL_GPT_TASK`` (a GPT of about 0.8 B parameters,
   context 1024, bf16 autocast, global batch 16) trained by elastic_dp on one worker and
   by the plain loop (in this driver process); model FLOPs utilisation = FLOPs per sample x samples/s / the GPU's
   dense bf16 peak (``elastic_dp.observe.metrics.PEAK_TFLOPS``, or ``--peak-tflops``).
3. ZeRO stage 3 against stage 0: the same filling GPT trained by elastic_dp on one worker
   at ``--zero 0`` and then at ``--zero 3`` (built on the meta device, its blocks gathered
   and freed one by one: on one GPU the gathers are copies, so this measures what stage
   3's hooks, frees and re-gathers cost the step), each run its rounds in turn on the
   device; the model FLOPs utilisation of each and their ratio.

    python -m benchmarks.bench_gpu --rounds 6 --steps-per-round 20
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import ray
import torch

from benchmarks.peers import local_ray
from benchmarks.tasks import FILL_GPT_TASK
from elastic_dp import CheckpointConfig, ClusterConfig, ElasticSampler, Task
from elastic_dp.api import build_coordinator
from elastic_dp.observe.metrics import RunRecorder, known_peak_tflops
from jobs.gpt import TASK


class PlainLoop:
    """The task trained by a plain PyTorch loop on one GPU: what a user writes by hand."""

    def __init__(self, task: Task) -> None:
        torch.manual_seed(task.defaults.seed)
        self.task, self.config = task, task.defaults
        self.model = task.model().cuda()
        self.optimizer = task.optimizer(self.model)
        self.dataset = task.dataset()
        self.sampler = ElasticSampler(len(self.dataset), global_batch=self.config.global_batch,
                                      seed=self.config.seed)
        self.step = 0

    def run(self, steps: int) -> float:
        """Train ``steps`` steps; seconds per step."""
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.config.precision == "bf16")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            indices = self.sampler.batch(self.step)
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(0, len(indices), self.config.micro_batch):
                chunk = indices[i:i + self.config.micro_batch]
                x, y = self.task.collate([self.dataset[int(j)] for j in chunk])
                with autocast:
                    loss = self.task.loss(self.model, (x.cuda(non_blocking=True), y.cuda(non_blocking=True)))
                (loss * (len(chunk) / len(indices))).backward()
            if self.config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
            self.optimizer.step()
            self.step += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps


def compare(task: Task, rounds: int, steps_per_round: int) -> dict:
    config = dataclasses.replace(task.defaults, steps=10**9)
    recorder = RunRecorder(None, total_steps=10**9, progress=False)
    coordinator = build_coordinator(task, config, ClusterConfig(workers=1, device="cuda"), CheckpointConfig(),
                                    recorder)
    coordinator.run_until(0)
    plain = PlainLoop(task)  # in this process, on the worker's GPU (Ray gave the worker all of it)
    ours, theirs = [], []
    try:
        for round_ in range(rounds):
            start = time.perf_counter()
            coordinator.run_until(coordinator.step + steps_per_round)
            ours.append((time.perf_counter() - start) / steps_per_round)
            theirs.append(plain.run(steps_per_round))
            print(f"{task.model.__name__} round {round_}: elastic_dp {ours[-1] * 1e3:.2f} ms/step, "
                  f"plain PyTorch {theirs[-1] * 1e3:.2f} ms/step" + ("  (warm-up)" if round_ == 0 else ""),
                  flush=True)
    finally:
        coordinator.close()
    a, b = statistics.median(ours[1:]), statistics.median(theirs[1:])
    result = {"elastic_dp_ms": round(a * 1e3, 3), "plain_ms": round(b * 1e3, 3), "ratio": round(a / b, 3),
              "median_round_ratio": round(statistics.median(x / y for x, y in zip(ours[1:], theirs[1:])), 3)}
    if task.flops_per_sample:
        peak = recorder.throughput.peak_flops or (known_peak_tflops(torch.cuda.get_device_name(0)) or 0) * 1e12
        if peak:
            for name, seconds in (("elastic_dp", a), ("plain", b)):
                result[f"{name}_mfu"] = round(task.flops_per_sample * config.global_batch / seconds / peak, 4)
            result["peak_tflops"] = peak / 1e12
    return result


def by_stage(task: Task, rounds: int, steps_per_round: int, device: str = "cuda") -> dict:
    """``task`` at ZeRO stage 0 and then stage 3 on one worker: median ms a step (round 0
    warm-up) and, where the peak is known, model FLOPs utilisation."""
    result = {}
    for zero in (0, 3):
        config = dataclasses.replace(task.defaults, steps=10**9, zero=zero)
        recorder = RunRecorder(None, total_steps=10**9, progress=False)
        coordinator = build_coordinator(task, config, ClusterConfig(workers=1, device=device), CheckpointConfig(),
                                        recorder)
        coordinator.run_until(0)
        times = []
        try:
            for round_ in range(rounds):
                start = time.perf_counter()
                coordinator.run_until(coordinator.step + steps_per_round)
                times.append((time.perf_counter() - start) / steps_per_round)
                print(f"stage {zero} round {round_}: {times[-1] * 1e3:.2f} ms/step"
                      + ("  (warm-up)" if round_ == 0 else ""), flush=True)
        finally:
            coordinator.close()
        seconds = statistics.median(times[1:])
        result[f"zero{zero}_ms"] = round(seconds * 1e3, 3)
        peak = recorder.throughput.peak_flops or (
            known_peak_tflops(torch.cuda.get_device_name(0)) if device == "cuda" else 0) * 1e12
        if task.flops_per_sample and peak:
            result[f"zero{zero}_mfu"] = round(task.flops_per_sample * config.global_batch / seconds / peak, 4)
    result["zero3_over_zero0"] = round(result["zero3_ms"] / result["zero0_ms"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--fill-steps-per-round", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "ray": ray.__version__}
    parts = {"gpt_job": lambda: compare(TASK, args.rounds, args.steps_per_round),
             "fill_gpt": lambda: compare(FILL_GPT_TASK, args.rounds, args.fill_steps_per_round),
             "fill_gpt_by_stage": lambda: by_stage(FILL_GPT_TASK, min(args.rounds, 4), args.fill_steps_per_round)}
    with local_ray(num_cpus=4):
        for name, part in parts.items():
            result[name] = part()
            # each part as it ends, so that a run stopped at its limit keeps the parts before
            print(json.dumps({name: result[name]}), flush=True)
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], "bench_gpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
