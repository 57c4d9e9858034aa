"""The elastic sampler: step -> global batch -> per-worker slices.

The sample indices of a step depend only on the dataset length, the global batch ``B``
and the seed, never on the number of workers (docs/design.md, fixed global batch). A plain
single-process loop replays a run exactly with::

    sampler = ElasticSampler(len(dataset), global_batch=B, seed=seed)
    for step in range(steps):
        indices = sampler.batch(step)          # the B indices of this step

The rule: ``steps_per_epoch = len(dataset) // B`` (the tail of each epoch is dropped);
step ``s`` belongs to epoch ``e = s // steps_per_epoch``; the epoch's order is
``numpy.random.default_rng([seed, e]).permutation(len(dataset))``, so every epoch is
reshuffled from the seed; the step takes positions ``(s % steps_per_epoch) * B`` up to
``+ B`` of that order.
"""

from __future__ import annotations

import functools

import numpy as np

from elastic_dp.config import TrainConfig
from elastic_dp.errors import CheckpointError, ConfigError


class ElasticSampler:
    """Deterministic global batches for any step, split over any number of workers."""

    def __init__(self, dataset_len: int, *, global_batch: int, seed: int) -> None:
        if global_batch <= 0:
            raise ConfigError(f"global_batch must be positive, got {global_batch} (--global-batch)")
        if dataset_len < global_batch:
            raise ConfigError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of "
                f"{global_batch}: lower --global-batch or use a larger dataset")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = dataset_len // global_batch

    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def batch(self, step: int) -> np.ndarray:
        """The ``global_batch`` sample indices that step ``step`` trains on."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = (step % self.steps_per_epoch) * self.global_batch
        return self._epoch_order(self.epoch_of(step))[start:start + self.global_batch]


def split(indices: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Contiguous slices of ``indices`` for ranks ``0..world_size-1``.

    Sizes differ by at most one; the first ``len % world_size`` ranks get the larger ones.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if len(indices) < world_size:
        raise ConfigError(
            f"a global batch of {len(indices)} cannot be split over {world_size} workers: "
            "raise --global-batch to at least the worker count or lower --workers")
    return list(np.array_split(np.asarray(indices), world_size))


def rank_slice(indices: np.ndarray, world_size: int, rank: int,
               sizes: tuple[int, ...] | None = None) -> np.ndarray:
    """``split(indices, world_size)[rank]``, without building the other slices; with
    ``sizes`` (one per rank, summing to the batch: ``--balance``) the contiguous slice of
    ``sizes[rank]`` samples after the lower ranks' instead."""
    if sizes is not None:
        if len(sizes) != world_size or sum(sizes) != len(indices) or min(sizes) < 1:
            raise ValueError(f"slice sizes {sizes} do not split a batch of {len(indices)} over {world_size} ranks")
        start = sum(sizes[:rank])
        return indices[start:start + sizes[rank]]
    if len(indices) < world_size:
        split(indices, world_size)  # raises the error that names the settings
    base, extra = divmod(len(indices), world_size)
    start = rank * base + min(rank, extra)
    return indices[start:start + base + (rank < extra)]


def micro_batches(indices: np.ndarray, micro_batch: int | None) -> list[np.ndarray]:
    """Consecutive chunks of at most ``micro_batch`` indices (one chunk when None)."""
    if micro_batch is None or len(indices) <= micro_batch:
        return [indices]
    return [indices[i:i + micro_batch] for i in range(0, len(indices), micro_batch)]


def check_resumable(saved: dict[str, int], train: TrainConfig, *, dataset_len: int | None = None) -> None:
    """Refuse to resume a checkpoint whose sampler settings (``saved``) differ from this
    run's: the sample order depends on them. ``dataset_len``: also compare the dataset."""
    ours = {"global_batch": train.global_batch, "seed": train.seed}
    if dataset_len is not None:
        ours["dataset_len"] = dataset_len
    flags = {"global_batch": "--global-batch", "seed": "--seed"}
    for key, value in ours.items():
        if saved[key] != value:
            fix = (f"resume with {flags[key]} {saved[key]}" if key in flags
                   else "resume with the dataset it was saved with")
            raise CheckpointError(f"the checkpoint was saved with {key}={saved[key]}, this run has "
                                  f"{value}: {fix} (a run's sample order depends on it)")


def check_same_run(saved: dict, ours: dict, where: str) -> None:
    """Refuse, for ``--resume auto``, a checkpoint saved by a run with other settings
    (``config.run_settings``): resuming it would not continue this run."""
    for key, value in ours.items():
        if key in saved and saved[key] != value:
            raise CheckpointError(f"--resume auto found {where}, saved with {key}={saved[key]!r}, and this run has "
                                  f"{key}={value!r}: run with the settings it was saved with, or pass another "
                                  "--run-name (or --resume never) to start a new run")
