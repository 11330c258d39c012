"""The predicted side of `shardwise check` (SPEC §9): what the analytic model says one rank of a
layout sends, saves and holds, and the rows that compare it with what a run measured
(`runtime.measure` measures; this module is pure arithmetic, no torch).

    CheckRow         one predicted-versus-measured item, its target and why it differs
    merge_rows       per pipeline stage and item, the rank with the largest error
    predicted_comm   every collective one rank issues per optimizer step (`estimate.comm`)
    comm_rows        per (mesh axis, op): the payload the model predicts vs the payload counted,
                     and SPEC §5's ring bytes vs the bytes measured on the wire (`Counted`,
                     `Traffic`; "assumed (ring)" where nothing could be measured)
    predicted_saved  bytes one layer saves per micro-batch (`estimate.memory`, SPEC §3)
    activation_note  why an activation row differs
    state_rows       parameters, gradients, fp32 masters, optimizer moments per rank (SPEC §2)
    peak_row         the predicted peak next to torch's allocator peak (reported)
    checkpoint_rows  one checkpoint's tensors (exact) and write time against this disk's
                     measured bandwidth (`estimate.goodput`)

Targets (`CheckRow.target`): communication payload exact (to float rounding, 1e-12
relative), saved activations within 1 %, state exact; "-" for a row outside the §3/§5 model
and for the wire rows, whose bytes include what no model here describes: TCP/IP headers and
the backend's own message headers, and its own algorithm where it is not the ring's
(docs/howto/check.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from shardwise.arch import ModelSpec
from shardwise.estimate.comm import (
    cp_comm_bytes_per_layer,
    dp_step_comm_ops,
    ep_comm_bytes_per_layer,
    ep_comm_bytes_routed,
    ep_count_exchange_bytes,
    pp_send_bytes_per_step,
    ring_bytes_on_wire,
    sequence_parallel_grad_comm_bytes,
    tied_embedding_comm_bytes,
    tp_comm_ops_per_layer,
    ulysses_comm_bytes_per_layer,
    vocab_parallel_comm_ops,
)
from shardwise.estimate.goodput import (
    checkpoint_bytes,
    checkpoint_bytes_per_param,
    checkpoint_writes,
)
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    bytes_per_param_training,
    layer_params,
    saved_tensors_per_layer,
    stage_layers,
    stage_params,
    training_memory_per_gpu,
)
from shardwise.layout import Layout, TrainSpec
from shardwise.units import dtype_bytes

__all__ = [
    "COUNTS_OP",
    "EXACT",
    "FRAMED",
    "REPORTED",
    "ROUTING_COUNTS_OP",
    "ROUTING_GATHER_OP",
    "RUNTIME_IMPL",
    "WITHIN_1PC",
    "CheckRow",
    "Counted",
    "Term",
    "Traffic",
    "activation_note",
    "checkpoint_rows",
    "comm_rows",
    "merge_rows",
    "peak_row",
    "predicted_comm",
    "predicted_saved",
    "ring_factor",
    "state_rows",
    "zero_units",
]

EXACT, WITHIN_1PC, REPORTED = "exact", "1%", "-"
FRAMED = "algorithm"  # a wire row: the algorithm's bytes + framing allowance (`_wire_row`)
RUNTIME_IMPL = "shardwise"  # the activation profile the runtime implements (estimate.profiles)
_ROUNDING = 1e-12  # "exact": equal to float rounding
# the op name under which expert parallelism's per-expert row-count exchange is counted
COUNTS_OP = "all-to-all (counts)"
# ... and the all-reduce of an MoE layer's per-expert counts over the ranks sharing its
# sequences (cp, SP), for the load-balancing loss (`runtime.parallelize.apply_sequence_shards`)
ROUTING_COUNTS_OP = "all-reduce (routing counts)"
# ... and the all-gather of their expert choices for the capacity (`_sequence_keep` there)
ROUTING_GATHER_OP = "all-gather (routing)"


# ------------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class CheckRow:
    """One predicted-versus-measured item of one rank (or the worst rank, after merging).

    item: "comm", "activations", "state" or "peak memory"; what: "tp all-reduce", "layer 3",
    "weights"…; predicted, measured: bytes (None where there is nothing to compare); target:
    "exact", "1%", "algorithm" (a wire row: measured within `allowed`, the algorithm's bytes
    plus the framing allowance) or "-"
    (reported, outside the model); note: why they differ, or how the prediction was composed;
    ranks: how many ranks the row stands for.
    """

    item: str
    what: str
    predicted: float | None
    measured: float | None
    target: str = EXACT
    note: str = ""
    rank: int = 0
    stage: int = 0
    ranks: int = 1
    allowed: tuple[float, float] | None = None  # FRAMED: the measured bytes' bounds

    @property
    def error(self) -> float | None:
        """(measured − predicted) / predicted; 0 when both are 0; None without both."""
        if self.predicted is None or self.measured is None:
            return None
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else math.inf
        return (self.measured - self.predicted) / self.predicted

    @property
    def ok(self) -> bool:
        """Whether the row meets its target (a "-" row always does)."""
        error = self.error
        if self.target == REPORTED:
            return True
        if self.target == FRAMED:
            return (self.allowed is not None and self.measured is not None
                    and self.allowed[0] <= self.measured <= self.allowed[1])
        if error is None:
            return False
        return abs(error) <= (_ROUNDING if self.target == EXACT else 0.01)

    def as_dict(self) -> dict[str, Any]:
        error = self.error
        return asdict(self) | {"error": None if error is None or math.isinf(error) else error,
                               "ok": self.ok}


def merge_rows(per_rank: Sequence[Sequence[CheckRow]]) -> list[CheckRow]:
    """One row per (pipeline stage, item, what): the rank with the largest error (a row that
    misses its target first), `ranks` set to how many ranks reported it."""
    groups: dict[tuple[int, str, str], list[CheckRow]] = {}
    for rows in per_rank:
        for row in rows:
            groups.setdefault((row.stage, row.item, row.what), []).append(row)

    def badness(row: CheckRow) -> tuple[bool, float]:
        error = row.error
        return (not row.ok, abs(error) if error is not None else 0.0)

    merged = [replace(max(rows, key=badness), ranks=len(rows)) for rows in groups.values()]
    order = {"comm": 0, "wire": 0, "activations": 1, "state": 2, "peak memory": 3}
    return sorted(merged, key=lambda r: (r.stage, order.get(r.item, 9)))


# ------------------------------------------------------------------------- predictions
@dataclass(frozen=True)
class Term:
    """One analytic traffic term: bytes per optimizer step this rank sends on (axis, op)."""

    axis: str
    op: str
    bytes: float
    label: str


def predicted_comm(model: ModelSpec, layout: Layout, train: TrainSpec, stage: int,
                   routing: Sequence[tuple[int, int, int]] = (), steps: int = 1,
                   aux_loss: bool = False, capacity: bool = False) -> list[Term]:
    """Every collective rank `stage` of the pipeline issues in one optimizer step, from
    `estimate.comm` (pure arithmetic; no torch). `routing`: the `(layer, rows out, rows in)`
    of each expert-parallel MoE call over `steps` steps (data-dependent; empty without ep). Axis names are the mesh's: gradients of dense weights are averaged over "dp"
    ("dp_cp" when cp > 1), expert gradients over "edp". `aux_loss`: the MoE layers'
    load-balancing loss is on (with cp or SP its per-expert counts are all-reduced);
    `capacity`: a capacity factor is set (with cp or SP the expert choices are all-gathered,
    int64)."""
    ab = dtype_bytes(train.dtype)
    gb = dtype_bytes(train.grad_dtype or train.dtype)  # gradient reductions (fp32 main_grad)
    t, p, c, e = layout.tp, layout.pp, layout.cp, layout.ep
    m = layout.microbatches(train)
    s, b, h = train.seq_len // c, layout.micro_batch, model.d_model
    rc, sp = layout.recompute, layout.sp and t > 1
    layers = stage_layers(model, layout, stage)
    moe = [k for k in layers if model.is_moe_layer(k)]
    first, last = stage == 0, stage == p - 1
    terms: list[Term] = []
    if t > 1:
        for k in layers:
            for op, nbytes, _ in tp_comm_ops_per_layer(s, b, h, t, ab, sp, mlp_pair=k not in moe,
                                                      recompute=rc):
                terms.append(Term("tp", op, m * nbytes, "f/g of the layers' pairs"))
        # the loss runs in at least fp32 (runtime.mixed_precision: bf16 logits cast up)
        for op, nbytes in vocab_parallel_comm_ops(s, b, h, t, ab, sp, embedding=first,
                                                  head=last, loss_bytes=max(ab, 4)):
            terms.append(Term("tp", op, m * nbytes, "vocab-parallel embedding/head/loss"))
        if sp:
            norms = (2 * len(layers) + last) * model.norm_params()
            replicated = norms + len(moe) * model.router_params()
            terms.append(Term("tp", "all-reduce",
                              sequence_parallel_grad_comm_bytes(replicated, t, gb),
                              "SP: norm (and router) gradients"))
        if model.is_mla:  # replicated down-projections and latent norms, partial per rank
            latent = len(layers) * (model.mla_params()[0] + model.latent_norm_params())
            terms.append(Term("tp", "all-reduce", sequence_parallel_grad_comm_bytes(
                latent, t, gb), "MLA: down-projection and latent-norm gradients"))
        if model.n_kv_heads < t and layout.zero:  # parallel_transformer._reduce_kv_shards
            n = layout.zero_degree  # an (a_kv, shard) buffer per layer unit
            terms.append(Term("tp", "all-reduce", sum(ring_bytes_on_wire(
                "all-reduce", model.n_kv_heads * _padded(u, n) // n * gb, t)
                for u, _, _ in _layer_units(model, layout, layers)[0]),
                "replicated kv heads: K, V elements of the ZeRO shards summed over replicas"))
        elif model.n_kv_heads < t:  # runtime.tensor_parallel.allreduce_replicated_kv_grads
            bias = model.qkv_bias or model.bias
            slots = len(layers) * 2 * model.kv_dim * (h + bias)  # (a_kv, d, h) for K and V
            terms.append(Term("tp", "all-reduce", ring_bytes_on_wire("all-reduce", slots * gb, t),
                              "replicated kv heads: K, V gradients summed over replicas"))
    if p > 1:
        terms.append(Term("pp", "send", pp_send_bytes_per_step(
            s, b, h, m, p, stage, layout.chunks, ab, t, sp), "activations and their gradients"))
        if model.tie_embeddings:
            tied = tied_embedding_comm_bytes(model.vocab, h, p, t, gb)
            if layout.zero:  # the embedding's gradient shard (padded), not the whole gradient
                n = layout.zero_degree
                numel = model.vocab // t * h
                tied *= _padded(numel, n) // n / numel
            terms.append(Term("pp", "all-reduce", tied, "tied embedding gradients"
                              + (" (ZeRO: this rank's shard)" if layout.zero else "")))
    if c > 1:
        terms += _cp_terms(model, layout, train, m * len(layers))
    if e > 1:
        rows_out = sum(r[1] for r in routing) / steps
        rows_in = sum(r[2] for r in routing) / steps
        calls = len(routing) / steps
        balanced = m * len(moe) * ep_comm_bytes_per_layer(s * b, model.top_k, h, e, ab)
        terms.append(Term("ep", "all-to-all", ep_comm_bytes_routed(
            rows_out, rows_in, h, ab, recompute=rc),
            f"dispatch/combine of the routing drawn ({rows_out:g} rows out, {rows_in:g} in "
            f"per step; balanced routing, SPEC §5: {balanced:,.0f} B)"))
        terms.append(Term("ep", COUNTS_OP, calls * ep_count_exchange_bytes(
            model.n_experts, e, recompute=rc), "per-expert row counts before each dispatch"))
    calls = m * len(moe) * (2 if rc == "full" else 1)  # MoE calls, full recompute's replays
    for axis, n, gathered in (("tp", t if sp else 1, s * b), ("cp", c, s * b * c)):
        if n > 1 and aux_loss and moe:  # (E,) fp64 counts
            terms.append(Term(axis, ROUTING_COUNTS_OP, calls * ring_bytes_on_wire(
                "all-reduce", model.n_experts * 8, n), "MoE load-balancing loss: per-expert "
                "counts summed over the ranks sharing the sequences"))
        if n > 1 and capacity and moe:  # every token's k choices, int64, up to the axis
            terms.append(Term(axis, ROUTING_GATHER_OP, calls * ring_bytes_on_wire(
                "all-gather", gathered * model.top_k * 8, n), "MoE capacity: the expert "
                "choices of the ranks sharing the sequences"))
    dense, experts = stage_params(model, layout, stage)
    replicas = layout.dp * c
    dp_axis = "dp_cp" if c > 1 else "dp"
    if layout.zero:  # ZeRO moves each flat unit padded to a multiple of its group
        dense, experts = (float(sum(_padded(u, n) for u, n, x in zero_units(model, layout, stage)
                                    if x == want)) for want in (False, True))
    # Without expert parallelism the experts are ordinary replicated weights.
    groups = ([(dp_axis, dense, replicas), ("edp", experts, replicas // e)] if e > 1
              else [(dp_axis, dense + experts, replicas)])
    k = layout.zero_degree
    if layout.zero and k < replicas:  # hybrid shard: ZeRO within groups of k, then replicas
        # (with ep > 1 the experts' edp ranks of a group shard them: max(k/e, 1) ranks)
        parts = ([("zero", dense, k, replicas), ("edp", experts, max(k // e, 1), replicas // e)]
                 if e > 1 else [("zero", dense + experts, k, replicas)])
        reductions = m if layout.zero >= 2 else 1  # as often as the reduce-scatter
        groups = [(f"{name}_shard", n_params, size) for name, n_params, size, _ in parts]
        for name, n_params, size, span in parts:
            if span > size:
                terms.append(Term(f"{name}_replica", "all-reduce", reductions * ring_bytes_on_wire(
                    "all-reduce", n_params / size * gb, span // size), "hybrid ZeRO: gradient "
                    "shards averaged over the groups"))
    for axis, n_params, n in groups:
        if n > 1:
            for op, nbytes in dp_step_comm_ops(n_params, n, layout.zero, gb, ab, m):
                what = f"ZeRO-{layout.zero}" if layout.zero else "gradient average"
                terms.append(Term(axis, op, nbytes, what))
    return terms


def _cp_terms(model: ModelSpec, layout: Layout, train: TrainSpec, calls: int) -> list[Term]:
    """Context parallelism's traffic over `calls` layer passes (micro-batches × layers): ring
    attention's K/V hops on "cp" (the hybrid's ring on "cp_ring", over cp/u ranks with 1/u of
    the heads), Ulysses' all-to-alls on "cp" (the hybrid's on "cp_a2a", over u ranks)."""
    t, c, u = layout.tp, layout.cp, layout.ulysses_degree
    kv = max(model.n_kv_heads // t, 1) * model.head_dim
    ab, s, b, rc = dtype_bytes(train.dtype), train.seq_len, layout.micro_batch, layout.recompute
    ring, a2a = ("cp", "cp") if layout.cp_kind != "hybrid" else ("cp_ring", "cp_a2a")
    terms = []
    if u < c:
        terms.append(Term(ring, "send", calls * cp_comm_bytes_per_layer(
            s, b, kv / u, c // u, ab, recompute=rc), "ring attention K, V and dK, dV"))
    if u > 1:
        terms.append(Term(a2a, "all-to-all", calls * ulysses_comm_bytes_per_layer(
            s, b, model.q_dim / t, kv, c, u, ab, recompute=rc),
            "Ulysses: Q, K, V and the attention output, their gradients back"))
    return terms


def ring_factor(op: str, n: int) -> float:
    """Bytes one rank sends per byte of payload by SPEC §5's ring: `2(N-1)/N` for all-reduce,
    `(N-1)/N` for reduce-scatter, all-gather and broadcast (payload: the full size `S`); 1 for
    all-to-all and send, whose payload is already the bytes leaving the rank. `op` may carry a
    label ("all-to-all (counts)")."""
    base = op.split(" (")[0]
    return 1.0 if base in ("all-to-all", "send") else ring_bytes_on_wire(base, 1.0, n)


@dataclass(frozen=True)
class Counted:
    """What one rank's counted collectives were handed (`runtime.collectives.CommCounter`):
    payload bytes and calls per (axis, op), and the size of every axis group called."""

    payload: dict[tuple[str, str], float]
    calls: dict[tuple[str, str], int]
    sizes: dict[str, int]


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sent on some TCP connections (`runtime.wire` measures them): data (the
    backend's messages, its own headers included, and any sent again), segments, IP + TCP
    header bytes per segment, and the data bytes retransmitted (part of `data`)."""

    data: float = 0.0
    segments: float = 0.0
    header: int = 0
    retransmitted: float = 0.0

    @property
    def wire(self) -> float:
        """Data plus IP and TCP headers: what left the rank at the IP layer."""
        return self.data + self.segments * self.header

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.data + other.data, self.segments + other.segments,
                       other.header or self.header, self.retransmitted + other.retransmitted)


