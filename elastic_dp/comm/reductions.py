"""Reductions: how a flat tensor of gradients crosses the ranks, as a plug-in.

The bucketed reducer (``elastic_dp.comm.reducer``) owns the buckets, the backward hooks
and the order of launches; what each bucket's collective is, it asks of its
``Reduction`` (the shape of DDP's communication hooks: a bucket in, a handle out). A mode
that reduces a tensor of its own goes through the same interface (DiLoCo's pseudo-gradient,
``modes.diloco.program``). These are built in:

- ``AllReduce``: every rank receives the SUM of the tensor (ZeRO stage 0, DiLoCo's outer
  step); with ``wire_dtype`` the tensor crosses in that dtype (DiLoCo's ``--outer-reduce
  bf16``: half the bytes, the sum rounded) and the result is copied back into it.
- ``ReduceScatter``: each rank receives its chunk of the SUM (ZeRO stages 1 to 3); with
  ``--shard-scope host`` (HSDP) its block's chunk, reduce-scattered inside the block and
  all-reduced among the chunk's replicas on the other hosts.
- ``PowerSGD`` (``elastic_dp.comm.compression``, ``--compress powersgd``): every rank receives
  a low-rank approximation of the SUM of each gradient matrix, with error feedback.
- ``Hierarchical``: every rank receives the SUM, in three steps that keep most bytes inside
  the hosts (``--all-reduce hierarchical``, docs/hosts.md): a reduce-scatter among the ranks
  of each host, an all-reduce of each piece among its owners on the other hosts, an
  all-gather inside each host. Where the generation does not span hosts with more than one
  rank on some host, it is the flat ``AllReduce`` (unless forced).

A reduction says whether its result is the plain SUM of what every rank sent (``sums``):
then the commit vote rides the tail of the last bucket's collective, costing no collective
of its own; a reduction whose result is not a plain sum (a compressor) has the vote cast on
a channel of its own (``elastic_dp.comm.vote.Ballot.send``).

A reduction may keep state between steps (a compressor's error feedback): it declares it
as ``ModelBuffers`` declares the model's buffers (``state``, ``load_state``). The step saves
it before the vote and restores it when the step does not commit (``save``, ``restore``);
each new generation re-cuts it (``resize``); each rank's checkpoint part holds its own as a
row of ``reduction/<key>`` (one row a rank), which a resumed run hands back to it whole
(``load_rows``: at the saved world size each rank takes its own row). The built-in ones
keep none.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, ClassVar

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.comm.handles import Summed
from elastic_dp.errors import CollectiveError
from elastic_dp.threads import set_os_name


class Reduction:
    """One bucket's collective over the ranks (a subclass per way of reducing)."""

    name: ClassVar[str]
    sums: ClassVar[bool] = True
    """The result is the plain SUM of what every rank sent, so a tensor appended to the
    bucket (the commit vote) is summed with it."""

    def __init__(self, group: CollectiveGroup) -> None:
        self.group = group
        self._generation: int | None = None  # the generation the state is cut for

    def _check(self, generation: int) -> None:
        """A launch of ``generation`` run later, on a reduction's own thread: where the group
        has moved on, ``CollectiveError`` instead of meeting the next generation's collectives."""
        if self.group.generation != generation:
            raise CollectiveError(f"a bucket launched in generation {generation} met generation "
                                  f"{self.group.generation}", rank=self.group.rank)

    def follow(self) -> None:
        """Before a step: where the group is of another generation than the state was cut
        for, re-cut it (``resize``). A reduction lives as long as its strategy, across
        generations, and is told of each one here."""
        if self._generation != self.group.generation:
            self._generation = self.group.generation
            self.resize(self.group.world_size)

    def bind(self, buckets: list[Any]) -> None:
        """The buckets this reduction will be launched on (``comm.reducer.Bucket``: their
        parameters and where each starts), for one that reduces each parameter by its shape
        (``comm.compression.PowerSGD``); the built-in ones reduce a bucket as a flat tensor."""

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        """Start reducing bucket ``index``'s flat ``tensor`` (``out``: where this rank's
        chunk of the result goes, for a scattering reduction); a handle with ``wait()``."""
        raise NotImplementedError

    def cast(self, ballot: Any, carried: bool) -> tuple[Any, Any]:
        """Right after the last bucket's launch: start the vote on its own channel (unless
        the last bucket ``carried`` it) and the ballot's payload, each as (the handle, the
        sum once waited for), or None. A reduction whose collectives run on a thread of its
        own may start them there, after its own (``compression.PowerSGD``: after the copies
        of its errors, so that a step counts only where every copy arrived)."""
        return None if carried else ballot.send(self.group), ballot.send_payload(self.group)

    @property
    def parts(self) -> int:
        """How many chunks a scattering reduction cuts a bucket into (its buckets are padded
        to a multiple of it); one a rank unless it says otherwise."""
        return self.group.world_size

    @property
    def part(self) -> int:
        """Which of ``parts`` this rank receives."""
        return self.group.rank

    def wire_bytes(self, tensor: torch.Tensor) -> int:
        """The bytes of ``tensor`` as this reduction sends them (before the collective's own
        algorithm multiplies them)."""
        return tensor.numel() * tensor.element_size()

    # -- state between steps (none for the built-in ones) ---------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """This rank's state, by name (saved in its checkpoint part)."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (as ``state`` returned it; empty: start fresh)."""

    def begin(self, step: int) -> None:
        """Step ``step`` begins (called before ``save``): for a reduction whose state must be
        known by step (``feedback.ErrorFeedback.rewind``)."""

    def save(self) -> None:
        """Before a step: keep the state to go back to if the step does not commit."""

    def restore(self) -> None:
        """The step did not commit: back to the state ``save`` kept."""

    def resize(self, world_size: int) -> None:
        """A new generation of ``world_size`` ranks: re-cut the state for it."""

    def holdings(self) -> dict[str, Any]:
        """What a re-formation must know of this rank's state of the reduction, beside the
        model's (a compressor's errors and who holds their copies: ``PowerSGD.holdings``);
        the built-in ones keep nothing of their own."""
        return {}

    def load_rows(self, rows: dict[str, torch.Tensor], rank: int, world_size: int) -> None:
        """From a checkpoint: ``rows[key]`` holds every saved rank's ``state()[key]``, one
        row a rank (none: the checkpoint has no state of a reduction). At the saved world
        size rank ``rank`` takes its own row; at another the state starts fresh (a reduction
        whose state must outlive a change of world size re-cuts the rows here instead)."""
        if rows and all(v.shape[0] == world_size for v in rows.values()):
            self.load_state({k: v[rank].clone() for k, v in rows.items()})
        else:
            self.load_state({})


