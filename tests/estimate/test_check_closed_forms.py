"""`shardwise check`'s predicted side against figures worked out by hand here, on cases where
every term is distinguishable: ZeRO's flat units padded to a group of 3 (no unit divides
evenly), DeepSeek's structure small (tiny-deepseek: MLA with a q latent and V narrower than
Q/K, a dense first layer, a shared expert beside 8 routed ones) under ep = 2, the row targets
at their edges and the merge's order. The measured side: tests/runtime/test_measure.py."""

import math

import pytest

from shardwise.arch import get_model
from shardwise.estimate.check import (
    FRAMED,
    CheckRow,
    Counted,
    Term,
    comm_rows,
    merge_rows,
    ring_factor,
    state_rows,
    zero_units,
)
from shardwise.layout import Layout, TrainSpec

TINY = get_model("tiny")  # 4 layers, h 64, 4 heads of 16, 2 kv heads, f 128, V 256, untied
TINY_DS = get_model("tiny-deepseek")  # 3 layers, h 64, 4 heads, f 128, V 256, untied

# tiny, by hand: a layer = Q, O (64·64 each) + K, V (64·32 each) + gate, up, down (64·128
# each) + two norms (64); the embedding and the head 256·64; the final norm 64
T_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # 36,992
T_VOCAB = 256 * 64  # 16,384
# tiny-deepseek, by hand (transformers' DeepseekV3Attention's projections): q_a 64·32, its
# norm 32, q_b 32·4·(16 + 8), kv_a 64·(16 + 8), its norm 16, kv_b 16·4·(16 + 16), o 4·16·64
DS_ATTN = 64 * 32 + 32 + 32 * 4 * 24 + 64 * 24 + 16 + 16 * 4 * 32 + 4 * 16 * 64  # 12,848
DS_DENSE = DS_ATTN + 2 * 64 + 3 * 64 * 128  # layer 0: the dense MLP (f 128)
# layers 1, 2: the router (8·64) and the shared expert (3·64·32) beside the attention
DS_MOE = DS_ATTN + 2 * 64 + 8 * 64 + 3 * 64 * 32
DS_EXPERTS = 8 * 3 * 64 * 32  # 8 routed experts of f 32


