"""SPEC §5: ring collectives, alpha-beta time, traffic per parallelism."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import (
    bus_bandwidth,
    collective_time,
    cp_comm_bytes_per_layer,
    dp_step_comm_bytes,
    dp_step_comm_ops,
    ep_comm_bytes_per_layer,
    ep_comm_bytes_routed,
    ep_count_exchange_bytes,
    hierarchical_all_reduce_time,
    pp_comm_bytes_per_microbatch,
    pp_send_bytes_per_step,
    ring_bytes_on_wire,
    ring_steps,
    sequence_parallel_grad_comm_bytes,
    tied_embedding_comm_bytes,
    tp_comm_bytes_per_layer,
    tp_comm_ops_per_layer,
    ulysses_comm_bytes_per_layer,
    vocab_parallel_comm_ops,
)
from shardwise.hardware import LINKS, Link


def test_spec_all_reduce_4000_bytes_on_4_ranks():
    assert ring_bytes_on_wire("all-reduce", 4000, 4) == 6000
    assert ring_steps("all-reduce", 4) == 6


@pytest.mark.parametrize("op", ["reduce-scatter", "all-gather", "all-to-all", "broadcast"])
def test_single_pass_ops(op):
    assert ring_bytes_on_wire(op, 8000, 8) == 7000
    assert ring_steps(op, 8) == 7


def test_spec_7b_gradients_all_reduce_time():
    size = 13.5e9
    nvlink = LINKS["nvlink4"]
    ndr = LINKS["ndr"]
    bandwidth_only = Link("x", nvlink.bandwidth, 0.0)
    # "≈ 52 ms" and "≈ 470 ms", bandwidth term only: 2·7/8·13.5 GB / β.
    assert collective_time("all-reduce", size, 8, bandwidth_only) == pytest.approx(0.052, abs=1e-3)
    assert collective_time("all-reduce", size, 8, nvlink) == pytest.approx(0.052, abs=1e-3)
    assert collective_time("all-reduce", size, 8, ndr) == pytest.approx(0.470, abs=5e-3)


@given(st.floats(1, 1e12), st.integers(2, 1 << 20))
def test_ring_bytes_tend_to_2S(size, n):
    sent = ring_bytes_on_wire("all-reduce", size, n)
    assert sent < 2 * size
    assert sent == pytest.approx(2 * size * (n - 1) / n)


def test_tree_wins_for_small_messages_on_many_ranks():
    link = LINKS["ndr"]
    small, big, n = 1e3, 1e10, 1024
    assert collective_time("all-reduce", small, n, link, "tree") < collective_time(
        "all-reduce", small, n, link)
    assert collective_time("all-reduce", big, 64, link, "tree") > collective_time(
        "all-reduce", big, 64, link)
    assert collective_time("all-reduce", small, n, link, "tree") == pytest.approx(
        2 * math.log2(n) * link.latency + 2 * small / link.bandwidth)


def test_hierarchical_all_reduce():
    nvlink, ndr, size = LINKS["nvlink4"], LINKS["ndr"], 1e9
    expected = (2 * (7 * nvlink.latency + 7 / 8 * size / nvlink.bandwidth)
                + 2 * 3 * ndr.latency + 2 * 3 / 4 * (size / 8) / ndr.bandwidth)
    assert hierarchical_all_reduce_time(size, 4, 8, nvlink, ndr) == pytest.approx(expected)
    assert collective_time("all-reduce", size, 32, nvlink, "hierarchical", nodes=4,
                           inter=ndr) == pytest.approx(expected)
    # Cheaper than a flat ring across the slow link.
    assert expected < collective_time("all-reduce", size, 32, ndr)


def test_bus_bandwidth_nccl_tests_definition():
    # all-reduce of 1 GB on 8 ranks in 10 ms: algbw 100 GB/s, busbw 175 GB/s.
    assert bus_bandwidth("all-reduce", 1e9, 8, 0.01) == pytest.approx(175e9)
    assert bus_bandwidth("all-gather", 1e9, 8, 0.01) == pytest.approx(87.5e9)


def test_dp_step_traffic_by_zero_stage():
    P, n = 1e9, 8
    ddp = 2 * 7 / 8 * 2 * P
    assert dp_step_comm_bytes(P, n, 0) == pytest.approx(ddp)
    assert dp_step_comm_bytes(P, n, 1) == pytest.approx(ddp)
    assert dp_step_comm_bytes(P, n, 2) == pytest.approx(ddp)
    assert dp_step_comm_bytes(P, n, 3) == pytest.approx(1.5 * ddp)


def test_tp_pp_cp_ep_formulas():
    s, b, h, t = 2048, 2, 4096, 8
    act = s * b * h * 2
    assert tp_comm_bytes_per_layer(s, b, h, t) == pytest.approx(4 * 2 * 7 / 8 * act)
    assert tp_comm_bytes_per_layer(s, b, h, t, sp=True) == tp_comm_bytes_per_layer(s, b, h, t)
    # SP as implemented (Megatron): 2 more all-gathers of the QKV / gate-up input backward
    assert tp_comm_bytes_per_layer(s, b, h, t, sp=True, regather=True) == pytest.approx(
        (4 * 2 + 2) * 7 / 8 * act)
    assert tp_comm_bytes_per_layer(s, b, h, t, regather=True) == tp_comm_bytes_per_layer(
        s, b, h, t)  # nothing to re-gather without SP
    assert tp_comm_bytes_per_layer(s, b, h, 1) == 0
    assert pp_comm_bytes_per_microbatch(s, b, h) == 2 * act
    kv, c = 1024, 4
    forward = 3 * 2 * (s / 4) * b * kv * 2
    assert cp_comm_bytes_per_layer(s, b, kv, c, backward=False) == forward
    assert ep_comm_bytes_per_layer(1000, 2, h, 4, backward=False) == 2 * 3 / 4 * 1000 * 2 * h * 2


def test_ulysses_all_to_all_bytes():
    """Jacobs et al. 2023 §3.2: per layer forward all-to-alls of Q, K, V and the output, each
    rank sending (u-1)/u of its rows; Llama-3-8B (q 4096, kv 1024 wide), s = 32k, cp 4, bf16."""
    rows = 32768 / 4
    forward = 3 / 4 * rows * (4096 + 1024 + 1024 + 4096) * 2
    assert ulysses_comm_bytes_per_layer(32768, 1, 4096, 1024, 4, backward=False) == forward
    assert ulysses_comm_bytes_per_layer(32768, 1, 4096, 1024, 4) == 2 * forward
    assert ulysses_comm_bytes_per_layer(32768, 1, 4096, 1024, 4, recompute="full") == 3 * forward
    # the hybrid's all-to-all inside groups of 2 of the 8 cp ranks: half of s/8 rows each
    assert ulysses_comm_bytes_per_layer(32768, 1, 4096, 1024, 8, 2, backward=False) == (
        1 / 2 * 32768 / 8 * 10240 * 2)
    # MHA: the paper's "4Nh/P" per GPU (N = s·b tokens), reached as P grows
    n_tokens, h = 32768, 4096
    for p in (8, 64, 512):
        volume = ulysses_comm_bytes_per_layer(n_tokens, 1, h, h, p, dtype_bytes=1,
                                              backward=False)
        assert volume == pytest.approx((p - 1) / p * 4 * n_tokens * h / p, rel=1e-12)


def test_ulysses_moves_mla_values_and_output_at_the_value_width():
    """MLA (DeepSeek-V3: 128 heads, d = 128 nope + 64 RoPE = 192, d_v = 128) at tp 8, cp 4:
    per tp rank Q and K 16·192 = 3072 wide, V and the output 16·128 = 2048 — each all-to-all
    at its own width, `(u-1)/u · (s/c)·b·(3072 + 3072 + 2048 + 2048)·bytes`; GQA with
    d_v = 3/4·d (q 4096, k 1024, v 768, o 3072): every width distinct."""
    model = get_model("deepseek-v3")
    t = 8
    assert (model.n_heads // t * model.head_dim, model.n_heads // t * model.value_head_dim) == (
        3072, 2048)
    rows, b = 32768 / 4, 2
    forward = 3 / 4 * rows * b * (3072 + 3072 + 2048 + 2048) * 2
    got = ulysses_comm_bytes_per_layer(32768, b, model.q_dim / t, model.kv_dim / t, 4,
                                       backward=False, v_dim=model.v_dim / t,
                                       o_dim=model.o_dim / t)
    assert got == forward
    assert got < ulysses_comm_bytes_per_layer(32768, b, 3072, 3072, 4, backward=False)
    gqa = ulysses_comm_bytes_per_layer(4096, 1, 4096, 1024, 8, 2, v_dim=768, o_dim=3072,
                                       recompute="selective")
    assert gqa == 3 * (1 / 2 * 4096 / 8 * (4096 + 1024 + 768 + 3072) * 2)


def test_zero_2_and_3_communicate_every_micro_batch():
    P, n, m = 1e9, 8, 4
    rs, ag = 7 / 8 * 2 * P, 7 / 8 * 2 * P  # one reduce-scatter / all-gather of bf16 P
    assert dp_step_comm_ops(P, n, 0, 2, 2, m) == dp_step_comm_ops(P, n, 0, 2, 2)
    assert dp_step_comm_ops(P, n, 1, 2, 2, m) == [("reduce-scatter", rs), ("all-gather", ag)]
    assert dp_step_comm_ops(P, n, 2, 2, 2, m) == [("reduce-scatter", m * rs), ("all-gather", ag)]
    ops = dp_step_comm_ops(P, n, 3, 2, 2, m)
    assert sorted(ops) == sorted([("reduce-scatter", m * rs)] + [("all-gather", ag)] * 2 * m)
    assert dp_step_comm_bytes(P, n, 3, microbatches=m) == pytest.approx(m * 1.5 * 2 * rs)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_ops_per_layer(sp):
    s, b, h, t = 2048, 2, 4096, 8
    act = s * b * h * 2
    ops = tp_comm_ops_per_layer(s, b, h, t, sp=sp)
    implemented = tp_comm_bytes_per_layer(s, b, h, t, sp=sp, regather=True)
    assert sum(n for _, n, _ in ops) == pytest.approx(implemented)
    # SPEC §5's figure, without SP's backward re-gathers
    textbook = tp_comm_ops_per_layer(s, b, h, t, sp=sp, regather=False)
    assert sum(n for _, n, _ in textbook) == pytest.approx(tp_comm_bytes_per_layer(s, b, h, t))
    assert implemented - tp_comm_bytes_per_layer(s, b, h, t) == pytest.approx(
        2 * 7 / 8 * act if sp else 0)  # 2 all-gathers (t-1)/t · sbh backward
    assert sum(n for _, n, fwd in ops if fwd) == pytest.approx(4 * 7 / 8 * act)  # 2 × 2(t-1)/t
    names = {op for op, _, _ in ops}
    assert names == ({"all-gather", "reduce-scatter"} if sp else {"all-reduce"})
    # an MoE layer replicated over tp: only the attention pair
    assert sum(n for _, n, _ in tp_comm_ops_per_layer(s, b, h, t, sp=sp, mlp_pair=False)) == (
        pytest.approx(implemented / 2))
    # full recompute (early stop) replays the attention's g (SP: its AG and RS, the MLP's AG)
    full = tp_comm_ops_per_layer(s, b, h, t, sp=sp, recompute="full")
    assert sum(n for _, n, _ in full) - sum(n for _, n, _ in ops) == pytest.approx(
        (3 if sp else 2) * 7 / 8 * act)


def test_vocab_parallel_ends_and_replicated_gradients():
    s, b, h, t = 1024, 1, 512, 4
    act, rows = s * b * h * 2, s * b * 2
    assert vocab_parallel_comm_ops(s, b, h, t, head=False) == [("all-reduce", 1.5 * act)]
    assert vocab_parallel_comm_ops(s, b, h, t, embedding=False) == [
        ("all-reduce", 1.5 * act)] + [("all-reduce", 1.5 * rows)] * 3
    assert vocab_parallel_comm_ops(s, b, h, t, sp=True, head=False) == [
        ("reduce-scatter", 0.75 * act), ("all-gather", 0.75 * act)]
    assert sequence_parallel_grad_comm_bytes(1000, 4, 2) == 3000
    assert tied_embedding_comm_bytes(32000, 4096, 4, 2) == 1.5 * 16000 * 4096 * 2


@pytest.mark.parametrize(("p", "v"), [(2, 1), (4, 1), (4, 2)])
def test_pipeline_sends_per_rank_add_up_to_every_boundary(p, v):
    s, b, h, m = 1024, 1, 512, 8
    per_rank = [pp_send_bytes_per_step(s, b, h, m, p, stage, v) for stage in range(p)]
    boundaries = p * v - 1
    assert sum(per_rank) == m * boundaries * pp_comm_bytes_per_microbatch(s, b, h)
    one_way = m * s * b * h * 2
    if v == 1:  # the ends send one way, the middle both ways
        assert per_rank == [one_way] + [2 * one_way] * (p - 2) + [one_way]
    else:  # rank 0: out of virtual stages 0 and 4, back out of 4
        assert per_rank[0] == 3 * one_way


def test_ep_traffic_for_the_routing_drawn_and_the_count_exchange():
    h, e = 512, 4
    balanced = 3 / 4 * 1000 * 2  # rows leaving a rank of 1000 tokens, top-2
    assert ep_comm_bytes_routed(balanced, balanced, h) == ep_comm_bytes_per_layer(1000, 2, h, e)
    assert ep_comm_bytes_routed(10, 30, h, backward=False) == 40 * h * 2
    assert ep_comm_bytes_routed(10, 30, h, recompute="full") == 3 * 40 * h * 2
    assert ep_count_exchange_bytes(8, 4) == 3 / 4 * 8 * 8


def test_cp_recompute_replays_one_forward():
    s, b, kv, c = 4096, 1, 1024, 4
    forward = cp_comm_bytes_per_layer(s, b, kv, c, backward=False)
    assert cp_comm_bytes_per_layer(s, b, kv, c, recompute="selective") == 4 * forward
    assert cp_comm_bytes_per_layer(s, b, kv, c, recompute="full") == 4 * forward


def test_bad_collective_inputs():
    with pytest.raises(ShardwiseError, match="unknown collective 'allreduce'"):
        ring_bytes_on_wire("allreduce", 1, 2)
    with pytest.raises(ShardwiseError, match="modelled for all-reduce only"):
        collective_time("all-gather", 1e6, 8, LINKS["ndr"], "tree")


# ------------------------------------------- what mutation testing found unchecked (issue 37)
# Each test below kills mutants benchmarks/mutation.py saw survive (docs/accuracy/mutation.md),
# with figures worked out by hand from SPEC §5.

def test_defaults_are_the_documented_ones():
    s, b, h = 1024, 2, 512
    act = s * b * h * 2  # bf16, the default
    assert sequence_parallel_grad_comm_bytes(1000, 4) == 1.5 * 1000 * 2
    assert tied_embedding_comm_bytes(32000, 4096, 4) == 1.5 * 32000 * 4096 * 2  # t = 1
    assert pp_comm_bytes_per_microbatch(s, b, h) == 2 * act
    # the scatter/gather optimisation divides by t only when asked for, and t defaults to 1
    assert pp_comm_bytes_per_microbatch(s, b, h, 2, 8) == 2 * act
    assert pp_comm_bytes_per_microbatch(s, b, h, scatter_gather=True) == 2 * act
    assert pp_comm_bytes_per_microbatch(s, b, h, 2, 8, scatter_gather=True) == 2 * act / 8
    # one chunk per stage, 8 micro-batches of one activation each way: the first of 4
    # stages sends activations only, the second activations and gradients
    assert pp_send_bytes_per_step(s, b, h, 8, 4, 0) == 8 * act
    assert pp_send_bytes_per_step(s, b, h, 8, 4, 1, tp=8) == 16 * act
    assert pp_send_bytes_per_step(s, b, h, 8, 4, 1, scatter_gather=True) == 16 * act
    assert pp_send_bytes_per_step(s, b, h, 8, 4, 1, 1, 2, 8, True) == 16 * act / 8
    P, n = 1e9, 8
    rs = ag = 7 / 8 * 2 * P
    assert dp_step_comm_ops(P, n, 0, 2, 2) == [("all-reduce", 2 * rs)]
    assert dp_step_comm_ops(P, n, 2, 2, 2) == [("reduce-scatter", rs), ("all-gather", ag)]
    # ZeRO-1 with fp32 gradients (Megatron's main_grad) gathers bf16 weights
    assert dp_step_comm_bytes(P, n, 1, grad_bytes=4, weight_bytes=2) == pytest.approx(
        7 / 8 * P * (4 + 2))


def test_recompute_replays_exactly_what_the_docstrings_say():
    s, b, kv, c = 4096, 1, 1024, 4
    forward = cp_comm_bytes_per_layer(s, b, kv, c, backward=False)
    assert forward == 3 * 2 * (s / c) * b * kv * 2
    assert cp_comm_bytes_per_layer(s, b, kv, c) == 3 * forward  # K, V + dK, dV backward
    assert ep_count_exchange_bytes(8, 4, recompute="full") == 2 * 3 / 4 * 8 * 8
    assert ep_count_exchange_bytes(8, 4, recompute="selective") == 3 / 4 * 8 * 8


def test_tp_ops_of_one_layer_written_out():
    s, b, h, t = 64, 2, 32, 4
    one = 3 / 4 * s * b * h * 2  # (t-1)/t of the (s, b, h) bf16 activation
    ag, rs, ar = "all-gather", "reduce-scatter", "all-reduce"
    pair_sp = [(ag, one, True), (rs, one, True), (rs, one, False), (ag, one, False)]
    assert tp_comm_ops_per_layer(s, b, h, t, sp=True, recompute="full") == (
        pair_sp * 2 + [(ag, one, False)] * 2  # the backward re-gathers
        + [(ag, one, False), (rs, one, False), (ag, one, False)])  # the replay
    assert tp_comm_ops_per_layer(s, b, h, t, sp=True, mlp_pair=False, recompute="full") == (
        [*pair_sp, (ag, one, False), (ag, one, False), (rs, one, False)])  # re-gather, replay
    assert tp_comm_ops_per_layer(s, b, h, t, recompute="full") == (
        [(ar, 2 * one, True), (ar, 2 * one, False)] * 2 + [(ar, 2 * one, False)])
    assert tp_comm_ops_per_layer(s, b, h, t) == tp_comm_ops_per_layer(s, b, h, t, sp=False)
    assert tp_comm_bytes_per_layer(s, b, h, t, backward=False) == 2 * 2 * one  # g twice


def test_vocab_parallel_ends_written_out():
    s, b, h, t = 64, 2, 32, 4
    act = s * b * h * 2
    # both ends: the embedding's and the head's all-reduce, the loss's three (s, b) fp32 ones
    assert vocab_parallel_comm_ops(s, b, h, t, loss_bytes=4) == (
        [("all-reduce", 1.5 * act)] * 2 + [("all-reduce", 1.5 * s * b * 4)] * 3)
    assert vocab_parallel_comm_ops(s, b, h, t, sp=True, loss_bytes=4) == (
        [("reduce-scatter", 0.75 * act), ("all-gather", 0.75 * act)] * 2
        + [("all-reduce", 1.5 * s * b * 4)] * 3)
    assert vocab_parallel_comm_ops(s, b, h, t, embedding=False, head=False) == []


def test_one_rank_and_one_node_cost_nothing_to_cross():
    nvlink, ndr, size = LINKS["nvlink4"], LINKS["ndr"], 1e9
    assert collective_time("all-reduce", size, 1, nvlink) == 0.0
    # one node (the default): reduce-scatter and all-gather inside, nothing across
    assert collective_time("all-reduce", size, 8, nvlink, "hierarchical", inter=ndr) == (
        pytest.approx(2 * (7 * nvlink.latency + 7 / 8 * size / nvlink.bandwidth)))
    # one GPU per node: nothing inside, a ring across the nodes
    assert hierarchical_all_reduce_time(size, 4, 1, nvlink, ndr) == pytest.approx(
        collective_time("all-reduce", size, 4, ndr))
    assert hierarchical_all_reduce_time(size, 1, 1, nvlink, ndr) == 0.0
    for nodes, gpus in ((0, 8), (4, 0)):
        with pytest.raises(ShardwiseError) as info:
            hierarchical_all_reduce_time(size, nodes, gpus, nvlink, ndr)
        assert str(info.value) == ("hierarchical all-reduce needs nodes ≥ 1 and "
                                   "gpus_per_node ≥ 1")


def test_bad_input_messages_name_the_argument():
    def message(call) -> str:
        with pytest.raises(ShardwiseError) as info:
            call()
        return str(info.value)

    assert message(lambda: ring_bytes_on_wire("allreduce", 1, 2)) == (
        "unknown collective 'allreduce'; valid: all-reduce, reduce-scatter, all-gather, "
        "all-to-all, broadcast")
    assert "n (ranks in the collective)" in message(lambda: ring_bytes_on_wire(
        "all-reduce", 1, 0))
    assert "size (bytes)" in message(lambda: ring_bytes_on_wire("all-reduce", -1, 2))
    assert "size (bytes)" in message(lambda: collective_time("all-reduce", math.nan, 2,
                                                             LINKS["ndr"]))
    assert message(lambda: collective_time("all-reduce", 1, 2, LINKS["ndr"], "star")) == (
        "unknown algorithm 'star'; valid: ring, tree, hierarchical")
    assert message(lambda: dp_step_comm_ops(1e9, 8, 4, 2, 2)) == "zero stage must be 0..3, got 4"
    # every per-axis helper checks its arguments before any arithmetic: a string where a
    # width belongs ('a' · 2 would be 'aa'), a group of 0 ranks, an unknown recompute
    assert message(lambda: cp_comm_bytes_per_layer(4096, 1, "a", 2)).startswith("kv_dim ")
    assert message(lambda: tp_comm_bytes_per_layer("x", 1, 4096, 2)).startswith("seq_len ")
    assert message(lambda: ulysses_comm_bytes_per_layer(4096, 1, 128, 64, 0)).startswith("c ")
    assert message(lambda: ep_comm_bytes_routed(-1.0, 2.0, 4096)).startswith("rows_out ")
    assert message(lambda: cp_comm_bytes_per_layer(4096, 1, 64, 2, recompute="some")) == (
        "recompute: unknown some; valid: none, selective, full, op-sac")


def test_every_path_checks_its_arguments_and_names_the_fix():
    """The tree and hierarchical paths and `bus_bandwidth` check the size themselves (the ring
    path's helpers would re-check it); a wrong link names its argument and where links come
    from; MAX_DEGREE itself is a valid group (a million GPUs, one per node)."""
    ndr, nvlink = LINKS["ndr"], LINKS["nvlink4"]
    for call in (lambda: collective_time("all-reduce", math.nan, 4, ndr, "tree"),
                 lambda: collective_time("all-reduce", -1.0, 4, ndr, "hierarchical",
                                         nodes=2, inter=ndr),
                 lambda: bus_bandwidth("all-reduce", -1.0, 4, 1.0)):
        with pytest.raises(ShardwiseError, match=r"size \(bytes\)"):
            call()
    with pytest.raises(ShardwiseError, match=r"^seconds must be "):  # the time, by its name
        bus_bandwidth("all-reduce", 1e9, 4, 0.0)
    for kwargs, name in (({"link": "ndr"}, "link"), ({"link": ndr, "inter": "ib"}, "inter")):
        with pytest.raises(ShardwiseError) as info:
            collective_time("all-reduce", 1e6, 4, algorithm="ring", **kwargs)
        shown = repr(kwargs[name])
        assert str(info.value) == f"{name} must be a Link (hardware.get_link), got {shown}"
    n, size = 2**20, 1e9  # nodes = MAX_DEGREE: a plain ring across them on the inter link
    assert hierarchical_all_reduce_time(size, n, 1, nvlink, ndr) == pytest.approx(
        2 * (n - 1) * ndr.latency + 2 * (n - 1) / n * size / ndr.bandwidth)
