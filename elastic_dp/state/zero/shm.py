"""Peer snapshot slots in shared memory, for a neighbour on the same host.

A ``Segment`` is a file in ``/dev/shm`` that its owner maps and writes its snapshots into,
and that its right neighbour maps too (``elastic_dp.state.zero.snapshots`` agrees on that through
the group's store). The file's name is removed as soon as the neighbour has mapped it, so
the memory goes when the last of the two processes unmaps it or dies, SIGKILL included.
A name left by a process killed before that (a window of milliseconds) is removed by the
next segment created on the host (``sweep``: the owner's PID is in the name).

A segment's bytes: a header of int64s (a random token the neighbour checks, the slot size, and each
slot's step), then ``SLOTS`` slots of fp32. Writing a slot first marks it empty (step
-1), then fills it, then sets its step: a writer killed part-way leaves it marked empty.
Readers read only while the writer is stopped or dead (after a failure), so no lock.
The space is reserved when the file is created (``posix_fallocate``): a full ``/dev/shm``
(Docker gives 64 MB by default) refuses it there, and the snapshot is sent over the
group instead, never a SIGBUS on a later write.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Callable

import torch

DIRECTORY = "/dev/shm"
PREFIX = "elastic-dp-snapshot-"
SLOTS = 2
_HEADER = 8  # int64s: token, numel, the step of each slot, unused
ENV = "ELASTIC_DP_SHARED_SNAPSHOTS"
"""Set to 0 to send every peer snapshot over the group, even to a neighbour on the same host."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and os.path.isdir(DIRECTORY)


class Segment:
    """``SLOTS`` snapshot slots of ``numel`` fp32 elements in a mapped file."""

    def __init__(self, path: str, buffer: mmap.mmap, numel: int) -> None:
        self.path, self.numel = path, numel
        self.header = torch.frombuffer(buffer, dtype=torch.int64, count=_HEADER)
        self.steps = self.header[2:2 + SLOTS]
        self.slots = torch.frombuffer(buffer, dtype=torch.float32, offset=_HEADER * 8,
                                      count=SLOTS * numel).view(SLOTS, numel)
        # the tensors hold the mapping: it is unmapped once they are all gone

    @property
    def token(self) -> int:
        return int(self.header[0])

    @staticmethod
    def size(numel: int) -> int:
        return _HEADER * 8 + SLOTS * numel * 4

    @classmethod
    def create(cls, numel: int) -> Segment | None:
        """A new segment with empty slots; None when ``/dev/shm`` cannot hold it."""
        sweep()
        path = os.path.join(DIRECTORY, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, cls.size(numel))
            segment = cls(path, mmap.mmap(fd, cls.size(numel)), numel)
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        segment.header[0], segment.header[1] = secrets.randbits(62), numel
        segment.steps.fill_(-1)
        return segment

    @classmethod
    def open(cls, path: str, token: int, numel: int) -> Segment | None:
        """The segment another process created at ``path``; None when it is not there (the
        owner is on another host) or is not the one announced."""
        if not path.startswith(os.path.join(DIRECTORY, PREFIX)):
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != cls.size(numel):
                return None
            segment = cls(path, mmap.mmap(fd, cls.size(numel)), numel)
        except OSError:
            return None
        finally:
            os.close(fd)
        return segment if (segment.token, int(segment.header[1])) == (token, numel) else None

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def held(self) -> list[int]:
        """The steps of the slots written whole, oldest first."""
        return sorted(int(s) for s in self.steps if s >= 0)

    def slot(self, step: int) -> torch.Tensor | None:
        for i, s in enumerate(self.steps.tolist()):
            if s == step:
                return self.slots[i]
        return None

    def write(self, step: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Write snapshot ``step`` with ``fill(slot)`` over the slot of the older step (or
        an empty one); the slot."""
        steps = self.steps.tolist()
        i = min(range(SLOTS), key=lambda j: steps[j])  # -1 (empty) first
        self.steps[i] = -1
        fill(self.slots[i])
        self.steps[i] = step
        return self.slots[i]


def sweep() -> None:
    """Remove the names of segments whose creator has died (killed before its neighbour
    had mapped it)."""
    try:
        names = os.listdir(DIRECTORY)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(DIRECTORY, name))
            except OSError:
                pass
        except (ValueError, PermissionError, OSError):
            pass  # not ours, or its creator lives
