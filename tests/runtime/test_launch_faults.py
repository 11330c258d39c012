"""No rank outlives its launcher, and a stopped rank is the one reported.

The reference is the process table (/proc): every process descending from a `shardwise train`
launcher that was killed is gone (or a zombie) within a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.runtime.launch import RankFailure, spawn

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid`, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))):
            parents.setdefault(st[1], []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if (st := _stat(pid)) is not None and st[0] != "Z"}


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.parametrize(("method", "sig"), [("spawn", signal.SIGKILL),
                                             ("forkserver", signal.SIGKILL),
                                             ("forkserver", signal.SIGTERM)])
def test_no_rank_outlives_a_killed_launcher(tmp_path, method, sig):
    log = tmp_path / "log.jsonl"
    env = os.environ | {"SHARDWISE_START_METHOD": method}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardwise", "train", "--dp", "2", "--steps", "100000",
         "--seq", "16", "--global-batch", "4", "--quiet", "--log", str(log),
         "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "50"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 2):  # the ranks train
            assert launcher.poll() is None and time.monotonic() < deadline, "no training"
            time.sleep(0.2)
        family = _descendants(launcher.pid)
        assert len(family) >= 2
        launcher.send_signal(sig)
        launcher.wait(10)
        end = time.monotonic() + 5
        while _alive(family) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _alive(family), {pid: _stat(pid) for pid in _alive(family)}
    finally:
        launcher.kill()
        for pid in _alive(_descendants(launcher.pid)):
            os.kill(pid, signal.SIGKILL)


def _stop_rank_one() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()
    return 0


@pytest.mark.slow
@pytest.mark.timing
def test_a_stopped_rank_is_the_one_reported():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 stopped responding \\(stopped") as info:
        spawn(_stop_rank_one, 2, timeout_s=4)
    assert info.value.rank == 1
    assert time.monotonic() - start < 4 + 30  # timeout + start-up and clean-up under load
