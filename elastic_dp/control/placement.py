"""What a worker needs from the cluster: its device kind and its placement bundle."""

from __future__ import annotations

import ray

from elastic_dp.errors import ConfigError


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` when the cluster has GPUs, else ``cpu``."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if device == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    if device == "cuda" and gpus < 1:
        raise ConfigError("--device cuda was asked for but the Ray cluster has no GPUs: "
                          "use --device cpu (gloo) or attach to a cluster with GPUs (--address)")
    return device


def worker_bundle(device: str, gpus: float = 1.0) -> dict[str, float]:
    """One worker's resources: a CPU slot, and on ``cuda`` its share ``gpus`` of a GPU."""
    return {"CPU": 1, "GPU": gpus} if device == "cuda" else {"CPU": 1}
