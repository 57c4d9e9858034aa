"""Several hosts on one slow link each (the testbed, benchmarks/hosts.py): bytes each host
sends over its link per step, from the kernel's counters, and samples/s, for elastic_dp's
flat and hierarchical all-reduce (stage 0) and ZeRO-2 and ZeRO-3 sharded inside each host
(``--shard-scope host``, HSDP), against torch DDP (a flat gloo ring) and FSDP2's HSDP
(``fully_shard`` on a 2-D ``DeviceMesh``), each started with torchrun on each host, all
training jobs.gpt in the same namespaces, next to ``elastic-dp plan``'s figure; and
``--compress powersgd:rank=2`` against DDP with torch's ``powerSGD_hook`` at rank 2, and
``--compress int8`` over every byte and on the hop between the hosts alone
(``--compress-scope hosts``); and ZeRO-3 over all the ranks, where the parameter gathers cross
the link, in fp32 and with ``--param-dtype bf16`` (bf16 gathers, fp32 reductions) against
FSDP2 over all the ranks with and without its bf16 ``MixedPrecisionPolicy``. As root (the
namespaces); docs/BENCHMARKS.md has the figures.

    python -m benchmarks.bench_hosts [--hosts 2] [--workers-per-host 2] [--rate-mbit 200] [--steps 24] [--rounds 1]
        [--only NAME,...]

Bytes are read between the commit times of steps 4 and steps-4 (start-up and the end left
out; the links sampled every 20 ms), and samples/s is the global batch over the median step
time there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.hosts import LinkLog, Testbed
from elastic_dp.observe.capacity import MemoryPlan
from elastic_dp.state.units import gathered_once, model_units
from jobs.gpt import TASK
from tests.scripts.scenario import lines

REPO = str(Path(__file__).resolve().parents[1])


def _measure(log: LinkLog, progress: Path, procs: list[subprocess.Popen], first: int, last: int,
             timeout_s: float = 600) -> dict:
    """Bytes per host per step between the commit times of steps ``first`` and ``last`` (the
    links sampled all along), and the median step time there."""
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{proc.args[-8:]} failed ({proc.returncode}): {err[-3000:]}")
    records = lines(progress)
    return {"bytes_per_host_per_step": log.per_step(records, first, last),
            "step_s": statistics.median(m["step_s"] for m in records if first < m["step"] <= last)}


RUNS = {
    # name: (elastic-dp train's flags, or the peer's torchrun module and flags;
    #        the plan's figure: its key and the plan's settings)
    "flat": (["--all-reduce", "flat"], ("flat", {})),
    "hierarchical": (["--all-reduce", "hierarchical"], ("hierarchical", {})),
    "zero2_host": (["--zero", "2", "--shard-scope", "host"], ("host", {"zero": 2})),
    "zero3_host": (["--zero", "3", "--shard-scope", "host"], ("host", {"zero": 3})),
    "ddp": (["benchmarks.ddp_gpt"], ("flat", {})),
    "fsdp2_hsdp": (["benchmarks.fsdp2_gpt", "--hsdp"], ("host", {"zero": 3})),
    "powersgd2": (["--compress", "powersgd:rank=2:start=2"], None),
    "int8": (["--compress", "int8"], None),
    "int8_hosts": (["--compress", "int8", "--compress-scope", "hosts"], None),
    "ddp_powersgd2": (["benchmarks.ddp_gpt", "--powersgd", "2"], None),
    "zero3": (["--zero", "3"], ("gloo", {"zero": 3})),
    "zero3_bf16": (["--zero", "3", "--param-dtype", "bf16"], ("gloo", {"zero": 3, "param_dtype": "bf16"})),
    "fsdp2": (["benchmarks.fsdp2_gpt"], ("gloo", {"zero": 3})),
    "fsdp2_bf16": (["benchmarks.fsdp2_gpt", "--param-dtype", "bf16"], ("gloo", {"zero": 3, "param_dtype": "bf16"})),
}
"""What each run is: elastic_dp's, or a peer's (``benchmarks.*``), and which figure of
``elastic-dp plan`` it is set against (FSDP2's HSDP moves what ``--shard-scope host`` does,
FSDP2 over all the ranks what ZeRO-3 does)."""


def elastic_dp(bed: Testbed, workers: int, steps: int, flags: list[str], out: Path) -> dict:
    with LinkLog(bed) as log:
        proc = bed.popen([sys.executable, "-m", "elastic_dp.cli", "train", "jobs.gpt", "--workers", str(workers),
                          "--steps", str(steps), *flags, "--out", str(out), "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        return _measure(log, out / "metrics.jsonl", [proc], 4, steps - 4)


def peer(bed: Testbed, per_host: int, steps: int, module: list[str], out: Path) -> dict:
    """A torch peer started as its users start it: torchrun on each host."""
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "progress.jsonl"
    with LinkLog(bed) as log:
        procs = [bed.popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={bed.hosts}",
                            f"--nproc-per-node={per_host}", f"--node-rank={h}", f"--master-addr={bed.address_of(0)}",
                            "--master-port=29500", "-m", *module, "--steps", str(steps),
                            "--progress", str(progress)],
                           host=h, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for h in range(bed.hosts)]
        return _measure(log, progress, procs, 4, steps - 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--workers-per-host", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=200)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default=",".join(RUNS), help=f"the runs, of {', '.join(RUNS)}")
    args = parser.parse_args()
    names = args.only.split(",")
    if not set(names) <= set(RUNS):
        sys.exit(f"--only takes {', '.join(RUNS)}, got {args.only}")
    reason = Testbed.unavailable()
    if reason:
        sys.exit(f"no testbed: {reason}")
    workers = args.hosts * args.workers_per_host
    model = TASK.model()
    params = sum(p.numel() for p in model.parameters())
    once = gathered_once(model, model_units(model, TASK.shard_units))  # stage 3's root and last unit
    gradient_bytes = 4 * params
    results: dict[str, list[dict]] = {name: [] for name in names}
    root = Path(tempfile.mkdtemp(prefix="edp-bench-hosts-"))
    with Testbed(hosts=args.hosts, slots=args.workers_per_host, rate_mbit=args.rate_mbit) as bed:
        for r in range(args.rounds):
            for name in results:
                out = root / f"{name}-{r}"
                started = time.monotonic()
                flags = RUNS[name][0]
                if flags[0].startswith("benchmarks."):
                    result = peer(bed, args.workers_per_host, args.steps, flags, out)
                else:
                    result = elastic_dp(bed, workers, args.steps, flags, out)
                result["wall_s"] = time.monotonic() - started
                results[name].append(result)
                print(name, json.dumps(result), flush=True)
    batch = TASK.defaults.global_batch
    print(f"\n{args.hosts} hosts x {args.workers_per_host} workers, {args.rate_mbit:g} Mbit/s links, jobs.gpt "
          f"({gradient_bytes / 1e6:.2f} MB of fp32 gradients), {args.rounds} round(s) of {args.steps} steps")
    print(f"{'':14}{'bytes/host/step':>18}{'x gradients':>13}{'plan':>8}{'s/step':>9}{'samples/s':>11}")
    for name, runs in results.items():
        sent = statistics.median(b for run in runs for b in run["bytes_per_host_per_step"])
        step_s = statistics.median(run["step_s"] for run in runs)
        plan = "—"
        if RUNS[name][1] is not None:  # the compressors' figures: elastic-dp plan --compress
            key, settings = RUNS[name][1]
            link = MemoryPlan(params=params, workers=workers, precision="fp32", hosts=args.hosts,
                              gathered_once=once if settings.get("zero") == 3 else 0.0,
                              **{"zero": 0, **settings}).link_bytes_per_step()[key]
            plan = f"{link / gradient_bytes:.2f}"
        print(f"{name:14}{sent:18,.0f}{sent / gradient_bytes:13.3f}{plan:>8}{step_s:9.3f}{batch / step_s:11.1f}")


if __name__ == "__main__":
    main()
