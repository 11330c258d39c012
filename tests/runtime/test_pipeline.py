"""Pipeline executor on real gloo ranks against the single-device model (float64), and
against torch.distributed.pipelining's own ZBV and DualPipeV schedules.

The required grid — GPipe, 1F1B, interleaved 1F1B (v = 2) and ZB-H1; p ∈ {2, 4}; m ∈ {1, 4, 8}
(interleaved needs p | m, so m ∈ {4, 8} there); ZBV and DualPipeV (two chunks in a V,
DualPipeV with m ≥ 2p) — runs inside one spawned world per p, since starting processes costs
more than the steps. Each rank checks, per configuration:

* loss and gradients against the single-device model on the whole batch, written out below;
* the peak micro-batch-chunks alive on its stage, measured while running, against the
  simulator's `peak_in_flight`, and counted until W (ZB-H1: min(p, m) on every stage);
* bytes sent against `pp_comm_bytes_per_microbatch`, per boundary between virtual stages on
  different ranks (the V's turn at stage p-1 stays on the rank);
* the measured actions: its own action list, in order, and causally after the actions on
  other ranks they receive from (on the host's monotonic clock).
"""

from collections import defaultdict
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import pp_comm_bytes_per_microbatch
from shardwise.runtime.launch import RankFailure, spawn
from shardwise.runtime.pipeline import (
    PipelineModel,
    VirtualStage,
    backward_input,
    backward_weight,
    measured_timeline,
    run_pipeline,
)
from shardwise.schedules import (
    get_schedule,
    make_schedule,
    parse_schedule,
    peak_in_flight,
    stage_of,
    virtual_stage,
)

TOL = 1e-12
N_LAYERS, HIDDEN, FFN, VOCAB = 9, 8, 12, 24  # 9 layers: uneven over 2, 4 and 8 stages
SEQ, MB = 4, 2  # each micro-batch: 2 sequences of 4 tokens
SEED = 7
DOUBLE = 8  # bytes per float64

SINGLE_CHUNK = [(name, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for m in (1, 4, 8)]
GRID = [*SINGLE_CHUNK, ("interleaved", 4, 2), ("interleaved", 8, 2), ("zbv", 3, 2),
        ("zbv", 8, 2), ("dualpipev", 8, 2)]


# ------------------------------------------------------------------- the single-device model
def single_device(tokens, targets):
    """Loss and gradients of the whole model on one device, the forward written out here."""
    model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
    x = model.embed[tokens]  # (B, s) -> (B, s, h)
    for block in model.blocks:
        x = x + torch.tanh(x @ block["w1"].T + block["b1"]) @ block["w2"].T + block["b2"]
    logits = x @ model.head.T  # (B, s, V)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    params = model.named_parameters()
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), dict(zip(params, grads))


def batch(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=gen),
            torch.randint(0, VOCAB, (rows, SEQ), generator=gen))


# ------------------------------------------------------------------------------- the worker
def _worlds(layouts):
    """On every rank: for each (pp, dp, configs), build that mesh and run every config."""
    from shardwise.layout import Layout
    from shardwise.runtime import collectives as C
    from shardwise.runtime.mesh import Mesh

    rows = []
    for pp, dp, configs in layouts:
        mesh = Mesh.from_layout(Layout(pp=pp, dp=dp), make_current=False)
        pp_axis, dp_axis = mesh.axis("pp"), mesh.axis("dp")
        for name, m, v, *extras in configs:
            first, last = extras[0] if extras else (0.0, 0.0)
            tokens, targets = batch(dp * m * MB, seed=100 + m)  # the global batch
            share = slice(dp_axis.rank * m * MB, (dp_axis.rank + 1) * m * MB)
            model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
            plan = make_schedule(name, pp, m, v)
            with C.counting() as counter:
                result = run_pipeline(model, plan, tokens[share], targets[share], pp_axis,
                                      dp_axis if dp > 1 else None,
                                      placement=get_schedule(name).placement,
                                      first_stage_extra=first, last_stage_extra=last)
            share_loss, _ = single_device(tokens[share], targets[share])
            _, want = single_device(tokens, targets)
            errors = {n: float((g - want[n]).abs().max() / want[n].abs().max())
                      for n, g in result.grads.items()}
            numel = sum(g.numel() for g in result.grads.values())
            result.grads = {}
            rows.append({"pp": pp, "dp": dp, "config": (name, m, v, first, last),
                         "dp_rank": dp_axis.rank, "result": result, "share_loss": share_loss,
                         "errors": errors, "numel": numel, "counter": counter.rows()})
    return rows


