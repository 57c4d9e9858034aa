"""The collective group: one torch.distributed process group per generation.

A ``CollectiveGroup`` is an object with a lifecycle, never a global::

    group = CollectiveGroup(backend="gloo", timeout_s=300)
    group.configure(store_host, store_port, generation=g, rank=r, world_size=n, hosts=hosts)
    work = group.all_reduce_async(tensor)   # SUM; ReduceOp.AVG is unreliable on gloo
    inside = group.subgroup("host")         # the ranks on this host: a group of their own
    ...
    group.destroy()                         # its sub-groups with it

Each generation knows its mesh (``elastic_dp.comm.mesh``: the host of every rank, the named
dimensions). A sub-group is built on demand, the first time this rank asks for it (every
rank of that sub-group must ask at the same point of its collectives, as for any
collective), on the generation's store under ``sub/<dim>/<i>/``; it belongs to the
generation: aborted with it, destroyed with it, never carried into the next.

The rendezvous keys of generation ``g`` live under the prefix ``gen{g}/`` of the
coordinator's TCPStore (docs/design.md, generations): a straggler from ``g-1`` can never join
``g``, and re-forming on the same store needs that fresh prefix anyway. The process group
is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), not through
``init_process_group``, so no default group or environment variable is involved and a
new generation is just a new object.

With one rank there is nothing to communicate: the same calls complete at once, so the
single-worker case runs the same code as any other.

gloo with CUDA tensors (workers sharing one GPU, which NCCL refuses): each call copies its
tensors to host memory, runs there, and ``wait()`` copies the result back, so the callers
use one code path for every backend and device.

gloo's reduce-scatter and all-gather are run as all-to-alls (``alltoall_base``): gloo's
own reduce-scatter all-reduces a copy of the whole input, and its all-gather copies out of
a buffer of its own; on two CPU ranks they took 2.5 and 1.6 times as long as the
all-to-all does for the same bytes (docs/zero.md). With two ranks the all-to-all sends
nothing to the rank itself, so the chunk goes straight from the caller's tensor.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Sequence

import torch
import torch.distributed as dist

from elastic_dp.comm.handles import Done, Staged, Summed, Watched, delayed_by_link, to_host
from elastic_dp.comm.mesh import Mesh
from elastic_dp.errors import CollectiveError

logger = logging.getLogger(__name__)


class CollectiveGroup:
    """A process group for one generation, with configure / abort / destroy."""

    def __init__(self, *, backend: str, timeout_s: float) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.delay_s = 0.0
        """``--inject slowlink``: the least time an all-reduce, reduce-scatter or all-gather takes."""
        self.timeout_s = timeout_s
        self.generation = -1
        self.rank = 0
        self.world_size = 0
        self.mesh = Mesh(())
        """The current generation's ranks and their hosts."""
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None
        self._calls: dist.ProcessGroup | Watched | None = None
        """Where the collectives start: gloo's group watched for an abort (``handles.Watched``),
        NCCL's itself (its abort is real)."""
        self.side = False
        """Also build the ``world`` sub-group with each generation (not on demand), for
        collectives made inside a step's forward and backward (``elastic_dp.comm.batchnorm``):
        on the main group they would interleave with the gradient buckets differently on a
        rank whose forward failed. Read when a generation's group is built."""
        self._subs: dict[str, CollectiveGroup] = {}
        """The generation's sub-groups built so far, by dimension."""
        self.label = ""
        """A sub-group's dimension and index (``host/0``), for what it logs and raises."""
        self._sockets: list[int] = []  # the gloo group's own TCP sockets, for abort()
        self._aborted = -1  # every generation up to this one is aborted
        self._lock = threading.Lock()  # configure (training thread) against abort (control thread)

    @property
    def configured(self) -> bool:
        return self.world_size > 0

    def configure(self, store_host: str, store_port: int, *, generation: int, rank: int,
                  world_size: int, hosts: Sequence[str] | None = None) -> None:
        """Join generation ``generation`` as ``rank`` of ``world_size`` (blocks until all join);
        ``hosts``: the host of every rank, in rank order (None: one host).

        Every rank first announces itself under the generation's prefix and waits until
        all have (polling, so that ``abort(generation)`` from another thread ends the wait
        with ``CollectiveError``: a peer that died before joining would otherwise hold the
        others in the process group's rendezvous until the timeout). Then the group is built.
        """
        if self.configured:
            self.destroy()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        hosts = tuple(hosts) if hosts is not None else ("",) * world_size
        if len(hosts) != world_size:
            raise ValueError(f"{len(hosts)} hosts for a generation of {world_size} ranks")
        with self._lock:
            self._check_not_aborted(generation, rank)
            self.generation, self.rank, self.world_size = generation, rank, world_size
            self.mesh = Mesh(hosts)
        if world_size == 1:
            return
        try:
            store = dist.TCPStore(store_host, store_port, is_master=False, timeout=self.timeout)
            self._store = dist.PrefixStore(f"gen{generation}/", store)
            self._arrive(generation, rank, world_size)
            self._build(rank, world_size)
            if self.side:
                self.subgroup("world")
        except BaseException:
            self._forget()
            raise
        if generation <= self._aborted:  # aborted while the group was being built
            self.abort(generation)
        logger.debug("gen %d rank %d/%d: %s group formed", generation, rank, world_size, self.backend)

    def _check_not_aborted(self, generation: int, rank: int) -> None:
        if generation <= self._aborted:
            raise CollectiveError(f"gen {generation} rank {rank}: the group was aborted while it formed",
                                  rank=rank)

    def _arrive(self, generation: int, rank: int, world_size: int) -> None:
        """Announce this rank and wait until every rank of the generation has."""
        self._store.set(f"arrived/{rank}", b"1")
        self._wait_keys([f"arrived/{r}" for r in range(world_size)], generation, rank, "not every rank joined")

    def _wait_keys(self, keys: list[str], generation: int, rank: int, what: str) -> None:
        """Poll the store until ``keys`` are set: ``abort(generation)`` from another thread
        ends the wait with CollectiveError, as the collective timeout does."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._store.check(keys):
            self._check_not_aborted(generation, rank)
            if time.monotonic() > deadline:
                raise CollectiveError(f"gen {generation} rank {rank}: {what} within the "
                                      f"collective timeout of {self.timeout.total_seconds():.0f} s", rank=rank)
            time.sleep(0.002)

    def share(self, key: str, value: str) -> None:
        """Tell the other ranks of this generation ``value`` under ``key`` (set-up between
        ranks, such as where a peer snapshot's shared memory is: ``elastic_dp.state.zero.snapshots``)."""
        self._require()
        self._store.set(key, value.encode())

    def shared(self, key: str) -> str:
        """What a rank ``share``d under ``key``, once it has (an abort ends the wait)."""
        self._require()
        self._wait_keys([key], self.generation, self.rank, f"no rank shared {key!r}")
        return self._store.get(key).decode()

    def _build(self, rank: int, world_size: int) -> None:
        if self.backend == "gloo":
            before = _socket_fds()
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)
            after = _socket_fds()
            self._sockets = [fd for fd, inode in after.items() if before.get(fd) != inode]
            generation = self.generation
            self._calls = Watched(self._pg, lambda: self._aborted >= generation, self._name())
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._pg = self._calls = dist.ProcessGroupNCCL(self._store, rank, world_size, options)

    def subgroup(self, dim: str, index: int | None = None, generation: int | None = None) -> CollectiveGroup:
        """This rank's group along the mesh's dimension ``dim`` (``mesh.DIMS``) in the current
        generation (``index``: which of ``mesh.groups(dim)``, for a rank in several; default
        the first that holds it), as a group of its own with the same calls (its ranks
        renumbered from 0 in rank order), built the first time it is asked for: every rank
        of it must ask at the same point (a rendezvous on the generation's store, which an
        abort ends). It is aborted and destroyed with this group; ``--inject slowlink`` does
        not delay it. ``generation``: the one the caller means; another (the group moved on
        meanwhile) raises ``CollectiveError`` instead of building the new generation's."""
        self._require()
        if generation is not None and generation != self.generation:
            raise CollectiveError(f"a sub-group of generation {generation} asked for in generation "
                                  f"{self.generation}", rank=self.rank)
        index = self.mesh.index(dim, self.rank) if index is None else index
        key = f"{dim}/{index}"
        with self._lock:
            sub = self._subs.get(key)
        if sub is not None:
            return sub
        ranks = self.mesh.groups(dim)[index]
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in the {dim} group {index} {ranks}")
        sub = CollectiveGroup(backend=self.backend, timeout_s=self.timeout_s)
        sub.generation, sub.rank, sub.world_size = self.generation, ranks.index(self.rank), len(ranks)
        sub.label = key
        sub.mesh = Mesh(tuple(self.mesh.hosts[r] for r in ranks))
        with self._lock:
            self._check_not_aborted(self.generation, self.rank)
            sub._aborted = self._aborted
            self._subs[key] = sub  # an abort from now on reaches it
        if len(ranks) > 1:
            try:
                sub._store = dist.PrefixStore(f"sub/{key}/", self._store)
                sub._arrive(self.generation, sub.rank, sub.world_size)
                sub._build(sub.rank, sub.world_size)
            except BaseException:  # not built: the next ask tries again, or meets the abort
                with self._lock:
                    self._subs.pop(key, None)
                sub._forget()
                raise
            if self.generation <= self._aborted:  # aborted while it was being built
                sub.abort(self.generation)
        return sub

    def _require(self) -> dist.ProcessGroup | Watched | None:
        if not self.configured:
            raise RuntimeError("the collective group is not configured")
        return self._calls

    def _staging(self, tensor: torch.Tensor) -> bool:
        return self.backend == "gloo" and tensor.is_cuda

    @delayed_by_link
    def all_reduce_async(self, tensor: torch.Tensor):
        """Start a SUM all-reduce of ``tensor`` in place; returns a handle with ``wait()``."""
        pg = self._require()
        if pg is None:
            return Done()
        if self._staging(tensor):
            host = to_host(tensor)
            return Staged(pg.allreduce([host]), [(tensor, host)])
        return pg.allreduce([tensor])

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduce_async(tensor).wait()
        return tensor

    def side_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """A SUM all-reduce of ``tensor`` in place on the ``world`` sub-group, built with the
        generation (``side``), waited for."""
        self._require()
        if self.world_size == 1:
            return tensor
        with self._lock:
            side = self._subs.get("world/0")
        if side is None:
            raise RuntimeError("the collective group was built without its side group (CollectiveGroup.side)")
        return side.all_reduce(tensor)

    @delayed_by_link
    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor):
        """Start a SUM reduce-scatter: ``output`` gets this rank's chunk of the sum of ``input``.

        ``input`` has ``world_size`` times the elements of ``output``; rank r receives
        elements ``[r * n, (r + 1) * n)``. ``output`` may be that chunk of ``input``.

        On gloo it is an all-to-all (rank j is sent chunk j) whose ``wait()`` sums the
        chunks received, in rank order: gloo's own reduce-scatter all-reduces a copy of the
        whole input, twice the bytes and 2.5 times the time (docs/zero.md). With two ranks
        only the other rank's chunk is sent, straight from ``input``, and this rank's own
        chunk is added where it is, not copied to itself first.
        """
        pg = self._require()
        if pg is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Done()
        if self.backend == "gloo":
            source = (to_host(input) if self._staging(input) else input).reshape(-1)
            n = output.numel()
            if self.world_size == 2:  # the other rank's chunk is sent as it is; this rank's stays
                other = 1 - self.rank
                received = torch.empty(n, dtype=source.dtype)
                sizes = [n, 0] if other == 0 else [0, n]
                work = pg.alltoall_base(received, source[other * n:(other + 1) * n], sizes, sizes,
                                        dist.AllToAllOptions())
                own = source[self.rank * n:(self.rank + 1) * n]
                return Summed(work, [received, own] if other == 0 else [own, received], output)
            received = torch.empty((self.world_size, n), dtype=source.dtype)
            work = pg.alltoall_base(received.view(-1), source, [], [], dist.AllToAllOptions())
            return Summed(work, list(received), output)
        return pg._reduce_scatter_base(output, input)

    @delayed_by_link
    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor):
        """Start an all-gather: ``output`` gets every rank's ``input``, in rank order.

        ``input`` may be this rank's own chunk of ``output`` (gathering in place).

        On gloo it is an all-to-all that sends every rank a copy of ``input`` and receives
        straight into ``output``: gloo's own all-gather receives into a buffer of its own
        and copies out of it, which takes 1.6 times as long (docs/zero.md). With two ranks
        nothing is copied: ``input`` itself is sent to the other rank, whose chunk is
        received in place (an all-to-all with nothing for itself).
        """
        pg = self._require()
        if pg is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Done()
        if self.backend == "gloo":
            n = input.numel()
            if self.world_size == 2:  # the chunk is sent as it is, and the other's received in place
                other, flat = 1 - self.rank, output.view(-1)
                mine, theirs = flat[self.rank * n:(self.rank + 1) * n], flat[other * n:(other + 1) * n]
                if mine.data_ptr() != input.data_ptr():
                    mine.copy_(input.reshape(-1))
                send = to_host(input) if self._staging(input) else input
                target = torch.empty(n, dtype=output.dtype) if self._staging(output) else theirs
                sizes = [n, 0] if other == 0 else [0, n]
                work = pg.alltoall_base(target, send.reshape(-1), sizes, sizes, dist.AllToAllOptions())
                return Staged(work, [(theirs, target)] if target is not theirs else [], keep=send)
            send = torch.empty((self.world_size, n), dtype=input.dtype)
            send.copy_(input.reshape(1, -1).expand(self.world_size, -1))  # from the GPU too, if there
            target = torch.empty(output.shape, dtype=output.dtype) if self._staging(output) else output
            work = pg.alltoall_base(target.view(-1), send.view(-1), [], [], dist.AllToAllOptions())
            return Staged(work, [(output, target)] if target is not output else [], keep=send)
        return pg._allgather_base(output, input)

    def all_to_all_async(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                         input_splits: list[int]):
        """Start an all-to-all of flat tensors: rank j receives ``input``'s ``j``-th run of
        ``input_splits[j]`` elements, and ``output`` gets every rank's run for this rank in
        rank order, ``output_splits[j]`` elements from rank ``j`` (uneven runs allowed).
        Not delayed by ``--inject slowlink`` (the hierarchical all-reduce's steps use it)."""
        pg = self._require()
        if pg is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Done()
        if self._staging(input) or self._staging(output):
            send = to_host(input)
            target = torch.empty(output.shape, dtype=output.dtype)
            work = pg.alltoall_base(target, send, output_splits, input_splits, dist.AllToAllOptions())
            return Staged(work, [(output, target)], keep=send)
        return pg.alltoall_base(output, input, output_splits, input_splits, dist.AllToAllOptions())

    def exchange_async(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> list:
        """Start sending ``send`` to rank ``dst`` and receiving rank ``src``'s tensor into
        ``recv`` (either may be None: that half is left out); their handles. ``send`` must
        not change until they are waited for."""
        pg = self._require()
        if pg is None:
            if send is not None and recv is not None:
                recv.copy_(send)
            return [Done()]
        works = []
        if send is not None:
            works.append(Staged(pg.send([to_host(send)], dst, 0), []) if self._staging(send)
                         else pg.send([send], dst, 0))
        if recv is not None:
            if self._staging(recv):
                host = torch.empty(recv.shape, dtype=recv.dtype)
                works.append(Staged(pg.recv([host], src, 0), [(recv, host)]))
            else:
                works.append(pg.recv([recv], src, 0))
        return works

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        pg = self._require()
        if pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            if self._staging(tensor):
                host = to_host(tensor)
                Staged(pg.broadcast([host], opts), [(tensor, host)]).wait()
            else:
                pg.broadcast([tensor], opts).wait()
        return tensor

    def abort(self, generation: int | None = None) -> None:
        """Make every collective blocked on this group raise, on this rank, now.

        ``generation`` (default: the current one) and every earlier one are aborted: a
        group of a later generation is left alone (a late abort cannot hit the next
        group), and one still forming gives up its rendezvous (``configure`` raises).

        Safe to call from another thread while the training thread is blocked in a
        collective; the group is unusable afterwards (``destroy()`` it once the blocked
        collective has returned). NCCL has a real abort. gloo has none that releases a
        blocked rank (docs/elastic.md), so the group's connected TCP sockets are shut
        down, which makes the blocked call raise in a few ms. Its listening socket is left
        alone: shutting that one down aborts the process.
        """
        with self._lock:
            generation = self.generation if generation is None else generation
            self._aborted = max(self._aborted, generation)
            if generation < self.generation:
                return
            subs = list(self._subs.values())
            if self._pg is None and not subs:
                return
            pg, sockets = self._pg, list(self._sockets)
        for sub in subs:
            sub.abort(generation)
        if pg is None:
            return
        if self.backend == "nccl":
            pg.abort()
            return
        for fd in sockets:
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue  # already closed
            try:
                if (sock.family in (socket.AF_INET, socket.AF_INET6)
                        and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            finally:
                sock.close()  # closes the duplicate only

    def destroy(self) -> None:
        """Let the group and its sub-groups go (after an abort, too); returns at once.

        The process group itself is dropped on a thread of its own (``_release``): a gloo
        group's teardown joins its threads, and a thread still running a collective finishes
        it first. An abort makes those raise within milliseconds; one it did not reach (a
        peer that neither answers nor closes) would hold the caller, the next generation's
        forming, until the collective timeout, so the caller does not wait for it (logged
        where it took over a second; ``wait_released`` waits)."""
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.destroy()
        if self.backend == "nccl" and self._pg is not None:
            self._pg.shutdown()
        held = [self._pg] if self._pg is not None else []
        what = self._name()
        self._forget()
        if held:
            _release(held, what)

    def _name(self) -> str:
        """``gen G rank R/N``, and which sub-group (its own rank and size)."""
        return f"gen {self.generation} rank {self.rank}/{self.world_size}" + (
            f" of the {self.label} sub-group" if self.label else "")

    def _forget(self) -> None:
        self._pg = self._calls = None
        self._subs = {}
        self._store = None
        self._sockets = []
        self.world_size = 0


_releasing: set[threading.Thread] = set()
_releasing_lock = threading.Lock()
SLOW_RELEASE_S = 1.0
"""A group's teardown that took longer than this is logged: some collective of it was in
flight, and no abort had released it."""


def _release(held: list[dist.ProcessGroup], what: str) -> None:
    """Drop the process group in ``held`` (its only reference) on a daemon thread: for gloo,
    the last reference closes its sockets and joins its threads."""

    def drop() -> None:
        start = time.monotonic()
        held.clear()
        took = time.monotonic() - start
        if took > SLOW_RELEASE_S:
            logger.warning("%s: the old group's teardown waited %.1f s for a collective still in flight "
                           "(no abort reached it)", what, took)

    thread = threading.Thread(target=drop, name="elastic-dp-release", daemon=True)
    with _releasing_lock:
        _releasing.difference_update([t for t in _releasing if not t.is_alive()])
        _releasing.add(thread)
    thread.start()


def wait_released(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the groups being let go (``CollectiveGroup.destroy``) to be
    released: their sockets closed and threads joined. Whether all were."""
    deadline = time.monotonic() + timeout_s
    with _releasing_lock:
        threads = list(_releasing)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _releasing_lock:
        _releasing.difference_update([t for t in threads if not t.is_alive()])
        return not _releasing


def _socket_fds() -> dict[int, str]:
    """This process's socket file descriptors and their inodes."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found
