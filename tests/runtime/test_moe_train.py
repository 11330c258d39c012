"""MoE training with a capacity factor, the load-balancing loss and shared experts on real
gloo ranks equals one device.

The reference is written out here: the single-device `Transformer` whose MoE layers call
`ops.moe.moe_layer` directly (through the `MoE.experts` swap point) with the same capacity
factor, over each micro-batch of `mbs` sequences as one routing group — the convention the
runtime uses: capacity `⌈cf · T·k / E⌉` per expert over the T = mbs·s tokens of one
micro-batch on one rank (Switch / Megatron-LM: per rank, before the expert-parallel
dispatch) — and whose objective is, per micro-batch, the mean cross-entropy plus `α · Σ` of
the layers' Switch losses, averaged over the m = B/mbs micro-batches of the step (torch's
AdamW and `clip_grad_norm_`). The runtime attaches the auxiliary losses in the layers
(`model.AuxLossAutoScaler`), so under pp they join the objective on their own stage.

Checked per step (fp64): the logged loss (mean cross-entropy) and the gradient norm before
clipping, relative ≤ 1e-10; the final parameters ≤ 1e-10 of each tensor's largest entry; and
that the reference really drops tokens and that α changes its trajectory.
"""

import functools

import pytest
import torch
from test_train import _train_layouts  # the rank worker (tests/runtime is on sys.path)
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

from shardwise.arch import get_model
from shardwise.estimate.check import ROUTING_COUNTS_OP, ROUTING_GATHER_OP
from shardwise.layout import Layout
from shardwise.ops.moe import MoEParams, moe_layer
from shardwise.runtime.data import Batches, load_tokens
from shardwise.runtime.launch import spawn
from shardwise.runtime.model import MoE, Transformer
from shardwise.runtime.train import TrainConfig

STEPS, SEQ, BATCH, MBS, CLIP, LR = 4, 16, 8, 2, 1.0, 3e-3
CF, ALPHA = 1.0, 0.1
TOL = 1e-10


def spec(shared: int = 0):
    model = get_model("tiny-moe")
    return model.with_(name="tiny-moe-shared", n_shared_experts=shared) if shared else model


def config(layout: str, shared: int = 0, alpha: float = ALPHA,
           cf: float | None = CF) -> TrainConfig:
    return TrainConfig(spec(shared), Layout.parse(f"{layout},mbs={MBS}"), steps=STEPS,
                       seq_len=SEQ, global_batch=BATCH, lr=LR, min_lr=LR / 10, warmup=1,
                       clip=CLIP, dtype="fp64", capacity_factor=cf, aux_loss_coef=alpha)


@functools.lru_cache
def reference(shared: int, alpha: float = ALPHA, cf: float | None = CF):
    """Single device: losses, pre-clip norms, final parameters, dropped assignments."""
    cfg = config("dp=1", shared, alpha, cf)
    net = Transformer(cfg.model, dtype=torch.float64, seed=cfg.seed)
    aux: list[torch.Tensor] = []
    dropped = [0]

    def experts(moe: MoE, x: torch.Tensor):
        result = moe_layer(x, MoEParams(moe.router, moe.w_gate, moe.w_up, moe.w_down),
                           moe.top_k, capacity_factor=cf)
        aux.append(result.aux_loss)
        dropped[0] += result.dropped
        return result.out, result.aux_loss.detach()

    for block in net.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.experts = functools.partial(experts, block.mlp)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    batches = Batches(load_tokens(), SEQ, BATCH, cfg.seed)
    losses, norms = [], []
    m = BATCH // MBS
    for step in range(STEPS):
        rows = batches.global_rows(step)  # (B, s + 1)
        opt.zero_grad()
        total = 0.0
        for micro in rows.split(MBS):  # (mbs, s + 1): one routing group
            aux.clear()
            ce = net.loss(micro[:, :-1], micro[:, 1:])
            ((ce + alpha * torch.stack(aux).sum()) / m).backward()
            total += ce.item() / m
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.step()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in net.named_parameters()}, dropped[0]


