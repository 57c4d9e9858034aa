"""What the scenario scripts share: reading a run's JSON lines as they grow, the
autoscaler's standing request, and a run
trained on a thread beside the main one (which adds, drains and removes nodes: Ray's
``Cluster`` is driven from the main thread only)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import ray
from ray.cluster_utils import Cluster

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


def drain_node(node_id: str, deadline_s: float, reason: str = "preemption test") -> None:
    """Drain ``node_id`` for preemption with a deadline ``deadline_s`` from now: what
    ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds``
    calls (ray/scripts/scripts.py), and autoscaler v2 before it takes a node."""
    from ray.core.generated import autoscaler_pb2
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   reason, int(time.time() * 1000 + deadline_s * 1000))
    assert accepted, why


def autoscaler_request() -> list[dict] | None:
    """The standing resource request of this cluster's autoscaler (None: never made)."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else None


def local_cluster(head_cpus: int) -> Cluster:
    """A ``ray.cluster_utils.Cluster`` whose head has ``head_cpus`` CPU slots, in a temp
    dir of its own (``training`` removes it), with this driver connected."""
    temp_dir = tempfile.mkdtemp(prefix="edp-ray-", dir="/tmp")
    # Cluster writes the head's address into Ray's default temp dir (tests/conftest.py)
    os.makedirs(os.path.dirname(ray._private.utils.get_ray_address_file(None)), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False,
                                                            "temp_dir": temp_dir})
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


@contextlib.contextmanager
def training(fit: Callable[[], object], cluster, fast: Path) -> Iterator[threading.Thread]:
    """Run ``fit`` on a thread for the body of the ``with``; then (however the body ended)
    let the run finish unpaced (``fast``), end Ray and ``cluster`` (and remove its temp
    dir), and raise the run's own error if it had one."""
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
        temp_dir = cluster.head_node.get_temp_dir_path()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        fast.unlink(missing_ok=True)
    if errors:
        raise errors[0]
