"""A Ray Data ``Dataset`` as a task's dataset (elastic_dp.data.raydata): executed once, its
rows read by index from its blocks in the object store, in ``iter_rows()``'s order with
``preserve_order``; a dataset whose order is not deterministic is refused naming the
setting. (Runs through a kill, a join and a resume at another worker count:
benchmarks/scenarios/test_data_sources.py.)"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from elastic_dp import ElasticSampler, TaskError
from elastic_dp.data import RayRows, rank_slice
from tests.reading import count_fetches, fetched_by, read_through_a_resize
from tests.tasks import _regression_rows, ray_regression


@contextlib.contextmanager
def _preserve_order(value: bool):
    import ray.data

    options = ray.data.DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, value
    try:
        yield
    finally:
        options.preserve_order = before


def _items_dataset():
    """``from_items`` and a ``map_batches``, 5 blocks of unequal content."""
    import ray.data

    with _preserve_order(True):
        return ray.data.from_items([{"id": i} for i in range(90)], override_num_blocks=5).map_batches(
            _regression_rows)


@pytest.mark.parametrize("factory", [_items_dataset, ray_regression], ids=["from_items", "range"])
def test_rows_are_iter_rows_rows_and_none_is_read_twice_by_a_worker_through_a_resize(ray_cluster, monkeypatch,
                                                                                       factory):
    """Three workers (copies of the rows as Ray pickles them for the actors) read steps 0-3
    of 5 rows a worker, two go on from step 4, each naming its steps ahead (``Horizon``).
    Every row equals the row ``iter_rows()`` yields at its index from a dataset the same
    factory builds anew (as a user's replay would); no worker reads a row from the object
    store twice (its re-split slice of step 4 holds rows it named at three)."""
    from ray import cloudpickle

    fetched = count_fetches(monkeypatch, RayRows, lambda _, block, rows: rows)
    rows = RayRows.of(factory())
    expected = list(factory().iter_rows())
    assert len(rows) == len(expected) and len(rows.blocks) >= 5
    workers = [cloudpickle.loads(cloudpickle.dumps(rows)) for _ in range(3)]

    def check(i, row):
        want = expected[i]
        assert set(row) == set(want) == {"x", "y"}
        assert np.array_equal(row["x"], want["x"]) and np.array_equal(row["y"], want["y"])
        assert row["x"].flags.writeable  # a copy: the cache does not hold the block alive

    sampler = ElasticSampler(len(rows), global_batch=15, seed=2)
    read_through_a_resize(workers, sampler, 8, 4, check)
    for w in workers[:2]:
        assert max(fetched_by(fetched, w).values()) == 1, "a row was read twice by one worker"
    new = rank_slice(sampler.batch(4), 2, 0)
    assert set(rank_slice(sampler.batch(4), 3, 0)) < set(new)
    assert all(fetched[(id(workers[0]), int(i))] == 1 for i in new)


def test_an_actor_reads_the_rows_from_the_object_store(ray_cluster):
    import ray

    rows = RayRows.of(ray_regression(40, 4))

    @ray.remote(num_cpus=0)
    def read(rows: RayRows, indices: list[int]) -> list:
        rows.read_ahead(indices)
        return [rows[i] for i in indices]

    got = ray.get(read.remote(rows, [39, 0, 17]))
    expected = list(ray_regression(40, 4).iter_rows())
    assert all(np.array_equal(g["x"], expected[i]["x"]) for g, i in zip(got, [39, 0, 17]))


def test_a_dataset_whose_order_is_not_deterministic_is_refused_naming_the_setting(ray_cluster):
    import ray.data

    with _preserve_order(False):
        unordered = ray.data.range(20).map_batches(_regression_rows)
    with pytest.raises(TaskError, match=r"without preserve_order.*execution_options\.preserve_order = True"):
        RayRows.of(unordered)
    with _preserve_order(True):
        shuffled = ray.data.range(20).random_shuffle()
        blocks = ray.data.range(20).randomize_block_order()
        seeded = ray.data.range(20).random_shuffle(seed=5)
    with pytest.raises(TaskError, match=r"random_shuffle\(\) without a seed.*random_shuffle\(seed=\.\.\.\)"):
        RayRows.of(shuffled)
    with pytest.raises(TaskError, match=r"randomize_block_order\(\) without a seed"):
        RayRows.of(blocks)
    assert sorted(r["id"] for r in (RayRows.of(seeded)[i] for i in range(20))) == list(range(20))
