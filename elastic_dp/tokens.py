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
once copied: the page cache keeps them), one ranged read per window on an object store. A worker therefore holds only what its slices need, whatever
the corpus's size. ``write_token_files`` (``elastic-dp tokenize``) writes a corpus from text.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
from typing import Any, Callable, Iterable

import numpy as np

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


class TokenWindows:
    """Windows of ``context + 1`` tokens over the token files under ``uri``, as
    ``(input, target)`` int64 tensors of ``context`` tokens each (``jobs.gpt``'s samples)."""

    def __init__(self, uri: str | os.PathLike, context: int) -> None:
        if context < 1:
            raise TaskError(f"a window needs context >= 1, got {context}")
        self.uri, self.context = str(uri), context
        index = read_index(self.uri)
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.files = [f["name"] for f in index["files"]]
        windows = [max(0, (f["tokens"] - 1) // context) for f in index["files"]]
        self.starts = np.cumsum([0, *windows]).tolist()
        """The first window of each file; the last entry is the number of windows."""
        self._storage: Storage | None = None
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # opened again where it is unpickled
        return {"uri": self.uri, "context": self.context, "dtype": self.dtype, "files": self.files,
                "starts": self.starts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._storage, self._open = None, {}

    def __getitem__(self, i: int):
        import torch

        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        f = bisect.bisect_right(self.starts, i) - 1
        first = (i - self.starts[f]) * self.context
        window = torch.from_numpy(self._read(f, first, self.context + 1).astype(np.int64))
        return window[:-1], window[1:]

    def _read(self, f: int, first: int, count: int) -> np.ndarray:
        """Tokens ``first .. first + count`` of file ``f``."""
        if self._storage is None:
            self._storage = Storage(self.uri, "the token files' URI")
        handle = self._open.get(f)
        if handle is None:
            path = self._storage.path(self.files[f])
            if self._storage.local:
                with open(path, "rb") as file:
                    handle = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                handle.madvise(mmap.MADV_RANDOM)  # no readahead around each window
            else:
                handle = self._storage.fs.open_input_file(path)
            self._open[f] = handle
        size = self.dtype.itemsize
        if isinstance(handle, mmap.mmap):
            window = np.frombuffer(handle, dtype=self.dtype, count=count, offset=first * size).copy()
            # the window's pages leave this process (the page cache keeps them): what it holds
            # resident does not grow with what it has read
            start = first * size // mmap.PAGESIZE * mmap.PAGESIZE
            handle.madvise(mmap.MADV_DONTNEED, start, (first + count) * size - start)
            return window
        return np.frombuffer(handle.read_at(count * size, first * size), dtype=self.dtype)
