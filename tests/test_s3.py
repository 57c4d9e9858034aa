"""Checkpoints in an object store: a real S3-compatible server (moto's standalone server)
on loopback, started by this module. Every rank writes its own part; the manifest,
written last, commits the checkpoint; ``--resume auto`` (the default with ``--storage``)
continues a run of the same name from its latest checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import pyarrow.fs as pafs
import pytest
from safetensors.torch import load_file

from elastic_dp import CheckpointConfig, CheckpointError, ClusterConfig, Trainer
from elastic_dp.errors import StorageError
from elastic_dp.tokens import TokenWindows, write_token_files
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.runs import fit
from tests.s3server import free_port
from tests.tasks import TINY_GPT_TASK

TOL = 2e-5  # float32 reduction order over 6 AdamW steps (as in test_resume)
# worst measured 2.6e-06 (2 tests here, 3 suite runs on 2026-12-04, python -m tests.noise): 8x margin


def _fit(workers, out, *, steps, storage, every=0, zero=0, resume=None):
    return fit(TINY_GPT_TASK, out, workers=workers, checkpoint=CheckpointConfig(storage=storage, every=every,
                                                                               resume=resume),
               steps=steps, zero=zero).summary


def _events(out) -> list[dict]:
    return read_lines(out / "events.jsonl")


def _checkpoints(fs, run_prefix: str) -> dict[str, list[str]]:
    """Checkpoint directory -> the objects in it."""
    found: dict[str, list[str]] = {}
    for info in fs.get_file_info(pafs.FileSelector(run_prefix, recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File:
            directory, name = info.path[len(run_prefix) + 1:].split("/")
            found.setdefault(directory, []).append(name)
    return {d: sorted(names) for d, names in sorted(found.items())}


def test_saved_by_every_rank_to_s3_resumed_at_another_worker_count_and_a_corrupted_object_refused(ray_cluster, s3, tmp_path):
    uri, fs, _ = s3
    # Run at 3 workers with ZeRO-1, saving after steps 2 and 4, stopping at 4.
    _fit(3, tmp_path / "first", steps=4, storage=uri, every=2, zero=1)
    first = _events(tmp_path / "first")
    decision = next(e for e in first if e["kind"] == "resume_decision")
    assert not decision["resumed"] and decision["storage"].startswith("s3://ckpt/runs/tasks-")
    run_prefix = decision["storage"].removeprefix("s3://")
    saved = _checkpoints(fs, run_prefix)
    assert [d[:13] for d in saved] == ["step-00000002", "step-00000004"]
    for names in saved.values():  # three ranks wrote their parts; the manifest came last
        assert names == ["manifest.json", *[f"{k}-0000{r}.safetensors" for k in ("model", "optim") for r in range(3)]]
    stalls = [e["stall_s"] for e in first if e["kind"] == "checkpoint_saved"]
    assert len(stalls) == 2

    # The same command with more steps, at 2 workers and stage 3: --resume auto continues it.
    # Its output goes to the object store too: rank 0 writes the weights (a unit at a time),
    # the logs are uploaded.
    _fit(2, uri.replace("/runs?", "/out/second?"), steps=6, storage=uri, zero=3)
    second_out = tmp_path / "second"
    second_out.mkdir()
    for name in ("initial.safetensors", "final.safetensors", "metrics.jsonl", "events.jsonl"):
        with fs.open_input_stream(f"ckpt/out/second/{name}") as f:
            (second_out / name).write_bytes(f.read())
    second = _events(second_out)
    decision = next(e for e in second if e["kind"] == "resume_decision")
    assert decision["resumed"] and decision["step"] == 4
    assert next(e for e in second if e["kind"] == "resumed")["saved_world_size"] == 3
    assert [json.loads(line)["step"] for line in (second_out / "metrics.jsonl").read_text().splitlines()] == [4, 5]
    uninterrupted = replay(TINY_GPT_TASK, dataclasses.replace(TINY_GPT_TASK.defaults, steps=6),
                           str(tmp_path / "first" / "initial.safetensors"))
    assert max_abs_diff(uninterrupted, load_file(second_out / "final.safetensors")) < TOL

    # A corrupted object is refused, naming it, and nothing is written; without its manifest
    # the damaged checkpoint does not exist: the run continues from the one before.
    older, newer = list(_checkpoints(fs, run_prefix))[-2:]
    _flip_last_byte(fs, f"{run_prefix}/{newer}/optim-00001.safetensors")
    with pytest.raises(CheckpointError, match=r"optim-00001\.safetensors does not match its sha256"):
        _fit(2, tmp_path / "refused", steps=8, storage=uri)
    assert not (tmp_path / "refused").exists()
    fs.delete_file(f"{run_prefix}/{newer}/manifest.json")
    _fit(2, tmp_path / "third", steps=8, storage=uri)
    decision = next(e for e in _events(tmp_path / "third") if e["kind"] == "resume_decision")
    assert decision["resumed"] and older in decision["checkpoint"]


def _flip_last_byte(fs, path: str) -> None:
    with fs.open_input_stream(path) as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))


def test_an_unreachable_endpoint_is_reported_within_seconds(s3):
    closed = free_port()
    start = time.monotonic()
    with pytest.raises(StorageError, match=rf"endpoint 127\.0\.0\.1:{closed} .* does not answer.*CheckpointConfig\.storage"):
        Trainer(TINY_GPT_TASK, checkpoint=CheckpointConfig(
            storage=f"s3://ckpt/x?endpoint_override=127.0.0.1:{closed}&scheme=http"))
    assert time.monotonic() - start < 5
    with pytest.raises(StorageError, match=r"CheckpointConfig\.storage='nosuch://bucket/x' is not a storage URI"):
        Trainer(TINY_GPT_TASK, checkpoint=CheckpointConfig(storage="nosuch://bucket/x"))


def test_a_bucket_that_does_not_exist_is_not_writable(ray_cluster, s3, tmp_path):
    _, _, port = s3
    with pytest.raises(StorageError, match=r"s3://missing/runs/.* is not writable.*pass a writable CheckpointConfig\.storage"):
        _fit(1, tmp_path / "out", steps=1,
             storage=f"s3://missing/runs?endpoint_override=127.0.0.1:{port}&scheme=http")
    assert not (tmp_path / "out").exists()


def test_a_run_on_token_files_in_s3_with_a_kill_and_a_join_ends_on_the_replay(ray_cluster, s3, tmp_path):
    """Each worker reads its windows by ranged reads of the objects (elastic_dp.tokens)."""
    from jobs import gpt

    uri = s3[0].replace("/runs?", "/corpus?")
    write_token_files([gpt.corpus(40_000)], uri, file_tokens=15_000)
    task = dataclasses.replace(TINY_GPT_TASK, dataset=functools.partial(TokenWindows, uri, 16))
    config = dataclasses.replace(task.defaults, steps=6)
    Trainer(task, train=config, cluster=ClusterConfig(workers=3, min_workers=1), out_dir=str(tmp_path),
            progress=False, inject=["kill:step=2:rank=1", "join:step=4"]).fit()
    changes = [e for e in _events(tmp_path) if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    assert [m["step"] for m in read_lines(tmp_path / "metrics.jsonl")] == list(range(6))
    expected = replay(task, config, str(tmp_path / "initial.safetensors"))
    assert max_abs_diff(load_file(tmp_path / "final.safetensors"), expected) < TOL
    assert sorted(i.base_name for i in s3[1].get_file_info(pafs.FileSelector("ckpt/corpus"))) == [
        "part-00000.bin", "part-00001.bin", "part-00002.bin", "tokens.json"]