class _CopiedBack:
    """A collective on a copy of a tensor in another dtype: ``wait()`` copies the result back."""

    def __init__(self, work: Any, sent: torch.Tensor, into: torch.Tensor) -> None:
        self.work, self.sent, self.into = work, sent, into

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            self.into.copy_(self.sent)
            self.work = self.sent = None
        return True


class AllReduce(Reduction):
    """Every rank receives the SUM, in place (``wire_dtype``: sent in that dtype, the sum
    rounded to it, then copied back)."""

    name = "allreduce"

    def __init__(self, group: CollectiveGroup, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(group)
        self.wire_dtype = wire_dtype

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if out is not None:
            raise ValueError("an all-reduce leaves its result in place: it takes no out")
        if self.wire_dtype is None or tensor.dtype == self.wire_dtype:
            return self.group.all_reduce_async(tensor)
        sent = tensor.to(self.wire_dtype)
        return _CopiedBack(self.group.all_reduce_async(sent), sent, tensor)

    def wire_bytes(self, tensor: torch.Tensor) -> int:
        dtype = self.wire_dtype or tensor.dtype
        return tensor.numel() * torch.empty((), dtype=dtype).element_size()


class ReduceScatter(Reduction):
    """Each rank receives its chunk of the SUM into ``out`` (which may be its own chunk of
    the tensor: in place).

    ``scope``: over which ranks the bucket is cut (ZeRO's ``--shard-scope``): ``all``, one
    chunk a rank; ``host`` (HSDP), one chunk a rank of a block (``comm.mesh``: the ranks of a
    ``shard`` group, inside one host), which every block holds a copy of. Then the bucket is
    reduce-scattered inside the rank's block, on the calling thread (in the order of the
    parameter all-gathers that share that group), and the chunk is all-reduced among its
    replicas (the rank's ``replica`` group, the only bytes that cross the hosts' links) on a
    thread of the reduction's own, in launch order, while backward goes on. The sum is the
    flat one up to float order (each block's first, then theirs).
    """

    name = "reducescatter"

    def __init__(self, group: CollectiveGroup, scope: str = "all") -> None:
        super().__init__(group)
        self.scope = scope
        self._thread = ReductionThread("edp-replicas", lambda: self.group.generation)

    @property
    def parts(self) -> int:
        return self.group.mesh.shards(self.scope)

    @property
    def part(self) -> int:
        return self.group.mesh.shard_of(self.group.rank, self.scope)

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if out is None:
            raise ValueError("a reduce-scatter needs out, this rank's chunk")
        group = self.group
        if self.parts == group.world_size:
            return group.reduce_scatter_async(out, tensor)
        work = group.subgroup("shard").reduce_scatter_async(out, tensor)
        return self._thread.submit(self._across, work, out, group.generation)

    def _across(self, work: Any, out: torch.Tensor, generation: int) -> None:
        work.wait()
        self.group.subgroup("replica", generation=generation).all_reduce_async(out).wait()


class ReductionThread:
    """A thread of a reduction's own, started on first use, that runs the steps of each
    launch one after another, in launch order.

    One thread a generation (``generation``: the group's current one, read at each launch):
    the first launch of a new generation starts a new thread, and the old one ends once its
    queue is done (its launches raise there, their generation gone). A collective of the
    old generation that no abort reached would otherwise hold every launch of the new one
    behind it until the collective timeout."""

    def __init__(self, name: str, generation: Callable[[], int]) -> None:
        self.name = name
        self.generation = generation
        self._pool: ThreadPoolExecutor | None = None
        self._generation: int | None = None  # the generation the thread runs launches of
        self._lock = threading.Lock()

    def submit(self, fn: Any, *args: Any) -> _Chained:
        """Run ``fn(*args)`` after the launches of this generation before it."""
        generation = self.generation()
        with self._lock:
            if self._pool is not None and self._generation != generation:
                self._pool.shutdown(wait=False)
                self._pool = None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"elastic-dp-{self.name}",
                                                initializer=set_os_name, initargs=(self.name,))
                self._generation = generation
            return _Chained(self._pool.submit(fn, *args))


