"""Data where Ray users keep it, through an elastic run: Parquet files on a real S3 server
(moto on loopback), read by row (``elastic_dp.data.ParquetRows``), ahead by row group.
Three workers through a kill and a join, then a resume at two, end where the one-process
replay of the same rows in ``pyarrow.parquet.read_table``'s order ends."""

from __future__ import annotations

import dataclasses
import functools

from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from elastic_dp.data import ParquetRows
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import MLP_TASK, parquet_mse, parquet_regression, write_parquet

TOL = 2e-5  # float32 reduction order over SGD steps, as tests/test_elastic.py's (worst measured 2.6e-06)


def test_parquet_in_s3_through_a_kill_a_join_and_a_resume_at_two_ends_on_the_replay(ray_cluster, s3, tmp_path):
    uri = s3[0].replace("/runs?", "/scenario-rows?")
    write_parquet(parquet_regression(150, seed=4), uri)
    task = dataclasses.replace(MLP_TASK, dataset=functools.partial(ParquetRows, uri), loss=parquet_mse)
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=4)
    first = dataclasses.replace(task.defaults, steps=8)
    Trainer(task, train=first, cluster=ClusterConfig(workers=3, min_workers=1), checkpoint=ckpt,
            out_dir=str(tmp_path / "first"), progress=False, inject=["kill:step=2:rank=1", "join:step=5"]).fit()
    changes = [e for e in read_lines(tmp_path / "first" / "events.jsonl") if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    assert [m["step"] for m in read_lines(tmp_path / "first" / "metrics.jsonl")] == list(range(8))
    initial = str(tmp_path / "first" / "initial.safetensors")
    assert max_abs_diff(load_file(tmp_path / "first" / "final.safetensors"), replay(task, first, initial)) < TOL
    second = dataclasses.replace(task.defaults, steps=14)
    Trainer(task, train=second, cluster=ClusterConfig(workers=2), out_dir=str(tmp_path / "second"), progress=False,
            checkpoint=dataclasses.replace(ckpt, resume="latest")).fit()
    resumed = [e for e in read_lines(tmp_path / "second" / "events.jsonl") if e["kind"] == "resumed"]
    assert resumed and resumed[0]["step"] == 8 and resumed[0]["world_size"] == 2
    assert max_abs_diff(load_file(tmp_path / "second" / "final.safetensors"), replay(task, second, initial)) < TOL
