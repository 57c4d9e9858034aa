"""Peer snapshots of a ZeRO chunk (DESIGN invariant 6): what a rank keeps of its own chunk
and of its left neighbour's, and the transfer between them.

Every ``snapshot_every`` committed steps rank ``r`` packs its chunk into host memory
(``keep_own``) and sends it to rank ``r+1`` while it receives rank ``r-1``'s (``send``):
the transfer runs on a thread of its own while the next step trains, and is waited for
at the next snapshot, or when the coordinator asks what the rank holds (``wait``). A
received snapshot counts only once it has arrived whole (``keep_peer``). A receive from
a peer that died never completes: the group's abort makes it fail, and it is dropped.

With fp32 parameters the first ``unsent`` elements (the masters, packed first) are not
sent: the all-gather brings rank ``r-1``'s chunk of the parameters to this rank, and
``elastic_dp.zero`` copies it into the received snapshot (``Exchange.masters_pending``).

Both lists keep the ``SNAPSHOTS_KEPT`` newest; their buffers are reused
(``shards.spare``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .collective import CollectiveGroup
from .shards import ShardState, Snapshot, keep, pack, spare

SNAPSHOT_WAIT_S = 5.0
"""How long ``Sharded.holdings`` waits for a peer snapshot still in flight (a healthy
peer's arrives in milliseconds; after an abort the wait fails at once)."""


@dataclass(slots=True)
class Exchange:
    """A peer snapshot on its way: ours to rank r+1 (``own``), rank r-1's into ``received``."""

    step: int
    own: Snapshot
    received: torch.Tensor
    done: Future
    """Completes when both transfers have."""
    masters_pending: bool = False
    """Rank r-1's master chunk was not sent: its fp32 masters are its chunk of the
    parameters, which the all-gather brings. It is copied out of the gathered parameters
    once they have arrived, before the next all-gather overwrites them."""


def _exchange(group: CollectiveGroup, send: torch.Tensor, dst: int, received: torch.Tensor, src: int) -> None:
    for work in group.exchange_async(send, dst, received, src):
        work.wait()


class PeerSnapshots:
    """One worker's snapshots and the one transfer in flight; ``configure`` for each
    generation (what it held is of the last one's layout and is forgotten)."""

    def __init__(self) -> None:
        self.own: list[Snapshot] = []
        self.peer: list[Snapshot] = []
        self.pending: Exchange | None = None
        self.group: CollectiveGroup | None = None
        self.rank, self.world_size, self.unsent = 0, 1, 0
        self._sender: ThreadPoolExecutor | None = None  # the transfers' thread, kept across generations

    def configure(self, group: CollectiveGroup, unsent: int) -> None:
        """Start the group's generation empty; ``unsent``: leading elements not sent."""
        self.group, self.rank, self.world_size, self.unsent = group, group.rank, group.world_size, unsent
        self.own, self.peer, self.pending = [], [], None

    def reset(self, own: ShardState, left: ShardState | None) -> None:
        """Hold ``own`` and the left neighbour's chunk ``left`` (given, not received)."""
        self.own, self.peer = [pack(own)], [pack(left)] if left is not None else []

    def keep_own(self, shard: ShardState) -> Snapshot:
        """Pack ``shard`` (this rank's chunk) as the newest own snapshot."""
        own = pack(shard, out=spare(self.own))
        keep(self.own, own)
        return own

    def send(self, own: Snapshot, device: torch.device | None = None) -> None:
        """Start sending ``own`` to the right neighbour and receiving the left one's (from
        ``device``: NCCL sends from the GPU). The last transfer must have been waited for."""
        group = self.group
        send = own.flat.to(device) if device is not None else own.flat
        received = spare(self.peer)  # not held while it is overwritten
        if received is None or received.device != send.device or received.shape != send.shape:
            received = torch.empty_like(send)
        dst, src = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-dp-snapshot")
        sent, into = send[self.unsent:], received[self.unsent:]  # the masters first, unsent if fp32
        if group.backend == "gloo":  # gloo writes what the socket takes in the caller's thread
            done = self._sender.submit(_exchange, group, sent, dst, into, src)
        else:  # NCCL ops are ordered on the training thread's stream and queued at once
            works = group.exchange_async(sent, dst, into, src)
            done = self._sender.submit(lambda: [work.wait() for work in works])
        self.pending = Exchange(own.step, Snapshot(own.step, send, own.keys), received, done,
                                masters_pending=self.unsent > 0)

    def wait(self, timeout_s: float | None = None) -> Exchange | None:
        """Take the transfer in flight once it is done (None: there is none); a failed one
        raises its error, a slow one ``TimeoutError``. Either way it is no longer pending."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.done.result(timeout=timeout_s)
        return pending

    def keep_peer(self, arrived: Exchange) -> None:
        """Hold the left neighbour's snapshot that ``arrived`` whole (its masters in)."""
        keep(self.peer, Snapshot(arrived.step, arrived.received.cpu(), arrived.own.keys))

    def drop(self) -> None:
        """Forget the transfer in flight, once its thread is done with the group (which
        the caller has aborted, so that a dead peer cannot hold it)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.done.result(timeout=SNAPSHOT_WAIT_S)
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
        return sum(s.flat.numel() * s.flat.element_size() for s in self.own + self.peer)

    def sizes(self) -> dict[str, int]:
        """Bytes of the newest own snapshot, and of what is sent of it."""
        if not self.own:
            return {"snapshot_bytes": 0, "snapshot_sent_bytes": 0}
        flat = self.own[-1].flat
        sent = (flat.numel() - self.unsent) * flat.element_size() if self.world_size > 1 else 0
        return {"snapshot_bytes": flat.numel() * flat.element_size(), "snapshot_sent_bytes": sent}