# A backend's own message headers, per call and peer, within which its data still "follows the
# ring": gloo's are 48 B each, 3-12 per peer and call (measured on torch 2.13's gloo,
# docs/howto/check.md).
FRAMING_PER_PEER = 1024
# SPEC §5's ring next to what a backend is known to run instead: (op, measured factor) -> why
OTHER_ALGORITHMS = {
    "reduce-scatter": (lambda n: 2 * (n - 1) / n,
                       "gloo runs reduce-scatter as an all-reduce of the whole input and keeps "
                       "its chunk (torch ProcessGroupGloo::reduce_scatter_tensor_coalesced): "
                       "2(N-1)/N·S"),
}


def comm_rows(terms: Sequence[Term], counted: Counted, steps: int, layout: Layout,
              wire: dict[tuple[str, str], Traffic] | None = None, unmeasured: str = ""
              ) -> list[CheckRow]:
    """Per (axis, op), two rows. Payload (item "comm", target exact): the bytes the calls were
    handed, predicted (the terms ÷ `ring_factor`) against counted. Wire (item "wire",
    reported): SPEC §5's ring bytes per rank against the bytes this rank's connections carried
    (`wire`), with the backend's algorithm named where its factor is not the ring's; without
    `wire`, "assumed (ring)" and why (`unmeasured`). Then one wire row for traffic outside
    the counted calls (the loss's and gradient norm's all-reduces)."""
    predicted: dict[tuple[str, str], list[Term]] = {}
    for term in terms:
        predicted.setdefault((term.axis, term.op), []).append(term)
    rows = []
    for key in sorted(set(predicted) | set(counted.payload)):
        axis, op = key
        parts = predicted.get(key, [])
        labels = list(dict.fromkeys(term.label for term in parts))
        note = "; ".join(labels) if parts else "not in the analytic model"
        ring = sum(term.bytes for term in parts)
        n = counted.sizes.get(axis)
        if n is None:  # never called: the size of its group is not known here
            payload, note = ring, note + "; never called (ring bytes, not payload)"
        else:
            payload = ring / ring_factor(op, n)
        row = CheckRow("comm", " ".join(key), payload, counted.payload.get(key, 0.0) / steps,
                       EXACT, note)
        if not row.ok and key == ("tp", "all-reduce") and layout.zero and (
                layout.sp or "MLA" in note):
            row = replace(row, note=note + "; ZeRO + SP or MLA: the runtime all-reduces over "
                          "tp the whole ZeRO shard of every unit holding a weight whose "
                          "gradient is partial over tp (other elements masked to zero), not "
                          "only those weights' gradients")
        rows.append(row)
        rows.append(_wire_row(key, ring, counted, steps, wire, unmeasured))
    other = {key: t for key, t in (wire or {}).items() if key not in predicted
             and key not in counted.payload}
    if other:
        rows.append(CheckRow(
            "wire", "not counted", None, sum(t.wire for t in other.values()) / steps, REPORTED,
            "bytes on the wire of calls outside the model and the counters: " + ", ".join(
                f"{' '.join(key) if key != ('?', '?') else 'before any call'} "
                f"{t.wire / steps:,.0f} B" for key, t in sorted(other.items()))))
    return rows