def _pad(n, k):
    return -(-n // k) * k


# ------------------------------------------------------------------- ZeRO's flat units
def test_zero_units_of_a_dense_model_in_order():
    units = zero_units(TINY, Layout.parse("dp=3,zero=1"), 0)
    assert units == [(T_VOCAB, 3, False), *[(T_LAYER, 3, False)] * 4, (64, 3, False),
                     (T_VOCAB, 3, False)]
    # tp = 2 splits the embedding and the head by vocabulary
    assert zero_units(TINY, Layout.parse("dp=2,tp=2,zero=1"), 0)[0] == (T_VOCAB // 2, 2, False)


def test_zero_units_split_over_stages_and_experts_over_edp():
    # pp = 2: stage 0 the embedding and layers 0-1; stage 1 layers 2-3, the norm and the head
    pp = Layout.parse("dp=2,pp=2,zero=1")
    assert zero_units(TINY, pp, 0) == [(T_VOCAB, 2, False), (T_LAYER, 2, False),
                                       (T_LAYER, 2, False)]
    assert zero_units(TINY, pp, 1) == [(T_LAYER, 2, False), (T_LAYER, 2, False),
                                       (64, 2, False), (T_VOCAB, 2, False)]
    # ep = 2 over dp = 4: each MoE layer's dense part over the 4 ZeRO ranks, its half of the
    # routed experts a unit of its own over the 2 edp ranks
    units = zero_units(TINY_DS, Layout.parse("dp=4,ep=2,zero=1"), 0)
    assert units == [(T_VOCAB, 4, False), (DS_DENSE, 4, False),
                     (DS_MOE, 4, False), (DS_EXPERTS // 2, 2, True),
                     (DS_MOE, 4, False), (DS_EXPERTS // 2, 2, True),
                     (64, 4, False), (T_VOCAB, 4, False)]
    # without ep the experts stay in their layer's unit
    plain = zero_units(TINY_DS, Layout.parse("dp=4,zero=1"), 0)
    assert plain[2] == (DS_MOE + DS_EXPERTS, 4, False) and len(plain) == 6


# ------------------------------------------------------------------------- state rows
def _state(model, layout, train):
    rows = state_rows(model, Layout.parse(layout), train, 0,
                      {"weights": 1, "grads": 2, "master": 3, "optimizer": 4})
    assert [r.what for r in rows] == ["weights", "grads", "master", "optimizer"]
    assert [r.measured for r in rows] == [1, 2, 3, 4]
    return [r.predicted for r in rows]


BF16 = TrainSpec(seq_len=32, global_batch=6, dtype="bf16", grad_dtype="bf16")
FP64 = TrainSpec(seq_len=32, global_batch=6, dtype="fp64")
P_TINY = 4 * T_LAYER + 2 * T_VOCAB + 64


def test_state_rows_unsharded_by_spec_bytes_per_parameter():
    # SPEC §2: bf16 weights and gradients, fp32 master, Adam's two fp32 moments
    assert _state(TINY, "dp=3", BF16) == [2 * P_TINY, 2 * P_TINY, 4 * P_TINY, 8 * P_TINY]
    # fp64 (the CPU runtime): no master, torch's Adam keeps two fp64 buffers
    assert _state(TINY, "dp=3", FP64) == [8 * P_TINY, 8 * P_TINY, 0, 16 * P_TINY]


def test_state_rows_under_zero_hold_padded_shards():
    full = 2 * _pad(T_VOCAB, 3) + 4 * _pad(T_LAYER, 3) + _pad(64, 3)  # every unit padded
    shard = full // 3
    assert full == P_TINY + 2 * 2 + 4 * 1 + 2  # 16,384 → +2, 36,992 → +1, 64 → +2
    assert _state(TINY, "dp=3,zero=1", BF16) == [2 * full, 2 * shard, 4 * shard, 8 * shard]
    assert _state(TINY, "dp=3,zero=2", BF16) == [2 * full, 2 * shard, 4 * shard, 8 * shard]
    assert _state(TINY, "dp=3,zero=3", BF16) == [2 * shard, 2 * shard, 4 * shard, 8 * shard]
    # experts over 2 edp ranks, the rest over 4
    dense = 2 * T_VOCAB + DS_DENSE + 2 * DS_MOE + 64
    shard = dense // 4 + 2 * (DS_EXPERTS // 2) // 2  # two MoE layers' halves over 2
    assert _state(TINY_DS, "dp=4,ep=2,zero=3", BF16) == [2 * shard, 2 * shard, 4 * shard,
                                                         8 * shard]


# ------------------------------------------------------------------------ row targets
def test_row_errors_and_targets_at_their_edges():
    assert CheckRow("comm", "x", 0.0, 5.0).error == math.inf
    assert CheckRow("comm", "x", 0.0, 5.0).as_dict()["error"] is None
    assert CheckRow("comm", "x", 4.0, 5.0).as_dict() | {"note": None} == {
        "item": "comm", "what": "x", "predicted": 4.0, "measured": 5.0, "target": "exact",
        "note": None, "rank": 0, "stage": 0, "ranks": 1, "allowed": None, "error": 0.25,
        "ok": False}
    assert not CheckRow("comm", "x", None, 5.0).ok and CheckRow("comm", "x", 5.0, None).error is None
    # exact: float rounding only
    assert CheckRow("comm", "x", 1.0, 1.0 + 1e-13).ok and not CheckRow("comm", "x", 1.0, 1.0 + 1e-11).ok
    # 1 %: both signs, the edge included
    for measured, ok in ((990.0, True), (1010.0, True), (989.9, False), (1010.1, False)):
        assert CheckRow("activations", "l", 1000.0, measured, "1%").ok is ok, measured
    # the wire's algorithm target: within its bounds, and never without them
    framed = CheckRow("wire", "x", 10.0, 12.0, FRAMED, allowed=(11.0, 12.0))
    assert framed.ok and not CheckRow("wire", "x", 10.0, 12.0, FRAMED).ok
    assert not CheckRow("wire", "x", 10.0, 12.5, FRAMED, allowed=(11.0, 12.0)).ok
    assert not CheckRow("wire", "x", 10.0, 10.5, FRAMED, allowed=(11.0, 12.0)).ok
    assert not CheckRow("wire", "x", 10.0, None, FRAMED, allowed=(11.0, 12.0)).ok


def test_merge_orders_items_and_puts_a_missed_target_first():
    def row(item, what, measured, target="exact", rank=0, stage=0):
        return CheckRow(item, what, 100.0, measured, target, rank=rank, stage=stage)

    merged = merge_rows([
        [row("peak memory", "p", 90.0, "-"), row("state", "w", 100.0), row("other", "o", 1.0),
         row("activations", "l", 100.5, "1%"), row("comm", "tp", 100.0)],
        # rank 1: a larger error that meets its target, and one that misses it
        [row("activations", "l", 100.9, "1%", rank=1), row("state", "w", 100.0, rank=1),
         row("wire", "tp", 100.0, rank=1), row("comm", "tp", 100.0, rank=1)],
        [row("activations", "l", 99.5, "1%", rank=2), row("state", "w", 99.0, rank=2)],
        [row("comm", "tp", 100.0, rank=3, stage=1)],
    ])
    assert [(r.stage, r.item, r.rank, r.ranks) for r in merged] == [
        (0, "comm", 0, 2), (0, "wire", 1, 1), (0, "activations", 1, 3), (0, "state", 2, 3),
        (0, "peak memory", 0, 1), (0, "other", 0, 1), (1, "comm", 3, 1)]


@pytest.mark.parametrize(("op", "n", "factor"), [
    ("all-reduce", 3, 4 / 3), ("reduce-scatter", 3, 2 / 3), ("all-gather", 5, 4 / 5),
    ("all-gather (routing)", 4, 3 / 4), ("all-to-all", 4, 1.0), ("send", 2, 1.0)])
def test_ring_factor_is_spec_5s_bytes_per_byte_of_payload(op, n, factor):
    assert ring_factor(op, n) == pytest.approx(factor, rel=1e-12)


# ------------------------------------------------------------------------- payload rows
def test_payload_rows_per_step_and_what_the_model_or_the_run_lacks():
    """Counted over 2 steps on dp = 3: the payload per step is the term ÷ the ring factor;
    a call the model lacks and a term never called get a row each, said so."""
    terms = [Term("dp", "all-reduce", 4 / 3 * 900.0, "gradient average"),
             Term("dp", "all-reduce", 4 / 3 * 300.0, "tied"),
             Term("pp", "send", 500.0, "activations")]
    counted = Counted({("dp", "all-reduce"): 2 * 1200.0, ("tp", "broadcast"): 64.0},
                      {("dp", "all-reduce"): 4, ("tp", "broadcast"): 2}, {"dp": 3, "tp": 2})
    rows = comm_rows(terms, counted, 2, Layout.parse("dp=3,pp=2"))
    comm = {r.what: r for r in rows if r.item == "comm"}
    assert set(comm) == {"dp all-reduce", "pp send", "tp broadcast"}
    dp = comm["dp all-reduce"]
    assert (dp.predicted, dp.measured, dp.ok) == (pytest.approx(1200.0), 1200.0, True)
    assert dp.note == "gradient average; tied"
    pp = comm["pp send"]
    assert (pp.predicted, pp.measured) == (500.0, 0.0)
    assert pp.note == "activations; never called (ring bytes, not payload)"
    tp = comm["tp broadcast"]
    assert (tp.predicted, tp.measured, tp.note) == (0.0, 32.0, "not in the analytic model")
    wire = [r for r in rows if r.item == "wire"]
    assert [r.what for r in wire] == ["dp all-reduce", "pp send", "tp broadcast"]
    assert [r.predicted for r in wire] == [pytest.approx(1600.0), 500.0, 0.0]
