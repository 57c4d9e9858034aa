"""Placing worker actors on the cluster through a Ray placement group."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .errors import ConfigError, PlacementError

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` when the cluster has GPUs, else ``cpu``."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if device == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    if device == "cuda" and gpus < 1:
        raise ConfigError("--device cuda was asked for but the Ray cluster has no GPUs: "
                          "use --device cpu (gloo) or attach to a cluster with GPUs (--address)")
    return device


def worker_bundle(device: str) -> dict[str, float]:
    return {"CPU": 1, "GPU": 1} if device == "cuda" else {"CPU": 1}


@dataclass(slots=True)
class Placement:
    """A ready placement group with one bundle per worker."""

    group: PlacementGroup
    size: int

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=index)

    def remove(self) -> None:
        remove_placement_group(self.group)


def _free_slots(bundle: dict[str, float]) -> int:
    free = ray.available_resources()
    return int(min(free.get(k, 0) // v for k, v in bundle.items()))


def place(workers: int, device: str, *, timeout_s: float) -> Placement:
    """Reserve one bundle per worker, waiting up to ``timeout_s`` for the capacity."""
    bundle = worker_bundle(device)
    free = _free_slots(bundle)
    if free < workers:
        logger.warning("waiting up to %.0f s for %d worker slots (%s each); %d free now",
                       timeout_s, workers, bundle, free)
    group = placement_group([bundle] * workers, strategy="PACK")
    start = time.monotonic()
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        free = _free_slots(bundle)
        total = int(min(ray.cluster_resources().get(k, 0) // v for k, v in bundle.items()))
        raise PlacementError(
            f"could not place {workers} workers ({bundle} each) within {timeout_s:.0f} s: the "
            f"cluster has room for {free} now and {total} in all. Lower --workers, free or add "
            "capacity, or raise --placement-timeout") from None
    logger.info("placed %d workers (%s each) in %.2f s", workers, bundle, time.monotonic() - start)
    return Placement(group=group, size=workers)