class _Chained:
    """A reduction run as several collectives one after another on the reduction's thread:
    ``wait()`` waits for the last, and raises what any of them raised."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.future.result(None if timeout is None else timeout.total_seconds())
        return True


class Hierarchical(Reduction):
    """Every rank receives the SUM, reduced inside each host first (``comm.mesh``: hosts, pieces).

    A bucket of ``n`` elements is cut into ``mesh.pieces`` pieces (one per rank of the
    largest host). On each host, every rank sends each of its peers the pieces that peer
    owns and sums what it receives for its own (an all-to-all: on a host with fewer ranks
    than pieces, a rank owns a contiguous block of several); each piece is all-reduced among
    its owners, one on every host (the ``across`` groups: the only bytes that cross the
    hosts' links, 2(H-1)/H of the bucket per host on a ring of H hosts, whatever the hosts'
    sizes); then each rank sends its summed pieces to its host's peers (an all-to-all into
    the bucket itself).

    The steps of one bucket run one after another on a thread of the reduction's own, and
    the buckets in launch order, so every rank issues the same collectives on each sub-group
    in the same order, while the training thread goes on with backward. A bucket launched in
    one generation and run after the group moved on raises ``CollectiveError`` instead of
    meeting the next generation's sub-groups (its sub-groups are asked for by generation).
    The sum is the flat one up to float order (each host's sum first, in rank order, then
    theirs).

    ``always``: reduce this way on any mesh (``--all-reduce hierarchical``); otherwise only
    where the mesh spans more than one host and some host holds more than one rank
    (``Mesh.spans_hosts``), else as ``AllReduce``.
    """

    name = "hierarchical"

    def __init__(self, group: CollectiveGroup, *, always: bool = False) -> None:
        super().__init__(group)
        self.always = always
        self._thread = ReductionThread("edp-hierarchy", lambda: self.group.generation)

    def active(self) -> bool:
        """Whether this generation reduces hierarchically (else flat)."""
        return self.group.world_size > 1 and (self.always or self.group.mesh.spans_hosts())

    def launch(self, index: int, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        if out is not None:
            raise ValueError("an all-reduce leaves its result in place: it takes no out")
        if not self.active():
            return self.group.all_reduce_async(tensor)
        return self._thread.submit(self._reduce, tensor, self.group.generation)

    def _reduce(self, tensor: torch.Tensor, generation: int) -> None:
        self._check(generation)
        reduce_in_hosts(self.group, tensor.view(-1), generation,
                        lambda i, across, piece: across.all_reduce_async(piece))


def reduce_in_hosts(group: CollectiveGroup, flat: torch.Tensor, generation: int,
                    across: Callable[[int, CollectiveGroup, torch.Tensor], Any]) -> None:
    """``flat`` (a rank's bucket) reduced in three steps (``Hierarchical``): its pieces summed
    inside the host, each piece the rank owns reduced across the hosts by ``across(i,
    group, piece)`` (which reduces ``piece`` in place over the ``across`` group of piece ``i``,
    one rank a host, and returns a handle to wait for, or None once done), and the pieces
    gathered inside the host."""
    mesh, rank = group.mesh, group.rank
    n, pieces = flat.numel(), mesh.pieces
    bounds = [i * n // pieces for i in range(pieces + 1)]
    peers = mesh.on_host(mesh.hosts[rank])
    spans = [mesh.owned(r) for r in peers]  # each peer's pieces, in local rank order
    sizes = [bounds[s[-1] + 1] - bounds[s[0]] for s in spans]
    mine = spans[peers.index(rank)]
    lo, hi = bounds[mine[0]], bounds[mine[-1] + 1]
    own = flat[lo:hi]
    inside = group.subgroup("host", generation=generation)
    if len(peers) > 1:  # every peer's copy of this rank's pieces, summed in rank order
        received = torch.empty(len(peers) * own.numel(), dtype=flat.dtype, device=flat.device)
        work = inside.all_to_all_async(received, flat, [own.numel()] * len(peers), sizes)
        Summed(work, list(received.view(len(peers), -1)), own).wait()
    works = [across(i, group.subgroup("across", i, generation), flat[bounds[i]:bounds[i + 1]])
             for i in mine if bounds[i + 1] > bounds[i]]
    for work in works:
        if work is not None:
            work.wait()
    if len(peers) > 1:  # this rank's summed pieces to every peer, every peer's into the bucket
        sent = own.repeat(len(peers))
        inside.all_to_all_async(flat, sent, sizes, [own.numel()] * len(peers)).wait()


def piece_bounds(group: CollectiveGroup, numel: int) -> list[int]:
    """Where ``reduce_in_hosts`` cuts a bucket of ``numel`` elements into pieces."""
    pieces = group.mesh.pieces
    return [i * numel // pieces for i in range(pieces + 1)]


def all_reduce(group: CollectiveGroup, choice: str | None) -> Reduction:
    """The gradient all-reduce ``--all-reduce`` chooses (``comm.settings.Buckets.all_reduce``):
    ``flat``, ``hierarchical``, or by the mesh of each generation (None)."""
    if choice == "flat":
        return AllReduce(group)
    return Hierarchical(group, always=choice == "hierarchical")
