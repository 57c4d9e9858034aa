"""Shared fixtures. Ray tests run on one local cluster that this test session starts
(its own temp dir) and stops; nothing else on the machine is touched."""

from __future__ import annotations

import os
import shutil
import tempfile

import pyarrow.fs as pafs
import pytest

from elastic_dp import keep_workers
from elastic_dp.control.membership.kept import KEPT
from tests.s3server import moto_server

# Credentials for the loopback S3 server of the ``s3`` fixture (moto accepts any). Set before
# Ray starts, so that the workers, which inherit Ray's environment, have them too.
for _key, _value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_key, _value)


def _gpus() -> int:
    """The GPUs this machine's torch sees (NVML's count, no CUDA context): a node started by
    ``ray.cluster_utils.Cluster`` has none unless told, unlike ``ray.init``'s."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="session")
def ray_cluster():
    """A one-node cluster of 4 CPU slots (``ray.cluster_utils.Cluster``: ``ray.init`` cannot
    leave out the log monitor, which tails every worker's log files, about 4% of a core in
    the tests, for output they never show). No worker processes are started ahead for the
    driver: each idle one takes about 1.2% of a core (measured: the idle cluster 5.9%
    with the two Ray starts, 4.0% without), and every test's workers are actors, which
    start their own."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="edp-ray-", dir="/tmp")
    # Cluster writes the head's address into Ray's default temp dir, whatever temp_dir says,
    # and fails where that dir does not exist (a fresh machine that never ran Ray)
    os.makedirs(os.path.dirname(ray._private.utils.get_ray_address_file(None)), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "num_gpus": _gpus(), "include_dashboard": False, "include_log_monitor": False, "temp_dir": temp_dir,
        "object_store_memory": 2**30,
        "_system_config": {"prestart_worker_first_driver": False, "enable_worker_prestart": False}})
    try:
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        with keep_workers():  # each run's worker processes serve the next test's run (docs/elastic.md)
            yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def fresh_workers(ray_cluster):
    """This test's runs start new worker processes and end them (a test that looks at the
    processes themselves): the kept ones are stopped, and none is kept until it ends."""
    KEPT.stop_all()
    depth, KEPT.depth = KEPT.depth, 0
    try:
        yield
    finally:
        KEPT.depth = depth


# -- tiers: ``-m "not ray"`` is the quick tier (README) ------------------------------------
def pytest_collection_modifyitems(config, items):
    """A test that uses the Ray cluster fixture needs Ray; so does one marked ``ray``
    by its module (it starts Ray in a subprocess)."""
    for item in items:
        if "ray_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.ray)


@pytest.fixture(autouse=True)
def _no_ray_outside_the_ray_tier(request, monkeypatch):
    """A test not marked ``ray`` that starts Ray in this process fails, naming the marker,
    so that the quick tier cannot come to need Ray unnoticed."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts Ray but is not marked ray: use the ray_cluster "
                           "fixture or mark it @pytest.mark.ray")

    monkeypatch.setattr(ray, "init", refuse)
    yield


# -- float noise, measured (tests/noise.py) ---------------------------------------------------
if os.environ.get("EDP_RECORD_DIFFS"):
    import json
    import sys

    import torch

    def _recording(check):
        """``check`` (torch.allclose, torch.testing.assert_close) that first appends its
        largest absolute difference and the test's place to the record."""

        def recorded(actual, expected, *args, **kwargs):
            caller = sys._getframe(1)
            if os.path.abspath(caller.f_code.co_filename).startswith(os.path.dirname(os.path.abspath(__file__))):
                diff = float((torch.as_tensor(actual).double() - torch.as_tensor(expected).double()).abs().max())
                test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
                at = f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}"
                with open(os.environ["EDP_RECORD_DIFFS"], "a") as f:
                    f.write(json.dumps({"test": test, "at": at, "diff": diff}) + "\n")
            return check(actual, expected, *args, **kwargs)

        return recorded

    torch.allclose = _recording(torch.allclose)
    torch.testing.assert_close = _recording(torch.testing.assert_close)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with bucket ``ckpt``: (storage URI, pyarrow S3 filesystem, port)."""
    with moto_server() as port:
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http"
        fs, _ = pafs.FileSystem.from_uri(f"s3://ckpt?{query}&allow_bucket_creation=true")
        fs.create_dir("ckpt")
        yield f"s3://ckpt/runs?{query}", fs, port