# ------------------------------------------------------------------------------ the checks
def _configs(results) -> Iterator[tuple[tuple, list[dict]]]:
    grouped = defaultdict(list)
    for rank_rows in results:
        for row in rank_rows:
            grouped[(row["pp"], row["dp"], row["config"])].append(row)
    yield from grouped.items()


def _counted(row, axis, op, field="bytes"):
    return sum(r[field] for r in row["counter"] if r["axis"] == axis and r["op"] == op)


def _check_all(results, expected_configs):
    seen = 0
    for (pp, dp, (name, m, v, _, _)), rows in _configs(results):
        seen += 1
        assert len(rows) == pp * dp
        plan = make_schedule(name, pp, m, v)
        placement = get_schedule(name).placement
        for row in rows:
            _check_rank(row, plan, pp, dp, m, v, placement)
        for replica in range(dp):
            mine = [row for row in rows if row["dp_rank"] == replica]
            _check_replica(mine, plan, pp, m, v, placement)
    assert seen == expected_configs


def _sends(pp, v, placement, stage):
    """Messages `stage` sends per micro-batch: for each of its virtual stages, an activation
    to the next and a gradient to the previous when that one lives on another rank."""
    def elsewhere(vs):
        return 0 <= vs < pp * v and stage_of(vs, pp, placement) != stage

    mine = [virtual_stage(stage, c, pp, placement) for c in range(v)]
    return sum(elsewhere(vs + 1) + elsewhere(vs - 1) for vs in mine)


def _check_rank(row, plan, pp, dp, m, v, placement):
    result, stage = row["result"], row["result"].stage
    where = (row["config"], stage, row["dp_rank"])
    # gradients and loss against the single-device model
    assert max(row["errors"].values()) <= TOL, (where, row["errors"])
    if stage == stage_of(pp * v - 1, pp, placement):  # the last virtual stage's rank
        assert result.loss == pytest.approx(row["share_loss"], rel=TOL, abs=TOL), where
    else:
        assert result.loss is None
    # activations alive, measured while running, against the simulator
    assert result.peak_alive == peak_in_flight(plan)[stage], where
    assert result.peak_alive_until_w == peak_in_flight(plan, until="W")[stage], where
    if row["config"][0] == "zb-h1":  # held until W, ZB-H1 keeps min(p, m) on every stage
        assert result.peak_alive_until_w == min(pp, m), where
    # bytes: s·b·h forward per boundary fed, s·b·h backward per boundary fed back
    # (with p = 1 the chunks hand over inside the rank: nothing goes on the wire)
    boundaries = _sends(pp, v, placement, stage)
    half = pp_comm_bytes_per_microbatch(SEQ, MB, HIDDEN, DOUBLE) / 2
    assert _counted(row, "pp", "send") == boundaries * m * half, where
    assert {r["op"] for r in row["counter"] if r["axis"] == "pp"} <= {"send"}
    # data parallel: one all-reduce of all this rank's gradients, after the last micro-batch
    # (one call carrying every gradient, and the gradients equal the full batch's)
    if dp > 1:
        assert _counted(row, "dp", "all-reduce", "calls") == 1, where
        assert _counted(row, "dp", "all-reduce") == 2 * (dp - 1) / dp * row["numel"] * DOUBLE
    else:
        assert not any(r["axis"] == "dp" for r in row["counter"])
    # the measured actions are this stage's list, in order
    assert [e.action for e in result.events] == plan[stage]
    assert all(e.start <= e.end for e in result.events)
    assert all(a.end <= b.start for a, b in zip(result.events, result.events[1:]))


