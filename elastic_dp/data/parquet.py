"""Parquet files as a map-style dataset, by row, local or on any ``pyarrow.fs`` store.

``ParquetRows(uri)`` takes one ``.parquet`` file or a directory of them (the files whose
names end in ``.parquet``, in name order; not its subdirectories). Sample ``i`` is the
``i``-th row of the files laid end to end, each file's rows in order: the order of
``pyarrow.parquet.read_table`` over the same files, which a user's own loop can list. A row
is a dict of its columns (``columns``: those only): a number is a numpy scalar, a list a
numpy array, a string a ``str``, so that torch's ``default_collate`` makes tensors of the
numbers and lists, as it does for a map-style dataset of numpy samples.

Each file's footer is read as the dataset is built (its row groups and their rows), so a
missing or unreadable file fails then, naming it, before any step. A row is read with its
row group, the unit Parquet stores together: the rows a worker names ahead
(``read_ahead``, ``elastic_dp.data.ahead``) are read by row group, one read of each row
group for all its rows named together, ``inflight`` row groups at a time, into a cache of
at most ``cache_mb`` MiB of rows (local files too: a row group is decoded once for the
rows named in it).
"""

from __future__ import annotations

import bisect
import functools
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_dp.data.ahead import AheadCache, detached
from elastic_dp.durable.storage import Storage
from elastic_dp.errors import TaskError

CACHE_MB = 256
"""The rows read ahead that a process keeps, in MiB (``cache_mb``)."""
INFLIGHT = 4
"""Row groups on their way at once (``inflight``)."""
ROW_OBJECT_BYTES = 128
"""What the cache counts a row's Python objects as, per column and for the row's dict,
beyond its Arrow bytes."""


class ParquetRows:
    """The rows of the Parquet files at ``uri``, by index (module docstring)."""

    def __init__(self, uri: str, columns: list[str] | None = None, *, cache_mb: float = CACHE_MB,
                 inflight: int = INFLIGHT) -> None:
        if cache_mb <= 0 or inflight < 1:
            raise TaskError(f"ParquetRows needs cache_mb > 0 and inflight >= 1, got {cache_mb} and {inflight}")
        self.uri, self.columns = str(uri), list(columns) if columns is not None else None
        self.cache_bytes, self.inflight = int(cache_mb * 2**20), inflight
        storage = Storage(self.uri, "the Parquet files' URI")
        self.paths, self.file_sizes = _parquet_files(storage, self.uri)
        self.groups: list[tuple[int, int]] = []
        """(file, row group) in order, each a piece of reading."""
        rows, nbytes, self.num_columns = [], 0, 0
        for f, path in enumerate(self.paths):
            metadata = _footer(storage, path)
            names = metadata.schema.to_arrow_schema().names
            self.num_columns = len(names)
            missing = sorted(set(self.columns or ()) - set(names))
            if missing:
                raise TaskError(f"{path} has no column {', '.join(missing)} (its columns: {', '.join(names)}): "
                                "name columns it has in ParquetRows(columns=...)")
            for g in range(metadata.num_row_groups):
                group = metadata.row_group(g)
                if group.num_rows:
                    self.groups.append((f, g))
                    rows.append(group.num_rows)
                    nbytes += group.total_byte_size
        self.starts = np.cumsum([0, *rows]).tolist()
        """The first row of each row group in ``groups``; the last entry is the number of rows."""
        self.row_bytes = max(1, nbytes // max(1, self.starts[-1]))
        """A row's bytes, uncompressed, on average (what the cache's bound counts a row as)."""
        self.__setstate__({})

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # the cache and the store's handles are each process's own
        return {k: v for k, v in self.__dict__.items() if k not in ("_storage", "_cache", "_open", "_footers", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._storage: Storage | None = None
        self._cache: AheadCache | None = None
        self._open: dict[int, Any] = {}  # a file's handle, its reads positional (the pool's threads share it)
        self._footers: dict[int, pq.FileMetaData] = {}
        self._lock = threading.Lock()

    @property
    def cache(self) -> AheadCache:
        with self._lock:
            if self._cache is None:
                self._storage = Storage(self.uri, "the Parquet files' URI")
                self._cache = AheadCache(self.cache_bytes, self.inflight, "edp-parquet")
        return self._cache

    @property
    def ahead_samples(self) -> int:
        """Rows a worker names ahead (``Horizon``): half of what the cache holds."""
        columns = len(self.columns) if self.columns is not None else self.num_columns
        return max(1, self.cache_bytes // (2 * (self.row_bytes + ROW_OBJECT_BYTES * (1 + columns))))

    def _locate(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return bisect.bisect_right(self.starts, i) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = int(i)
        return self.cache.get(i, functools.partial(self._fetch, self._locate(i), [i]))

    def read_ahead(self, indices) -> None:
        """Start reading the row groups of rows ``indices`` (those not held or on their way),
        one read of each for all its rows named."""
        cache = self.cache
        by_group: dict[int, list[int]] = {}
        for i in cache.missing([int(i) for i in indices]):
            by_group.setdefault(self._locate(i), []).append(i)
        for group, rows in by_group.items():
            cache.ahead(rows, functools.partial(self._fetch, group, rows))

    def _file(self, f: int) -> Any:
        with self._lock:
            if f not in self._open:
                self._open[f] = self._storage.fs.open_input_file(self.paths[f])
                self._footers[f] = pq.ParquetFile(self._open[f]).metadata
            return self._open[f]

    def _fetch(self, group: int, rows: list[int]) -> list[tuple[dict[str, Any], int]]:
        """Rows ``rows`` of row group ``group`` (of ``groups``), read with it."""
        f, g = self.groups[group]
        path = self.paths[f]
        try:
            table = pq.ParquetFile(self._file(f), metadata=self._footers.get(f)).read_row_group(g, columns=self.columns)
        except (OSError, pa.ArrowException) as exc:
            raise TaskError(f"reading row group {g} of {_url(self._storage, path)} failed: {exc}") from exc
        columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
        first, size = self.starts[group], self.row_bytes + ROW_OBJECT_BYTES * (1 + len(columns))
        return [(detached({name: values[i - first] for name, values in columns.items()}), size) for i in rows]


def _parquet_files(storage: Storage, uri: str) -> tuple[list[str], list[int]]:
    """The Parquet files at ``uri`` (a file, or a directory's ``*.parquet`` in name order),
    as paths on ``storage.fs``, and their sizes."""
    root = storage.path()
    info = storage.fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        return [root], [info.size]
    if info.type != pafs.FileType.Directory:
        raise TaskError(f"{uri} does not exist: point ParquetRows at a .parquet file or a directory of them")
    found = sorted((i for i in storage.fs.get_file_info(pafs.FileSelector(root))
                    if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")), key=lambda i: i.path)
    if not found:
        raise TaskError(f"{uri} holds no .parquet file: point ParquetRows at a .parquet file or a directory of them")
    return [i.path for i in found], [i.size for i in found]


def _footer(storage: Storage, path: str) -> pq.FileMetaData:
    """A Parquet file's footer, or a TaskError naming the file."""
    try:
        with storage.fs.open_input_file(path) as handle:
            return pq.ParquetFile(handle).metadata
    except (OSError, pa.ArrowException) as exc:
        raise TaskError(f"{_url(storage, path)} is not a readable Parquet file: {exc}") from exc


def _url(storage: Storage, path: str) -> str:
    """A file's location for messages, as the user wrote its root (without the query)."""
    return storage.url(path[len(storage.root):].lstrip("/"))
