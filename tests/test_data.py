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
    with pytest.raises(ConfigError, match=r"TrainConfig\.global_batch"):
        split(np.arange(2), 3)
    with pytest.raises(ConfigError, match=r"TrainConfig\.global_batch"):
        rank_slice(np.arange(2), 3, 0)


def test_micro_batches():
    assert [list(m) for m in micro_batches(np.arange(5), 2)] == [[0, 1], [2, 3], [4]]
    assert [list(m) for m in micro_batches(np.arange(5), None)] == [[0, 1, 2, 3, 4]]


def test_dataset_shorter_than_global_batch():
    with pytest.raises(ConfigError, match=r"fewer than one global batch.*TrainConfig\.global_batch"):
        ElasticSampler(5, global_batch=8, seed=0)


def test_rank_slices_of_given_sizes_cover_the_batch_in_order():
    batch = np.arange(10) * 7
    sizes = (6, 1, 3)
    slices = [rank_slice(batch, 3, r, sizes) for r in range(3)]
    assert [len(s) for s in slices] == [6, 1, 3]
    assert np.array_equal(np.concatenate(slices), batch)
    for bad in ((6, 1, 2), (5, 5), (10, 0, 0)):
        with pytest.raises(ValueError, match="do not split"):
            rank_slice(batch, 3, 0, bad)


def test_balanced_slices_follow_the_speeds_and_ignore_noise():
    from elastic_dp.messages import StepResult
    from elastic_dp.modes.sync.balance import Balancer, apportion

    assert apportion(10, [1, 1]) == (5, 5)
    assert apportion(10, [1, 0.25]) == (8, 2) or apportion(10, [1, 0.25]) == (7, 3)
    assert sum(apportion(32, [3.0, 1.0, 1e-9])) == 32 and min(apportion(32, [3.0, 1.0, 1e-9])) == 1
    balancer = Balancer(global_batch=12)
    members = ["a", "b", "c"]
    assert balancer.sizes(members, None) is None  # not measured yet: equal slices

    def step(seconds):
        balancer.observe({m: StepResult(step=0, rank=r, generation=0, committed=True, samples=4,
                                        timings={"compute_s": s}) for r, (m, s) in enumerate(zip(members, seconds))})

    step([0.04, 0.04, 0.041])
    assert balancer.sizes(members, None) is None  # within noise of the equal slices
    for _ in range(20):
        step([0.04, 0.04, 0.16])  # c is 4x slower per sample
    sizes = balancer.sizes(members, None)
    assert sum(sizes) == 12 and sizes[2] < sizes[0] == sizes[1]
    assert balancer.sizes(members, sizes) is sizes  # stable once it follows the speeds
