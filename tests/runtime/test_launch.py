"""`spawn` returns results in rank order, and a raising, dying or hanging rank fails the caller
within its timeout instead of hanging it; `launch` runs the same code under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.runtime.launch import RankFailure, spawn


def _who(tag: str) -> tuple[str, int, int, str, int]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return (tag, dist.get_rank(), dist.get_world_size(), os.environ["OMP_NUM_THREADS"],
            int(t.item()))


def _raise_on(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    dist.barrier()
    return 0


def _exit_on(bad: int) -> int:
    if dist.get_rank() == bad:
        os._exit(7)
    t = torch.ones(4)
    dist.all_reduce(t)
    return 0


def _hang_on(bad: int) -> int:
    if dist.get_rank() == bad:
        time.sleep(3600)
    dist.barrier()
    return 0


def _mismatch() -> int:
    """Ranks disagree on the tensor size: the collective errors instead of hanging."""
    t = torch.ones(4 if dist.get_rank() == 0 else 5)
    dist.all_reduce(t)
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_results_in_rank_order(method: str) -> None:
    assert spawn(_who, 2, "x", start_method=method) == [
        ("x", 0, 2, "1", 1), ("x", 1, 2, "1", 1)]


@pytest.mark.slow
def test_spawn_tcp_init_on_a_free_port() -> None:
    assert [r[1] for r in spawn(_who, 3, "y", init="tcp")] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.parametrize(("fn", "n", "message"), [
    (_raise_on, 4, "ValueError: deliberate failure on rank 2"),
    (_exit_on, 4, "died (exit code 7)"),
])
def test_failing_rank_raises_naming_it(fn, n: int, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(fn, n, 2, timeout_s=20)
    assert info.value.rank == 2
    assert "rank 2" in str(info.value) and message in str(info.value)
    assert time.monotonic() - start < 20


@pytest.mark.slow
@pytest.mark.timing
def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank|timed out"):
        spawn(_hang_on, 2, 1, timeout_s=3)
    assert time.monotonic() - start < 3 + 5 + 2 * 2 + 5


@pytest.mark.slow
def test_mismatched_rank_fails() -> None:
    with pytest.raises(RankFailure):
        spawn(_mismatch, 2, timeout_s=10)


@pytest.mark.slow
def test_launch_under_torchrun(tmp_path: Path) -> None:
    """The same `launch` call inside torchrun: init from env, results all-gathered."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from shardwise.runtime.launch import launch
        from shardwise.runtime import collectives as C

        def work():
            x = torch.arange(10, dtype=torch.float64) * (dist.get_rank() + 1)
            C.ring_all_reduce_p2p(x)
            return float(x.sum())

        if __name__ == "__main__":
            out = launch(work, 2)
            if dist.get_rank() == 0:
                print("RESULT", out)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT [135.0, 135.0]" in proc.stdout  # 45 · (1 + 2)
