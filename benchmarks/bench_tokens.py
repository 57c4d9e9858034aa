"""Reading token files (elastic_dp.tokens.TokenWindows): windows per second from a local
directory (memory-mapped) and from an S3-compatible object store (one ranged read per
window; moto's server on loopback here, so the figure is the per-request cost of the
client and a local server, not of a network), in the order an elastic sampler asks for
them.

    python -m benchmarks.bench_tokens --windows 2000 --context 1024 --json

The last line is one JSON object: ``local_windows_per_s``, ``s3_windows_per_s`` (each the
median of ``--rounds``), ``context``, ``windows``.
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
from elastic_dp.tokens import TokenWindows, write_token_files


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rate(dataset: TokenWindows, indices: np.ndarray) -> float:
    start = time.perf_counter()
    for i in indices:
        dataset[int(i)]
    return len(indices) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=2000)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=20_000_000, help="corpus size in tokens")
    parser.add_argument("--rounds", type=int, default=3)
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
            datasets = {name: TokenWindows(uri, args.context) for name, uri in uris.items()}
            sampler = ElasticSampler(len(datasets["local"]), global_batch=args.windows, seed=0)
            rates = {name: [] for name in datasets}
            for r in range(args.rounds):
                indices = sampler.batch(r)
                for name, dataset in datasets.items():
                    rates[name].append(_rate(dataset, indices))
    finally:
        server.terminate()
        server.wait(timeout=10)
    result = {"context": args.context, "windows": args.windows,
              **{f"{name}_windows_per_s": round(statistics.median(v), 1) for name, v in rates.items()},
              "rounds": {name: [round(x, 1) for x in v] for name, v in rates.items()}}
    if not args.json:
        for name, v in rates.items():
            print(f"{name}: median {statistics.median(v):.1f} windows/s of {args.context + 1} tokens ({v})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