def _check(results: list[list[dict]], configs: list[TrainConfig]) -> None:
    for i, cfg in enumerate(configs):
        where = f"{cfg.model.name} {cfg.layout.short()}"
        losses, norms, params, _ = reference(cfg.model.n_shared_experts, cfg.aux_loss_coef,
                                             cfg.capacity_factor)
        for r in results[0][i]["records"]:
            assert r.loss == pytest.approx(losses[r.step], rel=TOL), (where, r)
            assert r.grad_norm == pytest.approx(norms[r.step], rel=TOL), (where, r)
        gathered: dict[str, torch.Tensor] = {}
        for rank_rows in results:
            gathered.update(rank_rows[i]["params"] or {})
        assert sorted(gathered) == sorted(params), where
        for name, want in params.items():
            error = float((gathered[name] - want).abs().max() / want.abs().max())
            assert error <= TOL, (where, name, error)


def test_reference_drops_tokens_and_the_aux_loss_changes_training():
    losses, norms, _, dropped = reference(0)
    assert dropped > 0  # the capacity limit is exercised
    plain_losses, plain_norms, _, _ = reference(0, 0.0)
    assert plain_losses[0] == losses[0]  # the logged loss is the cross-entropy alone
    assert norms[0] != pytest.approx(plain_norms[0], rel=1e-6)  # α reaches the gradients
    assert losses[-1] != pytest.approx(plain_losses[-1], rel=1e-9)


# sequences split over cp (with ep) and over tp by SP (with full recompute, whose replay
# exchanges the routing again): the capacity and the aux loss are the whole micro-batch's
TWO = [config("dp=2"), config("dp=2,ep=2"), config("tp=2,recompute=full"), config("pp=2"),
       config("pp=2,schedule=zb-h1"), config("dp=2", shared=1), config("dp=2,ep=2", shared=1),
       config("cp=2,ep=2"), config("tp=2,sp=1,recompute=full")]


@pytest.mark.slow
def test_capacity_aux_loss_and_shared_experts_on_two_ranks_equal_single_device():
    """dp, ep, tp (with full recompute), pp under 1F1B and ZB-H1; shared experts under dp
    and ep; capacity and aux loss with the sequences split by cp and by SP."""
    _check(spawn(_train_layouts, 2, TWO, timeout_s=240), TWO)


def test_moe_options_are_checked_in_one_line():
    assert_one_line_error(shardwise("train", "--capacity-factor", "1.0", check=False),
                          "need a mixture-of-experts model")
    assert_one_line_error(shardwise("train", "--model", "tiny-moe", "--capacity-factor", "0",
                                    check=False), "--capacity-factor")


@pytest.mark.slow
def test_check_is_exact_with_capacity_aux_loss_and_shared_experts():
    """`shardwise check`'s rows hold: comm and state exact, each layer's saved bytes at the
    routing each call drew (dropped rows leave out their expert rows) within 1 % — the
    load-balancing loss adds Switch's f_i (E values), said in the note."""
    from shardwise.runtime.measure import run_check

    rows = run_check(config("dp=2,ep=2", shared=1), 1, timeout_s=240)
    assert rows and all(row.ok for row in rows), [r for r in rows if not r.ok]
    moe = [r for r in rows if r.item == "activations" and r.what.endswith("MoE")]
    assert moe and all("f_i" in r.note for r in moe if r.error)
    assert [r.error for r in rows if r.item in ("comm", "state")] == [0.0] * sum(
        r.item in ("comm", "state") for r in rows)
    # cp: the aux loss's per-expert counts all-reduced and the capacity's expert choices
    # all-gathered over cp, every MoE call
    rows = run_check(config("cp=2,ep=2"), 1, timeout_s=240)
    routing = [r for r in rows if r.item == "comm"
               and r.what in (f"cp {ROUTING_COUNTS_OP}", f"cp {ROUTING_GATHER_OP}")]
    assert len(routing) == 2 and all(r.error == 0 and r.measured for r in routing), routing


@pytest.mark.slow
def test_cli_trains_moe_with_capacity_and_aux_loss_like_one_device():
    """The user's path: `shardwise train … --capacity-factor --aux-loss-coef` on dp2×ep2."""
    out = shardwise_json("train", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--mbs",
                         str(MBS), "--steps", str(STEPS), "--seq", str(SEQ), "--global-batch",
                         str(BATCH), "--lr", str(LR), "--min-lr", str(LR / 10), "--warmup", "1",
                         "--clip", str(CLIP), "--dtype", "fp64", "--capacity-factor", str(CF),
                         "--aux-loss-coef", str(ALPHA), "--quiet")
    losses, norms, _, _ = reference(0)
    assert [r["loss"] for r in out["records"]] == pytest.approx(losses, rel=TOL)
    assert [r["grad_norm"] for r in out["records"]] == pytest.approx(norms, rel=TOL)
