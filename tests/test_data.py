"""The elastic sampler: deterministic global batches, reshuffled per epoch, split contiguously."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_dp import ConfigError, ElasticSampler, split
from elastic_dp.data import micro_batches, rank_slice


def test_batches_follow_the_documented_rule():
    sampler = ElasticSampler(103, global_batch=10, seed=7)
    assert sampler.steps_per_epoch == 10
    for step in (0, 3, 9, 10, 25):
        epoch = step // 10
        order = np.random.default_rng([7, epoch]).permutation(103)
        start = (step % 10) * 10
        assert np.array_equal(sampler.batch(step), order[start:start + 10])


def test_each_epoch_covers_distinct_samples_and_is_reshuffled():
    sampler = ElasticSampler(50, global_batch=10, seed=0)
    epoch0 = np.concatenate([sampler.batch(s) for s in range(5)])
    epoch1 = np.concatenate([sampler.batch(s) for s in range(5, 10)])
    assert sorted(epoch0) == list(range(50)) and sorted(epoch1) == list(range(50))
    assert not np.array_equal(epoch0, epoch1)
    assert np.array_equal(ElasticSampler(50, global_batch=10, seed=0).batch(7), sampler.batch(7))
    assert not np.array_equal(ElasticSampler(50, global_batch=10, seed=1).batch(0), sampler.batch(0))


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_split_is_contiguous_balanced_and_complete(world):
    indices = np.arange(100, 123)
    parts = split(indices, world)
    assert len(parts) == world
    assert np.array_equal(np.concatenate(parts), indices)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for rank in range(world):  # what each worker computes for itself in a window
        assert np.array_equal(rank_slice(indices, world, rank), parts[rank])


def test_split_refuses_more_workers_than_samples():
    with pytest.raises(ConfigError, match="--global-batch"):
        split(np.arange(2), 3)
    with pytest.raises(ConfigError, match="--global-batch"):
        rank_slice(np.arange(2), 3, 0)


def test_micro_batches():
    assert [list(m) for m in micro_batches(np.arange(5), 2)] == [[0, 1], [2, 3], [4]]
    assert [list(m) for m in micro_batches(np.arange(5), None)] == [[0, 1, 2, 3, 4]]


def test_dataset_shorter_than_global_batch():
    with pytest.raises(ConfigError, match="fewer than one global batch.*--global-batch"):
        ElasticSampler(5, global_batch=8, seed=0)
