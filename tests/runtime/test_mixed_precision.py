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


def config(layout: str = "", model: str = "tiny", dtype: str = "bf16",
           grad_dtype: str | None = None) -> TrainConfig:
    return TrainConfig(get_model(model), Layout.parse(layout), steps=STEPS, seq_len=SEQ,
                       global_batch=BATCH, lr=LR, min_lr=MIN_LR, warmup=WARMUP, clip=CLIP,
                       dtype=dtype, grad_dtype=grad_dtype)


def _gradients(net: Transformer, rows: torch.Tensor, grad_dtype: str | None
               ) -> tuple[float, list[torch.Tensor]]:
    """The step's mean loss and the gradient of every parameter on one device. `grad_dtype`
    None: the whole batch in one backward (bf16 gradients). "fp32" (Megatron's main_grad) or
    "bf16": micro-batches of one sequence, as the runs (`Layout.micro_batch` 1), each
    backward's bf16 gradients of `loss/B` added into a buffer of that dtype."""
    inputs, targets = rows[:, :-1], rows[:, 1:]  # (B, s) each
    params = list(net.parameters())
    net.zero_grad()
    if grad_dtype is None:
        loss = net.loss(inputs, targets)
        loss.backward()
        return loss.item(), [p.grad for p in params]
    acc = torch.float32 if grad_dtype == "fp32" else torch.bfloat16
    grads = [torch.zeros_like(p, dtype=acc) for p in params]
    total = 0.0
    for x, y in zip(inputs.split(1), targets.split(1)):  # (1, s) each
        net.zero_grad()
        loss = net.loss(x, y) / len(inputs)
        loss.backward()
        total += loss.item()
        for g, p in zip(grads, params):
            g.add_(p.grad)  # fp32: `main_grad += grad` in fp32
    return total, grads


@functools.lru_cache
def reference(model: str, dtype: str = "bf16", grad_dtype: str | None = None):
    """One device, the whole global batch, the recipe written out with torch's own pieces:
    bf16 `Transformer`, gradients as `_gradients` accumulates them, fp32 masters,
    `clip_grad_norm_` on the fp32 copies of the gradients, `torch.optim.AdamW` on the masters,
    weights ← bf16(master)."""
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
        loss, grads = _gradients(net, batches.global_rows(step), grad_dtype)
        for g, m in zip(grads, masters):
            m.grad = g.to(master)
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(loss)
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
        assert_parity(cfg, [rank_rows[i] for rank_rows in results], reference(cfg.model.name))


def assert_parity(cfg: TrainConfig, rows: list[dict], ref: tuple) -> None:
    """One layout's records and gathered fp32 masters (`rows`, one per rank) against `ref`."""
    where = f"{cfg.model.name} {cfg.layout.short()} grad {cfg.grad_dtype or cfg.dtype}"
    losses, norms, masters = ref
    records = rows[0]["records"]
    assert [r.step for r in records] == list(range(STEPS))
    for r in records:
        assert r.loss == pytest.approx(losses[r.step], rel=LOSS_TOL), (where, r)
        assert r.grad_norm == pytest.approx(norms[r.step], rel=NORM_TOL), (where, r)
    gathered: dict[str, torch.Tensor] = {}
    for rank_row in rows:
        gathered.update(rank_row["masters"] or {})
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
    assert_one_line_error(shardwise("train", "--dtype", "fp32", "--grad-dtype", "bf16",
                                    check=False),
                          "grad_dtype bf16 with dtype fp32 is not supported by the training "
                          "runtime; use grad_dtype fp32")


# ------------------------------------------------- fp32 gradients (Megatron's main_grad)
# With grad_dtype fp32 the runs are held to the same tolerances against the one-device
# reference that accumulates fp32 gradients (`_gradients`), and more: on the layouts whose
# ranks compute each sequence exactly as one device does (dp, ZeRO, pp: the same bf16
# forward and backward of one sequence, the loss seed 1/m a power of two), the first step's
# gradients differ from the reference only by the order of fp32 additions — ≤ 8 terms per
# element (8 micro-batches), each addition rounding by ≤ 2^-24 relative, so the norm by
# ≤ 8·2^-24 = 2^-21 (`FP32_NORM_TOL`; measured 2.7e-9). Accumulating or reducing in bf16
# instead rounds every partial sum to 2^-8 and misses it by far (measured 1.05e-4 for dp2
# with bf16 gradients, 4.5e-5 on one device accumulating the micro-batches in bf16;
# `test_fp32_gradient_tolerance_separates_the_accumulation_dtypes` and the bf16 control
# layout of the slow test check it, so the test can tell the two recipes apart). Over the
# 6 steps the fp32 runs also stay closer to the reference than the bf16 control: loss ≤
# 1.6e-5 relative on dp/ZeRO/pp (bf16 gradients: 6.5e-5), gradient norm ≤ 1.4e-4 (5.1e-4).
FP32_NORM_TOL = 2.0**-21
FP32_LAYOUTS = [config(layout, model, grad_dtype="fp32") for layout, model in (
    ("dp=2", "tiny"), ("dp=2,zero=1", "tiny"), ("dp=2,zero=2", "tiny"), ("dp=2,zero=3", "tiny"),
    ("tp=2,sp=1", "tiny"), ("pp=2", "tiny"), ("pp=2,schedule=zb-h1", "tiny"), ("cp=2", "tiny"),
    ("dp=2,ep=2", "tiny-moe"))]
SAME_PER_SEQUENCE = ("dp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3", "pp=2",
                     "pp=2,schedule=zb-h1")
BF16_CONTROL = config("dp=2")  # bf16 gradients: must miss FP32_NORM_TOL


def _step0_error(norm: float) -> float:
    want = reference("tiny", "bf16", "fp32")[1][0]
    return abs(norm - want) / want


@pytest.mark.slow
def test_fp32_gradients_on_every_axis_equal_one_device():
    results = spawn(_train_layouts, 2, [*FP32_LAYOUTS, BF16_CONTROL], timeout_s=540)
    for i, cfg in enumerate(FP32_LAYOUTS):
        rows = [rank_rows[i] for rank_rows in results]
        assert_parity(cfg, rows, reference(cfg.model.name, "bf16", "fp32"))
        if cfg.layout in [Layout.parse(text) for text in SAME_PER_SEQUENCE]:
            error = _step0_error(rows[0]["records"][0].grad_norm)
            assert error <= FP32_NORM_TOL, (cfg.layout.short(), error)
    control = results[0][-1]["records"][0].grad_norm
    assert _step0_error(control) > 10 * FP32_NORM_TOL


def test_fp32_gradient_tolerance_separates_the_accumulation_dtypes():
    """On one device the same micro-batches accumulated in bf16 miss the fp32 reference's
    first gradient norm by more than 10 × `FP32_NORM_TOL`."""
    bf16 = reference("tiny", "bf16", "bf16")[1][0]
    assert _step0_error(bf16) > 10 * FP32_NORM_TOL
