"""Composed N-D training on real gloo ranks equals single-device training on the same data.

Every layout trains the `tiny` model (or `tiny-moe`, or `tiny` with tied embeddings) for 20
steps in float64 — seq 32, global batch 8, AdamW with warm-up and cosine decay, gradients
clipped to a global norm of `CLIP` — and is compared, step by step, with `reference`: the
single-device `Transformer` trained on each step's whole global batch with torch's own AdamW
and `clip_grad_norm_`, written out below (the parallel code produced none of it). Checked:

* the loss of every step (the global batch's mean) and the gradient norm before clipping,
  relative error ≤ 1e-10 (fp64; fp32: losses ≤ 1e-5, norms ≤ 1e-3, parameters ≤ 1e-4);
* the learning rate of every step against the schedule written here;
* the final parameters, gathered over tp, ep, ZeRO and the pipeline stages, against the
  reference's, relative to each tensor's largest entry ≤ 1e-10;
* that `CLIP` cuts some steps and not others in the reference, so both branches are compared.

Layouts are grouped into one spawned world per size (2, 4, 8 ranks); each builds a fresh mesh.
"""

import functools
import json
import math
import os
import signal
import time

import pytest
import torch
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

from shardwise.arch import get_model
from shardwise.layout import Layout
from shardwise.runtime.data import Batches, load_tokens
from shardwise.runtime.launch import RankFailure, spawn
from shardwise.runtime.model import Transformer
from shardwise.runtime.train import DTYPES, TrainConfig, run, train

STEPS, SEQ, BATCH, CLIP = 20, 32, 8, 1.25
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 3
TOL = {"fp64": 1e-10, "fp32": 1e-5}
NORM_TOL = {"fp64": 1e-10, "fp32": 1e-3}  # fp32: one steep step amplifies the rounding
PARAM_TOL = {"fp64": 1e-10, "fp32": 1e-4}


# preset variants: "-tied" ties the embeddings, "-mqa" keeps one kv head (tp=2 replicates it),
# "-6l" has six layers
VARIANTS = {"-tied": {"tie_embeddings": True}, "-mqa": {"n_kv_heads": 1},
            "-6l": {"n_layers": 6}}  # six layers: room for uneven interleaved stages


def config(layout: str = "", model: str = "tiny", dtype: str = "fp64", **kw) -> TrainConfig:
    suffix = next((v for v in VARIANTS if model.endswith(v)), "")
    spec = get_model(model.removesuffix(suffix) if suffix else model)
    if suffix:
        spec = spec.with_(name=model, **VARIANTS[suffix])
    return TrainConfig(spec, Layout.parse(layout), steps=STEPS, seq_len=SEQ,
                       global_batch=BATCH, lr=LR, min_lr=MIN_LR, warmup=WARMUP, clip=CLIP,
                       dtype=dtype, **kw)


