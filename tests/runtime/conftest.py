"""Shared setup for the multi-process tests.

Every test here spawns real gloo worlds (2, 4 or 8 local CPU ranks) through
`shardwise.runtime.launch.spawn`. Ranks fork from a forkserver that imported torch once
(`SHARDWISE_START_METHOD=forkserver`): starting 8 ranks then takes well under a second
instead of ~10 s of torch imports on a 2-core machine; `test_launch.py` also checks the plain
`spawn` start method. Worker functions live at module level so the ranks can import them.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

os.environ.setdefault("SHARDWISE_START_METHOD", "forkserver")
