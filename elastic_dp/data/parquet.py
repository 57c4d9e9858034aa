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

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_dp.data.ahead import ROW_OBJECT_BYTES, PieceRows, detached
from elastic_dp.durable.storage import Storage
from elastic_dp.errors import TaskError

CACHE_MB = 256
"""The rows read ahead that a process keeps, in MiB (``cache_mb``)."""
INFLIGHT = 4
"""Row groups on their way at once (``inflight``)."""


class ParquetRows(PieceRows):
    """The rows of the Parquet files at ``uri``, by index (module docstring); a piece is a row
    group, of ``groups``."""

    LOCAL = (*PieceRows.LOCAL, "_storage", "_open", "_footers")
    cache_name = "edp-parquet"

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
        rows, nbytes, columns = [], 0, 0
        for f, path in enumerate(self.paths):
            metadata = _footer(storage, path)
            names = metadata.schema.to_arrow_schema().names
            columns = len(self.columns) if self.columns is not None else len(names)
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
        self.row_bytes = max(1, nbytes // max(1, self.starts[-1])) + ROW_OBJECT_BYTES * (1 + columns)
        """A row's bytes, uncompressed, on average, and its Python objects' (what the cache
        counts a row as)."""
        self._local_state()

    def _local_state(self) -> None:
        super()._local_state()
        self._storage: Storage | None = None
        self._open: dict[int, Any] = {}  # a file's handle, its reads positional (the pool's threads share it)
        self._footers: dict[int, pq.FileMetaData] = {}

    def _file(self, f: int) -> Any:
        with self._lock:
            if self._storage is None:
                self._storage = Storage(self.uri, "the Parquet files' URI")
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
        first = self.starts[group]
        return [(detached({name: values[i - first] for name, values in columns.items()}), self.row_bytes)
                for i in rows]


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
