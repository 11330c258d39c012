"""The predicted side of `shardwise check` (`estimate.check`, no torch): row targets, merging
over ranks, and the analytic traffic of a layout against figures worked out by hand here
(SPEC §5's ring formulas on the tiny model's shapes). The measured side is
tests/runtime/test_measure.py."""

from shardwise.arch import get_model
from shardwise.estimate.check import (
    CheckRow,
    Counted,
    Term,
    Traffic,
    comm_rows,
    merge_rows,
    predicted_comm,
    ring_factor,
)
from shardwise.layout import Layout, TrainSpec

SEQ, BATCH = 32, 4
TINY = get_model("tiny")  # 4 layers, h 64, 4 heads (d 16), 2 kv heads, f 128, V 256
P_TINY = 180_800  # 4·(2·64·64 + 2·64·32 + 3·64·128 + 2·64) + 2·256·64 + 64
F64 = 8


# ------------------------------------------------------------------------------ the rows
def test_row_targets():
    assert CheckRow("comm", "x", 6000.0, 6000.0).ok
    assert not CheckRow("comm", "x", 6000.0, 6001.0).ok
    assert CheckRow("comm", "x", 0.0, 0.0).error == 0.0
    assert not CheckRow("comm", "x", 0.0, 8.0).ok  # moved what the model says nothing of
    assert CheckRow("activations", "layer 0", 1000.0, 1009.0, "1%").ok
    assert not CheckRow("activations", "layer 0", 1000.0, 1011.0, "1%").ok
    assert CheckRow("peak memory", "x", 5.0, None, "-").ok
    assert CheckRow("peak memory", "x", 5.0, None, "-").as_dict()["error"] is None


def test_merge_keeps_the_worst_rank_of_each_stage():
    row = CheckRow("activations", "layer 0", 1000.0, 1000.0, "1%")
    worse = CheckRow("activations", "layer 0", 1000.0, 1008.0, "1%", rank=1)
    other_stage = CheckRow("activations", "layer 2", 1000.0, 1000.0, "1%", rank=2, stage=1)
    merged = merge_rows([[row], [worse], [other_stage]])
    assert [(r.stage, r.rank, r.ranks) for r in merged] == [(0, 1, 2), (1, 2, 1)]


# --------------------------------------------------------------- the analytic composition
def _terms(layout: str, stage: int = 0, model=TINY) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    train = TrainSpec(seq_len=SEQ, global_batch=BATCH, dtype="fp64")
    for term in predicted_comm(model, Layout.parse(layout), train, stage):
        out[(term.axis, term.op)] = out.get((term.axis, term.op), 0.0) + term.bytes
    return out


def test_predicted_traffic_against_figures_worked_out_by_hand():
    act = SEQ * 1 * 64 * F64  # one (s, b, h) activation, 16384 B; t = 2 sends S per all-reduce
    m = BATCH  # micro-batches without dp
    # tp=2: 4 f/g per layer, embedding g, head f, three (s, b) loss reductions per micro-batch
    assert _terms("tp=2") == {("tp", "all-reduce"): m * (16 * act + 2 * act + 3 * SEQ * F64)}
    # pp=2 interleaved ×2: rank 0 sends out of virtual stages 0 and 2, back out of 2
    assert _terms("pp=2,schedule=interleaved,chunks=2") == {("pp", "send"): 3 * m * act}
    # ZeRO-3 over 2: per micro-batch (2 of them) two gathers and a reduce-scatter of P/2
    assert _terms("dp=2,zero=3") == {("dp", "all-gather"): 2 * 2 * P_TINY * F64 / 2,
                                     ("dp", "reduce-scatter"): 2 * P_TINY * F64 / 2}
    # cp=2: K, V blocks (2, s/2, 32) around the ring: forward 1 hop, backward 2, per layer
    assert _terms("cp=2") == {("cp", "send"): m * 4 * 3 * 2 * 16 * 32 * F64,
                              ("dp_cp", "all-reduce"): P_TINY * F64}


def test_replicated_kv_heads_add_their_gradient_all_reduce():
    """tiny (2 kv heads of 16, h = 64, 4 layers) at tp=4: each layer's K and V gradients go
    through one (a_kv, d, h) all-reduce: 4·2·(2·16·64)·8 B · 2·3/4 = 196,608 B per step —
    the difference `shardwise check --tp 4 --dtype fp64` measured against tp=4 without it."""
    model, train = get_model("tiny"), TrainSpec(seq_len=64, global_batch=8, dtype="fp64")
    terms = [t for t in predicted_comm(model, Layout.parse("tp=4"), train, 0)
             if "replicated kv" in t.label]
    assert [t.bytes for t in terms] == [4 * 2 * (2 * 16 * 64) * 8 * 2 * 3 / 4]
    assert not [t for t in predicted_comm(model, Layout.parse("tp=2"), train, 0)
                if "replicated kv" in t.label]


