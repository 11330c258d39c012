"""SPEC §9: what the runtime really moves and keeps, against the analytic model.

Every layout trains `tiny` (`tiny-moe` for expert parallelism) for 2 steps in float64 on real
gloo ranks (seq 32, global batch 4) while `check_layout` counts the bytes each collective
sends, the bytes each layer saves for backward and the state each rank holds; the
predictions come from `estimate.comm` and `estimate.memory`, which know nothing of the
runtime. Targets: communication and state exact, saved activations within 1 %. Where the
runtime departs from the model (ZeRO-1's full gradients, ZeRO + SP's tp all-reduce of whole
shards) the rows must miss and say why. MoE blocks save exactly the §3 count, taken at the
routing each forward drew (under ep a rank's experts run the rows routed to them).
Sequence parallelism meets the §3 count (QKV and MLP inputs ÷t: the runtime keeps the
sequence shard and all-gathers it again in backward, as Megatron), and those backward
re-gathers are in the predicted and the hand-worked traffic.

A second, independent reference: figures for the tiny model worked out by hand here (SPEC §5's
ring formulas on its shapes), for the analytic composition itself and for what was measured.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from tests.cli_helpers import assert_one_line_error, shardwise

from shardwise.arch import get_model
from shardwise.estimate.check import CheckRow, merge_rows
from shardwise.estimate.memory import saved_tensors_per_layer
from shardwise.layout import Layout
from shardwise.runtime.launch import spawn
from shardwise.runtime.measure import LayerRecorder, _expert_load, check_layout
from shardwise.runtime.model import Transformer
from shardwise.runtime.parallelize import apply_recompute
from shardwise.runtime.train import TrainConfig, build, train_step

SEQ, BATCH, STEPS = 32, 4, 2
TINY = get_model("tiny")  # 4 layers, h 64, 4 heads (d 16), 2 kv heads, f 128, V 256
P_TINY = 180_800  # 4·(2·64·64 + 2·64·32 + 3·64·128 + 2·64) + 2·256·64 + 64
F64 = 8
CHECKPOINT = "weights, masters, moments (bytes)"  # `estimate.check.checkpoint_rows`


def config(layout: str, model: str = "tiny") -> TrainConfig:
    spec = get_model(model.removesuffix("-tied"))
    if model.endswith("-tied"):
        spec = spec.with_(name=model, tie_embeddings=True)
    return TrainConfig(spec, Layout.parse(layout), steps=STEPS, seq_len=SEQ,
                       global_batch=BATCH, dtype="fp64")


# -------------------------------------------------------------------- one process, no groups
def _record(model: Transformer, tokens: torch.Tensor) -> LayerRecorder:
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    recorder = LayerRecorder(model, lambda t: t.untyped_storage().data_ptr() in weights)
    with recorder:
        model.loss(tokens, tokens).backward()
    return recorder


def test_recorder_charges_each_layer_its_own_saved_tensors():
    model = Transformer(TINY, flash=True)
    recorder = _record(model, torch.randint(0, 256, (2, SEQ)))
    expected = sum(saved_tensors_per_layer(TINY, SEQ, 2, flash=True, dtype_bytes_=F64).values())
    assert [c.saved for c in recorder.calls] == [expected] * 4
    assert recorder.shared == [] and recorder.routing == []
    assert "run_blocks" not in model.__dict__  # the wrapper is gone


def test_full_recompute_keeps_layer_inputs_and_shares_the_rope_tables():
    model = Transformer(TINY, flash=True)
    apply_recompute(model, "full")
    recorder = _record(model, torch.randint(0, 256, (2, SEQ)))
    assert [c.saved for c in recorder.calls] == [SEQ * 2 * 64 * F64] * 4  # x (b, s, h)
    assert recorder.shared == [2 * SEQ * 16 * F64]  # cos and sin (s, d), one pass


# ------------------------------------------------------------------------- on real ranks
def _check_all(configs: list[TrainConfig]) -> list[list[CheckRow]]:
    return [check_layout(cfg, STEPS) for cfg in configs]


def _merged(results: list[list[list[CheckRow]]], i: int) -> dict[tuple[int, str, str], CheckRow]:
    return {(r.stage, r.item, r.what): r for r in merge_rows([rank[i] for rank in results])}


def _assert_targets(rows: dict, comm: set[str]) -> None:
    """Every row meets its target; the comm rows are exactly `comm` (so nothing passes by
    being absent on both sides)."""
    assert {what for (_, item, what) in rows if item == "comm"} == comm
    for row in rows.values():
        assert row.ok, row
    assert sum(item == "state" for _, item, _ in rows) == 4 * len({s for s, _, _ in rows})
    assert rows[(0, "checkpoint", CHECKPOINT)].target == "exact"  # one save, rank 0's rows
    if not torch.cuda.is_available():
        assert all(r.note.startswith("no GPU") for (_, item, _), r in rows.items()
                   if item == "peak memory")


TWO = [config("dp=2"), config("tp=2"), config("tp=2,sp=1"), config("pp=2"), config("cp=2"),
       config("dp=2,ep=2", "tiny-moe"), config("dp=2", "tiny-moe"), config("dp=2,zero=3"),
       config("cp=2,cp_kind=ulysses,recompute=selective")]
COMM = [{"dp all-reduce"}, {"tp all-reduce"}, {"tp all-gather", "tp reduce-scatter",
                                               "tp all-reduce"},
        {"pp send"}, {"cp send", "dp_cp all-reduce"},
        {"dp all-reduce", "ep all-to-all", "ep all-to-all (counts)"},
        {"dp all-reduce"},
        {"dp all-gather", "dp reduce-scatter"}, {"cp all-to-all", "dp_cp all-reduce"}]


def _load_with_tied_router(layout: str) -> dict[str, float]:
    """`check`'s expert load from one step of `tiny-moe` whose router logits all tie."""
    state = build(config(layout, "tiny-moe"))
    for block in state.model.model.blocks:
        block.mlp.router.data.zero_()
    recorder = LayerRecorder(state.model.model, lambda t: False, state.model.axis("ep").rank)
    with recorder:
        train_step(state)
    return _expert_load(recorder.expert_load, state.model.axis("ep"))


