"""Checkpoints prove themselves (issue 32, class 2): every file of a checkpoint is in its
manifest and every file DCP's metadata names is verified, the step inside is the directory's,
shardwise touches only directories it wrote, a checkpoint DCP cannot load is damage like any
other, and a resume that changes the optimizer schedule of the steps already taken says so.

References: the damage each test does itself (the file it changed, dropped or added); the
directory entries the test created (what is not shardwise's must still be there); the
learning rate `train_step` used at each step taken (`TrainConfig.lr_at` under the saved
settings); and, for the runs, the losses of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.cli_helpers import shardwise
from tests.runtime.checkpoint_files import write_checkpoint

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.runtime import checkpoint
from shardwise.runtime.checkpoint import (
    MANIFEST,
    MARKER,
    METADATA,
    check_start,
    damage,
    prune,
    write_manifest,
)
from shardwise.runtime.state import json_config
from shardwise.runtime.train import TrainConfig

TMP = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def cfg(directory: Path, **kw) -> TrainConfig:
    return TrainConfig(get_model("tiny"), Layout(dp=2), seq_len=16, global_batch=4,
                       checkpoint_dir=str(directory), resume=True, **({"steps": 8} | kw))


def fake(root: Path, step: int, config: TrainConfig, name: str | None = None) -> Path:
    meta = {"format": checkpoint.FORMAT, "step": step, "world_size": 2,
            "config": json_config(config), "data_sha256": checkpoint.data_fingerprint(None)}
    return write_checkpoint(root / (name or checkpoint.checkpoint_name(step)), meta)


def _listed(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())["files"]


def _unlist(path: Path, name: str) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"][name]
    (path / MANIFEST).write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- damage
DAMAGE = ["flip", "truncate", "delete", "unlist", "unlist+flip", "add", "rename",
          "restep", "unmark", "dcp-shard-gone"]


@settings(TMP, max_examples=40)
@given(kind=st.sampled_from(DAMAGE), data=st.data())
def test_every_kind_of_damage_is_named(tmp_path_factory, kind, data):
    """A checkpoint is intact exactly when nothing was done to it; each damage is named
    with the file it touched (or the step it contradicts), never loaded unverified."""
    root = tmp_path_factory.mktemp("ck")
    path = fake(root, 4, cfg(root))
    assert damage(path) is None
    files = sorted(_listed(path))
    name = data.draw(st.sampled_from(files), label="file")
    target = path / name
    size = target.stat().st_size  # (.metadata's varies from run to run: draw a fraction)
    where = data.draw(st.floats(0, 1), label="where")
    if kind in ("flip", "unlist+flip"):
        at = int(where * (size - 1))
        raw = bytearray(target.read_bytes())
        raw[at] ^= 0xFF
        target.write_bytes(bytes(raw))
    if kind == "truncate":
        os.truncate(target, int(where * (size - 1)))
    elif kind == "delete":
        target.unlink()
    elif kind in ("unlist", "unlist+flip"):
        _unlist(path, name)
    elif kind == "add":
        name = data.draw(st.sampled_from(["__2_0.distcp", "extra.bin", "sub/x"]))
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(b"12345678")
    elif kind == "rename":
        path = path.rename(root / "step-000099")
        name = "step-000099"
    elif kind == "restep":
        meta = json.loads((path / METADATA).read_text()) | {"step": 6}
        (path / METADATA).write_text(json.dumps(meta))
        write_manifest(path)
        name = "says step 6"
    elif kind == "unmark":
        (path / MARKER).unlink()
        (path / MANIFEST).unlink()
        write_manifest(path)
        name = MARKER
    elif kind == "dcp-shard-gone":
        (path / "__0_0.distcp").unlink()
        _unlist(path, "__0_0.distcp")
        name = "__0_0.distcp"
    problem = damage(path)
    assert problem is not None and name in problem and "\n" not in problem, (kind, problem)


def test_a_checkpoint_named_for_another_step_is_skipped_for_the_true_newest(tmp_path):
    config = cfg(tmp_path)
    fake(tmp_path, 2, config)
    newest = fake(tmp_path, 4, config)
    shutil.copytree(tmp_path / "step-000002", tmp_path / "step-000099")  # holds step 2
    heard: list[str] = []
    assert check_start(config, report=heard.append) == newest
    assert "step-000099" in heard[0] and "says step 2" in heard[0]


# ---------------------------------------------------------------------------- prune
@settings(TMP, max_examples=30)
@given(ours=st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
       liars=st.lists(st.integers(41, 60), max_size=2, unique=True),
       foreign=st.lists(st.integers(0, 60), max_size=3, unique=True),
       keep=st.integers(1, 3), data=st.data())
def test_prune_removes_only_old_checkpoints_and_leftovers_shardwise_wrote(
        tmp_path_factory, ours, liars, foreign, keep, data):
    root = tmp_path_factory.mktemp("ck")
    config = cfg(root)
    for step in ours:
        fake(root, step, config)
    for step in liars:  # our files, but shardwise.json names another step
        fake(root, step, config, name=f"step-{step + 100:06d}")
    mine = [root / f"step-{n:06d}" for n in foreign if not (root / f"step-{n:06d}").exists()]
    for path in mine:  # a person's directories that happen to look like checkpoints
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    users = [root / "notes.tmp-1", root / "step-000003.tmp-mine", root / "latest.tmp-x"]
    users[0].write_text("a user's file")
    users[1].mkdir()
    (users[1] / "data").write_text("a user's directory, no marker")
    users[2].write_text("not our pointer's name")
    leftovers = [root / f"step-000007.tmp-{uuid.uuid4().hex}",
                 root / f"latest.tmp-{uuid.uuid4().hex}"]
    leftovers[0].mkdir()
    (leftovers[0] / MARKER).write_text("")
    (leftovers[0] / "__0_0.distcp").write_bytes(b"half")
    leftovers[1].write_text("step-000007\n")
    newest = root / f"step-{data.draw(st.sampled_from(ours)):06d}"
    removed = prune(root, keep, newest=newest)
    trusted = sorted(n for n in ours if n <= int(newest.name[5:]))
    assert sorted(p.name for p in removed if p.name.startswith("step-") and ".tmp-" not in
                  p.name) == [f"step-{n:06d}" for n in trusted[:-keep]]
    assert all(p.exists() for p in [*mine, *users, newest])
    assert all((root / f"step-{n + 100:06d}").exists() for n in liars)
    assert all((root / f"step-{n:06d}").exists() for n in ours if n > int(newest.name[5:]))
    assert not any(p.exists() for p in leftovers)


def test_a_save_never_replaces_a_directory_shardwise_did_not_write(tmp_path):
    config = replace(cfg(tmp_path), resume=False, checkpoint_every=2, steps=4)
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "results.csv").write_text("a person's results")
    with pytest.raises(ShardwiseError, match="step-000004 exists and was not written by"):
        check_start(config)
    assert checkpoint._start_save(tmp_path / "step-000004")[1] is not None
    assert (tmp_path / "step-000004" / "results.csv").exists()
    assert check_start(replace(config, steps=3, checkpoint_every=0)) is None  # saves step 3


# ------------------------------------------------------------------ schedule changes
SCHEDULES = st.fixed_dictionaries({
    "lr": st.sampled_from([3e-3, 1e-3, 3e-3 + 1e-12]), "min_lr": st.sampled_from([3e-4, 0.0]),
    "warmup": st.integers(0, 4), "steps": st.integers(6, 12),
    "weight_decay": st.sampled_from([0.1, 0.0]), "clip": st.sampled_from([1.0, 0.5])})


@settings(TMP, max_examples=60)
@given(saved=SCHEDULES, new=SCHEDULES, start=st.integers(1, 5), named=st.booleans())
def test_a_resume_that_changes_the_schedule_of_steps_taken_is_refused(
        tmp_path_factory, saved, new, start, named):
    """Refused exactly when a step already taken ran with another learning rate, weight
    decay or clipping than the new settings give it, unless --override names each change;
    then the resumed run is the run the new settings describe."""
    root = tmp_path_factory.mktemp("ck")
    before = cfg(root, **saved)
    fake(root, start, before)
    after = cfg(root, **new)
    changed = {k for k in ("weight_decay", "clip") if saved[k] != new[k]}
    if any(before.lr_at(k) != after.lr_at(k) for k in range(start)):  # what train_step used
        changed |= {k for k in ("lr", "min_lr", "warmup", "steps") if saved[k] != new[k]}
    if named:
        after = replace(after, override=tuple(changed))
    if changed and not named:
        with pytest.raises(ShardwiseError, match="--override") as info:
            check_start(after)
        assert all(k in str(info.value) for k in changed)
    else:
        assert check_start(after) == root / checkpoint.checkpoint_name(start)


def test_cli_refuses_a_changed_learning_rate_until_override_names_it(tmp_path, capsys):
    """Before any rank starts (the command in this process: nothing is launched)."""
    from shardwise.cli import main

    fake(tmp_path, 2, replace(cfg(tmp_path), seed=0))
    common = ("train", "--dp", "2", "--seq", "16", "--global-batch", "4", "--steps", "8",
              "--checkpoint-dir", str(tmp_path), "--resume")
    for extra, fragments in (
            (("--lr", "0.01"), ("another optimizer schedule", "lr=0.003 → 0.01",
                                "--override lr")),
            (("--lr", "0.01", "--override", "warmup"), ("--override lr",)),
            (("--override", "momentum"), ("override names 'momentum'",))):
        with pytest.raises(SystemExit) as exit_:
            main([*common, *extra])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1, lines
        assert all(f in lines[0] for f in fragments), lines[0]


# ----------------------------------------------------------------------- real ranks
COMMON = ("--dp", "2", "--seq", "16", "--global-batch", "4", "--quiet", "--json",
          "--checkpoint-every", "2", "--resume")


def _losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in json.loads(result.stdout)["records"]}


@pytest.mark.slow
def test_real_resumes_trust_only_what_they_verify(tmp_path):
    """One run of 4 steps (checkpoints at 2 and 4), then resumes from copies of its
    directory: (a) step 4's shard changed and dropped from its manifest; (b) step 4's shard
    truncated with a manifest rewritten to match (only DCP can tell), beside a copy of step 2
    named step-000099 and a person's files. Both fall back to step 2 and reproduce the
    uninterrupted losses; (b) then saves steps 4 and 6 and prunes only step 2."""
    base = tmp_path / "base"
    first = shardwise("train", "--steps", "4", "--checkpoint-dir", str(base), *COMMON)
    want = _losses(first)

    unlisted = tmp_path / "a"
    shutil.copytree(base, unlisted)
    shard = unlisted / "step-000004" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-8:] = bytes(8)
    shard.write_bytes(bytes(raw))
    _unlist(unlisted / "step-000004", "__0_0.distcp")
    again = shardwise("train", "--steps", "4", "--checkpoint-dir", str(unlisted), *COMMON)
    assert "__0_0.distcp is not in its manifest" in again.stderr
    assert _losses(again) == {k: want[k] for k in (2, 3)}

    other = tmp_path / "b"
    shutil.copytree(base, other)
    shard = other / "step-000004" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    (other / "step-000004" / MANIFEST).unlink()
    write_manifest(other / "step-000004")  # damage() passes: only DCP can tell
    assert damage(other / "step-000004") is None
    shutil.copytree(other / "step-000002", other / "step-000099")
    (other / "notes.tmp-1").write_text("a person's file")
    (other / "step-000005.tmp-mine").mkdir()
    # 6 steps: the cosine of step 3, not taken yet when resuming from step 2, moves (step 4,
    # which looks intact until DCP reads it, has taken it: hence --override steps)
    again = shardwise("train", "--steps", "6", "--override", "steps", "--checkpoint-dir",
                      str(other), *COMMON)
    assert "step-000099 is damaged" in again.stderr
    assert "step-000004 cannot be loaded" in again.stderr
    losses = _losses(again)
    assert list(losses) == [2, 3, 4, 5] and {k: losses[k] for k in (2, 3)} == {
        k: want[k] for k in (2, 3)}  # steps 2 and 3 ran after updates at the same rates
    assert sorted(p.name for p in other.iterdir()) == [
        "latest", "notes.tmp-1", "step-000004", "step-000005.tmp-mine", "step-000006",
        "step-000099"]
    assert damage(other / "step-000004") is None  # the save replaced the damaged one


def _replace_with_a_file(state, record) -> None:
    """After the last step, on rank 0: the --save-hf directory becomes a file."""
    from shardwise.runtime.launch import rank

    target = Path(state.config.save_hf)
    if state.step == state.config.steps and rank() == 0:
        shutil.rmtree(target, ignore_errors=True)
        target.write_text("in the way")


@pytest.mark.slow
def test_a_failed_save_hf_keeps_the_model_and_says_where(tmp_path):
    """The model the run saved elsewhere is the model of its last checkpoint."""
    import torch

    from shardwise.runtime.hf import load_hf_weights
    from shardwise.runtime.launch import RankFailure
    from shardwise.runtime.model import Transformer
    from shardwise.runtime.train import run

    config = replace(cfg(tmp_path / "ck"), resume=False, steps=2, dtype="fp64",
                     save_hf=str(tmp_path / "hf"))
    with pytest.raises(RankFailure) as info:
        run(config, hooks=[_replace_with_a_file], timeout_s=120)
    message = str(info.value).splitlines()[0]
    assert f"cannot write the model to {tmp_path / 'hf'}" in message
    spare = Path(message.split("was written to ")[1].split(" instead")[0])
    model = Transformer(config.model, dtype=torch.float64)
    load_hf_weights(model, spare)
    saved = checkpoint.read_parameters(tmp_path / "ck" / "step-000002")
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    shutil.rmtree(spare)


@pytest.mark.slow
def test_a_diverging_run_stops_in_one_line(tmp_path):
    result = shardwise("train", "--steps", "4", "--lr", "1e30", "--clip", "0", "--seq", "16",
                       "--global-batch", "2", "--quiet", "--checkpoint-dir",
                       str(tmp_path), "--checkpoint-every", "1", check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "training diverged" in lines[0]
    step = int(lines[0].split("step ")[1].split(":")[0])
    kept = sorted(p.name for p in tmp_path.glob("step-*"))
    assert kept == [checkpoint.checkpoint_name(s) for s in range(1, step + 1)][-2:]
    assert all(damage(tmp_path / k) is None for k in kept)
