"""Sharded checkpoints: a resumed run follows the uninterrupted one, on the same layout or on
another, and no crash loses a finished checkpoint or a step.

The reference is always an uninterrupted run of `STEPS` steps (the `tiny` models in float64,
seq 32, global batch 8, AdamW with warm-up, cosine decay and clipping), never the resumed run:

* same layout, a new world resumed from the checkpoint at step `K`: every later loss and
  gradient norm, and the final parameters, equal the uninterrupted run's exactly (==);
* another layout (dp4 → dp2×tp2, dp2×pp2, ZeRO-3 + SP; ZeRO-2 + tp → dp4, pp2×tp2; MoE
  ep4 → pp2×ep2): the reduction order changes, so relative error ≤ 1e-10;
* a rank killed while publishing a checkpoint, a rank killed between checkpoints: the last
  complete checkpoint is the one found, the resumed run starts exactly at its step, and the
  steps logged by both runs cover 0..STEPS-1 once;
* the directory bookkeeping (newest complete checkpoint, `.tmp` leftovers, keep-K) and the
  flat-range → blocks arithmetic, without processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tests.cli_helpers import assert_one_line_error, shardwise
from tests.runtime.checkpoint_files import write_checkpoint

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.runtime import checkpoint
from shardwise.runtime.checkpoint import (
    METADATA,
    _blocks,
    _publish,
    check_start,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    prune,
    read_metadata,
    read_parameters,
)
from shardwise.runtime.checkpoint import save as checkpoint_save
from shardwise.runtime.launch import RankFailure, rank, spawn
from shardwise.runtime.state import json_config
from shardwise.runtime.train import TrainConfig, build, run, train

STEPS, K, EVERY = 8, 4, 2  # K: where the interrupted runs stop / resume
TOL = 1e-10


def config(layout: str = "dp=2", model: str = "tiny", dtype: str = "fp64", **kw
           ) -> TrainConfig:
    spec = get_model(model.removesuffix("-tied"))
    if model.endswith("-tied"):
        spec = spec.with_(name=model, tie_embeddings=True)
    return TrainConfig(spec, Layout.parse(layout), steps=STEPS, seq_len=32, global_batch=8,
                       lr=3e-3, min_lr=3e-4, warmup=2, clip=1.25, dtype=dtype, **kw)


def saving(cfg: TrainConfig, directory: Path | str, **kw) -> TrainConfig:
    return replace(cfg, checkpoint_dir=str(directory), checkpoint_every=EVERY, **kw)


# ------------------------------------------------------------------------------ on the ranks
class _Stop(Exception):
    """Ends a run after step K on every rank (a planned stop, not a crash)."""


def _stop_after_k(state, record) -> None:
    if state.step == K:
        raise _Stop


class _ParamsAt:
    """A hook keeping the gathered parameters after `step` steps (collective)."""

    def __init__(self, step: int):
        self.step, self.params = step, None

    def __call__(self, state, record) -> None:
        if state.step == self.step:
            self.params = state.model.full_parameters()


def _result(state, params_at: _ParamsAt | None = None) -> dict:
    """Records, and the gathered parameters from one rank per pipeline stage."""
    params = state.model.full_parameters()
    speaks = state.model.axis("dp_cp").rank == 0 and state.model.axis("tp").rank == 0
    return {"records": state.records, "params": params if speaks else None,
            "params_at": params_at.params if params_at and speaks else None}


def _uninterrupted_and_stopped(configs: list[TrainConfig], directories: list[str]) -> list:
    """Each config: an uninterrupted run, then a run saving every EVERY steps stopped at K."""
    out = []
    for cfg, directory in zip(configs, directories):
        uninterrupted = _result(train(cfg))
        stopped = build(saving(cfg, directory))
        with pytest.raises(_Stop):
            train(saving(cfg, directory), [_stop_after_k], stopped)
        out.append({"uninterrupted": uninterrupted, "stopped": stopped.records})
    return out


def _resumed(configs: list[TrainConfig]) -> list[dict]:
    return [_result(train(cfg)) for cfg in configs]


def _reference_saving_at_k(configs: list[TrainConfig]) -> list[dict]:
    """Uninterrupted runs that also save (after K and STEPS steps)."""
    out = []
    for cfg in configs:
        grab = _ParamsAt(K)
        out.append(_result(train(cfg, [grab]), grab))
    return out


def _resume_from(pairs: list[tuple[str, TrainConfig]]) -> list[dict]:
    """Build each config fresh, load the checkpoint given, train to the end."""
    out = []
    for path, cfg in pairs:
        state = build(cfg)
        assert load_checkpoint(state, path)
        assert state.step == K
        out.append(_result(train(cfg, state=state)))
    return out


_PUBLISH = checkpoint._publish  # save_checkpoint calls it from checkpoint.save


def _publish_or_die(tmp: Path, final: Path, keep: int) -> None:
    if final.name == checkpoint.checkpoint_name(K):  # every rank's files are written
        os.kill(os.getpid(), signal.SIGKILL)
    _PUBLISH(tmp, final, keep)


def _die_while_publishing_k(cfg: TrainConfig) -> None:
    if rank() == 0:
        checkpoint_save._publish = _publish_or_die
    train(cfg)


def _rank_one_dies_at_k(state, record) -> None:
    if torch.distributed.get_rank() == 1 and record.step == K:  # one step after a checkpoint
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------- checks
def gathered(results: list, pick) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for per_rank in results:
        out.update(pick(per_rank) or {})
    return out


def assert_same(got: list, want: list, exact: bool, where: str) -> None:
    """Records (steps, losses, gradient norms) equal: exactly or to TOL relative."""
    assert [r.step for r in got] == [r.step for r in want], where
    for g, w in zip(got, want):
        for name in ("loss", "grad_norm", "lr"):
            a, b = getattr(g, name), getattr(w, name)
            assert a == b if exact else a == pytest.approx(b, rel=TOL), (where, g.step, name)


def assert_params(got: dict, want: dict, exact: bool, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, w in want.items():
        if exact:
            assert torch.equal(got[name], w), (where, name)
        else:
            error = float((got[name] - w).abs().max() / w.abs().max())
            assert error <= TOL, (where, name, error)


TWO = [config("dp=2"), config("pp=2", "tiny-tied"), config("dp=2,ep=2", "tiny-moe"),
       config("dp=2,zero=3"), config("tp=2,sp=1,zero=1"),
       # mixed precision: the fp32 masters and moments are saved with the bf16 weights
       config("dp=2,zero=1", dtype="bf16"), config("dp=2,zero=3", dtype="bf16"),
       # fp32 gradient accumulation (main_grad): nothing more is saved, the resume is as exact
       config("dp=2,zero=2", dtype="bf16", grad_dtype="fp32")]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> tuple[Path, list[list[dict]]]:
    """Uninterrupted and stopped-at-K runs of every TWO layout, in one world."""
    root = tmp_path_factory.mktemp("two-ranks")
    return root, spawn(_uninterrupted_and_stopped, 2, TWO,
                       [str(root / f"run{i}") for i in range(len(TWO))], timeout_s=240)


def uninterrupted_dp2(first_runs) -> list:
    return first_runs[1][0][0]["uninterrupted"]["records"]


# ---------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_resume_on_the_same_layout_is_bit_identical(first_runs):
    root, first = first_runs
    dirs = [root / f"run{i}" for i in range(len(TWO))]
    assert all(latest_checkpoint(d).name == "step-000004" for d in dirs)
    second = spawn(_resumed, 2, [saving(c, d, resume=True) for c, d in zip(TWO, dirs)],
                   timeout_s=240)
    for i, cfg in enumerate(TWO):
        where = f"{cfg.model.name} {cfg.layout.short()}"
        want = first[0][i]["uninterrupted"]["records"]
        for per_rank in first:  # saving does not change the run
            assert_same(per_rank[i]["stopped"], want[:K], True, where)
        for per_rank in second:  # every rank's records: the global loss
            assert_same(per_rank[i]["records"], want[K:], True, where)
        final = gathered(first, lambda r, i=i: r[i]["uninterrupted"]["params"])
        assert_params(gathered(second, lambda r, i=i: r[i]["params"]), final, True, where)
        # The resumed run saved after steps 6 and 8 and pruned step 4 (keep 2); the last one,
        # read in this process with no process group, holds the final single-device weights.
        assert [p.name for p in complete_checkpoints(dirs[i])] == ["step-000006",
                                                                   "step-000008"]
        assert (dirs[i] / "latest").read_text() == "step-000008\n"
        assert_params(read_parameters(dirs[i] / "step-000008"), final, True, where)


SAVED = {"dp4": config("dp=4", checkpoint_every=K, checkpoint_keep=5),
         "zero2": config("dp=2,tp=2,zero=2,sp=1", checkpoint_every=K, checkpoint_keep=5),
         "moe": config("dp=4,ep=4", "tiny-moe", checkpoint_every=K, checkpoint_keep=5),
         # tiny's 2 kv heads over tp=4: each held by two tp ranks, saved once
         "kv-replicas": config("tp=4", checkpoint_every=K, checkpoint_keep=5)}
RESUMED = [("dp4", config("dp=2,tp=2")), ("dp4", config("dp=2,pp=2")),
           ("dp4", config("dp=2,tp=2,zero=3,sp=1")), ("zero2", config("dp=4")),
           ("zero2", config("pp=2,tp=2")), ("moe", config("dp=2,pp=2,ep=2", "tiny-moe")),
           ("kv-replicas", config("dp=2,tp=2,zero=1"))]


@pytest.mark.slow
def test_resume_on_another_layout_follows_the_uninterrupted_run(tmp_path):
    saved = {name: replace(cfg, checkpoint_dir=str(tmp_path / name))
             for name, cfg in SAVED.items()}
    first = spawn(_reference_saving_at_k, 4, list(saved.values()), timeout_s=240)
    reference = dict(zip(saved, zip(*first)))  # name -> every rank's result
    for name, per_rank in reference.items():  # one process, plain tensors
        at_k = gathered(per_rank, lambda r: r["params_at"])
        assert_params(read_parameters(tmp_path / name / "step-000004"), at_k, True, name)
    second = spawn(_resume_from, 4, [(str(tmp_path / name / "step-000004"), cfg)
                                     for name, cfg in RESUMED], timeout_s=240)
    for i, (name, cfg) in enumerate(RESUMED):
        where = f"{SAVED[name].layout.short()} -> {cfg.layout.short()}"
        want = reference[name]
        for per_rank in second:
            assert_same(per_rank[i]["records"], want[0]["records"][K:], False, where)
        assert_params(gathered(second, lambda r, i=i: r[i]["params"]),
                      gathered(want, lambda r: r["params"]), False, where)


@pytest.mark.slow
def test_a_crash_while_publishing_leaves_the_last_checkpoint(first_runs, tmp_path):
    cfg = saving(config("dp=2"), tmp_path)
    with pytest.raises(RankFailure, match="rank 0 died"):
        spawn(_die_while_publishing_k, 2, cfg, timeout_s=60)
    # Every rank wrote step 4, but it was never published: step 2 is the checkpoint.
    leftover, = tmp_path.glob("step-000004.tmp-*")
    assert (leftover / ".metadata").is_file() and (leftover / METADATA).is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"
    assert (tmp_path / "latest").read_text() == "step-000002\n"
    resumed = run(replace(cfg, resume=True), timeout_s=120)
    assert_same(resumed, uninterrupted_dp2(first_runs)[2:], True, "dp2 after the crash")
    assert not list(tmp_path.glob("*.tmp-*"))  # the next save removed the leftover


@pytest.mark.slow
@pytest.mark.timing
def test_a_killed_rank_resumes_without_losing_or_repeating_a_step(first_runs, tmp_path):
    log = tmp_path / "log.jsonl"
    cfg = saving(config("dp=2"), tmp_path / "ckpt", log_path=str(log))
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        run(cfg, hooks=[_rank_one_dies_at_k], timeout_s=30)
    assert time.monotonic() - start < 30
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(K + 1))  # the kill came after step K
    newest = latest_checkpoint(tmp_path / "ckpt")
    assert read_metadata(newest)["step"] == K  # step K itself was not saved

    resumed = run(replace(cfg, resume=True), timeout_s=120)
    assert resumed[0].step == K  # exactly at the checkpoint: step K is trained again
    steps = [r["step"] for r in logged if r["step"] < K] + [r.step for r in resumed]
    assert steps == list(range(STEPS))  # none lost, none repeated
    want = uninterrupted_dp2(first_runs)
    assert [r["loss"] for r in logged] == [r.loss for r in want[:K + 1]]
    assert_same(resumed, want[K:], True, "dp2 after the kill")
    final_log = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in final_log] == list(range(STEPS))
    assert [r["loss"] for r in final_log] == [r.loss for r in want]


# ------------------------------------------------------------------- no processes needed
@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2)])
def test_blocks_tile_a_flat_range_in_memory_order(shape):
    index = torch.arange(max(1, int(torch.tensor(shape).prod()))).view(shape)
    n = index.numel()
    for start in range(n):
        for stop in range(start + 1, n + 1):
            blocks = _blocks(shape, start, stop)
            assert len(blocks) <= max(1, 2 * len(shape) - 1)
            pieces = [index[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))].reshape(-1)
                      for offsets, sizes in blocks]
            assert torch.equal(torch.cat(pieces), torch.arange(start, stop)), (start, stop)


def fake_checkpoint(root: Path, name: str, step: int = 0, cfg: TrainConfig | None = None
                    ) -> Path:
    meta = {"format": checkpoint.FORMAT, "step": step, "world_size": 2,
            "config": json_config(cfg or config())}
    return write_checkpoint(root / name, meta)


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    fake_checkpoint(tmp_path, "step-000004")
    fake_checkpoint(tmp_path, "step-000010")
    fake_checkpoint(tmp_path, "step-000012.tmp-1f2e")  # unpublished
    (tmp_path / "step-000014").mkdir()  # no shardwise.json: not a checkpoint
    (tmp_path / "latest").write_text("step-000004\n")  # stale: the newest one wins
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000004", "step-000010"]


def test_publish_renames_points_latest_and_keeps_the_newest(tmp_path):
    for step in (2, 4, 6):
        tmp = fake_checkpoint(tmp_path, f"step-{step:06d}.tmp-{step}", step)
        fake_checkpoint(tmp_path, f"step-{step + 1:06d}.tmp-crashed", step + 1)
        _publish(tmp, tmp_path / f"step-{step:06d}", keep=2)
        assert (tmp_path / "latest").read_text() == f"step-{step:06d}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004",
                                                          "step-000006"]
    assert [p.name for p in prune(tmp_path, 1)] == ["step-000004"]
    with pytest.raises(ShardwiseError, match="keep must be ≥ 1"):
        prune(tmp_path, 0)


def test_check_start_refuses_what_would_mix_or_mismatch_runs(tmp_path):
    cfg = saving(config(), tmp_path)
    assert check_start(cfg) is None and check_start(replace(cfg, resume=True)) is None
    fake_checkpoint(tmp_path, "step-000004", 4, cfg)
    with pytest.raises(ShardwiseError, match="already holds checkpoints"):
        check_start(cfg)
    assert check_start(replace(cfg, resume=True)) == tmp_path / "step-000004"
    assert check_start(replace(cfg, resume=True, layout=Layout(tp=2))) is not None
    with pytest.raises(ShardwiseError, match="holds model 'tiny', not 'tiny-moe'"):
        check_start(replace(cfg, resume=True, model=get_model("tiny-moe")))
    with pytest.raises(ShardwiseError, match="trained in fp64, this run in fp32"):
        check_start(replace(cfg, resume=True, dtype="fp32"))
    with pytest.raises(ShardwiseError, match="already at step 4 of steps=4"):
        check_start(replace(cfg, resume=True, steps=4))
    for key, value in (("seq_len", cfg.seq_len * 2), ("global_batch", cfg.global_batch * 2),
                       ("seed", cfg.seed + 1), ("data", "other.txt")):
        with pytest.raises(ShardwiseError, match=f"trained with {key}="):
            check_start(replace(cfg, resume=True, **{key: value}))


# ---------------------------------------------------------------------------------- CLI
def test_cli_checkpoint_options_are_checked_in_one_line(tmp_path):
    assert_one_line_error(shardwise("train", "--resume", check=False),
                          "need a checkpoint directory")
    assert_one_line_error(shardwise("train", "--checkpoint-every", "2", check=False),
                          "need a checkpoint directory")
    fake_checkpoint(tmp_path, "step-000002", 2)
    assert_one_line_error(shardwise("train", "--checkpoint-dir", str(tmp_path), check=False),
                          "already holds checkpoints (newest: step-000002)", "--resume")


@pytest.mark.slow
def test_cli_saves_then_resumes_on_another_layout(tmp_path):
    common = ("--seq", "16", "--global-batch", "4", "--dtype", "fp64", "--quiet",
              "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2", "--resume")
    first = shardwise("train", "--dp", "2", "--steps", "4", *common, "--json")
    assert "note: no checkpoint in" in first.stderr and "starting from step 0" in first.stderr
    assert [r["step"] for r in json.loads(first.stdout)["records"]] == [0, 1, 2, 3]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000002", "step-000004"]
    # 6 steps instead of 4 move the cosine of step 3, already taken: said with --override
    second = shardwise("train", "--tp", "2", "--steps", "6", *common, "--override", "steps",
                       "--json")
    assert f"note: resuming from {tmp_path / 'step-000004'}" in second.stderr
    assert [r["step"] for r in json.loads(second.stdout)["records"]] == [4, 5]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000004", "step-000006"]
