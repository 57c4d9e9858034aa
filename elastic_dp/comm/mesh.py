"""A generation's mesh: where each rank runs, its named dimensions, and the rank order.

Every worker receives, with its rank, the host (the Ray node) of every rank of the
generation (``CollectiveGroup.configure(..., hosts=...)``), so each can tell, without
another round trip, which ranks share its host. From that the mesh names the groups a
collective can run over:

    world    every rank (a second process group beside the generation's main one)
    host     the ranks on this rank's host (the fast link inside a node)
    across   the ranks with this rank's local index on every host (the slow link between
             nodes: a hierarchical all-reduce reduces inside each host, then across)

``CollectiveGroup.subgroup(dim)`` builds the group of a dimension on demand, on the
generation's rendezvous store; it is aborted and destroyed with the generation.

The rank order of a generation is decided here, once (``rank_order``), from what the
state needs of it: where each rank copies its chunk to its neighbour (ZeRO's peer
snapshots) the neighbours are spread over hosts, so that losing a host keeps a copy of
every chunk; elsewhere the given order (the membership policy's) is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

DIMS = ("world", "host", "across")
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
            hosts = [self.on_host(h) for h in self.host_names]
            return [tuple(ranks[i] for ranks in hosts if i < len(ranks))
                    for i in range(max(len(ranks) for ranks in hosts))]
        raise ValueError(f"the mesh has the dimensions {', '.join(DIMS)}, not {dim!r}")

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim``."""
        return next(g for g in self.groups(dim) if rank in g)

    def index(self, dim: str, rank: int) -> int:
        """Which of ``groups(dim)`` holds ``rank`` (the group's name on the store)."""
        return next(i for i, g in enumerate(self.groups(dim)) if rank in g)


def rank_order(members: Sequence[Any], host_of: Callable[[Any], str], spread: bool) -> list[Any]:
    """A generation's rank order over ``members`` (given in the membership policy's order):
    with ``spread``, one in which rank ``r+1`` (cyclically: the holder of rank ``r``'s peer
    snapshot) is on another host than rank ``r`` wherever the hosts allow; else the given
    order.

    The hosts' members, the largest host first, fill the even positions and then the odd
    ones: two cyclic neighbours are then at least ``n // 2`` apart in that sequence, so
    every pair is on two hosts when no host holds more than ``n // 2`` members. On one host
    the given order is kept."""
    by_host: dict[str, list[Any]] = {}
    for m in members:
        by_host.setdefault(host_of(m), []).append(m)
    if not spread or len(by_host) < 2:
        return list(members)
    sequence = [m for group in sorted(by_host.values(), key=len, reverse=True) for m in group]
    slots = [*range(0, len(members), 2), *range(1, len(members), 2)]
    order: list[Any] = [None] * len(members)
    for slot, member in zip(slots, sequence):
        order[slot] = member
    return order
