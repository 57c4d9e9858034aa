"""Ray Data input against the same rows as a map-style dataset: the GPT job's samples per
second when its windows come from a Ray Dataset (``ray.data.range`` and a ``map_batches``
that cuts the corpus into windows; the workers read the rows from its blocks in the object
store, ``elastic_dp.data.raydata``) and when the same rows, listed by ``iter_rows()``, are a
Python list (map-style, in each worker's memory). Same model, loss, batch and workers;
the runs alternate, ``--rounds`` of each, on one local Ray.

    python -m benchmarks.bench_data_sources --workers 2 --steps 30 --rounds 3 --json

The last line is one JSON object: ``raydata_samples_per_s``, ``list_samples_per_s`` (each
the median over rounds of the global batch over the median step time after the first two
steps), their ratio ``raydata_over_list`` and the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import tempfile

import numpy as np

from jobs import gpt


@functools.lru_cache(maxsize=1)
def _tokens() -> np.ndarray:
    return np.frombuffer(gpt.corpus(), dtype=np.uint8).astype(np.int64)


def _windows(batch: dict) -> dict:
    """``map_batches``: window ``id`` of the corpus, input and next-byte target."""
    tokens, starts = _tokens(), batch["id"] * gpt.CONTEXT
    window = np.stack([tokens[s:s + gpt.CONTEXT + 1] for s in starts])
    return {"x": window[:, :-1], "y": window[:, 1:]}


def ray_windows(blocks: int = 16):
    """The GPT job's windows as a Ray Dataset, in order (``preserve_order``)."""
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return ray.data.range((len(_tokens()) - 1) // gpt.CONTEXT, override_num_blocks=blocks).map_batches(_windows)


def listed(rows: list) -> list:
    return rows


def dict_loss(model, batch) -> object:
    return gpt.loss(model, (batch["x"], batch["y"]))


def median_step_s(task, steps: int, workers: int, out: str) -> float:
    """``task``'s median step time over ``steps`` steps on ``workers`` (after the first two:
    the first reads and warms up), from the run's ``metrics.jsonl`` in ``out``."""
    from elastic_dp import ClusterConfig, Trainer

    Trainer(task, train=dataclasses.replace(task.defaults, steps=steps), cluster=ClusterConfig(workers=workers),
            out_dir=out, progress=False).fit()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_s"] for line in f if line.strip()]
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import ray

    from benchmarks import bench_data_sources as this  # noqa: PLW0406 — its functions by their module's name, not __main__'s

    ray.init(address="local", num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False)
    try:
        rows = list(this.ray_windows().iter_rows())
        base = dataclasses.replace(gpt.TASK, loss=this.dict_loss, eval_dataset=None, sample=None)
        tasks = {"raydata": dataclasses.replace(base, dataset=this.ray_windows),
                 "list": dataclasses.replace(base, dataset=functools.partial(this.listed, rows))}
        times: dict[str, list[float]] = {name: [] for name in tasks}
        with tempfile.TemporaryDirectory() as out:
            for r in range(args.rounds):
                for name, task in tasks.items():
                    times[name].append(median_step_s(task, args.steps, args.workers, os.path.join(out, f"{name}-{r}")))
    finally:
        ray.shutdown()
    batch = gpt.TASK.defaults.global_batch
    rates = {name: [batch / t for t in v] for name, v in times.items()}
    result = {f"{name}_samples_per_s": round(statistics.median(v), 1) for name, v in rates.items()}
    result["raydata_over_list"] = round(result["raydata_samples_per_s"] / result["list_samples_per_s"], 3)
    result.update(workers=args.workers, steps=args.steps, rows=len(rows),
                  rounds={name: [round(x, 1) for x in v] for name, v in rates.items()})
    if not args.json:
        for name, v in rates.items():
            print(f"{name}: median {statistics.median(v):.1f} samples/s ({[round(x, 1) for x in v]})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
