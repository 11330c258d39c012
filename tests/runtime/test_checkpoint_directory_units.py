"""The checkpoint directory's bookkeeping in one process, against what each test wrote itself:
which `*.tmp-*` entries count as an interrupted save's leftovers (`_leftovers`), what a
crash in the middle of a delete leaves (`_remove`: a checkpoint renamed to a `.tmp-` name
first, a leftover not renamed again), the size of the previous checkpoint that decides
whether a failed save was a full disk (`_size`, `_save_failure`: files past 1 MiB in a
subdirectory), which checkpoint a resume picks once DCP failed to load one (`_choose`), the
shardwise.json size limit (a sparse file one byte past it), and a real save/resume of a world
of one whose newest checkpoint verifies but does not load (`load_checkpoint`'s fallback)."""

from __future__ import annotations

import errno
import json
import os
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from tests.runtime.checkpoint_files import write_checkpoint  # noqa: E402

from shardwise.arch import get_model  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.layout import Layout  # noqa: E402
from shardwise.runtime.checkpoint import directory as D  # noqa: E402
from shardwise.runtime.checkpoint import load as L  # noqa: E402
from shardwise.runtime.checkpoint import manifest as M  # noqa: E402
from shardwise.runtime.checkpoint import save as S  # noqa: E402
from shardwise.runtime.state import TrainConfig, json_config  # noqa: E402


def _cfg(directory: Path, **kw) -> TrainConfig:
    return TrainConfig(get_model("tiny"), Layout(), seq_len=16, global_batch=2, dtype="fp64",
                       checkpoint_dir=str(directory), **({"steps": 8, "resume": True} | kw))


def _fake(root: Path, step: int, config: TrainConfig, extra=None) -> Path:
    meta = {"format": M.FORMAT, "step": step, "world_size": 1, "config": json_config(config),
            "data_sha256": M.data_fingerprint(config.data)}
    return write_checkpoint(root / M.checkpoint_name(step), meta, extra)


# ----------------------------------------------------------------------------- leftovers
def test_leftovers_are_our_tmp_directories_and_pointer_files_only(tmp_path):
    hexname = uuid.uuid4().hex
    ours_marked = tmp_path / "step-000002.tmp-half-deleted"  # any .tmp- name, with MARKER
    ours_marked.mkdir()
    (ours_marked / M.MARKER).write_text("")
    ours_empty = tmp_path / f"step-000003.tmp-{hexname}"  # a name we pick, empty
    ours_empty.mkdir()
    pointer = tmp_path / f"latest.tmp-{hexname}"
    pointer.write_text("step-000003\n")
    # not leftovers: empty directories under other names, an unmarked one under our name
    # with a user's file in it, a pointer name that is a directory
    for name in ("empty", "step-000004", "step-000005.tmp-mine", f"latest.tmp-{hexname[::-1]}"):
        (tmp_path / name).mkdir()
    kept = tmp_path / f"step-000006.tmp-{hexname[::-1]}"
    kept.mkdir()
    (kept / "notes.txt").write_text("a user's")
    assert D._leftovers(tmp_path) == sorted([ours_marked, ours_empty, pointer])
    assert D._leftovers(tmp_path / "absent") == []


# ------------------------------------------------------------- a crash in the middle of a delete
def _crash_in_rmtree(monkeypatch):
    def rmtree(path, *a, **k):
        raise OSError(errno.EIO, "simulated crash", str(path))
    monkeypatch.setattr(D.shutil, "rmtree", rmtree)


def test_a_crash_mid_delete_never_leaves_a_checkpoint_name(tmp_path, monkeypatch):
    path = _fake(tmp_path, 4, _cfg(tmp_path), {"sub": b""})
    (path / "sub").unlink()
    (path / "sub").mkdir()
    (path / "sub" / "x.distcp").write_bytes(b"x")
    _crash_in_rmtree(monkeypatch)
    with pytest.raises(OSError, match="simulated crash"):
        D._remove(path)
    assert not path.exists()
    (left,) = tmp_path.iterdir()
    assert M._OUR_TMP.fullmatch(left.name) and left.name.startswith("step-000004.tmp-")
    assert (left / M.MARKER).is_file()  # still recognisably ours
    assert D._leftovers(tmp_path) == [left]
    # a leftover being removed keeps its name (it is not renamed again)
    with pytest.raises(OSError, match="simulated crash"):
        D._remove(left)
    assert [p.name for p in tmp_path.iterdir()] == [left.name]
    monkeypatch.undo()
    D._remove(left)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------- a full disk or not
