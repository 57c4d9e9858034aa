"""What the scenario scripts share: reading a run's JSON lines as they grow, the
autoscaler's standing request, and a run
trained on a thread beside the main one (which adds, drains and removes nodes: Ray's
``Cluster`` is driven from the main thread only)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import ray

from tests.records import read_lines


def lines(path: Path) -> list[dict]:
    """The JSON lines of ``path`` so far (none before it exists)."""
    return read_lines(path) if path.exists() else []


def wait_for(path: Path, ok: Callable[[list[dict]], bool], timeout_s: float = 120.0) -> list[dict]:
    """Poll ``path``'s lines until ``ok`` holds or ``timeout_s`` passed; the lines then."""
    deadline = time.monotonic() + timeout_s
    while not ok(lines(path)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines(path)


def autoscaler_request() -> list[dict] | None:
    """The standing resource request of this cluster's autoscaler (None: never made)."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else None


@contextlib.contextmanager
def training(fit: Callable[[], object], cluster, fast: Path) -> Iterator[threading.Thread]:
    """Run ``fit`` on a thread for the body of the ``with``; then (however the body ended)
    let the run finish unpaced (``fast``), end Ray and ``cluster``, and raise the run's
    own error if it had one."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fit()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield thread
    finally:
        fast.touch()
        thread.join()
        ray.shutdown()
        cluster.shutdown()
        fast.unlink(missing_ok=True)
    if errors:
        raise errors[0]
