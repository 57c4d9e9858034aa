"""Parameter-server shards on a draining node (``--mode async``).

The shards and the lone shard's keeper are actors of the driver, placed by Ray (beside
the driver, usually). When Ray drains the node one of them runs on, the sequencer stops
leasing new steps, lets the gradients out be applied, and at that quiescent point the
actor hands its state to a new one, which Ray places on another node
(``AsyncMode._move``): no update is lost or applied twice, nothing rolls back.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Hashable

import ray

from elastic_dp.worker.leave import NOTICE_POLL_S, draining_nodes

logger = logging.getLogger(__name__)


class DrainWatch:
    """Which state holders (key -> actor) run on a draining node, read from Ray at most every
    ``NOTICE_POLL_S`` (between reads, the last answer)."""

    def __init__(self) -> None:
        self._nodes: dict[Any, str] = {}  # actor -> its node, asked once per actor, once a node drains
        self._moving: list[Hashable] = []
        self._next_read = 0.0
        self.started: dict[Hashable, tuple[Any, Any]] = {}
        """Holder key -> its successor's actor and the ref of its setup."""

    def draining(self, holders: dict[Hashable, Any]) -> list[Hashable]:
        """The keys of ``holders`` whose node is draining."""
        now = time.monotonic()
        if now < self._next_read:
            return self._moving
        self._next_read = now + NOTICE_POLL_S
        try:
            draining = draining_nodes()
        except Exception as exc:  # an older or unusual cluster: a lost shard is rebuilt from its keeper
            logger.debug("could not read the draining nodes: %s", exc)
            return []
        if not draining:  # the common case: no holder's node is asked for
            self._moving = []
            return self._moving
        unknown = [actor for actor in holders.values() if actor not in self._nodes]
        self._nodes.update(zip(unknown, ray.get([actor.node.remote() for actor in unknown])))
        self._moving = [key for key, actor in holders.items() if self._nodes[actor] in draining]
        return self._moving

    def successors(self, holders: dict[Hashable, Any], start: Callable[[Hashable], tuple[Any, Any]]) -> list:
        """Start a successor (``start(key)``: actor, setup ref) for each holder on a draining
        node, while training goes on; the setup refs not done yet (none: all can take over)."""
        for key in self.draining(holders):
            if key not in self.started:
                self.started[key] = start(key)
        refs = [built for _, built in self.started.values()]
        return ray.wait(refs, num_returns=len(refs), timeout=0)[1] if refs else []

    def moved(self) -> None:
        """The holders found draining were replaced (the next read finds their successors)."""
        self._moving, self._next_read, self.started = [], 0.0, {}
