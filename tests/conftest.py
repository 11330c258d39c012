"""Test-wide settings. Hypothesis: no per-example deadline (a shared 2-core machine makes
wall-clock deadlines flaky; the tests bound their own work), and derandomised examples so a CI
failure reproduces locally."""

from hypothesis import settings

settings.register_profile("shardwise", deadline=None, derandomize=True)
settings.load_profile("shardwise")
