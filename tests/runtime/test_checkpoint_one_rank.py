"""A checkpoint saved and loaded in this process by a world of one (a gloo group of one rank),
against the uninterrupted run: after resuming, the next step's parameters are bit-identical;
the saved tensors are the single-device model's (`read_parameters`: its names and shapes); AdamW's moments and step survive; the checkpoint verifies (`damage`).
Multi-rank saves and resumes on other layouts: tests/runtime/test_checkpoint.py."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from shardwise.arch import get_model  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.layout import Layout  # noqa: E402
from shardwise.runtime import train as T  # noqa: E402
from shardwise.runtime.checkpoint import (  # noqa: E402
    damage,
    latest_checkpoint,
    load_checkpoint,
    read_parameters,
    save_checkpoint,
)
from shardwise.runtime.state import TrainConfig  # noqa: E402


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])  # bf16: fp32 masters beside the weights
def test_save_then_resume_is_bit_identical(world_of_one, tmp_path, dtype):
    cfg = TrainConfig(get_model("tiny"), Layout(), steps=6, seq_len=16, global_batch=2,
                      dtype=dtype, lr=3e-3, warmup=1, checkpoint_dir=str(tmp_path / "ck"))
    state = T.build(cfg)
    for _ in range(2):
        T.train_step(state)
    path = save_checkpoint(state, tmp_path / "ck", keep=1)
    assert path.name == "step-000002" and damage(path) is None
    assert latest_checkpoint(tmp_path / "ck") == path
    saved = read_parameters(path)  # what a single-device Transformer loads: its names, shapes
    from shardwise.runtime.model import Transformer

    single = dict(Transformer(cfg.model).named_parameters())
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in single.items()}
    assert sum(v.numel() for v in saved.values()) == sum(
        p.numel() for p in state.model.parameters())
    reference = copy.deepcopy(state)
    T.train_step(reference)  # the uninterrupted run's step 3
    fresh = T.build(replace(cfg, resume=True))
    assert fresh.step == 0 and load_checkpoint(fresh, tmp_path / "ck") is True
    assert fresh.step == 2
    assert torch.equal(fresh.rng, state.rng)
    T.train_step(fresh)
    for a, b in zip(reference.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # the checkpoint directory itself loads too; a damaged one is named with its damage
    direct = T.build(replace(cfg, resume=True))
    assert load_checkpoint(direct, path) is True and direct.step == 2
    other = T.build(replace(cfg, resume=True, seq_len=32))
    with pytest.raises(ShardwiseError, match=r"trained with seq_len=16, this run has 32; "
                                             r"resume with --seq 16$"):
        load_checkpoint(other, path)
    # a second save keeps one checkpoint (keep=1)
    save_checkpoint(fresh, tmp_path / "ck", keep=1)
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")] == [
        "step-000003"]


def test_an_empty_directory_loads_nothing(world_of_one, tmp_path):
    cfg = TrainConfig(get_model("tiny"), Layout(), steps=2, seq_len=16, global_batch=2,
                      dtype="fp64")
    state = T.build(cfg)
    assert load_checkpoint(state, tmp_path) is False and state.step == 0


def test_a_fresh_run_refuses_a_directory_with_checkpoints_or_foreign_saves(tmp_path):
    """One line each: checkpoints there (resume or choose another), a directory shardwise did
    not write where this run would save (step 4 of every 4)."""
    from shardwise.runtime.checkpoint import check_start

    cfg = TrainConfig(get_model("tiny"), Layout(), steps=8, seq_len=16, global_batch=2,
                      dtype="fp64", checkpoint_dir=str(tmp_path), checkpoint_every=4)
    (tmp_path / "step-000004").mkdir()  # not ours: no marker, manifest or metadata
    with pytest.raises(ShardwiseError, match=r"would save checkpoint step-000004, but "):
        check_start(cfg)
    (tmp_path / "step-000004" / "shardwise.json").write_text("{}")
    with pytest.raises(ShardwiseError) as info:
        check_start(cfg)
    assert str(info.value) == (f"{tmp_path} already holds checkpoints (newest: step-000004); "
                               "resume from them (--resume) or choose an empty directory")
