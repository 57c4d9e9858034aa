"""Token files (elastic_dp.tokens): written from text, read back by numpy as flat arrays,
windowed as the GPT job's samples, read by ranges with a resident memory that does not
grow with the corpus; a run on them with a kill and a join ends on the replay. (On S3:
tests/test_s3.py.)"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from elastic_dp import ClusterConfig, TaskError, Trainer
from elastic_dp.cli import main
from elastic_dp.tokens import TokenWindows, text_pieces, write_token_files
from tests.records import read_lines
from tests.reference import max_abs_diff, replay
from tests.tasks import TINY_GPT_TASK

TOL = 2e-5  # float32 reduction order over 6 AdamW steps (as in test_elastic)
# worst measured 2.3e-06 (1 test here, 3 suite runs on 2026-12-04, python -m tests.noise): 9x margin


def test_written_files_are_flat_token_arrays_and_windows_never_span_two(tmp_path):
    texts = [b"hello world, " * 30, "and some more text\n" * 20]
    index = write_token_files(texts, tmp_path / "corpus", file_tokens=300)
    whole = b"".join(t if isinstance(t, bytes) else t.encode() for t in texts)
    assert index["tokens"] == len(whole) and [f["tokens"] for f in index["files"]] == [300, 300, len(whole) - 600]
    read = np.concatenate([np.fromfile(tmp_path / "corpus" / f["name"], dtype="<u2") for f in index["files"]])
    assert bytes(read.astype(np.uint8)) == whole
    assert json.loads((tmp_path / "corpus" / "tokens.json").read_text())["dtype"] == "uint16"
    windows = TokenWindows(tmp_path / "corpus", context=16)
    per_file = [(n - 1) // 16 for n in (300, 300, len(whole) - 600)]
    assert len(windows) == sum(per_file)
    x, y = windows[per_file[0]]  # the first window of the second file
    assert bytes(x.tolist()) == whole[300:316] and bytes(y.tolist()) == whole[301:317]
    assert x.dtype == torch.int64
    again = pickle.loads(pickle.dumps(windows))
    assert torch.equal(again[len(windows) - 1][1], windows[len(windows) - 1][1])
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_a_tokenizer_of_a_large_vocabulary_needs_uint32(tmp_path):
    big = lambda text: [70_000 + ord(c) for c in text]  # noqa: E731
    with pytest.raises(TaskError, match="token id 70111, outside uint16: write --dtype uint32"):
        write_token_files(["hello"], tmp_path / "a", tokenizer=big)
    write_token_files(["hello", "there"], tmp_path / "b", tokenizer=big, dtype="uint32")
    assert np.fromfile(tmp_path / "b" / "part-00000.bin", dtype="<u4").tolist() == [70_000 + ord(c) for c in "hellothere"]
    assert TokenWindows(tmp_path / "b", 4)[1][0].tolist() == [70_000 + ord(c) for c in "othe"]  # tokens 4-7


def test_a_directory_without_an_index_is_refused_naming_it(tmp_path):
    with pytest.raises(TaskError, match=r"tokens.json does not exist: point the dataset at a directory"):
        TokenWindows(tmp_path, 16)


def test_the_tokenize_command_writes_a_corpus_from_text_files(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("first file\n" * 50)
    (tmp_path / "b.txt").write_text("second\n" * 50)
    assert main(["tokenize", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out", str(tmp_path / "c"),
                 "--file-tokens", "500"]) == 0
    assert "wrote 900 tokens in 2 files" in capsys.readouterr().out
    assert len(TokenWindows(tmp_path / "c", 8)) == (500 - 1) // 8 + (400 - 1) // 8
    assert main(["tokenize", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "d")]) == 2
    assert "missing.txt is not a file" in capsys.readouterr().err


def test_a_text_file_is_read_in_pieces_that_tokenize_as_the_whole(tmp_path):
    """Bytes cut anywhere; text cut only after a line's end (a multi-byte character and
    the words stay whole), whatever the piece size."""
    text = "ünïcode line one\nsecond line, longer than the piece\nthird\n" * 20
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    pieces = list(text_pieces(tmp_path / "a.txt", binary=True, piece_bytes=7))
    assert len(pieces) > 100 and max(map(len, pieces)) == 7 and b"".join(pieces) == text.encode()
    lines = list(text_pieces(tmp_path / "a.txt", binary=False, piece_bytes=30))
    assert len(lines) > 20 and "".join(lines) == text and all(p.endswith("\n") for p in lines)


def _rss_kib() -> dict[str, int]:
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return fields


def test_reading_windows_of_a_corpus_20_times_a_workers_memory_keeps_residence_flat(tmp_path):
    """A sparse 6.5 GB token file (20x the ~310 MiB a worker actor takes): 2,000 windows read
    at random offsets leave this process's resident memory, anonymous or mapped from the
    file, where it was."""
    corpus = tmp_path / "big"
    corpus.mkdir()
    tokens = 20 * 310 * 2**20 // 2
    with open(corpus / "part-00000.bin", "wb") as f:
        f.truncate(tokens * 2)  # sparse: no disk taken, reads give zeros
    (corpus / "tokens.json").write_text(json.dumps({"format": 1, "dtype": "uint16", "tokenizer": "bytes", "tokens": tokens,
                                                    "files": [{"name": "part-00000.bin", "tokens": tokens}]}))
    windows = TokenWindows(corpus, 64)
    assert len(windows) * 65 * 2 > 6e9
    windows[0]
    before = _rss_kib()
    rng = random.Random(0)
    for _ in range(2000):
        x, _ = windows[rng.randrange(len(windows))]
    after = _rss_kib()
    assert int(x.sum()) == 0
    assert after["RssAnon"] - before["RssAnon"] < 16 * 1024, (before, after)
    assert after["RssFile"] - before["RssFile"] < 4 * 1024, (before, after)


@pytest.mark.ray
def test_a_run_on_local_token_files_with_a_kill_and_a_join_ends_on_the_replay(ray_cluster, tmp_path):
    from jobs import gpt

    write_token_files([gpt.corpus(40_000)], tmp_path / "corpus", file_tokens=15_000)
    task = dataclasses.replace(TINY_GPT_TASK, dataset=functools.partial(TokenWindows, str(tmp_path / "corpus"), 16))
    config = dataclasses.replace(task.defaults, steps=6)
    Trainer(task, train=config, cluster=ClusterConfig(workers=3, min_workers=1), out_dir=str(tmp_path / "out"),
            progress=False, inject=["kill:step=2:rank=1", "join:step=4"]).fit()
    events = read_lines(tmp_path / "out" / "events.jsonl")
    changes = [e for e in events if e["kind"] == "membership_changed"]
    assert sum(e["lost"] for e in changes) == 1 and sum(e.get("joined", 0) for e in changes) >= 1
    assert [m["step"] for m in read_lines(tmp_path / "out" / "metrics.jsonl")] == list(range(6))
    expected = replay(task, config, str(tmp_path / "out" / "initial.safetensors"))
    assert max_abs_diff(load_file(tmp_path / "out" / "final.safetensors"), expected) < TOL
    assert os.path.getsize(tmp_path / "corpus" / "part-00000.bin") == 30_000
