"""Test-wide settings. Hypothesis: no per-example deadline (a shared 2-core machine makes
wall-clock deadlines flaky; the tests bound their own work), and derandomised examples so a CI
failure reproduces locally. Timeouts (pytest-timeout): a hang fails the test, after 120 s, 300 s
for one that runs torch in this process (tests/runtime, emulate, demos), 600 s for a
multi-process (`slow`) one."""

import pytest
from hypothesis import settings

settings.register_profile("shardwise", deadline=None, derandomize=True)
settings.load_profile("shardwise")

# Limits of a test without a timeout of its own (pyproject's `timeout`, 120 s, is the rest's:
# the analytic, CLI and web tests): a multi-process one; one that trains or differentiates a
# model with torch in this process (a reference run: 20-30 s on a quiet 2-core machine, 120 s
# seen under load).
SLOW_TIMEOUT_S = 600
TORCH_TIMEOUT_S = 300
TORCH_DIRS = ("runtime", "emulate", "demos")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout"):
            continue
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        elif item.path.parent.name in TORCH_DIRS:
            item.add_marker(pytest.mark.timeout(TORCH_TIMEOUT_S))
