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


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (file store), destroyed afterwards."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    store = Path(tempfile.mkdtemp())
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
