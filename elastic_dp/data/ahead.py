"""Reading ahead: samples of remote data fetched on a pool before they are asked for, kept
in a bounded cache.

A dataset whose samples live far away (token files or Parquet on an object store, a Ray
Dataset's blocks) may have ``read_ahead(indices)`` and ``ahead_samples``. A worker's
``Horizon`` names to it the samples of the steps it will run, in the order it will read
them, up to ``ahead_samples`` ahead of the step that computes, half of that at a time, from
the sampler (which knows every future step's global batch) and the worker's place in the
group. The dataset groups what it is told by where it lies (one ranged read for the
samples of a stretch of a file, a row group, a block of rows) and ``AheadCache`` fetches
those, ``inflight`` at a time, while the steps go on; a read of a sample that is fetched or
on its way waits for it instead of fetching it again. What it holds is bounded: at most
``capacity_bytes`` of fetched samples, and ``inflight`` fetches on their way. A sample read
leaves before the ones not read yet (a sample is read once a step; one named ahead is
wanted soon), then the least recently named; a piece larger than the whole bound is read
and not kept.

Nothing here is state of the run: the sampler's position is the step, and a cache that
is lost (a new process, a re-formed group) only costs the fetches again.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from elastic_dp.threads import set_os_name

logger = logging.getLogger(__name__)

Load = Callable[[], list[tuple[Any, int]]]
"""One fetch: the pieces of the keys it was started for, in their order, each with its size
in bytes (what the bound counts)."""


def detached(row: dict[str, Any]) -> dict[str, Any]:
    """A row whose arrays are copies, not views of the block or row group it was read from:
    a view would keep the whole of that alive in the cache, past its bound (and read-only,
    which torch warns of when it makes a tensor of it)."""
    return {name: value.copy() if isinstance(value, np.ndarray) else value for name, value in row.items()}


ROW_OBJECT_BYTES = 128
"""What a cache counts a row's Python objects as (its dict, and each column's value),
beyond the row's own bytes."""


