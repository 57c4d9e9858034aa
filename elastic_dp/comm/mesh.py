"""A generation's mesh: where each rank runs, its named dimensions, and the rank order.

Every worker receives, with its rank, the host (the Ray node) of every rank of the
generation (``CollectiveGroup.configure(..., hosts=...)``), so each can tell, without
another round trip, which ranks share its host. From that the mesh names the groups a
collective can run over:

    world    every rank (a second process group beside the generation's main one)
    host     the ranks on this rank's host (the fast link inside a node)
    across   per piece of a hierarchical all-reduce, its owner on every host (the slow link
             between nodes: the all-reduce reduces inside each host, then across)
    shard    a block of ``block`` ranks inside one host, which shards ZeRO's state among
             itself under ``--shard-scope host`` (HSDP)
    replica  the ranks of one index in every block: the copies of one chunk of that state

``CollectiveGroup.subgroup(dim, index)`` builds a group of a dimension on demand, on the
generation's rendezvous store; it is aborted and destroyed with the generation.

The rank order of a generation is decided here, once (``rank_order``): the ranks of one host
are contiguous, the hosts in the order the membership policy lists their first member, and
a host's ranks in the policy's order; a joiner takes its place beside its host's ranks, not
at the end. A ring over the ranks then crosses each host boundary once. Across a
re-formation of the synchronous mode a joiner takes the rank of one of its host's ranks
that left, and the others keep theirs.

Where a rank copies its ZeRO chunk to a peer (peer snapshots), the peer is its right
neighbour in the snapshot ring (``right``, ``left``), which is not the rank order: the ring
alternates hosts wherever the hosts allow, so that losing a host keeps a copy of every chunk.

A hierarchical all-reduce (``comm.reductions.Hierarchical``) cuts a tensor into
``pieces`` pieces, one per rank of the largest host; on each host the pieces are dealt out
in contiguous blocks to its ranks (``owner``: with as many ranks as pieces, one each; with
fewer, some rank owns several), and the ``across`` group of piece ``i`` is its owner on
every host. On hosts of equal size a rank owns one piece and ``across`` pairs the ranks of
one local index.

ZeRO under ``--shard-scope host`` (HSDP) cuts its state into ``block`` chunks, the largest
number that divides every host's count of ranks: each host's ranks form blocks of that
size (``shard`` groups), each block holds one whole copy of the state, and the ranks of one
index in every block (a ``replica`` group) hold the same chunk. On hosts of equal size a
block is a host; on hosts of 2 and 1 ranks it is one rank (every rank a whole copy). On
one host there is one block of every rank: the same cut as ``--shard-scope all``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

DIMS = ("world", "host", "across", "shard", "replica")
"""The mesh's named dimensions (``Mesh.group``)."""