MIB = 1 << 20


def test_size_counts_every_file_below_the_checkpoint(tmp_path):
    sizes = {"a.distcp": 3 * MIB + 17, "sub/b.distcp": MIB + 5, "sub/deeper/c": 9}
    for name, n in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"\1" * n)
    assert S._size(tmp_path) == sum(sizes.values())
    assert S._size(None) == 0


@pytest.mark.parametrize(("free", "full"), [(2 * MIB, True), (3 * MIB, False),
                                            (MIB - 1, True)])
def test_a_failed_save_is_a_full_disk_when_less_than_the_previous_checkpoint_is_free(
        tmp_path, monkeypatch, free, full):
    """The previous checkpoint is 2 MiB + ~21 KiB (a 2 MiB shard in a subdirectory, DCP's
    files, shardwise.json, the manifest): 2 MiB free is less (a full disk, whatever the
    error said); 3 MiB is not (the error's own reason); under 1 MiB always is."""
    config = _cfg(tmp_path)
    previous = _fake(tmp_path, 4, config, {"deep": b""})
    (previous / "deep").unlink()
    (previous / "deep").mkdir()
    (previous / "deep" / "shard.distcp").write_bytes(b"\0" * (2 * MIB))
    size = sum(p.stat().st_size for p in previous.rglob("*") if p.is_file())
    assert 2 * MIB < size < 3 * MIB
    usage = os.statvfs(tmp_path)
    monkeypatch.setattr(S.shutil, "disk_usage",
                        lambda _: S.shutil._ntuple_diskusage(usage.f_blocks, 0, free))
    final = tmp_path / M.checkpoint_name(8)
    line = S._save_failure(ValueError("pos 17 out of range"), final)
    if full:
        assert line == (f"no space left on device {S._mount_point(tmp_path)} "
                        f"({free / MIB:.1f} MiB free) while saving checkpoint {final}; the "
                        f"previous checkpoint {previous} is kept; free space or use another "
                        "--checkpoint-dir")
    else:
        assert line == (f"cannot save checkpoint {final}: ValueError: pos 17 out of range; "
                        f"the previous checkpoint {previous} is kept")


# ------------------------------------------------------------ which checkpoint a resume picks
def test_a_resume_skips_the_checkpoints_dcp_failed_to_load(tmp_path):
    config = _cfg(tmp_path)
    old, new = _fake(tmp_path, 2, config), _fake(tmp_path, 4, config)
    assert L._choose(tmp_path, config, ()) == (str(new), None)
    assert L._choose(tmp_path, config, (new,)) == (str(old), None)
    assert L._choose(tmp_path, config, (new, old)) == (
        None, f"no checkpoint in {tmp_path} loads: {new}, {old} failed")
    # a checkpoint named directly: loaded, or refused once DCP failed on it
    assert L._choose(new, config, ()) == (str(new), None)
    assert L._choose(new, config, (new,)) == (
        None, f"checkpoint {new} is damaged: DCP could not load it")
    # one that does not fit this run names itself
    other = replace(config, seq_len=32)
    assert L._choose(tmp_path, other, ()) == (
        None, f"{new} was trained with seq_len=16, this run has 32; resume with --seq 16")
    assert L._choose(tmp_path / "none", config, ()) == (None, None)


# ------------------------------------------------------------------------ shardwise.json
def test_shardwise_json_past_its_size_limit_is_refused_by_name(tmp_path):
    path = _fake(tmp_path, 4, _cfg(tmp_path))
    meta = path / M.METADATA
    os.truncate(meta, M._MAX_JSON + 1)  # sparse: nothing written
    assert M._MAX_JSON == 64 * MIB
    with pytest.raises(ShardwiseError) as info:
        M.read_metadata(path)
    assert str(info.value) == (f"checkpoint {path}: shardwise.json {str(meta)!r} is "
                               f"{M._MAX_JSON + 1:,} bytes; at most {M._MAX_JSON:,} are read")
    meta.unlink()
    meta.mkdir()
    with pytest.raises(ShardwiseError) as info:
        M.read_metadata(path)
    assert str(info.value) == (f"checkpoint {path}: shardwise.json {str(meta)!r} is a "
                               "directory, not a file")


