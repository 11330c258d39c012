"""Test-wide settings. Hypothesis: no per-example deadline (a shared 2-core machine makes
wall-clock deadlines flaky; the tests bound their own work), and derandomised examples so a CI
failure reproduces locally. Timeouts (pytest-timeout): a hang fails the test, after 120 s, or
600 s for a multi-process (`slow`) one."""

import pytest
from hypothesis import settings

settings.register_profile("shardwise", deadline=None, derandomize=True)
settings.load_profile("shardwise")

SLOW_TIMEOUT_S = 600  # a multi-process test's limit (pyproject's `timeout` is the others')


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every `slow` test without a timeout of its own gets `SLOW_TIMEOUT_S`."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
