"""Parquet files by row (elastic_dp.data.ParquetRows), local and on a real S3 server (moto on
loopback): rows in ``pyarrow.parquet.read_table``'s order, read ahead by row group as the
workers of an elastic run name them, and a missing or corrupt file refused naming it."""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from elastic_dp import CheckpointConfig, ClusterConfig, ElasticSampler, TaskError, Trainer
from elastic_dp.data import ParquetRows, rank_slice
from tests.reading import count_fetches, fetched_by, read_through_a_resize
from tests.tasks import MLP_TASK, parquet_mse, parquet_regression, write_parquet


@pytest.fixture(scope="module")
def stores(s3, tmp_path_factory):
    """The same 3 files of 150 rows in all, rows groups of 20, local and in S3."""
    tables = parquet_regression(150)
    local = str(tmp_path_factory.mktemp("parquet") / "rows")
    remote = s3[0].replace("/runs?", "/rows?")
    for uri in (local, remote):
        write_parquet(tables, uri)
    return {"local": local, "s3": remote}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_rows_are_read_tables_in_order_and_none_is_read_twice_by_a_worker_through_a_resize(stores, where, monkeypatch):
    """Three workers read steps 0-3 of 10 rows a worker, then two go on from step 4, each
    naming its steps ahead as the trainer does (``Horizon``). Every row equals
    ``pq.read_table``'s row at its index; no worker reads a row from the store twice (its
    re-split slice of step 4 holds rows it named at three, read once); a worker reads a
    row group once for all the rows it named in it at once."""
    fetched = count_fetches(monkeypatch, ParquetRows, lambda _, group, rows: rows)
    expected = pq.read_table(stores[where]).to_pylist()
    workers = [ParquetRows(stores[where]) for _ in range(3)]
    assert len(workers[0]) == len(expected) == 150 and len(workers[0].groups) == 9

    def check(i, row):
        assert row["id"] == expected[i]["id"] == i
        assert np.array_equal(row["x"], np.float32(expected[i]["x"])) and row["x"].flags.writeable
        assert np.array_equal(row["y"], np.float32(expected[i]["y"]))

    sampler = ElasticSampler(150, global_batch=30, seed=1)
    read_through_a_resize(workers, sampler, 8, 4, check)
    for w in workers[:2]:
        assert max(fetched_by(fetched, w).values()) == 1, "a row was read twice by one worker"
        # named at once (the cache holds them all): one read a row group at three workers, and
        # one more of those holding rows the re-split at two gave it
        assert fetched[(id(w), "requests")] <= 2 * len(w.groups)
    old, new = rank_slice(sampler.batch(4), 3, 0), rank_slice(sampler.batch(4), 2, 0)
    assert set(old) < set(new) and all(fetched[(id(workers[0]), int(i))] == 1 for i in new)


def test_columns_and_a_default_collate_make_tensors_of_the_numbers(stores):
    import torch
    from torch.utils.data import default_collate

    rows = ParquetRows(stores["local"], columns=["x", "y"])
    batch = default_collate([rows[i] for i in (0, 60, 149)])
    assert set(batch) == {"x", "y"} and batch["x"].shape == (3, 8) and batch["x"].dtype == torch.float32
    with pytest.raises(TaskError, match=r"part-00\.parquet has no column z .*ParquetRows\(columns=\.\.\.\)"):
        ParquetRows(stores["local"], columns=["x", "z"])


def test_a_missing_or_corrupt_file_is_refused_naming_it(s3, stores, tmp_path):
    with pytest.raises(TaskError, match=r"nowhere does not exist: point ParquetRows at a \.parquet file"):
        ParquetRows(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match=r"empty holds no \.parquet file"):
        ParquetRows(str(tmp_path / "empty"))
    fs = s3[1]
    bad = s3[0].replace("/runs?", "/bad-rows?")
    write_parquet(parquet_regression(60), bad)
    with fs.open_input_file("ckpt/bad-rows/part-01.parquet") as f:
        data = f.read()
    with fs.open_output_stream("ckpt/bad-rows/part-01.parquet") as f:
        f.write(data[:len(data) // 2])  # the footer cut off
    with pytest.raises(TaskError, match=r"s3://ckpt/bad-rows/part-01\.parquet is not a readable Parquet file"):
        ParquetRows(bad)


def test_a_run_on_a_corrupt_file_fails_before_any_step_naming_it_and_writes_nothing(ray_cluster, tmp_path):
    rows = str(tmp_path / "rows")
    write_parquet(parquet_regression(60), rows)
    path = os.path.join(rows, "part-02.parquet")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 9)
    task = dataclasses.replace(MLP_TASK, dataset=functools.partial(ParquetRows, rows), loss=parquet_mse)
    with pytest.raises(TaskError, match=r"rows/part-02\.parquet is not a readable Parquet file"):
        Trainer(task, train=dataclasses.replace(task.defaults, steps=3), cluster=ClusterConfig(workers=2),
                checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=1), out_dir=str(tmp_path / "out"),
                progress=False).fit()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    assert not (tmp_path / "out" / "final.safetensors").exists()