# ---------------------------------------- a real save and resume, in a world of one rank
def test_a_checkpoint_that_verifies_but_does_not_load_falls_back_to_the_older(world_of_one,
                                                                            tmp_path):
    """Three saves (steps 1, 2, 3) with the default keep (2): steps 2 and 3 remain. Step 3's shard is cut to
    its first 1 MiB + 1 bytes (more than our hash chunk) and its manifest rewritten, so it
    verifies; DCP fails on it, and the resume loads step 2, saying why."""
    from shardwise.runtime import train as T
    from shardwise.runtime.checkpoint import damage, load_checkpoint, save_checkpoint

    config = _cfg(tmp_path / "ck", resume=False)
    state = T.build(config)
    T.train_step(state)
    for step in (1, 2, 3):  # the same weights under three step numbers (the step is a label)
        state.step = step
        save_checkpoint(state, tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "latest", "step-000002", "step-000003"]
    assert (tmp_path / "ck" / "latest").read_text() == "step-000003\n"
    newest = tmp_path / "ck" / "step-000003"
    (shard,) = newest.glob("*.distcp")
    assert shard.stat().st_size > 2 * M.HASH_CHUNK  # tiny in fp64 with AdamW: ~2.4 MB
    os.truncate(shard, M.HASH_CHUNK + 1)
    M.write_manifest(newest)
    assert damage(newest) is None
    heard = []
    fresh = T.build(replace(config, resume=True))
    assert load_checkpoint(fresh, tmp_path / "ck", report=heard.append) is True
    assert fresh.step == 2
    (line,) = heard
    prefix = f"checkpoint {newest} cannot be loaded ("
    assert line.startswith(prefix) and line.endswith("); trying an older one")
    reason = line[len(prefix):-len("); trying an older one")]
    kind, _, text = reason.partition(": ")
    assert kind.isidentifier() and text.strip()  # the error's type and its first line
    assert json.loads((newest / M.METADATA).read_text())["step"] == 3


# ------------------------------------------------------------------------------ publishing
def _tmp_save(root: Path, step: int, config: TrainConfig, payload: bytes) -> tuple[Path, Path]:
    """An unpublished save of `step` (as `_start_save` names it) holding `payload`."""
    final = root / M.checkpoint_name(step)
    tmp = _fake(root / "writing", step, config, {"payload.bin": payload})
    tmp = tmp.rename(final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}"))
    (root / "writing").rmdir()
    return tmp, final


def test_publish_replaces_the_same_step_and_prunes_only_up_to_it(tmp_path):
    """Steps 2, 4 and 8 published; step 6 saved again after a resume from 4 (keep=1): 6 is
    published and `latest` names it, 2 and 4 go (older), 8 stays (newer than what was just
    published: not this run's to judge). Then 6 saved once more replaces itself."""
    config = _cfg(tmp_path)
    for step in (2, 4, 8):
        _fake(tmp_path, step, config)
    tmp, final = _tmp_save(tmp_path, 6, config, b"first")
    D._publish(tmp, final, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000006",
                                                          "step-000008"]
    assert (tmp_path / M.LATEST).read_text() == "step-000006\n"
    assert M.damage(final) is None and (final / "payload.bin").read_bytes() == b"first"
    tmp, again = _tmp_save(tmp_path, 6, config, b"second")
    D._publish(tmp, again, keep=1)
    assert (final / "payload.bin").read_bytes() == b"second" and M.damage(final) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000006",
                                                          "step-000008"]


def test_a_directory_shardwise_did_not_write_is_never_replaced(tmp_path):
    config = _cfg(tmp_path)
    mine = tmp_path / M.checkpoint_name(6)
    mine.mkdir()
    (mine / "results.csv").write_text("a person's")
    assert D._foreign(mine) == (f"{mine} exists and was not written by shardwise (no "
                                f"{M.MARKER}); move it away or use another --checkpoint-dir")
    assert D._foreign(tmp_path / M.checkpoint_name(7)) is None
    tmp, final = _tmp_save(tmp_path, 6, config, b"x")
    with pytest.raises(ShardwiseError) as info:
        D._publish(tmp, final, keep=2)
    assert str(info.value) == D._foreign(mine)
    assert (mine / "results.csv").read_text() == "a person's"


# -------------------------------------------------------------- messages a resume refuses with
def test_a_malformed_shardwise_json_is_named(tmp_path):
    path = _fake(tmp_path, 4, _cfg(tmp_path))
    (path / M.METADATA).write_text('{"format": 1,')
    with pytest.raises(ShardwiseError, match=rf"^checkpoint {path}: shardwise\.json is not "
                                             "valid JSON: "):
        M.read_metadata(path)


