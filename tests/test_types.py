"""The type check (`mypy`, configured in pyproject.toml) passes on the package."""

from pathlib import Path

import pytest


def test_mypy_passes_on_src():
    api = pytest.importorskip("mypy.api")
    root = Path(__file__).resolve().parent.parent
    out, err, status = api.run(["--config-file", str(root / "pyproject.toml"),
                                str(root / "src" / "shardwise")])
    assert status == 0, out + err