def _wire_row(key: tuple[str, str], ring: float, counted: Counted, steps: int,
              wire: dict[tuple[str, str], Traffic] | None, unmeasured: str) -> CheckRow:
    """SPEC §5's ring bytes of (axis, op) per rank and step against the wire (comm_rows)."""
    axis, op = key
    what = f"{axis} {op}"
    if wire is None:
        return CheckRow("wire", what, ring, None, REPORTED, f"assumed (ring): {unmeasured}")
    measured = wire.get(key, Traffic())
    n, calls = counted.sizes.get(axis, 1), counted.calls.get(key, 0)
    payload = counted.payload.get(key, 0.0)
    note = (f"TCP data {measured.data / steps:,.0f} B + IP/TCP headers "
            f"{measured.segments * measured.header / steps:,.0f} B ({measured.segments / steps:,.0f} "
            f"segments × {measured.header} B)")
    if measured.retransmitted:
        note += f"; {measured.retransmitted / steps:,.0f} B of the data sent again (TCP)"
    once = measured.data - measured.retransmitted  # what the algorithm sent
    if not (payload and n > 1):
        return CheckRow("wire", what, ring, measured.wire / steps, REPORTED, note)
    slack = FRAMING_PER_PEER * (n - 1) * calls  # the backend's own message headers
    ring_f = ring_factor(op, n)
    other = OTHER_ALGORITHMS.get(op.split(" (")[0])

    def near(f: float) -> bool:
        return 0 <= once - f * payload <= slack

    if near(ring_f) and not (other and near(other[0](n))):
        factor, say = ring_f, f"data = SPEC §5's {ring_f:.3g}·payload + message headers"
    elif other and near(other[0](n)) and not near(ring_f):
        factor, say = other[0](n), f"not the ring: {other[1]}"
    elif near(ring_f):
        factor, say = ring_f, "payload too small to tell the algorithm from the message headers"
    else:
        factor = other[0](n) if other else ring_f
        say = (f"data {once / payload:.3g}·payload, not the ring's {ring_f:.3g}"
               + (f" nor the {factor:.3g} of the backend's own algorithm" if other else ""))
    # the wire = the algorithm's data + the backend's message headers (≤ `slack`) + what TCP
    # sent again + the IP/TCP headers of the segments counted
    low = factor * payload + measured.retransmitted + measured.segments * measured.header
    return CheckRow("wire", what, ring, measured.wire / steps, FRAMED, f"{note}; {say}",
                    allowed=(low / steps, (low + slack) / steps))


