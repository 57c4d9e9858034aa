"""Token files: a corpus larger than memory, read by ranges.

A corpus is a directory (local, a shared mount, or any ``pyarrow.fs`` URI such as
``s3://bucket/corpus?endpoint_override=host:port``) holding ``tokens.json`` and flat files
of token ids, ``part-00000.bin`` …: little-endian ``uint16`` or ``uint32``, nothing else, so
``numpy.fromfile(path, dtype)`` reads one. ``tokens.json`` says the dtype and each file's
token count (and the tokenizer that wrote it, for the record).

``TokenWindows`` is a map-style dataset over them: sample ``i`` is a window of
``context + 1`` tokens (input and next-token target), the windows of each file laid end
to end, in file order; a window never spans two files. It opens the files lazily, in the
process that reads them, and reads only the windows it is asked for: memory-mapped when
the files are local (without readahead, each window's pages released from the process
once copied: the page cache keeps them); on an object store read ahead of the step,
several fetches in flight, through a bounded cache (``elastic_dp.data.ahead``). A worker
therefore holds only what its slices need and its cache, whatever the corpus's size. ``write_token_files`` (``elastic-dp tokenize``) writes a corpus from text.
"""

from __future__ import annotations

import bisect
import functools
import json
import mmap
import os
import threading
from typing import Any, Callable, Iterable

import numpy as np

from elastic_dp.data.ahead import AheadCache
from elastic_dp.durable.storage import Storage
from elastic_dp.errors import TaskError

INDEX = "tokens.json"
DTYPES = ("uint16", "uint32")


def byte_tokens(text: str | bytes) -> list[int]:
    """The byte-level tokenizer (what ``jobs.gpt`` trains on): each byte is a token."""
    return list(text.encode() if isinstance(text, str) else text)


def write_token_files(texts: Iterable[str | bytes], uri: str | os.PathLike, *,
                      tokenizer: Callable[[str | bytes], list[int]] = byte_tokens, dtype: str | None = None,
                      file_tokens: int = 1 << 26, tokenizer_name: str = "bytes") -> dict[str, Any]:
    """Tokenize each of ``texts`` (strings or bytes, in order; documents are concatenated)
    and write them as token files under ``uri``, at most ``file_tokens`` tokens a file;
    ``tokens.json`` last, so a corpus without it is incomplete. ``dtype``: ``uint16``
    (the default, for vocabularies up to 65,536) or ``uint32``. Returns the index."""
    if dtype is None:
        dtype = "uint16"
    if dtype not in DTYPES:
        raise TaskError(f"token files hold uint16 or uint32 token ids, not {dtype!r} (--dtype)")
    if file_tokens < 2:
        raise TaskError(f"a token file needs at least 2 tokens, got {file_tokens} (--file-tokens)")
    storage = Storage(uri, "--out")
    limit = np.iinfo(dtype).max
    files: list[dict[str, Any]] = []
    pending: list[np.ndarray] = []
    held = 0

    def flush(ids: np.ndarray) -> None:
        data = ids.astype(f"<{np.dtype(dtype).str[1:]}")
        name = f"part-{len(files):05d}.bin"
        storage.write(name, data.tobytes())
        files.append({"name": name, "tokens": int(data.size)})

    for text in texts:
        ids = np.asarray(tokenizer(text), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() > limit):
            raise TaskError(f"the tokenizer returned token id {int(ids.max() if ids.max() > limit else ids.min())}, "
                            f"outside {dtype}: write --dtype uint32")
        pending.append(ids)
        held += ids.size
        if held >= file_tokens:  # whole files out of what is held, the rest kept for the next
            whole, start = np.concatenate(pending), 0
            while whole.size - start >= file_tokens:
                flush(whole[start:start + file_tokens])
                start += file_tokens
            pending, held = [whole[start:]], whole.size - start
    if held:
        flush(np.concatenate(pending))
    index = {"format": 1, "dtype": dtype, "tokenizer": tokenizer_name, "files": files,
             "tokens": sum(f["tokens"] for f in files)}
    storage.write(INDEX, json.dumps(index, indent=1).encode())
    return index


PIECE_BYTES = 16 << 20
"""``text_pieces`` reads a file this many bytes at a time (whole lines for a tokenizer of text)."""