def test_a_changed_schedule_or_text_is_refused_in_one_line(tmp_path):
    """Saved at step 4 with weight decay 0.1 and clipping 1.0: the new 0.0 and 0.5 are both
    named, saved → new, with the --override that accepts them; then another text."""
    from shardwise.runtime.checkpoint.start import _check_compatible

    saved = _cfg(tmp_path, weight_decay=0.1, clip=1.0)
    meta = {"format": M.FORMAT, "step": 4, "world_size": 1, "config": json_config(saved)}
    changed = _cfg(tmp_path, weight_decay=0.0, clip=0.5)
    with pytest.raises(ShardwiseError) as info:
        _check_compatible(tmp_path, meta, changed)
    assert str(info.value) == (
        f"{tmp_path} took its 4 step(s) with another optimizer schedule (weight_decay=0.1 → "
        "0.0, clip=1.0 → 0.5); resume with the same settings, or say the change is meant "
        "with --override weight_decay,clip")
    _check_compatible(tmp_path, meta, replace(changed, override=("weight_decay", "clip")))
    text = tmp_path / "corpus.txt"
    text.write_text("one text")
    with_data = _cfg(tmp_path, data=str(text))
    meta = {"format": M.FORMAT, "step": 4, "world_size": 1, "config": json_config(with_data),
            "data_sha256": M.data_fingerprint(str(text))}
    _check_compatible(tmp_path, meta, with_data)
    text.write_text("another text")
    with pytest.raises(ShardwiseError) as info:
        _check_compatible(tmp_path, meta, with_data)
    assert str(info.value) == (
        f"{tmp_path} was trained on other text: the text of --data {text} changed since the "
        "checkpoint (SHA-256 differs); resume on the original text or start a new run in an "
        "empty directory")


def test_check_start_refusals_are_whole_sentences(tmp_path):
    """A checkpoint of step 4 (fp64, 8 steps): another model, dtype, or a run of 4 steps is
    refused with its full sentence; a directory shardwise did not write where this run would
    save (step 8, the last; step 6, every 2) too — not at 5 (no save) or 10 (past the run)."""
    from shardwise.runtime.checkpoint import check_start

    config = _cfg(tmp_path, checkpoint_every=2)
    path = _fake(tmp_path, 4, config)
    cases = [
        (replace(config, model=get_model("tiny-moe")),
         f"{path} holds model 'tiny', not 'tiny-moe' (or with other dimensions); it cannot "
         "resume this run"),
        (replace(config, dtype="fp32"), f"{path} was trained in fp64, this run in fp32; use "
                                        "dtype fp64"),
        (replace(config, steps=4), f"{path} is already at step 4 of steps=4; train for more "
                                   "steps to continue"),
        (replace(config, resume=False), f"{tmp_path} already holds checkpoints (newest: "
                                        "step-000004); resume from them (--resume) or choose "
                                        "an empty directory"),
    ]
    for changed, message in cases:
        with pytest.raises(ShardwiseError) as info:
            check_start(changed)
        assert str(info.value) == message
    assert check_start(config) == path
    (tmp_path / "step-000005").mkdir()  # not a save of this run (every 2)
    assert check_start(config) == path
    for step in (6, 8):
        foreign = tmp_path / M.checkpoint_name(step)
        foreign.mkdir()
        with pytest.raises(ShardwiseError) as info:
            check_start(config)
        assert str(info.value) == (f"this run would save checkpoint {foreign.name}, but "
                                   f"{D._foreign(foreign)}")
        foreign.rmdir()
    (tmp_path / M.checkpoint_name(10)).mkdir()  # past the run's 8 steps
    assert check_start(config) == path


# ---------------------------------------------------------------- damage, one sentence each
BIG = 3 * M.HASH_CHUNK + 7  # a shard of three hash chunks and a bit


def _big_checkpoint(root: Path) -> Path:
    payload = bytes((i * 131 + 7) % 251 for i in range(BIG))
    return _fake(root, 4, _cfg(root), {"__1_0.distcp": payload})


@pytest.mark.parametrize("at", [M.HASH_CHUNK - 1, M.HASH_CHUNK, 2 * M.HASH_CHUNK, BIG - 1])
def test_a_byte_changed_at_a_hash_chunk_boundary_fails_the_checksum(tmp_path, at):
    path = _big_checkpoint(tmp_path)
    assert M.damage(path) is None
    shard = path / "__1_0.distcp"
    with shard.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    assert M.damage(path) == ("__1_0.distcp fails its SHA-256 checksum (bytes changed since "
                              "the save)")