def predicted_saved(model: ModelSpec, layout: Layout, train: TrainSpec, moe: bool
                     ) -> tuple[float, float | None, float]:
    """Bytes one layer saves per micro-batch on one rank (SPEC §3's generalised count): the
    layer without its MoE block, the MoE block (None for a dense layer, or under full
    recompute, which keeps the layer input only), and the bytes the count keeps per row an
    expert runs (its input, gate, up and down-projection input; 0 for a dense layer)."""
    t, c, rc = layout.tp, layout.cp, layout.recompute
    s, b, sp = train.seq_len, layout.micro_batch, layout.sp and layout.tp > 1
    if rc == "full":
        return activation_bytes_per_layer(model, s, b, tp=t, sp=sp, cp=c, recompute=rc,
                                          dtype=train.dtype, impl=train.profile), None, 0.0
    saved = saved_tensors_per_layer(model, s, b, tp=t, sp=sp, cp=c, flash=train.flash_attention,
                                    selective=rc == "selective",
                                    dtype_bytes_=dtype_bytes(train.dtype), moe=moe,
                                    impl=train.profile, a2a=layout.ulysses_degree)
    in_moe = {name for name in saved if name == "mlp_input"
              or name.startswith(("router_", "expert_", "shared_"))} if moe else set()
    per_row = sum(saved[name] for name in ("expert_inputs", "expert_gate", "expert_up",
                                           "expert_activation_input", "expert_down_input")
                  if name in saved) / (model.top_k * s / c * b) if moe else 0.0
    return (sum(v for name, v in saved.items() if name not in in_moe),
            sum(saved[name] for name in in_moe) if moe else None, per_row)