def _check_replica(rows, plan, pp, m, v, placement):
    """One pipeline: the loss, the layer partition, the bytes in total, causality in time."""
    assert sorted(n for row in rows for n in row["errors"]) == sorted(
        PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB).named_parameters())
    total = sum(_counted(row, "pp", "send") for row in rows)
    # stage boundaries that cross between ranks: pp·v - 1 in the loop, 2(pp-1) in the V
    wired = {"loop": pp * v - 1, "v": 2 * (pp - 1)}[placement] if pp > 1 else 0
    assert total == wired * m * pp_comm_bytes_per_microbatch(SEQ, MB, HIDDEN, DOUBLE)
    timeline = measured_timeline([row["result"] for row in rows])
    assert timeline.peak_in_flight == tuple(n / v for n in peak_in_flight(plan))
    start = {(e.action.kind, e.action.micro_batch,
              virtual_stage(e.stage, e.action.chunk, pp, placement)): e.start
             for e in timeline.events}
    last = pp * v - 1
    for (kind, j, vs), t in start.items():
        if kind == "F" and vs > 0:  # needs the activation of vs-1
            assert t > start[("F", j, vs - 1)]
        if kind == "B" and vs < last:  # needs the gradient of vs+1
            assert t > start[("B", j, vs + 1)]


# ---------------------------------------------------------------------------------- worlds
@pytest.mark.slow
def test_two_stages_every_schedule_equals_single_device():
    configs = [*GRID, ("1f1b", 4, 1, (2.0, 2.0))]  # extras move layers off the ends
    results = spawn(_worlds, 2, [(2, 1, configs)], timeout_s=120)
    _check_all(results, len(configs))


@pytest.mark.slow
def test_four_stages_every_schedule_equals_single_device():
    results = spawn(_worlds, 4, [(4, 1, GRID)], timeout_s=120)
    _check_all(results, len(GRID))


@pytest.mark.slow
def test_pipeline_with_data_parallel_syncs_once_and_equals_full_batch():
    configs = [("1f1b", 4, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2), ("gpipe", 1, 1)]
    pure_dp = [("interleaved", 4, 2)]  # p = 1: two chunks on one rank, plain data parallel
    results = spawn(_worlds, 4, [(2, 2, configs), (1, 4, pure_dp)], timeout_s=120)
    _check_all(results, len(configs) + len(pure_dp))


@pytest.mark.slow
def test_eight_ranks_pp8_and_pp4_dp2():
    layouts = [(8, 1, [("1f1b", 8, 1), ("zb-h1", 4, 1)]),
               (4, 2, [("interleaved", 8, 2), ("zb-h1", 8, 1)])]
    results = spawn(_worlds, 8, layouts, timeout_s=180)
    _check_all(results, 4)


# ------------------------------------------------------ against torch.distributed.pipelining
class _Piece(torch.nn.Module):
    """One virtual stage of `PipelineModel` as the nn.Module torch.distributed.pipelining
    stages need: the same weights as parameters, the last stage returning logits (torch's
    schedules apply the loss themselves)."""

    def __init__(self, model, stage):
        super().__init__()
        self.stage = stage
        self.weights = torch.nn.ParameterDict({
            name.replace(".", "_"): torch.nn.Parameter(t.detach().clone())
            for name, t in model.named_parameters(stage).items()})

    def forward(self, x):
        w = self.weights
        if self.stage.first:
            x = F.embedding(x, w["embed"])  # (b, s) -> (b, s, h)
        for k in self.stage.layers:
            hidden = torch.tanh(F.linear(x, w[f"blocks_{k}_w1"], w[f"blocks_{k}_b1"]))
            x = x + F.linear(hidden, w[f"blocks_{k}_w2"], w[f"blocks_{k}_b2"])
        return F.linear(x, w["head"]) if self.stage.last else x  # (b, s, V) logits


