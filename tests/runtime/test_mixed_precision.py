"""Mixed precision (bf16 weights and compute, fp32 master weights and AdamW state,
`runtime.mixed_precision`) on every parallel axis equals one device with the same recipe.

The reference (`reference`) is written out here with torch's own pieces. A parallel run
computes the same function in another summation order (tp splits the GEMMs' inner sums and
adds the parts in bf16, dp/ZeRO sum the ranks' bf16 gradients, cp merges attention blocks
online), so the runs differ by bf16 rounding, unit roundoff u = 2^-8, not by fp64's 1e-16.
Tolerances, derived from u:

* loss (every step), relative ≤ u/4 = 2^-10: the loss is the mean over N = B·s = 256 tokens of
  fp32 cross-entropies of bf16 logits; independent roundings of ≤ u per logit average down by
  √N = 16, times a 4× margin for the weights' drift over the steps (measured ≤ 2e-4; the same
  training in fp64 (its own fp64 initial draw) differs from the bf16 reference by 2.7e-2, > 25× the tolerance — the test
  below checks it, so a run that lost the recipe cannot pass);
* gradient norm before clipping (every step), relative ≤ 2u: each gradient element carries at
  most two roundings the reference does not (the rank's partial sum, the bf16 reduction)
  (measured ≤ 1.3e-3);
* final fp32 master weights, per tensor ‖Δ‖_F ≤ ‖w_T − w_0‖_F / 4 (a quarter of the distance
  the reference's weights travelled): Adam's update m/√v does not scale with the gradient, so
  an element whose gradient is at the rounding level can take a full lr step the other way;
  such elements are few (measured ≤ 0.092, under cp, whose online-softmax merge rounds most).
"""

import functools

import pytest
import torch
from tests.cli_helpers import assert_one_line_error, shardwise

from shardwise.arch import get_model
from shardwise.layout import Layout
from shardwise.runtime.data import Batches, load_tokens
from shardwise.runtime.launch import spawn
from shardwise.runtime.model import Transformer
from shardwise.runtime.train import TrainConfig, train

STEPS, SEQ, BATCH, CLIP = 6, 32, 8, 1.25
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2


def config(layout: str = "", model: str = "tiny", dtype: str = "bf16") -> TrainConfig:
    return TrainConfig(get_model(model), Layout.parse(layout), steps=STEPS, seq_len=SEQ,
                       global_batch=BATCH, lr=LR, min_lr=MIN_LR, warmup=WARMUP, clip=CLIP,
                       dtype=dtype)


@functools.lru_cache
def reference(model: str, dtype: str = "bf16"):
    """One device, the whole global batch, the recipe written out with torch's own pieces:
    bf16 `Transformer`, fp32 masters, `clip_grad_norm_` on the fp32 copies of the gradients,
    `torch.optim.AdamW` on the masters, weights ← bf16(master)."""
    cfg = config("", model, dtype)
    net = Transformer(cfg.model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float64,
                      seed=cfg.seed)
    params = list(net.parameters())
    master = torch.float32 if dtype == "bf16" else torch.float64  # fp64: no separate master
    masters = [p.detach().to(master).clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    batches = Batches(load_tokens(), SEQ, BATCH, cfg.seed)
    losses, norms = [], []
    for step in range(STEPS):
        rows = batches.global_rows(step)  # (B, s + 1)
        net.zero_grad()
        loss = net.loss(rows[:, :-1], rows[:, 1:])
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.to(master)
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(loss.item())
    names = [n for n, _ in net.named_parameters()]
    return losses, norms, dict(zip(names, masters))


# ------------------------------------------------------------------------------ on the ranks
def _train_layouts(configs: list[TrainConfig]) -> list[dict]:
    """Every rank: train each config; its records and, from one rank per pipeline stage, the
    fp32 master weights gathered over tp, ep, ZeRO."""
    rows = []
    for cfg in configs:
        state = train(cfg)
        masters = state.model.full_parameters(state.optimizer.masters)
        speaks = state.model.axis("dp_cp").rank == 0 and state.model.axis("tp").rank == 0
        rows.append({"records": state.records, "masters": masters if speaks else None})
    return rows


LOSS_TOL, NORM_TOL, PARAM_TOL = 2.0**-10, 2.0**-7, 0.25

LAYOUTS = [config("dp=2"), config("dp=2,zero=1"), config("dp=2,zero=2"), config("dp=2,zero=3"),
           config("tp=2,sp=1"), config("pp=2"), config("cp=2"),
           config("dp=2,ep=2", "tiny-moe")]


@pytest.mark.slow
def test_mixed_precision_on_every_axis_equals_one_device():
    results = spawn(_train_layouts, 2, LAYOUTS, timeout_s=480)
    for i, cfg in enumerate(LAYOUTS):
        where = f"{cfg.model.name} {cfg.layout.short()}"
        losses, norms, masters = reference(cfg.model.name)
        records = results[0][i]["records"]
        assert [r.step for r in records] == list(range(STEPS))
        for r in records:
            assert r.loss == pytest.approx(losses[r.step], rel=LOSS_TOL), (where, r)
            assert r.grad_norm == pytest.approx(norms[r.step], rel=NORM_TOL), (where, r)
        gathered: dict[str, torch.Tensor] = {}
        for rank_rows in results:
            gathered.update(rank_rows[i]["masters"] or {})
        assert sorted(gathered) == sorted(masters), where
        start = initial(cfg.model.name)
        for name, want in masters.items():
            got = gathered[name]
            assert got.dtype == torch.float32, (where, name)
            error = float((got - want).norm() / (want - start[name]).norm())
            assert error <= PARAM_TOL, (where, name, error)


@functools.lru_cache
def initial(model: str) -> dict[str, torch.Tensor]:
    net = Transformer(get_model(model), dtype=torch.bfloat16, seed=0)
    return {n: p.detach().float() for n, p in net.named_parameters()}


def test_the_loss_tolerance_separates_bf16_from_fp64():
    """The same training in fp64 (same seed, its fp64 draw) leaves the bf16 reference's loss
    by far more than `LOSS_TOL`: the parity test can tell the recipe apart."""
    bf16, fp64 = reference("tiny")[0], reference("tiny", "fp64")[0]
    assert max(abs(a - b) / b for a, b in zip(fp64, bf16)) > 10 * LOSS_TOL


def test_refused_precision_settings_are_one_line_errors():
    assert_one_line_error(shardwise("train", "--dtype", "bf16", "--grad-dtype", "fp32",
                                    check=False),
                          "grad_dtype fp32 with dtype bf16 is not supported")