@pytest.mark.slow
@pytest.mark.parametrize("layout, ranks", [("dp=1", 1), ("dp=2,ep=2", 2)])
def test_the_expert_load_is_the_busiest_ranks_share_of_the_routing(layout, ranks):
    """Tied logits send every token to the same k = 2 experts (top-k's tie rule), so the
    busiest ep rank receives the rows of all ep ranks for those of them it holds: λ = ep·n/k
    of the balanced share, n of its E/ep experts running."""
    spec, ep = get_model("tiny-moe"), Layout.parse(layout).ep
    chosen = torch.zeros(spec.n_experts).topk(spec.top_k).indices  # the experts every token picks
    local = spec.n_experts // ep
    n = max(int(((chosen // local) == r).sum()) for r in range(ep))  # on the busiest rank
    for load in spawn(_load_with_tied_router, ranks, layout, timeout_s=120):
        assert load == pytest.approx({"expert_load": ep * n / spec.top_k,
                                      "experts_active": n / local})


@pytest.mark.slow
def test_two_ranks_meet_every_target():
    results = spawn(_check_all, 2, TWO, timeout_s=240)
    rows = [_merged(results, i) for i in range(len(TWO))]
    for merged, comm in zip(rows, COMM):
        _assert_targets(merged, comm)
    dp, tp, sp, pp, cp, ep, moe_dp, zero3, ulysses = rows
    # Measured, against figures worked out by hand.
    act = SEQ * 64 * F64
    # The payload each call was handed (SPEC §5's S; the ring sends 2(N-1)/N·S = S of an
    # all-reduce on 2 ranks, (N-1)/N·S = S/2 of a gather or scatter).
    assert dp[(0, "comm", "dp all-reduce")].measured == P_TINY * F64
    # the checkpoint: fp64 weights and AdamW's two fp64 moments, each parameter once
    assert dp[(0, "checkpoint", CHECKPOINT)].measured == P_TINY * 3 * F64
    assert zero3[(0, "checkpoint", CHECKPOINT)].measured == P_TINY * 3 * F64
    # Without ep the experts are ordinary replicated weights: every parameter is averaged.
    every = get_model("tiny-moe").count_params().total
    assert moe_dp[(0, "comm", "dp all-reduce")].measured == every * F64
    assert tp[(0, "comm", "tp all-reduce")].measured == BATCH * (18 * act + 3 * SEQ * F64)
    assert zero3[(0, "comm", "dp all-gather")].measured == 2 * 2 * P_TINY * F64
    assert zero3[(0, "state", "weights")].measured == P_TINY * F64 / 2
    assert pp[(1, "comm", "pp send")].measured == BATCH * act  # gradients going back
    # Sequence parallelism keeps only the (s/2, b, h) shard of the QKV and MLP inputs: the
    # §3 count exactly, every layer.
    for k in range(4):
        row = sp[(0, "activations", f"layer {k}")]
        assert row.ok and row.measured == row.predicted, row
    # ... and all-gathers it again in backward. All-gathers per micro-batch, each (t-1)/t = 1/2
    # of an (s, b, h) activation: per layer the 2 of f forward, the 2 conjugates of g backward
    # and the 2 re-gathers; the head's f forward and the embedding's g conjugate backward.
    assert sp[(0, "comm", "tp all-gather")].measured == BATCH * (4 * 6 + 2) * act
    assert sp[(0, "comm", "tp reduce-scatter")].measured == BATCH * (4 * 4 + 2) * act
    # Ring attention also keeps the (c, s/c) int64 token positions: within 1 %, said.
    row = cp[(0, "activations", "layer 0")]
    assert row.measured - row.predicted == 8 * SEQ and "positions" in row.note
    # MoE: both halves save exactly the §3 count, the expert half at the routing drawn.
    for k in range(4):
        assert ep[(0, "activations", f"layer {k} attention")].error == 0
        moe_row = ep[(0, "activations", f"layer {k} MoE")]
        assert moe_row.error == 0 and moe_row.measured > 0, moe_row
    assert "routing drawn" in ep[(0, "comm", "ep all-to-all")].note
    # Ulysses: per layer and micro-batch the all-to-alls of Q, K, V (64, 32, 32 wide) and the
    # output, each sending the other rank half of this rank's s/2 rows: forward, backward,
    # and the forward again under selective recompute (the whole attention core replayed)
    per_call = (SEQ // 2) // 2 * (64 + 32 + 32 + 64) * F64
    assert ulysses[(0, "comm", "cp all-to-all")].measured == BATCH * 4 * 3 * per_call
    # ... and saves exactly the §3 count: the attention output sequence-sharded only (the
    # core's head-sharded copy is recomputed), no positions
    assert all(ulysses[(0, "activations", f"layer {k}")].error == 0 for k in range(4))
    # On the wire (gloo, the kernel's TCP counters): every counted op has its wire row, its
    # data within the ring's bytes plus gloo's message headers — but the reduce-scatter,
    # which gloo runs as an all-reduce (tests/runtime/test_wire.py)
    for merged, comm in zip(rows, COMM):
        for what in comm:
            wire = merged[(0, "wire", what)]
            assert wire.measured > wire.predicted, wire
            verdict = ("all-reduce of the whole input" if what.endswith("reduce-scatter")
                       else "SPEC §5's")
            assert verdict in wire.note, wire


@pytest.mark.slow
def test_eight_ranks_dp2_tp2_pp2_meet_every_target():
    cfg = [config("dp=2,tp=2,pp=2")]
    rows = _merged(spawn(_check_all, 8, cfg, timeout_s=240), 0)
    _assert_targets(rows, {"dp all-reduce", "pp send", "tp all-reduce"})
    assert {stage for stage, _, _ in rows} == {0, 1}
    # the step-time rows (median and fastest step) and the checkpoint's are rank 0's
    assert all(row.ranks == (1 if row.item in ("step time", "checkpoint") else 4)
               for row in rows.values())


# ---------------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_check_prints_rows_that_meet_their_targets():
    met = shardwise("check", "--dp", "2", "--seq", "32", "--global-batch", "4", "--dtype",
                    "fp64", "--steps", "1")
    # (12 rows + the all-reduce's per-call cost re-timed on the layout's groups + the time
    # the median step spent in dp's and the world's collectives + 5 checkpoint rows)
    # (+ its wire row and one for the world's bookkeeping all-reduces, loss and gradient norm)
    assert "All 22 rows meet their targets." in met.stdout
    assert "dp all-reduce" in met.stdout and "no GPU" in met.stdout


@pytest.mark.slow
def test_cli_check_json_on_tensor_and_sequence_parallelism():
    sp = shardwise("check", "--tp", "2", "--sp", "--seq", "32", "--global-batch", "2",
                   "--steps", "1", "--json")
    out = json.loads(sp.stdout)
    assert out["ok"] and out["ranks"] == 2 and out["layout"]["sp"]
    # 14 rows + tp's all-reduce, reduce-scatter and all-gather re-timed per call + the time
    # in tp's and the world's collectives + 5 checkpoint rows + 3 wire rows and the world's
    assert all(row["ok"] for row in out["rows"]) and len(out["rows"]) == 28


@pytest.mark.slow
@pytest.mark.parametrize(("grad_dtype", "grad_bytes"), [("bf16", 2), ("fp32", 4)])
def test_cli_check_measures_mixed_precision_zero2_state(grad_dtype, grad_bytes):
    """Mixed precision, ZeRO-2 over 2 ranks: SPEC §2's 2P + 14P/N bytes, measured — bf16
    weights whole, bf16 gradient shard, fp32 master shard, fp32 Adam moments shard; with fp32
    gradients (Megatron's main_grad, 18 B/param) the gradient shard is fp32: 2P + 16P/N."""
    mixed = json.loads(shardwise("check", "--dp", "2", "--zero", "2", "--dtype", "bf16",
                                 "--grad-dtype", grad_dtype, "--seq", "32",
                                 "--global-batch", "2", "--steps", "2", "--json").stdout)
    assert mixed["ok"], [row for row in mixed["rows"] if not row["ok"]]
    state = {row["what"]: row["measured"] for row in mixed["rows"] if row["item"] == "state"}
    assert state == {"weights": 2 * P_TINY, "grads": grad_bytes * P_TINY / 2,
                     "master": 4 * P_TINY / 2, "optimizer": 8 * P_TINY / 2}
    assert sum(state.values()) == 2 * P_TINY + (12 + grad_bytes) * P_TINY / 2
    # its checkpoint: bf16 weights, fp32 masters and moments, 2 + 4 + 8 B/param
    saved = {row["what"]: row["measured"] for row in mixed["rows"]
             if row["item"] == "checkpoint"}
    assert saved[CHECKPOINT] == 14 * P_TINY


@pytest.mark.slow
def test_cli_check_on_experts_meets_every_target():
    moe = shardwise("check", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--seq", "32",
                    "--global-batch", "2", "--steps", "1", "--dtype", "fp64", "--json")
    out = json.loads(moe.stdout)
    assert out["ok"] and out["ranks"] == 2 and out["layout"]["ep"] == 2
    assert all(row["ok"] for row in out["rows"])
    # bf16: the router's probabilities are fp32 in the runtime and in the count (HF Mixtral,
    # Megatron), so every MoE row is exact (the attention halves keep bf16 statistics)
    moe = shardwise("check", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--seq", "32",
                    "--global-batch", "2", "--steps", "1", "--dtype", "bf16", "--json")
    rows = [row for row in json.loads(moe.stdout)["rows"] if row["what"].endswith("MoE")]
    assert len(rows) == 4 and all(row["measured"] == row["predicted"] for row in rows), rows


@pytest.mark.slow
def test_cli_check_exits_1_on_a_missed_target():
    missed = shardwise("check", "--dp", "2", "--tp", "2", "--sp", "--zero", "1", "--seq", "32",
                       "--global-batch", "2", "--steps", "1", "--json", check=False)
    assert missed.returncode == 1, missed.stderr
    # (16 rows + 4 per-call costs: all-reduce, reduce-scatter, all-gather on 2, all-reduce on 4
    # + the time in tp's, dp's and the world's collectives + 5 checkpoint rows + 5 wire rows
    # and the world's)
    assert missed.stderr.strip() == "error: 1 of 34 rows miss their target (see the notes)"
    out = json.loads(missed.stdout)
    assert not out["ok"] and out["ranks"] == 4 and out["layout"]["zero"] == 1
    failing = {row["what"]: row["note"] for row in out["rows"] if not row["ok"]}
    assert set(failing) == {"tp all-reduce"}  # ZeRO-1 frees its full gradients once reduced
    assert "ZeRO + SP" in failing["tp all-reduce"]


PLANT = """
import shardwise.estimate.comm as comm
right = comm.ring_bytes_on_wire
def planted(op, size, n):  # the all-reduce's 2(N-1)/N written as 2N/N
    return right(op, size, n) * (n / (n - 1) if op == "all-reduce" and n > 1 else 1)
comm.ring_bytes_on_wire = planted
"""


@pytest.mark.slow
def test_cli_check_fails_on_a_wrong_wire_formula(tmp_path):
    """A factor planted in SPEC §5's ring bytes (loaded into `shardwise check` and each of its
    ranks through `sitecustomize`) cancels in the payload rows (predicted ÷ the same ring
    factor) but not on the wire: the wire rows miss and `check` exits 1."""
    (tmp_path / "sitecustomize.py").write_text(PLANT)
    env = os.environ | {"COLUMNS": "200",
                        "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    run = subprocess.run([sys.executable, "-m", "shardwise", "check", "--dp", "2", "--seq",
                          "32", "--global-batch", "4", "--dtype", "fp64", "--steps", "1",
                          "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stderr
    out = json.loads(run.stdout)
    failing = {(row["item"], row["what"]) for row in out["rows"] if not row["ok"]}
    assert failing == {("wire", "dp all-reduce")}, failing
    assert "not the ring's 2" in next(row["note"] for row in out["rows"]
                                      if (row["item"], row["what"]) == ("wire", "dp all-reduce"))


def test_cli_check_bad_input_is_a_one_line_error():
    assert_one_line_error(shardwise("check", "--tp", "3", check=False),
                          "tp=3 does not divide n_heads=4")
    assert_one_line_error(shardwise("check", "--model", "no-such-model", check=False),
                          "unknown model")