def text_pieces(path: str | os.PathLike, *, binary: bool, piece_bytes: int = PIECE_BYTES) -> Iterable[str | bytes]:
    """A text file in pieces of about ``piece_bytes``, so that no file is held whole:
    raw bytes for the byte-level tokenizer (which is the same however they are cut),
    else UTF-8 text cut only after a line's end, so that a tokenizer never sees a word,
    or a character, cut in two."""
    if binary:
        with open(path, "rb") as f:
            while piece := f.read(piece_bytes):
                yield piece
        return
    with open(path, encoding="utf-8") as f:
        lines, held = [], 0
        for line in f:
            lines.append(line)
            held += len(line)
            if held >= piece_bytes:
                yield "".join(lines)
                lines, held = [], 0
        if lines:
            yield "".join(lines)


def load_tokenizer(spec: str) -> Callable[[str], list[int]]:
    """``module:name``: an importable callable, text -> list of token ids."""
    import importlib

    module, _, name = spec.partition(":")
    try:
        tokenizer = getattr(importlib.import_module(module), name) if name else None
    except (ImportError, AttributeError) as exc:
        raise TaskError(f"--tokenizer {spec}: {exc}") from None
    if not callable(tokenizer):
        raise TaskError(f"--tokenizer {spec} is not module:name of a callable (text -> list of token ids)")
    return tokenizer


def read_index(uri: str | os.PathLike) -> dict[str, Any]:
    """A corpus's ``tokens.json``, checked."""
    storage = Storage(uri, "the token files' URI")
    if not storage.exists(INDEX):
        raise TaskError(f"{storage.url(INDEX)} does not exist: point the dataset at a directory that "
                        "write_token_files (elastic-dp tokenize) wrote")
    index = json.loads(storage.read(INDEX))
    if index.get("dtype") not in DTYPES or not index.get("files"):
        raise TaskError(f"{storage.url(INDEX)} is not a token-file index (dtype {index.get('dtype')!r}, "
                        f"{len(index.get('files') or [])} files)")
    return index


CACHE_MB = 256
"""``TokenWindows``' read-ahead cache on an object store, per process (``cache_mb``)."""
SPAN_MB = 4
"""The longest stretch of a file one ranged read covers (``span_mb``)."""
REQUEST_BYTES = 1 << 20
"""What one request to an object store costs, in bytes read: its latency (tens of ms) at the
store's bandwidth (100 MB/s and more). A stretch is read whole when the bytes it reads
beyond its windows' cost less than the requests it saves."""
INFLIGHT = 8
"""Fetches on their way at once (``inflight``): a store's latency is paid once for as many."""


