"""Shared fixtures. Ray tests run on one local cluster that this test session starts
(its own temp dir) and stops; nothing else on the machine is touched."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="edp-ray-", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=temp_dir,
             configure_logging=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