def test_each_damage_is_one_sentence(tmp_path):
    path = _big_checkpoint(tmp_path)
    shard = path / "__1_0.distcp"
    os.truncate(shard, BIG - M.HASH_CHUNK)
    assert M.damage(path) == (f"__1_0.distcp is {BIG - M.HASH_CHUNK} bytes, {BIG} when saved "
                              "(truncated or overwritten)")
    shard.unlink()
    assert M.damage(path) == "__1_0.distcp is missing"
    manifest = json.loads((path / M.MANIFEST).read_text())
    for name, what in ((M.MARKER, "shardwise's marker"), (M.METADATA, "shardwise's metadata"),
                       (M.DCP_METADATA, "DCP's metadata")):
        files = {k: v for k, v in manifest["files"].items() if k != name}
        (path / M.MANIFEST).write_text(json.dumps({"files": files}))
        assert M.damage(path) == (f"its manifest does not cover {name} ({what}): not a "
                                  "checkpoint shardwise wrote, or damaged")
    # DCP's own shard dropped from disk and manifest alike: .metadata still names it
    (path / "__0_0.distcp").unlink()
    M.write_manifest(path)
    assert M.damage(path) == ("DCP's .metadata names __0_0.distcp, which its manifest does "
                              "not cover")
    (path / M.DCP_METADATA).write_bytes(b"\x80not a pickle")
    M.write_manifest(path)
    assert M.damage(path).startswith("DCP's .metadata cannot be read (")
    (path / M.MANIFEST).write_text('{"files": {"x": {"bytes": "many"}}}')
    assert M.damage(path).startswith(f"its checksum manifest {M.MANIFEST} is unreadable or "
                                     "malformed (")
    (path / M.MANIFEST).unlink()
    assert M.damage(path) == f"its checksum manifest {M.MANIFEST} is missing"


def test_a_renamed_checkpoint_is_damage(tmp_path):
    path = _big_checkpoint(tmp_path).rename(tmp_path / "step-000099")
    assert M.damage(path) == ("shardwise.json says step 4 but the directory is step-000099 "
                              "(renamed or copied: its step cannot be trusted)")
    other = path.rename(tmp_path / "kept-aside")  # not a step name: its step is not checked
    assert M.damage(other) is None


# -------------------------------------------------------------------------------- the lock
def test_a_lock_that_cannot_be_read_or_keeps_being_taken_is_refused(tmp_path, monkeypatch):
    lock = tmp_path / M.LOCK
    lock.write_text("not a pid\n")
    with pytest.raises(ShardwiseError) as info:
        D.DirectoryLock(tmp_path).__enter__()
    assert str(info.value) == (f"{tmp_path} is in use by another run (an unreadable lock); "
                               "wait for it or use another --checkpoint-dir (if no such run "
                               f"is alive, delete {lock})")
    tries = []
    monkeypatch.setattr(D.DirectoryLock, "_refuse_or_clear", lambda self: tries.append(1))
    with pytest.raises(ShardwiseError) as info:  # cleared each time, and each time retaken
        D.DirectoryLock(tmp_path).__enter__()
    assert str(info.value) == f"could not lock {tmp_path} (another run keeps taking it)"
    assert len(tries) == 3 and lock.read_text() == "not a pid\n"
    assert [p.name for p in tmp_path.iterdir()] == [M.LOCK]  # its temporary file removed


def test_a_lock_naming_pid_0_is_unreadable_and_never_released_by_a_refused_run(tmp_path):
    """pid 0 is no process (kill(0, …) signals the caller's group): such a lock is refused
    as unreadable, not taken over; a lock object that never held it leaves it in place."""
    import socket

    lock = tmp_path / M.LOCK
    lock.write_text(f"0 {socket.gethostname()}\n")
    refused = D.DirectoryLock(tmp_path)
    with pytest.raises(ShardwiseError, match=r"in use by another run \(an unreadable lock\)"):
        refused.__enter__()
    refused.__exit__(None, None, None)
    assert lock.read_text() == f"0 {socket.gethostname()}\n"


def test_a_lock_holders_liveness_is_probed_without_a_signal():
    """`_alive` asks the kernel whether the holder exists (signal 0) and leaves it running:
    a live child is alive and still running afterwards (SIGHUP would end it), a reaped one is
    not alive."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert D._alive(child.pid)
        with pytest.raises(subprocess.TimeoutExpired):  # not signalled: still running
            child.wait(timeout=0.5)
    finally:
        child.kill()
        child.wait()
    assert not D._alive(child.pid)
