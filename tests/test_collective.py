"""The collective group's lifecycle: abort releases a rank blocked in a gloo collective,
and re-forming generation after generation leaks no threads or sockets."""

from __future__ import annotations

import datetime
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from elastic_dp.collective import CollectiveGroup, _socket_fds


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _reform_with_abort(store_port: int, generation: int) -> float:
    """Both ranks join ``generation``; rank 0 blocks in an all-reduce rank 1 never joins;
    rank 0's group is aborted from another thread. Returns seconds from abort to release."""
    groups = [CollectiveGroup(backend="gloo", timeout_s=60) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: groups[r].configure("127.0.0.1", store_port, generation=generation,
                                                    rank=r, world_size=2), range(2)))
    released = threading.Event()
    errors = []

    def blocked():
        try:
            groups[0].all_reduce(torch.ones(1000))
        except RuntimeError as exc:
            errors.append(exc)
        released.set()

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.05)
    assert not released.is_set(), "the all-reduce must be blocked on the absent peer"
    start = time.perf_counter()
    groups[0].abort()
    assert released.wait(10), "abort() must release the blocked rank"
    took = time.perf_counter() - start
    thread.join()
    assert errors, "the blocked collective raises"
    for g in groups:
        g.destroy()
    return took


def test_abort_releases_a_blocked_rank_and_twenty_generations_leak_nothing():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    _reform_with_abort(store.port, 0)  # warm-up: gloo's first use starts its lasting threads
    threads, sockets = _native_threads(), len(_socket_fds())
    release_times = [_reform_with_abort(store.port, g) for g in range(1, 21)]
    time.sleep(0.5)
    assert _native_threads() <= threads, "threads leaked across 20 re-formations"
    assert len(_socket_fds()) <= sockets, "sockets leaked across 20 re-formations"
    assert max(release_times) < 1.0


def test_destroyed_group_refuses_collectives():
    group = CollectiveGroup(backend="gloo", timeout_s=5)
    with pytest.raises(RuntimeError, match="not configured"):
        group.all_reduce(torch.ones(1))
