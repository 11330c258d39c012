"""The package's public surface and its docstring example."""

import doctest

import shardwise.schedules


def test_public_names_exist():
    assert all(hasattr(shardwise.schedules, name) for name in shardwise.schedules.__all__)


def test_package_docstring_example_runs():
    assert doctest.testmod(shardwise.schedules).failed == 0