class TokenWindows:
    """Windows of ``context + 1`` tokens over the token files under ``uri``, as
    ``(input, target)`` int64 tensors of ``context`` tokens each (``jobs.gpt``'s samples).

    On an object store the windows are read ahead (``read_ahead``: a worker names the
    windows of the steps ahead of it, ``elastic_dp.data.ahead``) into a cache of at most
    ``cache_mb`` MiB, ``inflight`` fetches at a time. The windows named together are
    grouped by stretch of at most ``span_mb`` MiB of their file: one ranged read brings
    those of a stretch when the bytes it reads between them cost less than the requests it
    saves (``REQUEST_BYTES`` a request), else each window is its own read. Local files are
    memory-mapped and read as asked."""

    def __init__(self, uri: str | os.PathLike, context: int, *, cache_mb: float = CACHE_MB,
                 span_mb: float = SPAN_MB, inflight: int = INFLIGHT) -> None:
        if context < 1:
            raise TaskError(f"a window needs context >= 1, got {context}")
        for name, value in (("cache_mb", cache_mb), ("span_mb", span_mb), ("inflight", inflight)):
            if value <= 0:
                raise TaskError(f"TokenWindows' {name} must be positive, got {value}")
        self.uri, self.context = str(uri), context
        self.cache_bytes, self.span_bytes, self.inflight = int(cache_mb * 2**20), int(span_mb * 2**20), inflight
        index = read_index(self.uri)
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.files = [f["name"] for f in index["files"]]
        windows = [max(0, (f["tokens"] - 1) // context) for f in index["files"]]
        self.starts = np.cumsum([0, *windows]).tolist()
        """The first window of each file; the last entry is the number of windows."""
        self.window_bytes = (context + 1) * self.dtype.itemsize
        self.__setstate__({})

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # opened again where it is unpickled
        return {k: v for k, v in self.__dict__.items() if k not in ("_storage", "_open", "_cache", "_lock", "read_bytes")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._storage, self._open, self._cache = None, {}, None
        self.read_bytes = 0
        """Bytes read from the object store by this process's copy."""
        self._lock = threading.Lock()  # the prefetch thread and the step's may open files at once

    @property
    def cache(self) -> AheadCache | None:
        """The read-ahead cache (None on local files, memory-mapped, or before any read)."""
        return self._cache

    @property
    def ahead_samples(self) -> int:
        """Windows a worker names ahead (``Horizon``): half of what the cache holds; none on
        local files."""
        return 0 if self._remote() is None else max(1, self.cache_bytes // (2 * self.window_bytes))

    def __getitem__(self, i: int):
        import torch

        f, first = self._locate(i)
        cache = self._remote()
        if cache is None:
            tokens = self._mapped(f, first, self.context + 1)
        else:
            data = cache.get(int(i), functools.partial(self._fetch, [(f, first)]))
            tokens = np.frombuffer(data, dtype=self.dtype)
        window = torch.from_numpy(tokens.astype(np.int64))
        return window[:-1], window[1:]

    def _locate(self, i: int) -> tuple[int, int]:
        """Window ``i``'s file and its first token there."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        f = bisect.bisect_right(self.starts, i) - 1
        return f, (i - self.starts[f]) * self.context

    def read_ahead(self, indices: Iterable[int]) -> None:
        """Start fetching windows ``indices`` from an object store (a no-op on local files):
        one ranged read for those of a stretch of a file that they fill enough, else one
        each; the windows held or on their way are not fetched again."""
        cache = self._remote()
        if cache is None:
            return
        size = self.dtype.itemsize
        stretches: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for i in cache.missing([int(i) for i in indices]):
            f, first = self._locate(i)
            stretches.setdefault((f, first * size // self.span_bytes), []).append((i, f, first))
        for windows in stretches.values():
            windows.sort(key=lambda w: w[2])
            while windows:
                # the longest run from the first window that stays within one span
                end = bisect.bisect_right([w[2] * size for w in windows], windows[0][2] * size + self.span_bytes
                                          - self.window_bytes)
                run, windows = windows[:max(end, 1)], windows[max(end, 1):]
                read = (run[-1][2] - run[0][2]) * size + self.window_bytes
                if len(run) > 1 and read - len(run) * self.window_bytes <= (len(run) - 1) * REQUEST_BYTES:
                    cache.ahead([w[0] for w in run], functools.partial(self._fetch, [w[1:] for w in run]))
                else:
                    for i, f, first in run:
                        cache.ahead([i], functools.partial(self._fetch, [(f, first)]))

    def _remote(self) -> AheadCache | None:
        """The read-ahead cache on an object store; None on local files."""
        with self._lock:
            if self._storage is None:
                storage = Storage(self.uri, "the token files' URI")
                if not storage.local:
                    self._cache = AheadCache(self.cache_bytes, self.inflight, "edp-tokens")
                self._storage = storage
        return self._cache

    def _file(self, f: int) -> Any:
        handle = self._open.get(f)
        if handle is not None:
            return handle
        with self._lock:
            if f in self._open:
                return self._open[f]
            path = self._storage.path(self.files[f])
            if self._storage.local:
                with open(path, "rb") as file:
                    handle = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                handle.madvise(mmap.MADV_RANDOM)  # no readahead around each window
            else:
                handle = self._storage.fs.open_input_file(path)
            self._open[f] = handle
        return handle

    def _fetch(self, windows: list[tuple[int, int]]) -> list[tuple[bytes, int]]:
        """Windows ``(file, first token)`` of one file, in order, with one ranged read from
        the first's start to the last's end; each window's bytes cut out of it."""
        size, f = self.dtype.itemsize, windows[0][0]
        start, stop = windows[0][1] * size, windows[-1][1] * size + self.window_bytes
        data = self._file(f).read_at(stop - start, start)
        self.read_bytes += len(data)  # a statistic: a lost update under threads costs nothing
        if len(data) != stop - start:
            raise TaskError(f"{self._storage.url(self.files[f])} is shorter than tokens.json says: "
                            f"{len(data)} bytes at {start}, {stop - start} asked for")
        view = memoryview(data)
        return [(bytes(view[first * size - start:first * size - start + self.window_bytes]), self.window_bytes)
                for _, first in windows]

    def _mapped(self, f: int, first: int, count: int) -> np.ndarray:
        """Tokens ``first .. first + count`` of local file ``f``, memory-mapped."""
        size = self.dtype.itemsize
        handle = self._file(f)
        window = np.frombuffer(handle, dtype=self.dtype, count=count, offset=first * size).copy()
        # the window's pages leave this process (the page cache keeps them): what it holds
        # resident does not grow with what it has read
        start = first * size // mmap.PAGESIZE * mmap.PAGESIZE
        handle.madvise(mmap.MADV_DONTNEED, start, (first + count) * size - start)
        return window