def activation_note(row: CheckRow, layout: Layout, train: TrainSpec,
                    model: ModelSpec | None = None) -> list[str]:
    """Why an activation row differs: the runtime facts that make it differ, with their size."""
    if row.error == 0 or layout.recompute == "full":
        return []
    notes = []
    c, ab = layout.cp, dtype_bytes(train.dtype)
    if (model is not None and ab < 4 and train.impl == RUNTIME_IMPL
            and not row.what.endswith("MoE")):  # (the router's probabilities are fp32 in both)
        # the count keeps statistics in fp32; the runtime's bf16 kernels keep them in bf16
        rows = train.seq_len / c * layout.micro_batch
        t, sp = layout.tp, layout.sp and layout.tp > 1
        lse = (max(model.n_heads // t, 1) * rows
               if train.flash_attention and layout.recompute != "selective" else 0)
        latent = (1 + bool(model.q_lora_rank)) if model.is_mla else 0  # MLA's latent norms
        what, n = "RMSNorm's rstd and attention's log-sum-exp", (2 / (t if sp else 1)
                                                                 + latent) * rows + lse
        notes.append(f"{train.dtype}: the runtime keeps {what} in {train.dtype}, the count in "
                     f"fp32: −{n * (4 - ab):,.0f} B")
    if c > layout.ulysses_degree:  # ring attention (the hybrid's too)
        notes.append(f"ring attention also saves the zigzag token positions, (c, s/c) int64: "
                     f"+{8 * train.seq_len:,} B")
        if not train.flash_attention:
            notes.append("ring attention keeps its output and log-sum-exp, never the scores")
    return notes


def zero_units(model: ModelSpec, layout: Layout, stage: int) -> list[tuple[int, int, bool]]:
    """The flat units `runtime.zero` builds on one rank of pipeline `stage`, in order:
    (parameters, ranks the unit is sharded over, whether it holds experts). The embedding
    (first stage), each layer (its experts a unit of their own, over `edp`, when ep > 1), the
    final norm and the head (last stage; a tied head with pp = 1 is the embedding itself)."""
    h, t = model.d_model, layout.tp
    n = layout.zero_degree
    units: list[tuple[int, int, bool]] = []
    if stage == 0:
        units.append((round(model.vocab * h / t + model.learned_positions * h), n, False))
    dense, experts = _layer_units(model, layout, stage_layers(model, layout, stage))
    for unit, expert_unit in zip(dense, experts):
        units += [unit] if expert_unit is None else [unit, expert_unit]
    if stage == layout.pp - 1:
        units.append((round(model.norm_params()), n, False))
        if not model.tie_embeddings or layout.pp > 1:
            units.append((round(model.vocab * h / t), n, False))
    return units


def _layer_units(model: ModelSpec, layout: Layout, layers: Sequence[int]
                 ) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int, bool] | None]]:
    """Each layer's ZeRO unit (its dense weights: attention, norms, router, the MLP or
    replicated experts) and, under ep > 1, its experts' unit over `edp` (else None)."""
    t, e, n = layout.tp, layout.ep, layout.zero_degree
    dense_layer, moe_layer, expert_layer = layer_params(model, t, e)
    dense: list[tuple[int, int, bool]] = []
    experts: list[tuple[int, int, bool] | None] = []
    for k in layers:
        moe = model.is_moe_layer(k)
        own = moe_layer if moe else dense_layer
        dense.append((round(own + (expert_layer if moe and e == 1 else 0)), n, False))
        experts.append((round(expert_layer), max(n // e, 1), True) if moe and e > 1 else None)
    return dense, experts


def _padded(numel: int, n: int) -> int:
    """A flat unit's length padded to a multiple of the `n` ranks sharding it (runtime.zero)."""
    return -(-numel // n) * n


def state_rows(model: ModelSpec, layout: Layout, train: TrainSpec, stage: int,
                measured: dict[str, int]) -> list[CheckRow]:
    """Weights, gradients, fp32 master weights (mixed precision) and optimizer moments one rank
    holds after a step (SPEC §2: bf16 + bf16 grads + Adam = 2 + 2 + 4 + 8 B/param). Under ZeRO
    each flat unit is padded to a multiple of its shard group (`zero_units`), and the
    gradients held after the step are the reduce-scattered shard on every stage (ZeRO-1 holds
    the full gradients only from backward until they are reduce-scattered at the step)."""
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    dense, experts = stage_params(model, layout, stage)
    n = layout.zero_degree
    note = (f"{dense:,.0f} dense + {experts:,.0f} expert params; "
            f"{state.weight:g}/{state.grad:g}/{state.master:g}/{state.moments:g} B per param "
            "(weights/grads/master/moments)")
    if layout.zero:
        units = zero_units(model, layout, stage)
        full = sum(_padded(u, k) for u, k, _ in units)
        shard = sum(_padded(u, k) // k for u, k, _ in units)
        predicted = (state.weight * (shard if layout.zero == 3 else full),
                     state.grad * shard, state.master * shard, state.moments * shard)
        note += (f", ZeRO-{layout.zero} over {n}: {len(units)} flat units padded to "
                 f"{full:,} elements, {shard:,} per shard; gradients held after the step: "
                 "the shard")
    else:
        params = dense + experts  # unsharded: every rank holds its whole share
        predicted = (state.weight * params, state.grad * params, state.master * params,
                     state.moments * params)
    notes = {"master": "fp32 master copies of the bf16 weights (mixed precision; none when "
                       "the weights are fp32 or wider)",
             "optimizer": "AdamW's two moments"}
    return [CheckRow("state", name, predicted[i], measured[name], EXACT,
                     f"{notes[name]}; {note}" if name in notes else note)
            for i, name in enumerate(("weights", "grads", "master", "optimizer"))]


def peak_row(model: ModelSpec, layout: Layout, train: TrainSpec, stage: int,
             measured: float | None) -> CheckRow:
    """The peak-memory row of `stage`: the modelled peak against `max_memory_allocated`
    (reported, no target; None on CPU)."""
    breakdown = training_memory_per_gpu(model, layout, train)[stage]
    predicted = breakdown.peak  # held memory + the largest transient (MemoryBreakdown.peak)
    if measured is None:
        return CheckRow("peak memory", "max_memory_allocated", predicted, None, REPORTED,
                        "no GPU: this run is on CPU (gloo), whose allocator cannot report "
                        f"a peak; modelled peak from {breakdown.peak_term}")
    return CheckRow("peak memory", "max_memory_allocated", predicted, measured, REPORTED,
                    "allocator peak: the model's state and activations plus transient buffers "
                    f"(modelled: {breakdown.peak_transient or 'none'}; not modelled: collective "
                    "and recompute buffers, fragmentation); CUDA context excluded")


def checkpoint_rows(model: ModelSpec, layout: Layout, train: TrainSpec,
                    measured: dict[str, float]) -> list[CheckRow]:
    """One checkpoint of the run (`runtime.saving.measure_checkpoint`) against
    `estimate.goodput`: its weights, fp32 masters and moments (exact: `P ×` the stack's bytes
    per parameter), its other tensors, the busiest rank's file, the bytes on disk (reported),
    and the write time this machine's measured disk bandwidth predicts for the whole
    checkpoint (reported: one machine writes every rank's share)."""
    per_param = checkpoint_bytes_per_param(train, layout.zero)
    whole = checkpoint_bytes(model, train, layout.zero)
    rank = float(checkpoint_writes(model, layout.world_size, train, **layout.codes(),
                                   partition=layout.partition)[0])
    bandwidth = measured["bandwidth"]
    return [
        CheckRow("checkpoint", "weights, masters, moments (bytes)", whole, measured["state"],
                 EXACT, f"{model.count_params().total:,} params × {per_param:g} B "
                 f"({train.dtype}, the {train.impl} runtime's format); measured: the chunks "
                 "DCP's .metadata lists, each once"),
        CheckRow("checkpoint", "step counters, RNG (bytes)", None, measured["other"], REPORTED,
                 "AdamW's step count per parameter and the CPU generator's state: outside "
                 "the per-parameter model"),
        CheckRow("checkpoint", "busiest rank's file (bytes)", rank,
                 measured["busiest_rank_bytes"], REPORTED,
                 "predicted: an even share of its stage (DCP gives each replicated chunk to "
                 "the rank with the least planned so far); measured: its .distcp file, "
                 "torch.save's framing of every chunk included"),
        CheckRow("checkpoint", "on disk (bytes)", None, measured["disk_bytes"], REPORTED,
                 "every file: the tensors in torch.save framing, DCP's .metadata, "
                 "shardwise.json and the checksum manifest"),
        CheckRow("checkpoint", "write (s)", whole / bandwidth, measured["seconds"], REPORTED,
                 f"predicted: the tensors ÷ this disk's {bandwidth / 1e6:,.0f} MB/s "
                 f"({measured['disk_test_bytes'] / 2**20:g} MiB written and fsync'ed into the "
                 "same directory just before); measured: the "
                 "whole save, with DCP's planning and serialisation, the manifest's SHA-256 "
                 "of every file, the fsyncs and the atomic publish"),
    ]
