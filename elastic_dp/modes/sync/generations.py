"""The synchronous mode's collective groups: one per generation, on one rendezvous store.

Every membership change forms a new generation ``g`` whose rendezvous keys live under the
prefix ``gen{g}/`` of the coordinator's TCPStore (docs/design.md, generations). A generation whose
forming failed is never reused: the next attempt takes the next number.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ray
import torch.distributed as dist

from elastic_dp.faults import Fault
from elastic_dp.modes.calls import Calls

logger = logging.getLogger(__name__)


class Generations:
    """Forms each generation's group over its members and runs calls on the members."""

    def __init__(self, calls: Calls, link_delay_s: float = 0.0,
                 formed: Callable[[int, list[Any]], None] | None = None) -> None:
        self.calls = calls
        self.formed = formed
        """Told of each generation formed (its number, its members in rank order)."""
        self.link_delay_s = link_delay_s  # --inject slowlink: each member's collectives' least time
        self.generation = -1
        self.members: list[Any] = []
        """The current generation, in rank order."""
        self._store: dist.TCPStore | None = None

    def form(self, members: list[Any], faults: dict[int, Fault] | None = None) -> None:
        """Form the next generation over ``members`` (ranks in list order, as
        ``CollectiveRun.rank_order`` decided), each told the host of every rank; ``faults``
        (rank -> fault, phase ``reform``) fire in those ranks as they join."""
        if self._store is None:
            self._store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True,
                                        wait_for_workers=False, use_libuv=True)
        self.generation += 1
        host, faults = ray.util.get_node_ip_address(), faults or {}
        hosts = tuple(m.info.node_id for m in members)  # the generation's mesh (elastic_dp.comm.mesh)
        calls = {m.actor.configure_group.remote(host, self._store.port, self.generation, rank, len(members),
                                                faults.get(rank), self.link_delay_s, hosts): m
                 for rank, m in enumerate(members)}
        self.run(members, calls)
        self.members = list(members)
        logger.debug("generation %d formed over %d workers", self.generation, len(members))
        if self.formed is not None:
            self.formed(self.generation, self.members)

    def run(self, group: list[Any], calls: dict[object, Any]) -> dict[Any, Any]:
        """Results of ``calls`` (ref -> member of ``group``); lost members raise ``MembersLost``."""
        return self.calls.run(group, calls, self.generation)

    def call_all(self, method: str, *args: Any) -> dict[Any, Any]:
        """``method(*args)`` on every member of the current generation."""
        return self.run(self.members, {getattr(m.actor, method).remote(*args): m for m in self.members})
