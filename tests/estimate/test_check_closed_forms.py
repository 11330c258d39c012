"""`shardwise check`'s predicted side against figures worked out by hand here, on cases where
every term is distinguishable: ZeRO's flat units padded to a group of 3 (no unit divides
evenly), DeepSeek's structure small (tiny-deepseek: MLA with a q latent and V narrower than
Q/K, a dense first layer, a shared expert beside 8 routed ones) under ep = 2, the row targets
at their edges and the merge's order. The measured side: tests/runtime/test_measure.py."""

import math
from dataclasses import replace

import pytest

from shardwise.arch import get_model
from shardwise.estimate.check import (
    EXACT,
    FRAMED,
    FRAMING_PER_PEER,
    ROUTING_GATHER_OP,
    CheckRow,
    Counted,
    Term,
    Traffic,
    activation_note,
    checkpoint_rows,
    comm_rows,
    merge_rows,
    peak_row,
    predicted_comm,
    predicted_saved,
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
        [row("other", "o", 1.0), row("peak memory", "p", 90.0, "-"), row("state", "w", 100.0),
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


# ------------------------------------------------------- predicted traffic, term by term
F64 = 8  # the CPU runtime's dtype: activations, gradients and weights in fp64


def _by_label(model, layout, stage=0, seq=32, batch=8, **kw):
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype="fp64")
    out: dict[tuple[str, str, str], float] = {}
    for term in predicted_comm(model, Layout.parse(layout), train, stage, **kw):
        key = (term.axis, term.op, term.label)
        out[key] = out.get(key, 0.0) + term.bytes
    return out


def _ring(op, size, n):  # SPEC §5: 2(N−1)/N·S for an all-reduce, (N−1)/N·S otherwise
    return (2 if op == "all-reduce" else 1) * (n - 1) / n * size


def test_deepseek_under_tp_sp_and_ep_term_by_term():
    """tiny-deepseek at tp = 2 with SP, ep = 2 over dp = 4, one stage, 2 micro-batches of 32:
    the replicated weights' partial gradients (SP: 7 norms and 2 routers; MLA: 3 layers'
    down-projections and latent norms), the routing drawn (16 rows out, 18 in), the count
    exchange, the load-balancing counts and the capacity's choices over the SP ranks, and the
    dense and expert gradient all-reduces."""
    routing = [(1, 10, 14), (2, 6, 4)]
    terms = _by_label(TINY_DS, "tp=2,sp=1,ep=2,dp=4", routing=routing, aux_loss=True,
                      capacity=True)
    sp = ("tp", "all-reduce", "SP: norm (and router) gradients")
    assert terms[sp] == _ring("all-reduce", ((2 * 3 + 1) * 64 + 2 * 8 * 64) * F64, 2)
    mla = ("tp", "all-reduce", "MLA: down-projection and latent-norm gradients")
    assert terms[mla] == _ring("all-reduce", 3 * (64 * 32 + 64 * 24 + 32 + 16) * F64, 2)
    balanced = 2 * 2 * 2 * 2 * _ring("all-to-all", 32 * 2, 2) * 64 * F64  # m·moe·(2 ways)·fb
    dispatch = ("ep", "all-to-all", f"dispatch/combine of the routing drawn (16 rows out, 18 "
                f"in per step; balanced routing, SPEC §5: {balanced:,.0f} B)")
    assert terms[dispatch] == (16 + 18) * 64 * F64 * 2  # forward and backward
    counts = ("ep", "all-to-all (counts)", "per-expert row counts before each dispatch")
    assert terms[counts] == 2 * _ring("all-to-all", 8 * 8, 2)  # 2 calls of E int64
    calls = 2 * 2  # micro-batches × MoE layers
    assert terms[("tp", "all-reduce (routing counts)", "MoE load-balancing loss: per-expert "
                  "counts summed over the ranks sharing the sequences")] == calls * _ring(
        "all-reduce", 8 * 8, 2)
    assert terms[("tp", "all-gather (routing)", "MoE capacity: the expert choices of the ranks "
                  "sharing the sequences")] == calls * _ring("all-gather", 32 * 1 * 2 * 8, 2)
    # dense: the embedding and head (V/t·h), 3 layers at tp = 2, the final norm; experts: half
    # of each MoE layer's 8 over ep, ÷ tp
    attention = 64 * 32 + 64 * 24 + 48 + (32 * 96 + 16 * 128 + 64 * 64) / 2 + 128
    dense = 2 * 128 * 64 + (attention + 3 * 64 * 128 / 2) + 2 * (
        attention + 8 * 64 + 3 * 64 * 32 / 2) + 64
    experts = 2 * 8 * 3 * 64 * 32 / 4
    assert terms[("dp", "all-reduce", "gradient average")] == _ring("all-reduce", dense * F64, 4)
    assert terms[("edp", "all-reduce", "gradient average")] == _ring("all-reduce",
                                                                      experts * F64, 2)
    # full recompute replays each forward all-to-all and the routing calls
    full = _by_label(TINY_DS, "tp=2,sp=1,ep=2,dp=4,recompute=full", routing=routing,
                     aux_loss=True)
    assert full[counts] == 2 * terms[counts]
    assert sum(v for k, v in full.items() if k[0] == "ep" and k[1] == "all-to-all") == (
        16 + 18) * 64 * F64 * 3
    assert full[("tp", "all-reduce (routing counts)", "MoE load-balancing loss: per-expert "
                 "counts summed over the ranks sharing the sequences")] == 2 * calls * _ring(
        "all-reduce", 8 * 8, 2)


def test_routing_calls_over_cp_gather_the_whole_sequence():
    terms = _by_label(TINY_DS, "cp=2,dp=1", seq=64, aux_loss=True, capacity=True)
    calls = 8 * 2  # 8 micro-batches × 2 MoE layers
    assert terms[("cp", "all-gather (routing)", "MoE capacity: the expert choices of the ranks "
                  "sharing the sequences")] == calls * _ring("all-gather", 64 * 2 * 8, 2)
    assert ("tp", "all-reduce (routing counts)") not in {k[:2] for k in terms}
    assert not [k for k in _by_label(TINY, "cp=2", seq=64, aux_loss=True) if "routing" in k[1]]


def test_replicated_kv_heads_under_zero_sum_the_shards():
    """tiny (2 kv heads) at tp = 4 with ZeRO-1 over 2: per layer unit (its tp = 4 share,
    10,368 parameters) an all-reduce over tp of a_kv = 2 copies of the unit's shard."""
    unit = 2 * 64 * 64 / 4 + 2 * 64 * 16 + 128 + 3 * 64 * 128 / 4
    terms = _by_label(TINY, "tp=4,dp=2,zero=1")
    key = ("tp", "all-reduce", "replicated kv heads: K, V elements of the ZeRO shards summed "
           "over replicas")
    assert terms[key] == 4 * _ring("all-reduce", 2 * unit / 2 * F64, 4)


def test_tied_embedding_gradients_over_the_pipeline_zero_shard_padded():
    tied = TINY.with_(tie_embeddings=True)
    plain = _by_label(tied, "pp=2,dp=3", batch=6)
    assert plain[("pp", "all-reduce", "tied embedding gradients")] == _ring(
        "all-reduce", 256 * 64 * F64, 2)
    # ZeRO over 3: the rank's shard of the gradient, 16,384 padded to 16,386, ÷ 3
    zero = _by_label(tied, "pp=2,dp=3,zero=1", batch=6)
    assert zero[("pp", "all-reduce", "tied embedding gradients (ZeRO: this rank's shard)")] == (
        pytest.approx(_ring("all-reduce", 256 * 64 * F64, 2) * 5462 / 16384))
    # tp = 2 halves the vocabulary: 8,192 padded to 8,193 ÷ 3 = 2,731
    tp = _by_label(tied, "pp=2,tp=2,dp=3,zero=1", batch=6)
    assert tp[("pp", "all-reduce", "tied embedding gradients (ZeRO: this rank's shard)")] == (
        pytest.approx(_ring("all-reduce", 128 * 64 * F64, 2) * 2731 / 8192))
    assert tp[("pp", "send", "activations and their gradients")] > 0


def test_hybrid_zero_shards_in_groups_and_averages_the_shards_over_them():
    """tiny, ZeRO-2 in groups of 2 of dp = 4, 2 micro-batches: reduce-scatter and all-gather
    within the group, and after each reduce-scatter the shard all-reduced over the 2 groups."""
    p = 4 * T_LAYER + 2 * T_VOCAB + 64  # every unit even: no padding
    terms = _by_label(TINY, "dp=4,zero=2,zero_group=2")
    assert terms[("zero_replica", "all-reduce", "hybrid ZeRO: gradient shards averaged over "
                  "the groups")] == 2 * _ring("all-reduce", p / 2 * F64, 2)
    assert terms[("zero_shard", "reduce-scatter", "ZeRO-2")] == 2 * _ring("reduce-scatter",
                                                                          p * F64, 2)
    assert terms[("zero_shard", "all-gather", "ZeRO-2")] == _ring("all-gather", p * F64, 2)
    # ZeRO-1: one reduction per step; experts over edp groups of max(k/e, 1)
    one = _by_label(TINY, "dp=4,zero=1,zero_group=2")
    assert one[("zero_replica", "all-reduce", "hybrid ZeRO: gradient shards averaged over "
                "the groups")] == _ring("all-reduce", p / 2 * F64, 2)
    moe = _by_label(TINY_DS, "dp=8,ep=2,zero=1,zero_group=4")
    experts = 2 * DS_EXPERTS / 2  # two MoE layers' halves
    assert moe[("edp_replica", "all-reduce", "hybrid ZeRO: gradient shards averaged over the "
                "groups")] == _ring("all-reduce", experts / 2 * F64, 2)
    assert moe[("edp_shard", "reduce-scatter", "ZeRO-1")] == _ring("reduce-scatter",
                                                                   experts * F64, 2)


# ------------------------------------------------------------------------- what is kept
RUNTIME64 = TrainSpec(seq_len=32, global_batch=4, dtype="fp64", impl="shardwise")


def test_predicted_saved_splits_the_moe_block_and_counts_per_expert_row():
    _, moe, per_row = predicted_saved(TINY_DS, Layout.parse("dp=1"), RUNTIME64, True)
    # per row an expert runs: its input (h) and SwiGLU's gate, up and down input (f_e each)
    assert per_row == (64 + 3 * 32) * F64
    assert moe is not None and moe > 64 * per_row  # 2 of 32 rows per token: 64 rows at least
    assert predicted_saved(TINY, Layout.parse("dp=1"), RUNTIME64, False)[1:] == (None, 0.0)
    # full recompute keeps the layer input, (s, b, h)
    full = predicted_saved(TINY_DS, Layout.parse("dp=1,recompute=full"), RUNTIME64, True)
    assert full == (32 * 64 * F64, None, 0.0)
    two = predicted_saved(TINY_DS, Layout.parse("dp=1,recompute=full,mb=2"),
                          TrainSpec(seq_len=32, global_batch=4, dtype="fp64",
                                    impl="shardwise"), True)
    assert two[0] == 2 * 32 * 64 * F64


def test_activation_notes_size_each_runtime_fact():
    row = CheckRow("activations", "layer 0", 1000.0, 990.0, "1%")
    bf16 = TrainSpec(seq_len=64, global_batch=4, dtype="bf16", impl="shardwise")
    # tp = 2 with SP, cp = 2 ring: rows s/c·b = 32; FlashAttention's log-sum-exp per local
    # head (4/2) — bf16 in the runtime's reference kernel off the CPU, fp32 in the count
    # (RMSNorm's rstd is fp32 in both)
    notes = activation_note(row, Layout.parse("tp=2,sp=1,cp=2"), bf16, TINY)
    n = 2 * 32
    assert notes == [f"bf16: the runtime keeps attention's log-sum-exp in bf16 off the CPU, "
                     f"the count in fp32: −{n * 2:,.0f} B",
                     "ring attention also saves the zigzag token positions, (c, s/c) int64: "
                     "+512 B"]
    # selective recompute keeps no log-sum-exp: nothing differs on MLA either
    assert activation_note(row, Layout.parse("dp=1,recompute=selective"), bf16, TINY_DS) == []
    # no note where the row is exact, under full recompute, for an MoE row's fp32 router
    assert activation_note(CheckRow("activations", "l", 5.0, 5.0), Layout(), bf16, TINY) == []
    assert activation_note(row, Layout.parse("dp=1,recompute=full"), bf16, TINY) == []
    moe_row = CheckRow("activations", "layer 1 MoE", 1000.0, 990.0, "1%")
    assert activation_note(moe_row, Layout.parse("dp=1"), bf16, TINY_DS) == []
    # without FlashAttention ring attention keeps its output and log-sum-exp, not scores
    eager = TrainSpec(seq_len=64, global_batch=4, dtype="fp64", impl="shardwise",
                      flash_attention=False)
    assert activation_note(row, Layout.parse("cp=2"), eager, TINY)[-1] == (
        "ring attention keeps its output and log-sum-exp, never the scores")


def test_checkpoint_rows_against_goodput_bytes_by_hand():
    measured = dict(bandwidth=2e9, state=1.0, other=2.0, busiest_rank_bytes=3.0,
                    disk_bytes=4.0, seconds=5.0, disk_test_bytes=2**21)
    rows = checkpoint_rows(TINY, Layout.parse("dp=2"), RUNTIME64, measured)
    whole = P_TINY * (8 + 16)  # fp64 weights and torch's two fp64 Adam moments, no master
    assert [(r.what, r.predicted, r.measured, r.target) for r in rows] == [
        ("weights, masters, moments (bytes)", whole, 1.0, "exact"),
        ("step counters, RNG (bytes)", None, 2.0, "-"),
        ("busiest rank's file (bytes)", whole / 2, 3.0, "-"),  # DCP spreads the replicas
        ("on disk (bytes)", None, 4.0, "-"),
        ("write (s)", whole / 2e9, 5.0, "-")]
    assert rows[0].note.startswith("180,800 params × 24 B (fp64, the shardwise runtime's")
    assert "this disk's 2,000 MB/s (2 MiB written" in rows[-1].note


def test_peak_row_is_reported_with_its_basis():
    cpu = peak_row(TINY, Layout.parse("dp=2"), RUNTIME64, 0, None)
    assert (cpu.item, cpu.what, cpu.measured, cpu.target, cpu.ok) == (
        "peak memory", "max_memory_allocated", None, "-", True)
    assert cpu.note.startswith("no GPU: this run is on CPU (gloo)")
    gpu = peak_row(TINY, Layout.parse("dp=2"), RUNTIME64, 0, 123.0)
    assert (gpu.predicted, gpu.measured) == (cpu.predicted, 123.0)
    assert gpu.note.startswith("allocator peak: the model's state and activations")
    assert cpu.predicted > whole_state(TINY)


def whole_state(model):
    return model.count_params().total * (8 + 8 + 16)  # fp64 weights, gradients, moments


def test_context_parallel_terms_per_kind():
    """tiny (2 kv heads of 16: kv 32; q 64), s 64, 8 micro-batches × 4 layers. Ring over c:
    (c−1)·2·(s/c)·b·kv·bytes forward, ×3 with backward (Liu et al. 2023); Ulysses over u:
    (u−1)/u·(s/c)·b·(2q + 2kv)·bytes, ×2 (Jacobs et al. 2023 §3.2); the hybrid a ring of c/u
    ranks over s·u/c rows with kv/u, after the all-to-alls in groups of u."""
    calls = 8 * 4
    ring = _by_label(TINY, "cp=2", seq=64)
    assert ring[("cp", "send", "ring attention K, V and dK, dV")] == calls * (
        1 * 2 * 32 * 32 * F64 * 3)
    ulysses = _by_label(TINY, "cp=2,cp_kind=ulysses", seq=64)
    assert ulysses[("cp", "all-to-all", "Ulysses: Q, K, V and the attention output, their "
                    "gradients back")] == calls * (1 / 2 * 32 * (2 * 64 + 2 * 32) * F64 * 2)
    hybrid = _by_label(TINY, "cp=4,cp_kind=hybrid,ulysses=2", seq=64)
    assert hybrid[("cp_ring", "send", "ring attention K, V and dK, dV")] == calls * (
        1 * 2 * (64 * 2 / 4) * (32 / 2) * F64 * 3)
    assert hybrid[("cp_a2a", "all-to-all", "Ulysses: Q, K, V and the attention output, their "
                   "gradients back")] == calls * (1 / 2 * 16 * (2 * 64 + 2 * 32) * F64 * 2)
    # tp = 2 halves q and the kv heads (2 of 2: one each)
    tp = _by_label(TINY, "cp=2,tp=2,cp_kind=ulysses", seq=64)
    assert tp[("cp", "all-to-all", "Ulysses: Q, K, V and the attention output, their "
               "gradients back")] == calls * (1 / 2 * 32 * (2 * 32 + 2 * 16) * F64 * 2)


def test_context_parallel_terms_at_mla_widths():
    """tiny-deepseek (MLA: 4 heads and 4 kv heads, d = 16 nope + 8 RoPE = 24, d_v 16), s 64,
    8 micro-batches × 3 layers: Ulysses moves Q and K at d, V and the output at d_v,
    (u−1)/u·(s/c)·b·(96 + 96 + 64 + 64)·bytes, ×2; the hybrid's ring K at d and V at d_v,
    (s·u/c)·b·(96 + 64)/u·bytes a hop."""
    assert (TINY_DS.n_heads, TINY_DS.n_kv_heads, TINY_DS.head_dim, TINY_DS.value_head_dim) == (
        4, 4, 24, 16)
    calls = 8 * 3
    label = "Ulysses: Q, K, V and the attention output, their gradients back"
    ulysses = _by_label(TINY_DS, "cp=2,cp_kind=ulysses", seq=64)
    assert ulysses[("cp", "all-to-all", label)] == calls * (
        1 / 2 * 32 * (96 + 96 + 64 + 64) * F64 * 2)
    hybrid = _by_label(TINY_DS, "cp=4,cp_kind=hybrid,ulysses=2", seq=64)
    assert hybrid[("cp_a2a", "all-to-all", label)] == calls * (
        1 / 2 * 16 * (96 + 96 + 64 + 64) * F64 * 2)
    assert hybrid[("cp_ring", "send", "ring attention K, V and dK, dV")] == calls * (
        1 * (64 * 2 / 4) * (96 + 64) / 2 * F64 * 3)


def test_traffic_adds_up_and_uncounted_bytes_are_reported():
    total = Traffic(1.0, 2.0, 52, 3.0) + Traffic(10.0, 20.0, 40, 30.0)
    assert total == Traffic(11.0, 22.0, 40, 33.0) and total.wire == 11 + 22 * 40
    assert (Traffic(5.0, 1.0, 52) + Traffic()).header == 52
    counted = Counted({("dp", "all-reduce"): 1200.0}, {("dp", "all-reduce"): 1}, {"dp": 3})
    wire = {("dp", "all-reduce"): Traffic(1600.0 + 100, 10, 52),
            ("?", "?"): Traffic(100.0, 1, 52), ("world", "all-reduce"): Traffic(48.0, 1, 52)}
    rows = comm_rows([Term("dp", "all-reduce", 1600.0, "g")], counted, 2,
                     Layout.parse("dp=3"), wire)
    last = rows[-1]
    assert (last.item, last.what, last.predicted, last.target) == ("wire", "not counted", None,
                                                                   "-")
    assert last.measured == (152 + 100) / 2
    assert last.note == ("bytes on the wire of calls outside the model and the counters: "
                         "before any call 76 B, world all-reduce 50 B")


def test_wire_row_neither_algorithm_keeps_the_backends_bounds():
    """4 MB reduce-scatter on 4 ranks, 2 calls, data at 1·payload: neither the ring's 0.75 nor
    gloo's 1.5 — the verdict uses gloo's algorithm (its bounds), and says both factors."""
    counted = Counted({("dp", "reduce-scatter"): 4e6}, {("dp", "reduce-scatter"): 2}, {"dp": 4})
    wire = {("dp", "reduce-scatter"): Traffic(4e6, 60, 52)}
    row = comm_rows([Term("dp", "reduce-scatter", 3e6, "ZeRO")], counted, 1,
                    Layout.parse("dp=4"), wire)[1]
    assert not row.ok and row.allowed == (1.5 * 4e6 + 60 * 52, 1.5 * 4e6 + 60 * 52 + 1024 * 3 * 2)
    assert row.note.endswith("data 1·payload, not the ring's 0.75 nor the 1.5 of the backend's "
                             "own algorithm")
    counted = Counted({("dp", "all-gather"): 4e6}, {("dp", "all-gather"): 2}, {"dp": 4})
    row = comm_rows([Term("dp", "all-gather", 3e6, "ZeRO")], counted, 1, Layout.parse("dp=4"),
                    {("dp", "all-gather"): Traffic(4e6, 60, 52)})[1]
    assert row.note.endswith("data 1·payload, not the ring's 0.75")
    assert row.allowed == (0.75 * 4e6 + 60 * 52, 0.75 * 4e6 + 60 * 52 + 1024 * 3 * 2)
    # a call never counted on a group never called: no slack, reported as measured
    lone = comm_rows([Term("pp", "send", 500.0, "a")], Counted({}, {}, {}), 1,
                     Layout.parse("pp=2"), {("pp", "send"): Traffic(500.0, 1, 52)})[1]
    assert (lone.target, lone.measured) == ("-", 552.0)
    assert lone.predicted == 500.0  # the model's bytes still shown beside what was measured


def test_a_missed_tp_all_reduce_under_zero_with_sp_or_mla_says_why():
    counted = Counted({("tp", "all-reduce"): 900.0}, {("tp", "all-reduce"): 3}, {"tp": 2})
    terms = [Term("tp", "all-reduce", 1600.0, "SP: norm (and router) gradients")]
    why = ("; ZeRO + SP or MLA: the runtime all-reduces over tp the whole ZeRO shard of every "
           "unit holding a weight whose gradient is partial over tp (other elements masked to "
           "zero), not only those weights' gradients")
    for layout, said in (("tp=2,sp=1,zero=1,dp=2", True), ("tp=2,sp=1,dp=2", False),
                         ("tp=2,zero=1,dp=2", False)):
        row = comm_rows(terms, counted, 1, Layout.parse(layout))[0]
        assert row.note == "SP: norm (and router) gradients" + (why if said else ""), layout
    mla = [Term("tp", "all-reduce", 1600.0, "MLA: down-projection and latent-norm gradients")]
    assert comm_rows(mla, counted, 1, Layout.parse("tp=2,zero=1,dp=2"))[0].note.endswith(why)
    # met: no note
    met = Counted({("tp", "all-reduce"): 1600.0}, {("tp", "all-reduce"): 3}, {"tp": 2})
    assert comm_rows(terms, met, 1, Layout.parse("tp=2,sp=1,zero=1,dp=2"))[0].note == (
        "SP: norm (and router) gradients")


def test_tp_pairs_per_layer_kind_and_replicated_kv_without_zero():
    """tp = 2 (no SP), 8 micro-batches of (32, 1, 64) fp64: a dense layer's attention and MLP
    pairs all-reduce twice each (f backward, g forward); an MoE layer's attention pair only
    (the experts' dispatch replaces the MLP's): 4 + 2 + 2 all-reduces of s·b·h per
    micro-batch, each sending 2(t−1)/t = 1× its payload."""
    terms = _by_label(TINY_DS, "tp=2")
    assert terms[("tp", "all-reduce", "f/g of the layers' pairs")] == 8 * 8 * 32 * 64 * F64
    # tiny at tp = 4 without ZeRO: each layer's K and V gradients, (a_kv, d, h), summed over tp
    kv = _by_label(TINY, "tp=4")
    assert kv[("tp", "all-reduce", "replicated kv heads: K, V gradients summed over "
               "replicas")] == _ring("all-reduce", 4 * 2 * 32 * 64 * F64, 4)


def test_hybrid_zero_with_experts_names_both_shard_groups():
    moe = _by_label(TINY_DS, "dp=8,ep=2,zero=1,zero_group=4")
    dense = 2 * T_VOCAB + DS_DENSE + 2 * DS_MOE + 64
    assert moe[("zero_shard", "reduce-scatter", "ZeRO-1")] == _ring("reduce-scatter",
                                                                   dense * F64, 4)
    assert moe[("zero_replica", "all-reduce", "hybrid ZeRO: gradient shards averaged over the "
                "groups")] == _ring("all-reduce", dense / 4 * F64, 2)
    # groups of 2 with ep = 2: each expert shard on max(2/2, 1) = 1 rank, nothing to scatter
    small = _by_label(TINY_DS, "dp=8,ep=2,zero=1,zero_group=2")
    assert not [k for k in small if k[0] == "edp_shard"]
    assert small[("edp_replica", "all-reduce", "hybrid ZeRO: gradient shards averaged over the "
                  "groups")] == _ring("all-reduce", DS_EXPERTS * F64, 4)


def test_state_and_checkpoint_rows_say_what_they_hold():
    rows = state_rows(TINY, Layout.parse("dp=3,zero=1"), RUNTIME64, 0,
                      {"weights": 1, "grads": 2, "master": 3, "optimizer": 4})
    assert {r.item for r in rows} == {"state"}
    assert rows[0].note == ("180,800 dense + 0 expert params; 8/8/0/16 B per param "
                            "(weights/grads/master/moments), ZeRO-1 over 3: 7 flat units padded "
                            "to 180,810 elements, 60,270 per shard; gradients held after the "
                            "step: the shard")
    assert rows[3].note.startswith("AdamW's two moments; 180,800 dense")
    measured = dict(bandwidth=2e9, state=1.0, other=2.0, busiest_rank_bytes=3.0,
                    disk_bytes=4.0, seconds=5.0, disk_test_bytes=2**21)
    rows = checkpoint_rows(TINY, Layout.parse("dp=2"), RUNTIME64, measured)
    assert {r.item for r in rows} == {"checkpoint"}
    assert [r.note for r in rows] == [
        "180,800 params × 24 B (fp64, the shardwise runtime's format); measured: the chunks "
        "DCP's .metadata lists, each once",
        "AdamW's step count per parameter and the CPU generator's state: outside the "
        "per-parameter model",
        "predicted: an even share of its stage (DCP gives each replicated chunk to the rank "
        "with the least planned so far); measured: its .distcp file, torch.save's framing of "
        "every chunk included",
        "every file: the tensors in torch.save framing, DCP's .metadata, shardwise.json and "
        "the checksum manifest",
        "predicted: the tensors ÷ this disk's 2,000 MB/s (2 MiB written and fsync'ed into the "
        "same directory just before); measured: the whole save, with DCP's planning and "
        "serialisation, the manifest's SHA-256 of every file, the fsyncs and the atomic "
        "publish"]
    # the peak row names the transient its peak adds: the loss's fp32 buffer s·b·V·4 =
    # 32,768 B outweighs FlashAttention's dq accumulator s·b·h·4 = 8,192 B
    peak = peak_row(TINY, Layout.parse("dp=2"), RUNTIME64, 0, 1.0)
    assert "(modelled: loss buffer; not modelled:" in peak.note


def test_predicted_saved_under_sp_and_selective_recompute():
    from shardwise.estimate.activations import saved_tensors_per_layer

    full = predicted_saved(TINY, Layout.parse("tp=2,sp=1,recompute=full"), RUNTIME64, False)
    assert full == (32 * 64 * F64 / 2, None, 0.0)  # the layer input ÷ t under SP
    dense, moe, _ = predicted_saved(TINY_DS, Layout.parse("dp=1,recompute=selective"),
                                    RUNTIME64, True)
    saved = saved_tensors_per_layer(TINY_DS, 32, 1, flash=True, selective=True,
                                    dtype_bytes_=F64, moe=True)
    assert dense + moe == pytest.approx(sum(saved.values()))


def test_wire_row_at_each_edge_of_the_framing_allowance():
    """4 MB reduce-scatter on 4 ranks, 2 calls: data at exactly the ring's 0.75·payload, and
    at it plus the whole allowance FRAMING_PER_PEER·(n−1)·calls, is the ring; a byte past
    either edge is not. The comm row above it is exact (the counters' payload)."""
    counted = Counted({("dp", "reduce-scatter"): 4e6}, {("dp", "reduce-scatter"): 2}, {"dp": 4})
    slack = FRAMING_PER_PEER * 3 * 2
    for data, ring in ((3e6, True), (3e6 + slack, True), (3e6 - 1, False),
                       (3e6 + slack + 1, False)):
        comm, wire = comm_rows([Term("dp", "reduce-scatter", 3e6, "ZeRO")], counted, 1,
                               Layout.parse("dp=4"),
                               {("dp", "reduce-scatter"): Traffic(data, 60, 52)})[:2]
        assert comm.target == EXACT and comm.predicted == 4e6
        said = wire.note.endswith("data = SPEC §5's 0.75·payload + message headers")
        assert said is ring, data


def test_pipeline_sends_scatter_over_tp_with_sp_and_routing_gathers_only_with_capacity():
    """tiny at tp = 2 with SP, pp = 2, 8 micro-batches of 32 (fp64): stage 0 sends each
    micro-batch's (s, b, h) activation forward, split over tp by the scatter/gather
    optimisation: 8·32·64·8/2 B. tiny-deepseek at tp = 2 with SP, ep = 2: the expert choices
    are all-gathered over tp only when a capacity factor drops tokens, not dropless."""
    sends = _by_label(TINY, "tp=2,sp=1,pp=2")[("pp", "send", "activations and their gradients")]
    assert sends == 8 * 32 * 64 * 8 / 2

    def gathered(capacity):
        terms = _by_label(TINY_DS, "tp=2,sp=1,ep=2,dp=2", capacity=capacity)
        return sum(v for (axis, op, _), v in terms.items() if op == ROUTING_GATHER_OP)

    # 4 micro-batches × 2 MoE layers, every token's top-k int64 choices over tp = 2
    assert gathered(True) == 4 * 2 * _ring("all-gather", 32 * TINY_DS.top_k * 8, 2)
    assert gathered(False) == 0


def test_zero_units_count_learned_positions_in_the_embedding_unit():
    """A model with learned positions (32 × h) at tp = 2: the first unit is the vocabulary-
    parallel embedding V·h/t plus the whole position table."""
    model = replace(TINY, learned_positions=32).validate()
    first = zero_units(model, Layout.parse("tp=2,dp=2,zero=1"), 0)[0]
    assert first == (256 * 64 / 2 + 32 * 64, 2, False)
