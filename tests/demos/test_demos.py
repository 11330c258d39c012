"""Each demo's public function (`shardwise.demos`) on real ranks: its rows, its checks against
the formulas and the single-device references, and its argument checks. The runtime pieces the
demos exercise are tested in tests/runtime; tests/demos/test_demo_cli.py runs every demo
through the CLI."""

import pytest

from shardwise.demos.data_parallel import run_ddp_demo, run_zero_demo
from shardwise.demos.tensor_parallel import run_tp_demo
from shardwise.emulate.ring_attention import causal_block_work
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import (
    cp_comm_bytes_per_layer,
    ep_comm_bytes_per_layer,
    pp_comm_bytes_per_microbatch,
)

TOL = 1e-12  # float64
FP32_TOL = 1e-5  # SPEC §8: fp32 equal to float reassociation
DOUBLE = 8  # bytes per float64


def _measured(rows: list[dict]) -> dict[str, float]:
    """{check: measured} of a demo's rows (their own `ok` is not what these tests trust)."""
    return {row["check"]: row["measured"] for row in rows}


@pytest.mark.slow
def test_ring_demo_rows() -> None:
    from shardwise.demos.ring import run_ring_demo

    n, sizes = 3, (10, 1001)
    measured = list(_measured(run_ring_demo(ranks=n, sizes=sizes)).values())
    assert len(measured) == 4
    for i, numel in enumerate(sizes):
        assert measured[2 * i] <= TOL  # vs the backend's all-reduce, max rel. diff
        # rank 0 sends N-1 tensor_split chunks in each phase: (r-s-1) mod N, then (r-s) mod N
        q, extra = divmod(numel, n)
        chunk = [q + (k < extra) for k in range(n)]
        sent = sum(chunk[(-s - 1) % n] + chunk[-s % n] for s in range(n - 1)) * DOUBLE
        assert measured[2 * i + 1] == sent  # 2(N-1)/N·S when N divides the size


@pytest.mark.slow
def test_ddp_demo_fp32_on_two_ranks() -> None:
    rows = run_ddp_demo(ranks=2)
    by = {check.split(" (")[0].split(",")[0]: value for check, value in _measured(rows).items()}
    assert by["PyTorch DDP vs full batch"] < 1e-6
    assert by["bucketed hooks"] <= FP32_TOL and by["bucketed vs PyTorch DDP"] <= FP32_TOL
    assert by["rank agreement over 2 ranks"] == 0.0
    # the demo's MLP 16 → 32 → 32 → 8 with biases, fp32 gradients all-reduced (2 ranks: S)
    params = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 8 + 8
    assert by["bytes sent per rank per step"] == params * 4


@pytest.mark.slow
def test_zero_demo_rows() -> None:
    rows = list(_measured(run_zero_demo(ranks=2, steps=2)).values())
    assert len(rows) == 12
    # three bias-free layers 16·w, w·w, w·8 with w = 4N = 8: P = 256, float64
    p = 16 * 8 + 8 * 8 + 8 * 8
    # SPEC §2 per rank (8 B weights, 8 B grads, 16 B Adam moments, N = 2): stage 0 all of it;
    # 1 shards the moments, 2 the gradients too, 3 everything
    state = [32 * p, (16 + 8) * p, (8 + 12) * p, 16 * p]
    # SPEC §5 per rank (ring bytes of the counted payload, (N-1)/N = 1/2): all-reduce of the
    # gradients; RS of gradients + AG of weights; ZeRO-3 two AGs and an RS
    traffic = [p * 8, p * 8, p * 8, 1.5 * p * 8]
    for stage in range(4):
        params_vs_ddp, held, sent = rows[3 * stage: 3 * stage + 3]
        assert params_vs_ddp <= TOL and (held, sent) == (state[stage], traffic[stage]), stage


