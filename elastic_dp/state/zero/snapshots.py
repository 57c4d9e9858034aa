"""Peer snapshots of a ZeRO chunk (docs/design.md, no single copy): what a rank keeps of its own chunk
and of its left neighbour's, and the transfer between them.

The neighbours are the snapshot ring's (``comm.mesh.Mesh.right``, ``left``), which alternates
hosts wherever it can, not the rank order (where a host's ranks are contiguous). Every
``snapshot_every`` committed steps a rank packs its chunk into host memory (``keep_own``)
and sends it to its right neighbour while it receives its left one's (``send``):
the transfer runs on a thread of its own while the next step trains, and is waited for
at the next snapshot, or when the coordinator asks what the rank holds (``wait``). A
received snapshot counts only once it has arrived whole (``keep_peer``). A receive from
a peer that died never completes: the group's abort makes it fail, and it is dropped.

With fp32 parameters the first ``unsent`` elements (the masters, packed first) are not
sent: the all-gather brings the left neighbour's chunk of the parameters to this rank, and
``elastic_dp.state.zero.sharded`` copies it into the received snapshot (``Exchange.masters_pending``).

A neighbour on the same host is sent nothing: the owner packs its snapshots into slots
in shared memory that the neighbour has mapped (``elastic_dp.state.zero.shm``), and they outlive the
owner's process as a received copy would. Which neighbours share memory is agreed
through the group's store whenever the snapshot's size changes (the first snapshot with
optimizer state, once per generation): each rank offers a segment, its right neighbour
maps it if it can, and says so. The same snapshot is then the owner's own and the
neighbour's peer snapshot; a node's loss takes both, as it takes a copy sent to a
neighbour on the same node. ``ELASTIC_DP_SHARED_SNAPSHOTS=0`` turns this off.

Both kinds keep the ``SNAPSHOTS_KEPT`` newest; their buffers are reused
(``shards.spare``, the segment's slots).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from elastic_dp.comm.group import CollectiveGroup
from elastic_dp.state.base import nbytes
from elastic_dp.state.zero import shm
from elastic_dp.state.zero.chunks import (
    SNAPSHOTS_KEPT,
    ChunkState,
    Snapshot,
    keep,
    pack,
    packed_numel,
    spare,
    state_keys,
)
from elastic_dp.threads import set_os_name

SNAPSHOT_WAIT_S = 5.0
"""How long ``Sharded.holdings`` waits for a peer snapshot still in flight (a healthy
peer's arrives in milliseconds; after an abort the wait fails at once)."""


@dataclass(slots=True)
class Exchange:
    """A peer snapshot on its way: ours to the right neighbour (``own``), the left one's into ``received``."""

    step: int
    own: Snapshot
    received: torch.Tensor | None
    """None: the left neighbour's snapshots are in shared memory."""
    done: Future
    """Completes when both transfers have."""
    masters_pending: bool = False
    """The left neighbour's master chunk was not sent: its fp32 masters are its chunk of the
    parameters, which the all-gather brings. It is copied out of the gathered parameters
    once they have arrived, before the next all-gather overwrites them."""


def _exchange(group: CollectiveGroup, send: torch.Tensor | None, dst: int, received: torch.Tensor | None,
              src: int) -> None:
    for work in group.exchange_async(send, dst, received, src):
        work.wait()


def _pack_into(shard: ChunkState, slot: torch.Tensor) -> None:
    if pack(shard, out=slot).flat.data_ptr() != slot.data_ptr():
        raise RuntimeError(f"a snapshot of {packed_numel(shard)} elements does not fit a slot of {slot.numel()}")


class PeerSnapshots:
    """One worker's snapshots and the one transfer in flight; ``configure`` for each
    generation (what it held is of the last one's cut and is forgotten)."""

    def __init__(self) -> None:
        self.own: list[Snapshot] = []
        self._peer: list[Snapshot] = []  # received, or given
        self.pending: Exchange | None = None
        self.group: CollectiveGroup | None = None
        self.rank, self.world_size, self.unsent = 0, 1, 0
        self.out: shm.Segment | None = None  # ours, mapped by the right neighbour
        self.into: shm.Segment | None = None  # the left neighbour's, mapped here
        self._numel = 0  # the snapshot size the neighbours last agreed on
        self._agreed = 0  # agreements this generation (their keys in the store)
        self._sender: ThreadPoolExecutor | None = None  # the transfers' thread, kept across generations

    def configure(self, group: CollectiveGroup, unsent: int, peers: bool = True) -> None:
        """Start the group's generation empty; ``unsent``: leading elements not sent;
        ``peers``: False where no snapshot goes to a neighbour (every chunk has a replica:
        ``--shard-scope host``), only the own ones are kept."""
        self.group, self.rank, self.unsent = group, group.rank, unsent
        self.world_size = group.world_size if peers else 1
        self.own, self._peer, self.pending = [], [], None
        self.out = self.into = None  # unmapped once no snapshot of them is held either
        self._numel = self._agreed = 0

    def reset(self, own: ChunkState, left: ChunkState | None) -> None:
        """Hold ``own`` and the left neighbour's chunk ``left`` (given, not received); the
        snapshots in shared memory, of another trajectory, are no longer held by anyone."""
        if self.out is not None:
            self.out.steps.fill_(-1)
        self.own, self._peer = [pack(own)], [pack(left)] if left is not None else []

    @property
    def peer(self) -> list[Snapshot]:
        """The left neighbour's snapshots held here, oldest first, the ``SNAPSHOTS_KEPT``
        newest: in its shared memory, or received (or given) before that was agreed."""
        if self.into is None:
            return self._peer
        shared = self._shared_peer()  # first: it lets go of the held ones it supersedes
        return self._peer + shared

    def _shared_peer(self) -> list[Snapshot]:
        """The left neighbour's snapshots in its shared memory; the ones held from before
        (given, or received before sharing was agreed) that they supersede are let go."""
        keys = self.own[-1].keys if self.own else ()  # the neighbour's optimizer is the same
        held = self.into.held()
        shared = [Snapshot(step, self.into.slot(step), keys) for step in held]
        self._peer = [s for s in self._peer if s.step < min(held, default=1 << 62)]
        self._peer = self._peer[max(0, len(self._peer) + len(shared) - SNAPSHOTS_KEPT):]
        return shared

    def keep_own(self, shard: ChunkState) -> Snapshot:
        """Pack ``shard`` (this rank's chunk) as the newest own snapshot: into shared memory
        when the right neighbour maps it."""
        numel = packed_numel(shard)
        if numel != self._numel and self.world_size > 1:
            self._agree(numel)
        if self.out is None:
            own = pack(shard, out=spare(self.own))
        else:
            held = self.out.held()
            replaced = set(held[:-1])  # all but the newest: the slot written next
            self.own = [s for s in self.own if s.step not in replaced]
            own = Snapshot(shard.step, self.out.write(shard.step, lambda slot: _pack_into(shard, slot)),
                           state_keys(shard))
        keep(self.own, own)
        if self.into is not None:
            self._shared_peer()  # let go of what the neighbour's shared snapshots supersede
        return own

    def _agree(self, numel: int) -> None:
        """Agree with both neighbours whether they share memory, for snapshots of ``numel``:
        offer a segment to the right one and map the left one's (a collective)."""
        group, self._agreed = self.group, self._agreed + 1
        left, right = group.mesh.left(self.rank), group.mesh.right(self.rank)
        key = f"snapshot-memory/{self._agreed}"
        out = shm.Segment.create(numel) if shm.enabled() else None
        try:
            group.share(f"{key}/offer/{self.rank}", f"{out.path} {out.token}" if out is not None else "")
            offer = group.shared(f"{key}/offer/{left}").split()
            into = shm.Segment.open(offer[0], int(offer[1]), numel) if offer else None
            group.share(f"{key}/mapped/{self.rank}", "1" if into is not None else "")
            mapped = group.shared(f"{key}/mapped/{right}") == "1"
        finally:
            if out is not None:
                out.unlink()  # mapped by the neighbour by now, or never
        self.out, self.into, self._numel = out if mapped else None, into, numel

    def send(self, own: Snapshot, device: torch.device | None = None) -> None:
        """Start sending ``own`` to the right neighbour and receiving the left one's (from
        ``device``: NCCL sends from the GPU). The last transfer must have been waited for."""
        group = self.group
        if self.out is not None and self.into is not None:
            return  # both neighbours read shared memory: nothing to send
        device = device if device is not None else own.flat.device
        send = own.flat.to(device) if self.out is None else None
        received = None
        if self.into is None:
            received = spare(self._peer)  # not held while it is overwritten
            if received is None or received.device != device or received.shape != own.flat.shape:
                received = torch.empty(own.flat.shape, dtype=own.flat.dtype, device=device)
        dst, src = group.mesh.right(self.rank), group.mesh.left(self.rank)
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-dp-snapshot",
                                              initializer=set_os_name, initargs=("edp-snapshot",))
        # the masters first, unsent if fp32
        sent = send[self.unsent:] if send is not None else None
        into = received[self.unsent:] if received is not None else None
        if group.backend == "gloo":  # gloo writes what the socket takes in the caller's thread
            done = self._sender.submit(_exchange, group, sent, dst, into, src)
        else:  # NCCL ops are ordered on the training thread's stream and queued at once
            works = group.exchange_async(sent, dst, into, src)
            done = self._sender.submit(lambda: [work.wait() for work in works])
        self.pending = Exchange(own.step, Snapshot(own.step, own.flat if send is None else send, own.keys), received, done,
                                masters_pending=self.unsent > 0 and received is not None)

    def wait(self, timeout_s: float | None = None) -> Exchange | None:
        """Take the transfer in flight once it is done (None: there is none); a failed one
        raises its error, a slow one ``TimeoutError``. Either way it is no longer pending."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.done.result(timeout=timeout_s)
        return pending

    def keep_peer(self, arrived: Exchange) -> None:
        """Hold the left neighbour's snapshot that ``arrived`` whole (its masters in)."""
        if arrived.received is not None:
            keep(self._peer, Snapshot(arrived.step, arrived.received.cpu(), arrived.own.keys))

    def drop(self) -> None:
        """Forget the transfer in flight, once its thread is done with the group (which
        the caller has aborted, so that a dead peer cannot hold it)."""
        try:
            self.wait(SNAPSHOT_WAIT_S)
        except Exception:
            pass  # aborted: dropped

    def find(self, kind: str, step: int) -> Snapshot:
        """The ``own`` or ``peer`` snapshot of ``step``."""
        snaps = {"own": self.own, "peer": self.peer}[kind]
        snap = next((s for s in snaps if s.step == step), None)
        if snap is None:
            raise ValueError(f"no {kind} snapshot of step {step} (have {[s.step for s in snaps]})")
        return snap

    def bytes_held(self) -> int:
        """Snapshot bytes in this process's memory, with the transfer in flight's buffers
        (the left neighbour's shared snapshots are in its memory)."""
        flats = [s.flat for s in self.own + self._peer]
        if self.pending is not None:  # its send is one of ``own`` unless copied to the device
            flats += [t for t in (self.pending.own.flat, self.pending.received) if t is not None]
        return nbytes({t.data_ptr(): t for t in flats}.values())

    def sizes(self) -> dict[str, int]:
        """Bytes of the newest own snapshot, and of what is sent of it."""
        if not self.own:
            return {"snapshot_bytes": 0, "snapshot_sent_bytes": 0}
        flat = self.own[-1].flat
        sent = (flat.numel() - self.unsent) * flat.element_size() if self.world_size > 1 and self.out is None else 0
        return {"snapshot_bytes": flat.numel() * flat.element_size(), "snapshot_sent_bytes": sent}