# ---------------------------------------------------------------- payload and wire rows
def _rows(wire, op="reduce-scatter", n=4, payload=4_000_000.0, calls=2):
    """One predicted term of `op` on a "dp" group of `n` and what a run counted: a payload
    of `payload` bytes over `calls` calls in one step."""
    ring = payload * (2 * (n - 1) / n if op == "all-reduce" else (n - 1) / n)
    counted = Counted({("dp", op): payload}, {("dp", op): calls}, {"dp": n})
    return comm_rows([Term("dp", op, ring, "ZeRO")], counted, 1, Layout.parse(f"dp={n}"),
                     wire, "gloo not in use")


def test_payload_rows_undo_the_ring_factor():
    # SPEC §5: the ring sends 2(N-1)/N·S of an all-reduce, (N-1)/N·S of the others; the
    # payload of all-to-all and send is already the bytes leaving the rank
    assert ring_factor("all-reduce", 4) == 1.5 and ring_factor("all-gather", 4) == 0.75
    assert ring_factor("all-reduce (routing counts)", 2) == 1.0
    assert ring_factor("all-to-all (counts)", 4) == ring_factor("send", 8) == 1.0
    payload, wire = _rows(None)
    assert (payload.item, payload.predicted, payload.measured, payload.ok) == (
        "comm", 4_000_000.0, 4_000_000.0, True)
    # nothing measured: the wire row keeps the ring's bytes and says they are assumed
    assert (wire.item, wire.predicted, wire.measured) == ("wire", 3_000_000.0, None)
    assert wire.note == "assumed (ring): gloo not in use" and wire.target == "-"


def test_wire_rows_name_the_algorithm_the_bytes_show():
    headers = 60 * 52
    # data = the ring's 3/4 of 4 MB + 2 calls' message headers (48 B, 12 per peer): ring
    ring = Traffic(3_000_000 + 2 * 3 * 12 * 48, 60, 52)
    row = _rows({("dp", "reduce-scatter"): ring})[1]
    assert row.measured == ring.data + headers and "SPEC §5's 0.75·payload" in row.note
    # its verdict: the ring's 3 MB + the headers counted, up to 1 KiB of message headers per
    # peer and call (3 peers, 2 calls) more
    assert row.target == "algorithm" and row.ok
    assert row.allowed == (3_000_000 + headers, 3_000_000 + headers + 1024 * 3 * 2)
    # data = 2(N-1)/N of it: gloo's reduce-scatter is an all-reduce
    row = _rows({("dp", "reduce-scatter"): Traffic(6_000_000 + 1000, 60, 52)})[1]
    assert row.ok and "all-reduce of the whole input" in row.note and row.error == 1.0 + (
        1000 + headers) / 3_000_000
    # TCP's retransmissions are said, and left out of the algorithm's bytes
    row = _rows({("dp", "reduce-scatter"): Traffic(6_000_000 + 1000 + 65_000, 61, 52,
                                                   65_000)})[1]
    assert "65,000 B of the data sent again" in row.note and "all-reduce of the whole" in row.note
    # neither: the measured factor is said
    row = _rows({("dp", "reduce-scatter"): Traffic(4_000_000, 60, 52)})[1]
    assert "data 1·payload, not the ring's 0.75" in row.note and not row.ok
    # at the edges of the framing allowance: 1 B under the ring's bytes, 1 B over its headers
    for extra, ok in ((-1, False), (0, True), (1024 * 3 * 2, True), (1024 * 3 * 2 + 1, False)):
        assert _rows({("dp", "all-gather"): Traffic(3_000_000 + extra, 60, 52)},
                     op="all-gather")[1].ok is ok, extra
    # 16 bytes: the message headers outweigh any difference between the algorithms
    row = _rows({("dp", "reduce-scatter"): Traffic(900, 4, 52)}, payload=16.0)[1]
    assert "too small to tell" in row.note
    # bytes of calls the counters leave out get a row of their own
    rows = _rows({("dp", "reduce-scatter"): ring, ("world", "all-reduce"): Traffic(600, 2, 52)})
    assert (rows[-1].what, rows[-1].measured) == ("not counted", 600 + 2 * 52)
