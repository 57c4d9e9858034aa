"""Reading token files (elastic_dp.tokens.TokenWindows): windows per second from a local
directory (memory-mapped) and from an S3-compatible object store (moto's server on
loopback here, so the figure is the per-request cost of the client and a local server,
not of a network), in the order an elastic sampler asks for them, one worker's steps of
``--batch`` windows read as the trainer reads them: the step's slice and the next one's
named to the dataset (``read_ahead``), then the step's windows read.

Four ways, each from a cold start (a new dataset, an empty cache): ``local`` memory-mapped;
``s3_before`` one ranged read a window, nothing read ahead (the reader before the
read-ahead); ``s3_ahead`` read ahead with the default cache (256 MiB); ``s3_small_cache``
read ahead with a cache of ``--cache-mb`` (a fifth of the corpus by default: what a corpus
much larger than the cache reads like).

    python -m benchmarks.bench_tokens --steps 200 --batch 32 --context 1024 --gpt-steps 40 --json

``--gpt-steps N`` also trains the GPT job (``jobs.gpt``, one worker, its defaults) for N steps on
its corpus as token files, local and in the S3 server, alternating, ``--rounds`` times each,
and compares the median step time after the first two steps (``gpt_s3_over_local``).

The last line is one JSON object: ``<way>_windows_per_s`` (each the median of ``--rounds``),
the rounds, the requests and MiB each way asked the store for, ``context``, ``batch``,
``steps``; with ``--gpt-steps`` the GPT job's ``gpt_local_step_s``, ``gpt_s3_step_s`` and
their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.fs as pafs

from elastic_dp import ElasticSampler
from elastic_dp.data.ahead import Horizon
from elastic_dp.tokens import TokenWindows, write_token_files


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rate(dataset: TokenWindows, sampler: ElasticSampler, steps: int, ahead: bool) -> float:
    """Windows a second over ``steps`` steps, read as a worker reads them (its ``Horizon``
    naming the steps ahead before each step's reads)."""
    horizon = Horizon(dataset) if ahead else None
    start = time.perf_counter()
    for step in range(steps):
        if horizon is not None:
            horizon.at(step, sampler.batch, "one worker", steps - 1)
        for i in sampler.batch(step):
            dataset[int(i)]
    return steps * sampler.global_batch / (time.perf_counter() - start)


def _gpt_step_s(uri: str, steps: int, out: str) -> float:
    """The GPT job's median step time over ``steps`` steps on the token files at ``uri``, one worker."""
    import dataclasses
    import functools

    from benchmarks.bench_data_sources import median_step_s
    from jobs import gpt

    task = dataclasses.replace(gpt.TASK, dataset=functools.partial(TokenWindows, uri, gpt.CONTEXT), eval_dataset=None,
                               sample=None)
    return median_step_s(task, steps, 1, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="windows a step (one worker's slice)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--cache-mb", type=float, default=8.0, help="s3_small_cache's cache, a fifth of the corpus")
    parser.add_argument("--tokens", type=int, default=20_000_000, help="corpus size in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpt-steps", type=int, default=0, help="also time the GPT job's step, local against S3")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(key, value)
    rng = np.random.default_rng(0)
    corpus = [rng.integers(0, 256, args.tokens, dtype=np.uint16).tobytes()]
    byte_ids = lambda data: np.frombuffer(data, dtype=np.uint16)  # noqa: E731
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(150):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http"
        fs, _ = pafs.FileSystem.from_uri(f"s3://tokens?{query}&allow_bucket_creation=true")
        fs.create_dir("tokens")
        with tempfile.TemporaryDirectory() as local:
            uris = {"local": local, "s3": f"s3://tokens/corpus?{query}"}
            for uri in uris.values():
                write_token_files(corpus, uri, tokenizer=byte_ids, file_tokens=args.tokens // 4)
            ways = {"local": (uris["local"], {}, False), "s3_before": (uris["s3"], {}, False),
                    "s3_ahead": (uris["s3"], {}, True),
                    "s3_small_cache": (uris["s3"], {"cache_mb": args.cache_mb}, True)}
            length = len(TokenWindows(uris["local"], args.context))
            rates = {name: [] for name in ways}
            requests = {name: [] for name in ways}
            for r in range(args.rounds):
                sampler = ElasticSampler(length, global_batch=args.batch, seed=r)
                for name, (uri, options, ahead) in ways.items():
                    dataset = TokenWindows(uri, args.context, **options)
                    rates[name].append(_rate(dataset, sampler, args.steps, ahead))
                    if dataset.cache is not None:
                        requests[name].append((dataset.cache.loads, round(dataset.read_bytes / 2**20, 1)))
                        dataset.cache.close()
            gpt_times: dict[str, list[float]] = {"local": [], "s3": []}
            if args.gpt_steps:
                import ray

                from jobs import gpt

                ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
                try:
                    gpt_uris = {"local": os.path.join(local, "gpt"), "s3": f"s3://tokens/gpt?{query}"}
                    for uri in gpt_uris.values():
                        write_token_files([gpt.corpus()], uri)
                    for r in range(args.rounds):
                        for name, uri in gpt_uris.items():
                            gpt_times[name].append(_gpt_step_s(uri, args.gpt_steps, os.path.join(local, f"run-{name}-{r}")))
                finally:
                    ray.shutdown()
    finally:
        server.terminate()
        server.wait(timeout=10)
    result = {"context": args.context, "batch": args.batch, "steps": args.steps, "cache_mb": args.cache_mb,
              **{f"{name}_windows_per_s": round(statistics.median(v), 1) for name, v in rates.items()},
              "rounds": {name: [round(x, 1) for x in v] for name, v in rates.items()},
              "requests_and_mib": {name: v for name, v in requests.items() if v}}
    if args.gpt_steps:
        local_s, s3_s = (statistics.median(gpt_times[k]) for k in ("local", "s3"))
        result.update(gpt_local_step_s=round(local_s, 4), gpt_s3_step_s=round(s3_s, 4),
                      gpt_s3_over_local=round(s3_s / local_s, 3),
                      gpt_rounds={k: [round(x, 4) for x in v] for k, v in gpt_times.items()})
    if not args.json:
        for name, v in rates.items():
            print(f"{name}: median {statistics.median(v):.1f} windows/s of {args.context + 1} tokens ({v})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