class PieceRows:
    """A map-style dataset of rows stored in pieces that are read whole (Parquet's row
    groups, a Ray Dataset's blocks): row ``i`` lies in piece ``bisect(starts, i) - 1``. The
    rows a worker names ahead are read by piece, one read of a piece for all its rows named at
    once, into an ``AheadCache`` of ``cache_bytes``; a row read alone reads its piece for it.
    A reader sets ``starts`` (the first row of each piece, then the number of rows),
    ``row_bytes`` (what the cache counts a row as: ``ROW_OBJECT_BYTES`` included),
    ``cache_bytes`` and ``inflight``, calls ``_local_state`` as it is built and unpickled,
    and reads a piece's rows in ``_fetch``."""

    LOCAL: tuple[str, ...] = ("_cache", "_lock")
    """Attributes that are each process's own: not pickled, made again where unpickled."""
    cache_name = "edp-rows"

    starts: list[int]
    row_bytes: int
    cache_bytes: int
    inflight: int

    def _local_state(self) -> None:
        self._cache: AheadCache | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self.LOCAL}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local_state()

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def cache(self) -> AheadCache:
        with self._lock:
            if self._cache is None:
                self._cache = AheadCache(self.cache_bytes, self.inflight, self.cache_name)
        return self._cache

    @property
    def ahead_samples(self) -> int:
        """Rows a worker names ahead (``Horizon``): half of what the cache holds."""
        return max(1, self.cache_bytes // (2 * self.row_bytes))

    def _locate(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return bisect.bisect_right(self.starts, i) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = int(i)
        return self.cache.get(i, functools.partial(self._fetch, self._locate(i), [i]))

    def read_ahead(self, indices) -> None:
        """Start reading the pieces of rows ``indices`` (those not held or on their way), one
        read of each for all its rows named."""
        cache = self.cache
        by_piece: dict[int, list[int]] = {}
        for i in cache.missing([int(i) for i in indices]):
            by_piece.setdefault(self._locate(i), []).append(i)
        for piece, rows in by_piece.items():
            cache.ahead(rows, functools.partial(self._fetch, piece, rows))

    def _fetch(self, piece: int, rows: list[int]) -> list[tuple[dict[str, Any], int]]:
        """Rows ``rows`` of piece ``piece``, each with ``row_bytes``."""
        raise NotImplementedError


class AheadCache:
    """Pieces by key, fetched ahead on ``inflight`` threads, at most ``capacity_bytes`` kept.
    One fetch may bring several pieces (a ranged read that covers several samples)."""

    def __init__(self, capacity_bytes: int, inflight: int, name: str = "edp-read") -> None:
        if capacity_bytes < 0 or inflight < 1:
            raise ValueError(f"a read-ahead cache needs capacity_bytes >= 0 and inflight >= 1, "
                             f"got {capacity_bytes} and {inflight}")
        self.capacity_bytes, self.inflight, self.name = capacity_bytes, inflight, name
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Future] = OrderedDict()  # least recently used first
        self._sizes: dict[Hashable, int] = {}  # the fetched ones
        self._held = 0
        self._pool: ThreadPoolExecutor | None = None
        self.loads = 0
        """Fetches started (each one request to the store: the tests count them)."""
        self.loaded_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def missing(self, keys: list[Hashable]) -> list[Hashable]:
        """Those of ``keys`` neither held nor on their way, each once, in their order."""
        with self._lock:
            return [k for k in dict.fromkeys(keys) if k not in self._entries]

    def ahead(self, keys: list[Hashable], load: Load) -> None:
        """Start one fetch of ``keys``' pieces on the pool (those held or on their way are not
        fetched again: ``load`` must bring them all, the others are dropped)."""
        with self._lock:
            fresh = {k: Future() for k in dict.fromkeys(keys) if k not in self._entries}
            if not fresh:
                return
            self._entries.update(fresh)
            self.loads += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.inflight, thread_name_prefix=self.name,
                                                initializer=set_os_name, initargs=(self.name,))
            pool = self._pool
        pool.submit(self._fetch, list(keys), load, fresh)

    def get(self, key: Hashable, load: Load) -> Any:
        """``key``'s piece: the one held or on its way, else fetched now on this thread
        (``load`` brings it alone). A fetch that failed raises here, and the next ``get``
        tries it again."""
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                mine = False
            else:
                future = self._entries[key] = Future()
                self.loads += 1
                mine = True
            # a piece read is the first to leave: a sample is read once a step (again only
            # in a re-run step), and the ones named ahead are wanted soon
            self._entries.move_to_end(key, last=False)
        if mine:
            self._fetch([key], load, {key: future})
        return future.result()

    def _fetch(self, keys: list[Hashable], load: Load, futures: dict[Hashable, Future]) -> None:
        try:
            pieces = load()
            if len(pieces) != len(keys):
                raise RuntimeError(f"a fetch for {len(keys)} pieces brought {len(pieces)}")
        except BaseException as exc:  # noqa: BLE001 — each reader of these pieces raises it
            with self._lock:
                for key, future in futures.items():
                    if self._entries.get(key) is future:
                        del self._entries[key]
            for future in futures.values():
                future.set_exception(exc)
            return
        arrived = dict(zip(keys, pieces))  # a key named twice (a batch that crosses an epoch) once
        with self._lock:
            for key, future in futures.items():
                size = arrived[key][1]
                self.loaded_bytes += size
                if self._entries.get(key) is future:
                    if size > self.capacity_bytes:
                        del self._entries[key]  # read, not kept: it would not fit
                    else:
                        self._sizes[key] = size
                        self._held += size
            self._evict(keep=set(futures))
        for key, future in futures.items():
            future.set_result(arrived[key][0])

    def _evict(self, keep: set) -> None:
        """Drop fetched pieces, least recently used first, until the held ones fit."""
        for key in list(self._entries):
            if self._held <= self.capacity_bytes:
                return
            if key in keep or key not in self._sizes:
                continue  # the pieces just fetched, or ones on their way
            del self._entries[key]
            self._held -= self._sizes.pop(key)

    def close(self) -> None:
        """Let the pool's threads go (fetches on their way finish first) and drop what is held."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._entries.clear()
            self._sizes.clear()
            self._held = 0
        if pool is not None:
            pool.shutdown(wait=False)


class Horizon:
    """Which samples a worker names to its dataset ahead (``read_ahead``): the slices of the
    steps after the one it runs, as many samples ahead as the dataset asks for (its
    ``ahead_samples``, what its cache holds), named half of that at a time so that each
    naming brings many samples of a piece of the store together. A new layout (another
    generation, rank, world size or slice sizes) names again from the step it starts at."""

    def __init__(self, dataset: Any) -> None:
        self._hint = getattr(dataset, "read_ahead", None)
        self.samples = int(getattr(dataset, "ahead_samples", 0) or 0)
        self._layout: Hashable = None
        self._until = -1  # the last step named

    def now(self, indices: Any) -> None:
        """Name a slice about to be read (its reads then go together), whatever was named."""
        if self._hint is not None and len(indices):
            try:
                self._hint(indices)
            except Exception:  # the read of the same samples raises it
                logger.debug("the dataset's read_ahead failed", exc_info=True)

    def at(self, step: int, slice_of: Callable[[int], Any], layout: Hashable, last: int) -> None:
        """Before step ``step`` of layout ``layout`` computes: name what comes up to ``last``
        (the run's last step). ``slice_of(s)``: step ``s``'s samples for this worker."""
        if self._hint is None:
            return
        if layout != self._layout:
            self._layout, self._until = layout, step - 1
        self._until = max(self._until, step - 1)  # a step skipped (an evaluation's, a resume's) is not named
        steps = max(1, self.samples // max(1, len(slice_of(step))))
        if self._until - step < (steps + 1) // 2 and self._until < last:
            upto = min(last, step + steps)
            self._hint(np.concatenate([slice_of(s) for s in range(self._until + 1, upto + 1)]))
            self._until = upto
