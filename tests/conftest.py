"""Shared fixtures. Ray tests run on one local cluster that this test session starts
(its own temp dir) and stops; nothing else on the machine is touched."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Credentials for the loopback S3 server of tests/test_s3.py (moto accepts any). Set before
# Ray starts, so that the workers, which inherit Ray's environment, have them too.
for _key, _value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_key, _value)


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
