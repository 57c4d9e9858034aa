"""Run a function on several gloo ranks as threads of this process (no Ray)."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch.distributed as dist

from elastic_dp.comm.group import CollectiveGroup

T = TypeVar("T")


def run_ranks(world: int, fn: Callable[[CollectiveGroup], T], *, generation: int = 0, side: bool = False,
              hosts: tuple[str, ...] | None = None) -> list[T]:
    """Call ``fn(group)`` on ``world`` ranks at once; return the results in rank order
    (``side``: the groups have their second process group, ``CollectiveGroup.side``;
    ``hosts``: the host each rank is told it runs on, the generation's mesh)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))

    def rank_main(rank: int) -> T:
        group = CollectiveGroup(backend="gloo", timeout_s=30)
        group.side = side
        group.configure("127.0.0.1", store.port, generation=generation, rank=rank, world_size=world, hosts=hosts)
        try:
            return fn(group)
        finally:
            group.destroy()

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_main, range(world)))
