"""Shared setup for the multi-process tests.

Every test here spawns real gloo worlds (2, 4 or 8 local CPU ranks) through
`shardwise.runtime.launch.spawn` with its default start method — the one `shardwise demo`
and `shardwise train` use (a forkserver that imported torch once); `test_launch.py` also
checks the plain `spawn` start method. Worker functions live at module level so the ranks
can import them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