@pytest.mark.slow
def test_tp_demo_rows() -> None:
    rows = list(_measured(run_tp_demo(ranks=2)).values())
    assert len(rows) == 12
    # the demo's block: s = 8, b = 2, h = 32, float64, t = 2 (each collective (t-1)/t·S = S/2,
    # an all-reduce 2(t-1)/t·S = S)
    act = 8 * 2 * 32 * DOUBLE
    # tp: f and g of attention and MLP, forward and backward: 4 all-reduces of S; tp+sp:
    # all-gathers and reduce-scatters instead, plus the 2 re-gathers in backward: 10 of S/2
    per_layer = {"tp": 4 * act, "tp+sp": 10 * act / 2}
    for i, mode in enumerate(("tp", "tp+sp")):
        out, grad_x, grads, sent, loss, emb_head = rows[6 * i: 6 * i + 6]
        assert max(out, grad_x, grads, loss, emb_head) <= TOL, mode
        assert sent == per_layer[mode], mode


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "schedule", "m", "v", "dp", "peaks"), [
    (4, "zb-h1", 4, 1, 2, "(2, 1)"),  # 1F1B's min(p - i, m)
    (2, "dualpipev", 4, 2, 1, "(2.5, 2.5)"),  # 2p + 1 chunks of half a stage
])
def test_pipeline_demo_reports_its_checks_and_both_timelines(ranks, schedule, m, v, dp,
                                                             peaks):
    from shardwise.demos.pipeline import format_pipeline_demo, run_pipeline_demo

    report = run_pipeline_demo(ranks, schedule, m, v, dp=dp, seq_len=8, micro_batch=2)
    p = ranks // dp
    assert (report["p"], report["m"], report["v"]) == (p, m, v)
    checks = {row["check"]: row for row in report["rows"]}
    for row in report["rows"]:  # the differences from one device, measured here
        if isinstance(row["expected"], str) and row["expected"].startswith("≤"):
            assert row["measured"] <= TOL, row
    loss = checks["loss vs single device"]
    assert abs(loss["measured"] - loss["expected"]) <= TOL * abs(loss["expected"])
    row = checks["peak micro-batches alive per stage (F→B)"]
    assert row["measured"] == row["expected"] == peaks
    bytes_row = checks["p2p bytes per boundary per micro-batch"]
    assert bytes_row["measured"] == pp_comm_bytes_per_microbatch(8, 2, 64, DOUBLE)  # tiny: h=64
    assert "peak alive counted until W" in checks  # both split (some of) their backwards
    assert any(c.startswith("dp all-reduces") for c in checks) == (dp > 1)
    assert 0 <= report["simulated_bubble"] < 1 and 0 <= report["measured_bubble"] < 1
    for chart in (report["measured_timeline"], report["simulated_timeline"]):
        assert len(chart.splitlines()) == p
    text = format_pipeline_demo(report)
    assert "measured timeline" in text and "simulated timeline" in text


def test_pipeline_demo_rejects_bad_arguments_before_spawning():
    from shardwise.demos.pipeline import run_pipeline_demo

    with pytest.raises(ShardwiseError, match="multiple of dp"):
        run_pipeline_demo(ranks=3, dp=2)
    with pytest.raises(ShardwiseError, match="unknown schedule"):
        run_pipeline_demo(ranks=2, schedule="nope")
    with pytest.raises(ShardwiseError, match="interleaved"):
        run_pipeline_demo(ranks=2, schedule="1f1b", chunks=2)


@pytest.mark.slow
def test_ring_attention_demo_rows():
    from shardwise.demos.context_parallel import run_ring_attention_demo

    rows = run_ring_attention_demo(2, layouts=("contiguous", "zigzag"))
    assert [row["case"] for row in rows] == ["contiguous causal", "contiguous", "zigzag causal",
                                             "zigzag"]
    assert all(row["max_diff"] < TOL for row in rows)
    for row in rows:  # K, V blocks (b 2, s/c 16, 2 kv heads × d 8) passed around the ring
        assert row["bytes_measured"] == cp_comm_bytes_per_layer(32, 2, 2 * 8, 2, 8), row
    assert rows[0]["causal_pairs"] == causal_block_work(2, 16, "contiguous")
    assert rows[0]["blocks_skipped"] == [1, 0]


@pytest.mark.slow
def test_ulysses_demo_runs_the_hybrid_on_four_ranks():
    """All-to-all inside pairs of ranks, ring attention across the pairs (USP): attention and
    a 2-layer model equal to one device; bytes per rank worked out here (s = 32, b = 2): a
    rank's s/c·b = 16 rows of Q (8 heads of 8), K and V (4 or 8 heads) and the output, the
    pair's all-to-all sending half of them, forward and backward; the ring's one hop a K and
    a V block of the pair's 16 tokens × b of half the kv heads, forward and twice backward."""
    from shardwise.demos.ulysses import run_ulysses_demo

    rows = run_ulysses_demo(4, kinds=("hybrid",))
    assert [(row["check"], row["case"]) for row in rows] == [
        ("attention", "GQA causal"), ("attention", "MHA causal"), ("attention", "GQA"),
        ("attention", "MHA"), ("model loss and gradients", "2 layers")]
    assert all(row["ok"] and row["max_diff"] < TOL for row in rows), rows
    for row, kv_heads in zip(rows, (4, 8, 4, 8)):
        a2a = 2 * 1 / 2 * 16 * (2 * 64 + 2 * kv_heads * 8) * DOUBLE
        ring = 3 * 2 * 16 * 2 * (kv_heads // 2 * 8) * DOUBLE
        assert row["bytes_measured"] == a2a + ring


@pytest.mark.slow
def test_moe_demo_rows():
    from shardwise.demos.expert_parallel import run_moe_demo

    rows = run_moe_demo(2, top_k=2, capacity_factor=0.5)
    assert [row["routing"] for row in rows] == ["balanced", "random", "random"]
    assert all(row["max_diff"] < TOL for row in rows)
    experts, tokens, hidden = 4, 8, 16  # the demo's defaults for 2 ranks
    assert rows[0]["bytes_measured"] == ep_comm_bytes_per_layer(tokens, 2, hidden, 2, 8)
    assert rows[0]["tokens_per_expert"] == [2 * tokens * 2 // experts] * experts
    assert rows[0]["imbalance"] == 1.0
    assert rows[2]["dropped"] > 0 and rows[1]["dropped"] == 0
