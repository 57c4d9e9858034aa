"""Reading ahead (elastic_dp.data.ahead): the bounded cache, and token windows read ahead from
a real S3 server (moto on loopback) as the workers of an elastic run read them: every window
equal to the local file's, through a resize, and none fetched twice by a worker."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from elastic_dp import ElasticSampler
from elastic_dp.data import rank_slice
from elastic_dp.data.ahead import AheadCache
from elastic_dp.tokens import TokenWindows, write_token_files
from tests.reading import count_fetches, fetched_by, read_through_a_resize


def _pieces(keys, size, calls):
    def load():
        calls.append(tuple(keys))
        return [(f"piece {k}", size) for k in keys]
    return load


def _settle(cache: AheadCache, held: int) -> None:
    deadline = time.monotonic() + 5
    while cache.held_bytes != held:
        assert time.monotonic() < deadline, f"the pool's fetches did not arrive: {cache.held_bytes} held"
        time.sleep(0.01)


def test_the_cache_keeps_its_bound_lets_read_pieces_go_first_and_fetches_each_once():
    calls: list[tuple] = []
    cache = AheadCache(capacity_bytes=100, inflight=2)
    cache.ahead(["a", "b"], _pieces(["a", "b"], 30, calls))  # one fetch, two pieces
    assert cache.get("a", _pieces(["a"], 30, calls)) == "piece a"
    assert calls == [("a", "b")] and cache.loads == 1
    cache.ahead(["c"], _pieces(["c"], 30, calls))
    _settle(cache, 90)
    # a fourth piece of 30 does not fit 100: "a", read, leaves; "b" and "c", named and not
    # read yet, stay, though "b" was named before "a" was read
    cache.ahead(["d"], _pieces(["d"], 30, calls))
    assert cache.get("d", _pieces(["d"], 30, calls)) == "piece d"  # waits for the pool's fetch
    assert "a" not in cache and all(k in cache for k in "bcd") and cache.held_bytes == 90
    assert [cache.get(k, _pieces([k], 30, calls)) for k in "bc"] == ["piece b", "piece c"]
    assert cache.loads == 3 and calls == [("a", "b"), ("c",), ("d",)]
    # a key named twice in one fetch (the steps named ahead cross an epoch) arrives once
    cache.ahead(["e", "e"], _pieces(["e", "e"], 10, calls))
    assert cache.get("e", _pieces(["e"], 10, calls)) == "piece e" and cache.loads == 4
    # a piece over the whole bound is read and not kept
    assert cache.get("big", _pieces(["big"], 500, calls)) == "piece big" and "big" not in cache
    assert cache.held_bytes == 100
    cache.close()


def test_a_fetch_that_fails_raises_for_every_reader_and_the_next_read_tries_again():
    cache = AheadCache(capacity_bytes=1 << 20, inflight=2)
    gate = threading.Event()

    def broken():
        gate.wait(5)
        raise OSError("the store said no")

    cache.ahead(["x", "y"], broken)
    errors = []
    readers = [threading.Thread(target=lambda k=k: errors.append(_raised(cache, k))) for k in ("x", "y")]
    for t in readers:
        t.start()
    gate.set()
    for t in readers:
        t.join(5)
    assert errors == ["the store said no", "the store said no"]
    assert cache.get("x", lambda: [("fine", 4)]) == "fine" and cache.loads == 2


def _raised(cache: AheadCache, key: str) -> str | None:
    try:
        cache.get(key, lambda: pytest.fail("a piece on its way was fetched again"))
    except OSError as exc:
        return str(exc)
    return None


def test_readers_of_one_piece_on_many_threads_fetch_it_once():
    calls: list[tuple] = []
    cache = AheadCache(capacity_bytes=1 << 20, inflight=4)

    def slow():
        time.sleep(0.1)
        calls.append(("k",))
        return [("value", 8)]

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("k", slow))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == ["value"] * 6 and calls == [("k",)]


@pytest.fixture(scope="module")
def corpora(s3, tmp_path_factory):
    """The same corpus of 600,000 random uint16 tokens in 3 files, local and in S3."""
    ids = np.random.default_rng(0).integers(0, 65_000, 600_000, dtype=np.uint16)
    tokens = lambda data: np.frombuffer(data, dtype=np.uint16)
    local = tmp_path_factory.mktemp("corpus")
    remote = s3[0].replace("/runs?", "/ahead-corpus?")
    for uri in (local, remote):
        write_token_files([ids.tobytes()], uri, tokenizer=tokens, file_tokens=200_000)
    return str(local), remote


@pytest.mark.parametrize("cache_mb", [256, 0.01], ids=["cache-over-corpus", "cache-under-corpus"])
def test_windows_read_ahead_through_a_resize_are_the_files_and_none_is_fetched_twice(corpora, monkeypatch, cache_mb):
    """Three workers read steps 0-5 of 8 windows a worker, then the run goes on at two from
    step 6 (a re-split: workers 0 and 1 keep their datasets and caches, as survivors do).
    Each worker names its steps ahead as the trainer does (``Horizon``). Every window read
    equals the local file's; no window is fetched twice by one worker, the windows a
    survivor had named ahead before the resize included (its re-split slice of step 6
    overlaps what it named for step 6 at three); a worker asks the store far fewer times
    than it reads windows when its cache holds the corpus, and never more than once a
    window when it does not."""
    fetched = count_fetches(monkeypatch, TokenWindows,
                            lambda w, windows: (w.starts[f] + first // w.context for f, first in windows))
    local, remote = corpora
    context, batch, steps = 64, 24, 12
    expected = TokenWindows(local, context)
    sampler = ElasticSampler(len(expected), global_batch=batch, seed=3)
    workers = [TokenWindows(remote, context, cache_mb=cache_mb) for _ in range(3)]

    def check(i, window):
        assert np.array_equal(window[0], expected[i][0]) and np.array_equal(window[1], expected[i][1]), i

    read = read_through_a_resize(workers, sampler, steps, 6, check)
    for w in workers:
        cache = w.cache
        assert cache is not None and cache.held_bytes <= w.cache_bytes
        windows = fetched_by(fetched, w)
        assert windows and max(windows.values()) == 1, "a window was fetched twice by one worker"
        requests = fetched[(id(w), "requests")]
        assert requests <= len(windows)
        if cache_mb == 256:
            assert requests * 4 <= read[id(w)], (requests, read[id(w)])
    # the resize re-split step 6 and on: rank 0's new slice of step 6 holds the windows of its
    # old one, named ahead at three workers, and none of them was fetched again
    old, new = rank_slice(sampler.batch(6), 3, 0), rank_slice(sampler.batch(6), 2, 0)
    assert set(old) < set(new)
    assert all(fetched[(id(workers[0]), int(i))] == 1 for i in new)
    for w in workers:
        w.cache.close()


def test_local_windows_are_read_as_asked_and_name_nothing(corpora):
    local, _ = corpora
    windows = TokenWindows(local, 64)
    assert windows.ahead_samples == 0
    windows.read_ahead([0, 1, 2])
    assert windows.cache is None
    assert len(windows[5][0]) == 64