@dataclass(frozen=True, slots=True)
class Mesh:
    """The ranks of one generation and the host each runs on."""

    hosts: tuple[str, ...]
    """The host of each rank, in rank order (an empty name: not known, one host)."""

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def host_names(self) -> tuple[str, ...]:
        """The hosts, in the order of their first rank."""
        return tuple(dict.fromkeys(self.hosts))

    def on_host(self, host: str) -> tuple[int, ...]:
        """The ranks on ``host``, in rank order."""
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    def local_rank(self, rank: int) -> int:
        """``rank``'s index among the ranks on its host."""
        return self.on_host(self.hosts[rank]).index(rank)

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """The groups of ranks along ``dim``, each in rank order (every rank in one of them;
        ``across``: one per local index, over the hosts that have that many ranks)."""
        if dim == "world":
            return [tuple(range(self.world_size))]
        if dim == "host":
            return [self.on_host(h) for h in self.host_names]
        if dim == "across":
            return [tuple(self.owner(h, i) for h in self.host_names) for i in range(self.pieces)]
        if dim == "shard":
            return [ranks[i:i + self.block] for h in self.host_names
                    for ranks in [self.on_host(h)] for i in range(0, len(ranks), self.block)]
        if dim == "replica":
            return [tuple(sorted(block[i] for block in self.groups("shard"))) for i in range(self.block)]
        raise ValueError(f"the mesh has the dimensions {', '.join(DIMS)}, not {dim!r}")

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim`` (the first, where it is in several)."""
        return self.groups(dim)[self.index(dim, rank)]

    def index(self, dim: str, rank: int) -> int:
        """Which of ``groups(dim)`` holds ``rank`` (the group's name on the store; the
        first, where it is in several)."""
        return self.indices(dim, rank)[0]

    def indices(self, dim: str, rank: int) -> list[int]:
        """Every one of ``groups(dim)`` that holds ``rank``."""
        return [i for i, g in enumerate(self.groups(dim)) if rank in g]

    # -- the hierarchical all-reduce's pieces -----------------------------------------------------
    @property
    def pieces(self) -> int:
        """How many pieces a hierarchical all-reduce cuts a tensor into: the ranks of the
        largest host."""
        return max((len(self.on_host(h)) for h in self.host_names), default=1)

    def owner(self, host: str, piece: int) -> int:
        """The rank on ``host`` that owns ``piece`` (contiguous blocks of pieces per rank)."""
        ranks = self.on_host(host)
        return ranks[piece * len(ranks) // self.pieces]

    def owned(self, rank: int) -> range:
        """The pieces ``rank`` owns (contiguous)."""
        host = self.hosts[rank]
        mine = [i for i in range(self.pieces) if self.owner(host, i) == rank]
        return range(mine[0], mine[-1] + 1)

    def spans_hosts(self) -> bool:
        """More than one host, and some host holds more than one rank: where a hierarchical
        all-reduce sends fewer bytes over the hosts' links than a flat ring."""
        return len(self.host_names) > 1 and self.pieces > 1

    # -- HSDP's blocks -----------------------------------------------------------------------------
    @property
    def block(self) -> int:
        """The ranks of one ``shard`` group: the largest number that divides every host's
        count of ranks (on one host, all of them)."""
        return math.gcd(*(len(self.on_host(h)) for h in self.host_names)) if self.hosts else 1

    def shards(self, scope: str) -> int:
        """How many chunks ZeRO cuts its state into under ``--shard-scope scope``: every
        rank's (``all``) or a block's (``host``)."""
        return self.world_size if scope == "all" else self.block

    def shard_of(self, rank: int, scope: str) -> int:
        """The chunk ``rank`` holds under ``--shard-scope scope``."""
        return rank if scope == "all" else self.local_rank(rank) % self.block

    # -- the snapshot ring ----------------------------------------------------------------------
    @property
    def ring(self) -> tuple[int, ...]:
        """The ranks in snapshot-ring order: each rank's right neighbour (the next, cyclically)
        keeps its peer snapshot, on another host wherever the hosts allow."""
        return tuple(_spread(list(range(self.world_size)), lambda r: self.hosts[r]))

    def right(self, rank: int) -> int:
        """The rank that keeps ``rank``'s peer snapshot."""
        ring = self.ring
        return ring[(ring.index(rank) + 1) % len(ring)]

    def left(self, rank: int) -> int:
        """The rank whose peer snapshot ``rank`` keeps."""
        ring = self.ring
        return ring[(ring.index(rank) - 1) % len(ring)]

    def near_ring(self, rank: int) -> tuple[int, ...]:
        """The ring of copies that stay near ``rank`` (a compressor's errors, which are copied
        every step: docs/compression.md): the ranks of its host, where it has others; else
        the ranks that are alone on their hosts, one ring over those hosts (only one: itself)."""
        host = self.on_host(self.hosts[rank])
        if len(host) > 1:
            return host
        return tuple(r for r in range(self.world_size) if len(self.on_host(self.hosts[r])) == 1)

    def near_right(self, rank: int) -> int:
        """The rank that keeps ``rank``'s near copy (itself: none does)."""
        ring = self.near_ring(rank)
        return ring[(ring.index(rank) + 1) % len(ring)]

    def near_left(self, rank: int) -> int:
        """The rank whose near copy ``rank`` keeps (itself: none)."""
        ring = self.near_ring(rank)
        return ring[(ring.index(rank) - 1) % len(ring)]


def rank_order(members: Sequence[Any], host_of: Callable[[Any], str], previous: Sequence[Any] = ()) -> list[Any]:
    """A generation's rank order over ``members`` (given in the membership policy's order):
    each host's members contiguous, the hosts in the order of their first member.

    With ``previous``, the last generation's rank order, the hosts that were in it keep
    their order there (new hosts after them), a host's members who were in it keep their
    order, and a joiner takes the place of one of its host's ranks that left, where one
    did (the first such place first), else its place after its host's ranks. A worker that
    replaces a lost or leaving one on the same host (a promoted spare) then takes its rank,
    and every other rank keeps its own: under ZeRO each keeps the chunk it holds, and only
    the lost chunk moves."""
    by_host = _by_host(members, host_of)
    if not previous:
        return [m for group in by_host.values() for m in group]
    was, kept = set(previous), {}
    for host in [*_by_host(previous, host_of), *by_host]:
        if host not in by_host or host in kept:
            continue
        group = by_host[host]
        joiners, present, order = [m for m in group if m not in was], set(group), []
        for m in previous:
            if host_of(m) != host:
                continue
            if m in present:
                order.append(m)
            elif joiners:  # a rank of this host that left: a joiner takes its place
                order.append(joiners.pop(0))
        kept[host] = order + joiners
    return [m for group in kept.values() for m in group]


def _by_host(items: Sequence[Any], host_of: Callable[[Any], str]) -> dict[str, list[Any]]:
    """``items`` by host, the hosts in the order of their first item, each host's in order."""
    by_host: dict[str, list[Any]] = {}
    for item in items:
        by_host.setdefault(host_of(item), []).append(item)
    return by_host


def _spread(items: list[Any], host_of: Callable[[Any], str]) -> list[Any]:
    """``items`` in a cyclic order in which each one's successor is on another host than it
    wherever the hosts allow (on one host: as given).

    The hosts' items, the largest host first, fill the even positions and then the odd
    ones: two cyclic neighbours are then at least ``n // 2`` apart in that sequence, so
    every pair is on two hosts when no host holds more than ``n // 2`` items."""
    by_host = _by_host(items, host_of)
    if len(by_host) < 2:
        return list(items)
    sequence = [m for group in sorted(by_host.values(), key=len, reverse=True) for m in group]
    slots = [*range(0, len(items), 2), *range(1, len(items), 2)]
    order: list[Any] = [None] * len(items)
    for slot, item in zip(slots, sequence):
        order[slot] = item
    return order
