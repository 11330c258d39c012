"""Damaged checkpoints, changed data, two runs in one directory, a full disk.

The references are the bytes the save wrote (the manifest's SHA-256 is checked against
`hashlib` of the file here), the files the test itself damages, and the checkpoint the
uninterrupted history must resume from (the newest one the test left intact).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from tests.cli_helpers import assert_one_line_error, shardwise
from tests.runtime.checkpoint_files import write_checkpoint

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.runtime import checkpoint
from shardwise.runtime.checkpoint import (
    HASH_CHUNK,
    MANIFEST,
    METADATA,
    DirectoryLock,
    check_start,
    damage,
    read_metadata,
    resume_point,
    write_manifest,
)
from shardwise.runtime.state import json_config
from shardwise.runtime.train import TrainConfig

SHARD = "__0_0.distcp"


def cfg(directory: Path, **kw) -> TrainConfig:
    return TrainConfig(get_model("tiny"), Layout(dp=2), steps=8, seq_len=16, global_batch=4,
                       checkpoint_dir=str(directory), resume=True, **kw)


def fake(root: Path, step: int, config: TrainConfig, **extra) -> Path:
    """A checkpoint directory: shardwise.json, DCP's `.metadata` and shard (a real DCP save
    of one tensor), a second pseudo-random shard, and the manifest over them."""
    meta = {"format": checkpoint.FORMAT, "step": step, "world_size": 2,
            "config": json_config(config), "data_sha256": checkpoint.data_fingerprint(config.data)}
    return write_checkpoint(root / checkpoint.checkpoint_name(step), meta | extra,
                            {"__1_0.distcp": hashlib.sha256(b"1").digest() * 512})  # 16 KiB


def xor(path: Path, at: int, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0x5A for b in data[at:at + n])
    path.write_bytes(bytes(data))


def zero(path: Path, at: int, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(n)
    path.write_bytes(bytes(data))


DAMAGES = {
    "xor 4 KiB of a shard": (lambda p: xor(p / SHARD, 4096), SHARD, "SHA-256"),
    "zero 4 KiB of a shard": (lambda p: zero(p / SHARD, 0), SHARD, "SHA-256"),
    "truncate a shard": (lambda p: os.truncate(p / SHARD, 100), SHARD, "truncated"),
    "delete a shard": (lambda p: (p / SHARD).unlink(), SHARD, "missing"),
    "delete .metadata": (lambda p: (p / ".metadata").unlink(), ".metadata", "missing"),
    "truncate shardwise.json": (lambda p: os.truncate(p / METADATA, 10), METADATA, "truncated"),
    "delete the manifest": (lambda p: (p / MANIFEST).unlink(), MANIFEST, "missing"),
    "malformed manifest": (lambda p: (p / MANIFEST).write_text("{"), MANIFEST, "malformed"),
}


@pytest.mark.parametrize("what", list(DAMAGES))
def test_every_damage_is_named_with_its_file(tmp_path, what):
    path = fake(tmp_path, 4, cfg(tmp_path))
    assert damage(path) is None
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert manifest[SHARD]["sha256"] == hashlib.sha256((path / SHARD).read_bytes()).hexdigest()
    hurt, name, kind = DAMAGES[what]
    hurt(path)
    problem = damage(path)
    assert problem is not None and name in problem and kind in problem, problem


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda m: m.pop("config"), "no 'config'"),
    (lambda m: m["config"].pop("seq_len"), "no config.'seq_len'"),
    (lambda m: m.update(step="ten"), "step is 'ten', not an integer"),
    (lambda m: m.update(step=True), "step is True, not an integer"),
    (lambda m: m["config"].update(seed=None), "config.seed is None"),
    (lambda m: m.update(format=99), "format 99"),
])
def test_a_malformed_shardwise_json_is_one_line_even_with_a_matching_manifest(tmp_path, edit,
                                                                              expected):
    path = fake(tmp_path, 4, cfg(tmp_path))
    meta = json.loads((path / METADATA).read_text())
    edit(meta)
    (path / METADATA).write_text(json.dumps(meta))
    write_manifest(path)  # as if written so: the checksum passes, the content does not
    with pytest.raises(ShardwiseError, match=f"checkpoint {path}: .*{expected}"):
        read_metadata(path)
    assert expected in damage(path)


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_says_so(tmp_path):
    config = cfg(tmp_path)
    older, newest = fake(tmp_path, 2, config), fake(tmp_path, 4, config)
    assert resume_point(tmp_path) == (newest, [])
    xor(newest / SHARD, 0)
    heard: list[str] = []
    assert check_start(config, report=heard.append) == older
    assert len(heard) == 1 and str(newest) in heard[0] and "SHA-256" in heard[0]
    assert "resuming from the older step-000002" in heard[0]
    (older / ".metadata").unlink()
    with pytest.raises(ShardwiseError, match="no intact checkpoint") as info:
        check_start(config)
    assert str(newest) in str(info.value) and str(older) in str(info.value)


def test_a_checkpoint_without_shardwise_json_is_damaged_not_skipped(tmp_path):
    config = cfg(tmp_path)
    older, newest = fake(tmp_path, 2, config), fake(tmp_path, 4, config)
    (newest / METADATA).unlink()
    path, skipped = resume_point(tmp_path)
    assert path == older and METADATA in skipped[0] and "missing" in skipped[0]
    with pytest.raises(ShardwiseError, match="already holds checkpoints"):
        check_start(replace(config, resume=False))


def test_a_changed_data_text_is_refused(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the ring reduces two buffers. " * 200)
    config = cfg(tmp_path / "ckpt", data=str(text))
    fake(tmp_path / "ckpt", 4, config)
    assert check_start(config) == tmp_path / "ckpt" / "step-000004"
    text.write_text("the ring reduces two buffers! " * 200)  # same path, same length
    with pytest.raises(ShardwiseError, match="trained on other text: the text of --data"):
        check_start(config)


BIG = "__1_0.distcp"
BIG_BYTES = HASH_CHUNK * 5 // 2 + 7  # three reads of `HASH_CHUNK`, the last one partial


@pytest.mark.parametrize("at", [HASH_CHUNK, HASH_CHUNK + 12345, BIG_BYTES - 1],
                         ids=["second-chunk-first-byte", "second-chunk", "last-partial-chunk"])
def test_a_file_larger_than_the_hash_chunk_is_verified_past_its_first_chunk(tmp_path, at):
    """A shard of 2.5 hashing chunks (every other file here is far under one): its manifest
    SHA-256 is hashlib's over the whole file, and one byte changed past the first chunk (the
    size unchanged) is damage."""
    blob = random.Random(0).randbytes(BIG_BYTES)
    config = cfg(tmp_path)
    meta = {"format": checkpoint.FORMAT, "step": 4, "world_size": 2,
            "config": json_config(config), "data_sha256": checkpoint.data_fingerprint(None)}
    path = write_checkpoint(tmp_path / checkpoint.checkpoint_name(4), meta, {BIG: blob})
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert manifest[BIG] == {"bytes": BIG_BYTES, "sha256": hashlib.sha256(blob).hexdigest()}
    assert damage(path) is None
    xor(path / BIG, at, 1)
    problem = damage(path)
    assert problem is not None and BIG in problem and "SHA-256" in problem, problem
    xor(path / BIG, at, 1)  # undone: intact again
    assert damage(path) is None


def test_a_data_text_larger_than_the_hash_chunk_changed_past_its_first_chunk_is_refused(
        tmp_path):
    """The --data fingerprint reads the file `HASH_CHUNK` bytes at a time: a text of 2.5
    chunks changed in one character of its third chunk (same length) is other text."""
    text = tmp_path / "corpus.txt"
    line = "the ring reduces two buffers. "
    body = line * (BIG_BYTES // len(line) + 1)
    text.write_text(body)
    assert text.stat().st_size > 2 * HASH_CHUNK
    config = cfg(tmp_path / "ckpt", data=str(text))
    fake(tmp_path / "ckpt", 4, config)
    assert check_start(config) == tmp_path / "ckpt" / "step-000004"
    at = 2 * HASH_CHUNK + 100
    at = body.index(".", at)  # a full stop in the third chunk
    text.write_text(body[:at] + "!" + body[at + 1:])
    stamp = text.stat().st_mtime_ns + 10**9  # an edit a second later (the fingerprint's cache
    os.utime(text, ns=(stamp, stamp))  # is keyed on mtime; a fast rewrite can keep it)
    with pytest.raises(ShardwiseError, match="trained on other text: the text of --data"):
        check_start(config)


@pytest.fixture
def hangup_fails():
    """A SIGHUP to this process fails the test instead of ending the run: the lock below
    probes its own holder, this process, which a probe must not signal."""
    def fail(*_: object) -> None:
        pytest.fail("this process was sent SIGHUP")

    before = signal.signal(signal.SIGHUP, fail)
    yield
    signal.signal(signal.SIGHUP, before)


@pytest.mark.usefixtures("hangup_fails")
def test_the_directory_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    with DirectoryLock(tmp_path):
        assert (tmp_path / ".lock").read_text().split() == [str(os.getpid()),
                                                             socket.gethostname()]
        with pytest.raises(ShardwiseError, match=f"in use by another run \\(pid {os.getpid()}"):
            DirectoryLock(tmp_path).__enter__()
    assert not (tmp_path / ".lock").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{dead.pid} {socket.gethostname()}\n")
    with DirectoryLock(tmp_path):  # a killed launcher's lock
        assert (tmp_path / ".lock").read_text().split()[0] == str(os.getpid())
    (tmp_path / ".lock").write_text(f"{dead.pid} another-host\n")  # cannot be checked
    with pytest.raises(ShardwiseError, match="another-host"):
        DirectoryLock(tmp_path).__enter__()


def test_cli_refuses_a_locked_directory_and_an_all_damaged_one_before_starting(tmp_path):
    (tmp_path / ".lock").write_text(f"{os.getpid()} {socket.gethostname()}\n")
    assert_one_line_error(shardwise("train", "--checkpoint-dir", str(tmp_path), check=False),
                          "in use by another run", str(os.getpid()))
    (tmp_path / ".lock").unlink()
    only = fake(tmp_path, 2, cfg(tmp_path, seed=0))
    os.truncate(only / SHARD, 7)
    assert_one_line_error(shardwise("train", "--checkpoint-dir", str(tmp_path), "--resume",
                                    check=False),
                          "no intact checkpoint", str(only), "truncated")


# --------------------------------------------------------------------------- real ranks
COMMON = ("--dp", "2", "--seq", "16", "--global-batch", "4", "--quiet", "--json",
          "--checkpoint-every", "2", "--resume")


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_skipped_by_a_real_resume(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("a pipeline stage sends its activations in fixed order. " * 100)
    run = ("--checkpoint-dir", str(tmp_path / "ck"), "--data", str(data), *COMMON)
    shardwise("train", "--steps", "4", *run)
    step2, step4 = tmp_path / "ck" / "step-000002", tmp_path / "ck" / "step-000004"
    meta = json.loads((step4 / METADATA).read_text())
    assert meta["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert damage(step2) is None and damage(step4) is None
    xor(step4 / SHARD, 4096)
    resumed = shardwise("train", "--steps", "5", *run)
    assert f"checkpoint {step4} is damaged" in resumed.stderr
    assert f"note: resuming from {step2}" in resumed.stderr
    assert [r["step"] for r in json.loads(resumed.stdout)["records"]] == [2, 3, 4]


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    if shutil.which("mount") is None or not _tmpfs(disk, "4m"):
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        stale = disk / "step-000001.tmp-deadbeef"  # an interrupted save's leftover
        stale.mkdir()
        (stale / checkpoint.MARKER).write_text("")  # written first by every save
        (stale / "__0_0.distcp").write_bytes(bytes(3 << 20))
        result = shardwise("train", "--steps", "4", "--checkpoint-dir", str(disk), *COMMON,
                           check=False)
        lines = [line for line in result.stderr.splitlines() if not line.startswith("note:")]
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert f"no space left on device {disk}" in lines[0]
        assert f"the previous checkpoint {disk / 'step-000002'} is kept" in lines[0]
        assert sorted(p.name for p in disk.iterdir()) == ["latest", "step-000002"]
        assert damage(disk / "step-000002") is None
    finally:
        subprocess.run(["umount", str(disk)], check=False)
