"""The suite's fixtures and tiers (tests/conftest.py) for the long scenarios here."""

from tests.conftest import _no_ray_outside_the_ray_tier, pytest_collection_modifyitems, ray_cluster, s3  # noqa: F401