def schedule(step: int) -> float:
    """Linear warm-up to LR over WARMUP steps, cosine to MIN_LR at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / (STEPS - 1 - WARMUP)
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * t)) / 2


@functools.lru_cache
def reference(model: str, dtype: str):
    """Single device, whole global batch: losses, pre-clip norms, final parameters."""
    cfg = config("", model, dtype)
    net = Transformer(cfg.model, dtype=DTYPES[dtype], seed=cfg.seed)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    batches = Batches(load_tokens(), SEQ, BATCH, cfg.seed)
    losses, norms = [], []
    for step in range(STEPS):
        rows = batches.global_rows(step)  # (B, s + 1)
        opt.zero_grad()
        loss = net.loss(rows[:, :-1], rows[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in net.named_parameters()}


# ------------------------------------------------------------------------------ on the ranks
def _train_layouts(configs: list[TrainConfig]) -> list[dict]:
    """Every rank: train each config; return its records and, from one rank per pipeline
    stage, the gathered parameters."""
    rows = []
    for cfg in configs:
        state = train(cfg)
        params = state.model.full_parameters()
        speaks = state.model.axis("dp_cp").rank == 0 and state.model.axis("tp").rank == 0
        rows.append({"records": state.records, "params": params if speaks else None})
    return rows


def _check(results: list[list[dict]], configs: list[TrainConfig]) -> None:
    for i, cfg in enumerate(configs):
        where = f"{cfg.model.name} {cfg.layout.short()} {cfg.dtype}"
        losses, norms, params = reference(cfg.model.name, cfg.dtype)
        records = results[0][i]["records"]
        assert [r.step for r in records] == list(range(STEPS))
        for rank_rows in results:  # every rank reports the same global loss
            assert [r.loss for r in rank_rows[i]["records"]] == [r.loss for r in records]
        for r in records:
            assert r.loss == pytest.approx(losses[r.step], rel=TOL[cfg.dtype]), (where, r)
            assert r.grad_norm == pytest.approx(norms[r.step], rel=NORM_TOL[cfg.dtype]), (
                where, r)
            assert r.lr == pytest.approx(schedule(r.step), rel=1e-15)
        gathered: dict[str, torch.Tensor] = {}
        for rank_rows in results:
            gathered.update(rank_rows[i]["params"] or {})
        assert sorted(gathered) == sorted(params), where
        for name, want in params.items():
            error = float((gathered[name] - want).abs().max() / want.abs().max())
            assert error <= PARAM_TOL[cfg.dtype], (where, name, error)


def test_reference_clips_some_steps_and_not_others():
    _, norms, _ = reference("tiny", "fp64")
    assert min(norms) < CLIP < max(norms)


# ---------------------------------------------------------------------------------- worlds
TWO = [config("dp=2"), config("tp=2"), config("tp=2,sp=1,recompute=full"),
       config("pp=2"), config("pp=2,schedule=interleaved,chunks=2"),
       config("pp=2,schedule=gpipe", "tiny-tied"), config("cp=2"),
       config("dp=2,ep=2", "tiny-moe"), config("dp=2,zero=3"),
       config("dp=2,tp=1,mbs=2", dtype="fp32"), config("tp=2", dtype="fp32"),
       config("pp=2,schedule=zb-h1", "tiny-tied"),
       config("pp=2,schedule=zb-h1,recompute=full"), config("dp=2,zero=3,recompute=full"),
       config("cp=2,cp_kind=ulysses")]


@pytest.mark.slow
def test_two_ranks_dp_tp_sp_pp_cp_ep_zero3_equal_single_device():
    _check(spawn(_train_layouts, 2, TWO, timeout_s=240), TWO)


FOUR = [config("tp=2,cp=2"), config("dp=2,cp=2,zero=2"), config("dp=2,tp=2,zero=3,sp=1"),
        config("dp=2,pp=2,ep=2,recompute=selective", "tiny-moe"),
        config("pp=4,schedule=zb-h1,mbs=2"),
        config("tp=4")]  # tiny has 2 kv heads: replicated over pairs of tp ranks


@pytest.mark.slow
def test_four_ranks_tp_cp_zero_sp_ep_pp_replicated_kv_equal_single_device():
    _check(spawn(_train_layouts, 4, FOUR, timeout_s=240), FOUR)


UNEVEN = [config("pp=2,partition=3:1"), config("pp=2,partition=1:3,schedule=gpipe"),
          config("pp=2,schedule=interleaved,chunks=2,partition=4:2", "tiny-6l")]


@pytest.mark.slow
def test_uneven_pipeline_stages_equal_single_device():
    """tiny's 4 layers as 3 + 1 and 1 + 3 (`Layout.partition`), and 6 layers as 4 + 2 over two
    chunks each (Megatron's rule: stage 0 holds layers 0-1 and 3-4, stage 1 layers 2 and 5):
    fp64 parity."""
    _check(spawn(_train_layouts, 2, UNEVEN, timeout_s=240), UNEVEN)


# ZeRO compositions: tied embeddings (one parameter, two modules), ZeRO-1 with experts over edp
ZERO_TWO = [config("dp=2,zero=3", "tiny-tied"), config("dp=2,ep=2,zero=1", "tiny-moe")]


@pytest.mark.slow
def test_two_ranks_zero_with_tied_embeddings_and_experts_equal_single_device():
    _check(spawn(_train_layouts, 2, ZERO_TWO, timeout_s=240), ZERO_TWO)


# ZeRO over each pipeline stage's dp group (Megatron's distributed optimizer), a tied
# embedding split between the first and the last stage; ZeRO-2 and ZeRO-3 under ZB-H1 (B of
# micro-batch j+1 runs before W of j: the reduce-scatter waits for W; ZeRO-3's with full
# recompute, whose replay re-gathers the weights and defers the linears' dW as F did)
ZERO_FOUR = [config("dp=2,pp=2,zero=1"), config("dp=2,pp=2,zero=2,schedule=gpipe"),
             config("dp=2,pp=2,zero=3", "tiny-tied"), config("dp=2,pp=2,zero=2,schedule=zb-h1"),
             config("dp=2,pp=2,zero=3,schedule=zb-h1"),
             config("dp=2,pp=2,zero=3,schedule=zb-h1,recompute=full", "tiny-tied")]


@pytest.mark.slow
def test_four_ranks_zero_over_pipeline_stages_equal_single_device():
    _check(spawn(_train_layouts, 4, ZERO_FOUR, timeout_s=240), ZERO_FOUR)


# Hybrid ZeRO (HSDP): shard within groups of 2 dp(·cp) ranks, average across the groups; with
# ep=2 the experts' edp ranks of a group (one here) shard them, averaged over the groups
ZERO_HYBRID = [config("dp=4,zero=1,zero_group=2"), config("dp=2,cp=2,zero=3,zero_group=2"),
               config("dp=4,ep=2,zero=3,zero_group=2", "tiny-moe")]


@pytest.mark.slow
def test_four_ranks_hybrid_zero_groups_equal_single_device():
    _check(spawn(_train_layouts, 4, ZERO_HYBRID, timeout_s=240), ZERO_HYBRID)


# ZeRO-2/3 with experts sharded over edp (groups of 2), ZeRO with a kv head replicated over tp
ZERO_MORE = [config("dp=4,ep=2,zero=2", "tiny-moe"), config("dp=4,ep=2,zero=3", "tiny-moe"),
             config("dp=2,tp=2,zero=2", "tiny-mqa")]


@pytest.mark.slow
def test_four_ranks_zero_with_experts_and_replicated_kv_heads_equal_single_device():
    _check(spawn(_train_layouts, 4, ZERO_MORE, timeout_s=400), ZERO_MORE)


EIGHT = [config("dp=2,tp=2,pp=2")]


@pytest.mark.slow
def test_eight_ranks_dp2_tp2_pp2_equal_single_device():
    _check(spawn(_train_layouts, 8, EIGHT, timeout_s=240), EIGHT)


# --------------------------------------------------------------------------------- failures
def _die_on_rank_one(state, record) -> None:
    if torch.distributed.get_rank() == 1 and record.step == 2:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timing
def test_a_killed_rank_fails_the_run_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        run(config("dp=2"), hooks=[_die_on_rank_one], timeout_s=30)
    assert time.monotonic() - start < 30


def test_impossible_layouts_are_one_line_errors():
    assert_one_line_error(shardwise("train", "--tp", "3", check=False),
                          "tp=3 does not divide n_heads=4")
    assert_one_line_error(shardwise("train", "--model", "tiny-moe", "--dp", "6", "--ep", "2",
                                    "--zero", "1", "--zero-group", "3", "--global-batch", "6",
                                    check=False),
                          "neither a multiple nor a divisor of ep=2")
    assert_one_line_error(shardwise("train", "--ep", "2", "--dp", "2", check=False),
                          "needs a mixture-of-experts model")


def test_too_little_text_is_a_one_line_error(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("far too short")
    assert_one_line_error(shardwise("train", "--data", str(text), check=False),
                          "fewer than one global batch")


def test_world_size_mismatch_under_torchrun_is_a_one_line_error(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(name, value)
    assert_one_line_error(shardwise("train", "--dp", "2", check=False),
                          "needs dp·tp·pp·cp = 2·1·1·1 = 2 ranks but torchrun started 4")


@pytest.mark.slow
def test_cli_trains_on_a_text_file_and_writes_log_and_plot(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("Every rank reads its own shard of the global batch. " * 40)
    log, png = tmp_path / "log.jsonl", tmp_path / "loss.png"
    out = shardwise_json("train", "--dp", "2", "--tp", "2", "--steps", "3", "--seq", "16",
                         "--global-batch", "4", "--data", str(text), "--log", str(log),
                         "--plot", str(png), "--quiet")
    assert out["ranks"] == 4 and [r["step"] for r in out["records"]] == [0, 1, 2]
    lines = log.read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [r["loss"] for r in out["records"]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_torchrun_runs_the_train_command_in_place():
    """`torchrun … -m shardwise train` (the README's multi-node command, on one node): the
    ranks torchrun started run the CLI's train command in place and follow the same loss
    curve as the ranks `shardwise train` spawns itself."""
    import subprocess
    import sys

    args = ["train", "--dp", "2", "--steps", "3", "--seq", "16", "--global-batch", "4",
            "--dtype", "fp64", "--quiet"]
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "shardwise", *args, "--json"], capture_output=True, text=True, timeout=240)
    assert torchrun.returncode == 0, torchrun.stderr
    under_torchrun = json.loads(torchrun.stdout)  # rank 0 alone prints
    spawned = shardwise_json(*args)
    assert under_torchrun["ranks"] == 2
    assert ([r["loss"] for r in under_torchrun["records"]]
            == pytest.approx([r["loss"] for r in spawned["records"]], rel=1e-12))
