"""Where checkpoints and run outputs live: a local directory, a shared mount, or an object store.

``Storage`` resolves a URI once with ``pyarrow.fs`` (which Ray already brings): a plain
path or ``file://`` is the local filesystem; ``s3://bucket/prefix?endpoint_override=…``
(and every other scheme pyarrow knows, such as ``gs://`` and ``hdfs://``) is that
store. Credentials come from the usual environment (``AWS_ACCESS_KEY_ID`` …), not the
URI. A ``Storage`` is picklable and is rebuilt from its URI in each worker, so every
rank writes and reads its own files and nothing passes through the driver.

Writes of one object are whole or absent: local files are written under a temporary
name, fsynced and renamed; object stores make a put visible only when it completes.
What spans several objects (a checkpoint) is committed by writing its manifest last.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow
import pyarrow.fs as pafs

from elastic_dp.errors import StorageError

_PROBE_TIMEOUT_S = 3.0


class Storage:
    """Files under one root URI. Paths given to its methods are relative to the root."""

    def __init__(self, uri: str | os.PathLike, setting: str = "--storage") -> None:
        self.uri, self.setting = str(uri), setting
        self.fs, self.root = _resolve(self.uri, setting)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def __reduce__(self):
        return Storage, (self.uri, self.setting)

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    def child(self, name: str) -> "Storage":
        """The storage under ``name`` (a run's own prefix)."""
        if self.local:
            return Storage(os.path.join(self.root, name), self.setting)
        parts = urlsplit(self.uri)
        return Storage(parts._replace(path=parts.path.rstrip("/") + "/" + name).geturl(), self.setting)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}".rstrip("/") if rel else self.root

    def url(self, rel: str = "") -> str:
        """A readable location of ``rel`` for messages."""
        if self.local:
            return self.path(rel)
        return f"{self.uri.split('?')[0].rstrip('/')}/{rel}".rstrip("/")

    # -- operations ----------------------------------------------------------------------
    def write(self, rel: str, data: bytes | memoryview) -> None:
        """Write one file whole (or not at all)."""
        self.write_pieces(rel, [data])

    def write_pieces(self, rel: str, pieces: Iterable[bytes | memoryview]) -> None:
        """Write one file from ``pieces`` as they come, whole or not at all: a local one is
        renamed into place when complete, a remote one deleted if a piece fails."""
        target = self.path(rel)
        if self.local:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(target).with_name(f".{Path(target).name}.{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    for piece in pieces:
                        f.write(piece)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
                _fsync_dir(Path(target).parent)
            finally:
                tmp.unlink(missing_ok=True)
            return
        with self._errors(f"write {self.url(rel)}"):
            try:
                with self.fs.open_output_stream(target) as f:
                    for piece in pieces:
                        f.write(piece)
            except BaseException:
                if self.fs.get_file_info(target).type != pafs.FileType.NotFound:
                    self.fs.delete_file(target)  # the stream's close completed a part of it
                raise

    def read(self, rel: str) -> bytes:
        with self._errors(f"read {self.url(rel)}"):
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()

    def exists(self, rel: str) -> bool:
        with self._errors(f"look up {self.url(rel)}"):
            return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def list(self, rel: str = "") -> list[tuple[str, bool]]:
        """The entries directly under ``rel``: (name, is a directory); [] when there is none."""
        with self._errors(f"list {self.url(rel)}"):
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        return [(i.base_name, i.type == pafs.FileType.Directory) for i in infos]

    def delete(self, rel: str) -> None:
        """Delete a directory and everything under it (nothing when it does not exist)."""
        with self._errors(f"delete {self.url(rel)}"):
            if self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound:
                self.fs.delete_dir(self.path(rel))

    def check_path(self) -> None:
        """A local root that could not become a directory fails now, naming the setting, and
        nothing is created: the root, or the first of its parents that exists, is a file, or
        a directory this process cannot write into. (An object store's is checked by writing.)"""
        if not self.local:
            return
        path = Path(self.root)
        existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
        if not existing.is_dir():
            where = "is a file" if existing == path else f"is under {existing}, which is a file"
            raise StorageError(f"{self.setting} {self.root} {where}, not a directory: pass a directory "
                               f"(one that exists, or that can be made) as {self.setting}")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StorageError(f"{self.setting} {self.root}: {existing} is not writable by this process: pass a "
                               f"writable {self.setting}")

    def check_writable(self) -> None:
        """Fail now, before training, if files cannot be written here."""
        self.check_path()
        probe = f".probe-{uuid.uuid4().hex}"
        try:
            if self.local:
                Path(self.root).mkdir(parents=True, exist_ok=True)
            else:
                self.fs.create_dir(self.root)  # a bucket, or nothing (object stores have no directories)
            self.write(probe, b"ok")
            self.fs.delete_file(self.path(probe))
        except (OSError, StorageError, pyarrow.ArrowException) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split("\n")[0]
            raise StorageError(f"{self.url()} is not writable ({reason}): pass a writable {self.setting}") from None

    def _errors(self, what: str):
        return _Translate(what, self.setting)


class _Translate:
    """Turns pyarrow's and the OS's errors into a StorageError that says what failed."""

    def __init__(self, what: str, setting: str) -> None:
        self.what, self.setting = what, setting

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and isinstance(exc, (OSError, pyarrow.ArrowException)) \
                and not isinstance(exc, StorageError):
            if isinstance(exc, FileNotFoundError):
                return False
            reason = str(exc).split("\n")[0]
            raise StorageError(f"could not {self.what}: {reason} (check {self.setting})") from None
        return False


def _resolve(uri: str, setting: str) -> tuple[pafs.FileSystem, str]:
    scheme = urlsplit(uri).scheme
    if not scheme or len(scheme) == 1:  # a path (a Windows drive letter is not a scheme)
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    if scheme == "file":
        return pafs.LocalFileSystem(), urlsplit(uri).path
    endpoint = parse_qs(urlsplit(uri).query).get("endpoint_override")
    if endpoint:
        _probe_endpoint(endpoint[0], uri, setting)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pyarrow.ArrowInvalid, ValueError) as exc:
        raise StorageError(f"{setting} {uri!r} is not a storage URI pyarrow can open ({exc}): pass a local "
                           "path, or a URI such as s3://bucket/prefix or gs://bucket/prefix") from None
    except (OSError, pyarrow.ArrowException) as exc:
        raise StorageError(f"{setting} {uri!r} could not be opened ({str(exc).splitlines()[0]})") from None


def _probe_endpoint(endpoint: str, uri: str, setting: str) -> None:
    """Fail within seconds when nothing answers at an object store's endpoint (the S3
    client would retry for much longer, and a worker would find out mid-run)."""
    target = endpoint if "://" in endpoint else f"//{endpoint}"
    parts = urlsplit(target)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise StorageError(f"the object store endpoint {endpoint} of {setting} {uri.split('?')[0]} does not answer "
                           f"({exc.strerror or exc}): start it, or fix endpoint_override in {setting}") from None


def probe_writable(directory: Path) -> None:
    """Create the local ``directory`` and write and remove a file in it; OSError when that fails."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".probe-{uuid.uuid4().hex}"
    probe.write_bytes(b"ok")
    probe.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