def _against_pipelining(cases):
    """On every rank: our executor and torch's own schedule class on the same weights and
    batch; the relative gradient error per parameter and both losses."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.pipeline import virtual_stages

    rank, p = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(pp=p))
    rows = []
    for name, m in cases:
        info = get_schedule(name)
        tokens, targets = batch(m * MB, seed=200 + m)
        ours = run_pipeline(PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED),
                            make_schedule(name, p, m), tokens, targets,
                            placement=info.placement)
        model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
        stages = virtual_stages(N_LAYERS, p, 2)
        pieces = [_Piece(model, stages[virtual_stage(rank, c, p, info.placement)])
                  for c in range(2)]
        theirs = get_schedule_class(info.torchtitan)(
            [PipelineStage(piece, piece.stage.index, 2 * p, torch.device("cpu"))
             for piece in pieces], m,
            loss_fn=lambda logits, y: F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)))
        losses = []
        holds_ends = any(piece.stage.first or piece.stage.last for piece in pieces)
        theirs.step(*([tokens] if holds_ends else []),
                    **({"target": targets, "losses": losses} if holds_ends else {}))
        grads = {n.replace("_", "."): t.grad for piece in pieces
                 for n, t in piece.weights.items()}
        assert grads.keys() == ours.grads.keys()
        errors = {n: float((ours.grads[n] - g).abs().max() / g.abs().max()) for n, g in
                  grads.items()}
        rows.append({"schedule": name, "rank": rank, "errors": errors, "loss": ours.loss,
                     "their_loss": float(sum(losses) / m) if losses else None})
    return rows


@pytest.mark.slow
def test_v_schedules_equal_pipelinings_own_zbv_and_dualpipev():
    """ZBV and DualPipeV on our executor and on torch.distributed.pipelining's
    `ScheduleZBVZeroBubble` / `ScheduleDualPipeV` (2.13), same module, weights and batch:
    equal gradients (fp64) and losses. (The orders are equal too:
    tests/schedules/test_generators.py.)"""
    results = spawn(_against_pipelining, 2, [("zbv", 3), ("dualpipev", 5)], timeout_s=120)
    rows = [row for rank_rows in results for row in rank_rows]
    assert {(row["schedule"], row["rank"]) for row in rows} == {
        (name, rank) for name in ("zbv", "dualpipev") for rank in (0, 1)}
    for row in rows:
        assert max(row["errors"].values()) <= TOL, row
        if row["rank"] == 0:  # the V's ends: the first and the last virtual stage
            assert row["loss"] == pytest.approx(row["their_loss"], rel=TOL)
        else:
            assert row["loss"] is None and row["their_loss"] is None


# ------------------------------------------------------------------------- failures, no hang
def _mismatched_schedules():
    import torch.distributed as dist

    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh

    Mesh.from_layout(Layout(pp=2))
    name = "gpipe" if dist.get_rank() == 1 else "1f1b"  # would deadlock: F2 vs B0 first
    tokens, targets = batch(4 * MB, 1)
    model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
    return run_pipeline(model, make_schedule(name, 2, 4), tokens, targets)


@pytest.mark.slow
def test_stages_running_different_schedules_fail_instead_of_hanging():
    with pytest.raises(RankFailure, match="disagree"):
        spawn(_mismatched_schedules, 2, timeout_s=30)


def _last_stage_fails():
    import torch.distributed as dist

    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh

    Mesh.from_layout(Layout(pp=2))
    tokens, targets = batch(4 * MB, 1)
    if dist.get_rank() == 1:
        targets[-1, -1] = VOCAB  # out of range: the loss of micro-batch 3 raises mid-step
    model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
    return run_pipeline(model, make_schedule("1f1b", 2, 4), tokens, targets)


@pytest.mark.slow
def test_a_rank_failing_mid_step_fails_the_run_without_hanging():
    with pytest.raises(RankFailure, match="rank 1"):
        spawn(_last_stage_fails, 2, timeout_s=30)


# --------------------------------------------------------------------- in process, no group
def test_a_deadlocking_schedule_is_rejected_before_any_message():
    tokens, targets = batch(2 * MB, 1)
    model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
    # stage 0 waits for B0 before sending F1, which stage 1 needs before it runs B0
    plan = parse_schedule("0: F0 B0 F1 B1\n1: F0 F1 B0 B1")
    plan_ok = parse_schedule("0: F0 F1 B0 B1\n1: F0 F1 B0 B1")
    with pytest.raises(ShardwiseError, match="deadlock"):
        run_pipeline(model, plan, tokens, targets)
    with pytest.raises(ShardwiseError, match="equal micro-batches"):
        run_pipeline(model, plan_ok, tokens[:3], targets[:3])
    with pytest.raises(ShardwiseError, match="at least one layer per stage"):
        run_pipeline(model, make_schedule("interleaved", 4, 4, 3), *batch(4 * MB, 1))


def _matmuls(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
                Count.mm += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.mm


@pytest.mark.parametrize("first", [True, False])
def test_zb_split_b_computes_input_gradients_only_and_w_the_rest(first):
    """ZB-H1's B runs one product per linear (dX = dY·W), W the other (dW = dYᵀ·X), and
    together they give autograd's full backward."""
    layers = (0, 1) if first else (1, 2)
    stage = VirtualStage(0 if first else 1, 2, layers)
    tokens, targets = batch(MB, 3)
    linears = 2 * len(layers) + 1  # two per block, plus the head

    def run(split):
        model = PipelineModel.build(N_LAYERS, HIDDEN, FFN, VOCAB, SEED)
        inp = tokens if first else torch.randn(MB, SEQ, HIDDEN, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(4))
        inp = inp if first else inp.requires_grad_()
        x = None if first else inp
        saved = []
        loss = model.forward_stage(VirtualStage(stage.index, 1 + stage.index, layers), inp,
                                   targets, saved if split else None)
        seed = torch.tensor(0.5, dtype=torch.float64)
        if split:
            box = {}
            b_mm = _matmuls(lambda: box.update(out=backward_input(loss, x, saved, seed)))
            dx, pending = box["out"]
            w_mm = _matmuls(lambda: backward_weight(pending))
        else:
            b_mm = _matmuls(lambda: torch.autograd.backward(loss, seed))
            w_mm, dx = 0, None if first else inp.grad
        params = model.named_parameters(VirtualStage(stage.index, 1 + stage.index, layers))
        return b_mm, w_mm, dx, {n: t.grad for n, t in params.items()}

    b_mm, w_mm, dx, grads = run(split=True)
    full_mm, _, dx_ref, grads_ref = run(split=False)
    assert (b_mm, w_mm, full_mm) == (linears, linears, 2 * linears)
    if not first:
        assert torch.allclose(dx, dx_ref, rtol=TOL, atol=TOL)
    assert grads.keys() == grads_ref.keys()
    for n in grads:
        assert torch.allclose(grads[n], grads_ref[n], rtol=TOL, atol=TOL), n


