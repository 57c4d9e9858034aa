"""Data where Ray users keep it, through an elastic run: Parquet files on a real S3 server
(moto on loopback), read by row (``elastic_dp.data.ParquetRows``), ahead by row group; a
Ray Data ``Dataset`` (``ray.data.range`` and a ``map_batches``) as the task's dataset,
read by row from its blocks in the object store. Three workers through a kill and a join,
then a resume at two, end where the one-process replay of the same rows ends (in
``pyarrow.parquet.read_table``'s order; in ``iter_rows()``'s with ``preserve_order``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, ClusterConfig, Trainer
from elastic_dp.data import ParquetRows
from tests.procs import ROOT
from tests.raydata_job import TASK as RAY_DATA_JOB
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import (
    MLP_TASK,
    hf_rows,
    parquet_mse,
    parquet_regression,
    ray_regression,
    ray_rows_listed,
    write_hf_regression,
    write_parquet,
)

TOL = 2e-5  # float32 reduction order over SGD steps, as tests/test_elastic.py's (worst measured 2.6e-06)


def _kill_join_resume(task, tmp_path, replayed=None) -> None:
    """3 workers to step 8 through a kill at step 2 and a join at step 5, checkpoints every
    4; then a resume at 2 workers to step 14. Both end on the one-process replay (of
    ``replayed``, the same rows as a map-style dataset, where the task's is not one)."""
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=4)
    first = dataclasses.replace(task.defaults, steps=8)
    Trainer(task, train=first, cluster=ClusterConfig(workers=3, min_workers=1), checkpoint=ckpt,
            out_dir=str(tmp_path / "first"), progress=False, inject=["kill:step=2:rank=1", "join:step=5"]).fit()
    changes = [e for e in read_lines(tmp_path / "first" / "events.jsonl") if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    assert [m["step"] for m in read_lines(tmp_path / "first" / "metrics.jsonl")] == list(range(8))
    reference = dataclasses.replace(task, dataset=replayed) if replayed is not None else task
    initial = str(tmp_path / "first" / "initial.safetensors")
    assert max_abs_diff(load_file(tmp_path / "first" / "final.safetensors"), replay(reference, first, initial)) < TOL
    second = dataclasses.replace(task.defaults, steps=14)
    Trainer(task, train=second, cluster=ClusterConfig(workers=2), out_dir=str(tmp_path / "second"), progress=False,
            checkpoint=dataclasses.replace(ckpt, resume="latest")).fit()
    resumed = [e for e in read_lines(tmp_path / "second" / "events.jsonl") if e["kind"] == "resumed"]
    assert resumed and resumed[0]["step"] == 8 and resumed[0]["world_size"] == 2
    assert max_abs_diff(load_file(tmp_path / "second" / "final.safetensors"),
                        replay(reference, second, initial)) < TOL


def test_parquet_in_s3_through_a_kill_a_join_and_a_resume_at_two_ends_on_the_replay(ray_cluster, s3, tmp_path):
    uri = s3[0].replace("/runs?", "/scenario-rows?")
    write_parquet(parquet_regression(150, seed=4), uri)
    _kill_join_resume(dataclasses.replace(MLP_TASK, dataset=functools.partial(ParquetRows, uri), loss=parquet_mse),
                      tmp_path)


def test_a_ray_dataset_through_a_kill_a_join_and_a_resume_at_two_ends_on_the_replay(ray_cluster, tmp_path):
    """The replay reads the rows ``iter_rows()`` lists from a dataset the factory builds anew."""
    task = dataclasses.replace(MLP_TASK, dataset=ray_regression, loss=parquet_mse)
    _kill_join_resume(task, tmp_path, replayed=ray_rows_listed)


def test_a_ray_data_job_from_the_command_line_starts_ray_once_and_ends_on_the_replay(ray_cluster, tmp_path):
    """``elastic-dp train`` starts an embedded local Ray itself; it builds the task's dataset
    beside Ray's start (to refuse a small one early), where a Ray Dataset's factory would
    start Ray too: it must not (without the guard the run died, "Failed to connect to GCS").
    The replay lists the rows on this process's own cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "elastic_dp.cli", "train", "tests.raydata_job", "--workers", "2",
                           "--steps", "5", "--out", str(tmp_path / "out"), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = dataclasses.replace(RAY_DATA_JOB.defaults, steps=5)
    expected = replay(dataclasses.replace(RAY_DATA_JOB, dataset=ray_rows_listed), config,
                      str(tmp_path / "out" / "initial.safetensors"))
    assert max_abs_diff(load_file(tmp_path / "out" / "final.safetensors"), expected) < TOL


def test_a_hugging_face_dataset_through_a_kill_a_join_and_a_resume_at_two_ends_on_the_replay(ray_cluster, tmp_path):
    """Hugging Face ``datasets`` (Arrow files on disk, ``load_from_disk``) is map-style: it
    goes through the map-style path as it is, rows as numpy (``with_format("numpy")``)."""
    write_hf_regression(str(tmp_path / "hf"))
    _kill_join_resume(dataclasses.replace(MLP_TASK, dataset=functools.partial(hf_rows, str(tmp_path / "hf")),
                                          loss=parquet_mse), tmp_path)
