"""Readers of remote data read as the workers of an elastic run read them: the fetches a
reader asks its store for, counted, and a resize from three workers to two, each naming its
steps ahead as the trainer does (``elastic_dp.data.ahead.Horizon``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from elastic_dp import ElasticSampler
from elastic_dp.data import rank_slice
from elastic_dp.data.ahead import Horizon


def count_fetches(monkeypatch, reader: type, samples_of: Callable[..., Iterable[int]]) -> Counter:
    """Wrap ``reader._fetch``: each sample a fetch brought, by ``(id(dataset), sample)``, and
    each fetch, by ``(id(dataset), "requests")``: what the store was asked for.
    ``samples_of(dataset, *fetch_args)`` names the samples of a fetch."""
    fetched: Counter = Counter()
    fetch = reader._fetch

    def counted(self, *args):
        fetched[(id(self), "requests")] += 1
        for i in samples_of(self, *args):
            fetched[(id(self), int(i))] += 1
        return fetch(self, *args)

    monkeypatch.setattr(reader, "_fetch", counted)
    return fetched


def fetched_by(fetched: Counter, dataset: Any) -> dict[int, int]:
    """The samples ``dataset`` fetched, each with how many times."""
    return {k[1]: n for k, n in fetched.items() if k[0] == id(dataset) and k[1] != "requests"}


def read_through_a_resize(workers: list, sampler: ElasticSampler, steps: int, resize_at: int,
                          check: Callable[[int, Any], None]) -> Counter:
    """Workers 0-2 read their slices of steps ``0 .. resize_at - 1`` at three, workers 0-1 the
    rest at two (survivors keep their datasets and caches), each naming its steps ahead
    first; ``check(i, sample)`` for every sample read. Returns the samples read by each
    worker, by ``id``."""
    horizons = [Horizon(w) for w in workers]
    read: Counter = Counter()
    for step in range(steps):
        world = 3 if step < resize_at else 2
        for rank in range(world):
            def slice_of(s: int, rank: int = rank, world: int = world):
                return rank_slice(sampler.batch(s), world, rank)

            horizons[rank].at(step, slice_of, (world, rank), steps - 1)
            for i in slice_of(step):
                check(int(i), workers[rank][int(i)])
                read[id(workers[rank])] += 1
    return read