def test_transformer_b_defers_exactly_the_linear_weight_gradients_to_w():
    """Under `defer_linears`, a backward inside `deferring_weight_grads` (ZB-H1's B) leaves
    every linear weight without a gradient and hands over one (X, dY) pair per linear call
    (7 per layer: q, k, v, o, gate, up, down; plus the head); norms and the embedding get
    theirs in B. W (`backward_weight`) then completes the gradients: equal to plain autograd's
    on the same model (fp64)."""
    from shardwise.arch import get_model
    from shardwise.runtime.model import Transformer
    from shardwise.runtime.pipeline import backward_weight, defer_linears, deferring_weight_grads

    spec = get_model("tiny")
    tokens = torch.randint(0, spec.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = Transformer(spec, dtype=torch.float64, seed=3)
    plain.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    split = Transformer(spec, dtype=torch.float64, seed=3)
    with defer_linears():
        loss = split.loss(tokens[:, :-1], tokens[:, 1:])
    with deferring_weight_grads() as later:
        loss.backward()
    linears = {id(m.weight) for m in split.modules() if isinstance(m, torch.nn.Linear)}
    assert len(later) == 7 * spec.n_layers + 1
    assert {id(op.weight) for op, _ in later} == linears
    for name, p in split.named_parameters():
        assert (p.grad is None) == (id(p) in linears), name
    backward_weight(later)
    want = dict(plain.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-12, atol=1e-15)
