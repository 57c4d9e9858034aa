"""A job module whose optimizer factory returns nothing (tests/test_bad_input.py runs it
through the CLI)."""

from tests.tasks import NO_OPTIMIZER_TASK as TASK  # noqa: F401
