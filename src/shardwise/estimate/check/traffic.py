"""What one rank sends per optimizer step (`predicted_comm`, from `estimate.comm`'s formulas)
and the rows comparing it with a run: the payload handed to each collective (exact) and the
bytes on the wire (`comm_rows`: within the algorithm's bytes plus the framing allowance,
docs/howto/check.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shardwise.arch import ModelSpec
from shardwise.estimate.check.rows import (
    COUNTS_OP,
    EXACT,
    FRAMED,
    REPORTED,
    ROUTING_COUNTS_OP,
    ROUTING_GATHER_OP,
    CheckRow,
)
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
from shardwise.estimate.memory import (
    layer_params,
    stage_layers,
    stage_params,
)
from shardwise.layout import Layout, TrainSpec
from shardwise.units import dtype_bytes


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
    kv_heads = max(model.n_kv_heads // t, 1)
    kv, v = kv_heads * model.head_dim, kv_heads * model.value_head_dim  # K at d, V at d_v
    ab, s, b, rc = dtype_bytes(train.dtype), train.seq_len, layout.micro_batch, layout.recompute
    ring, a2a = ("cp", "cp") if layout.cp_kind != "hybrid" else ("cp_ring", "cp_a2a")
    terms = []
    if u < c:
        terms.append(Term(ring, "send", calls * cp_comm_bytes_per_layer(
            s, b, (kv + v) / 2 / u, c // u, ab, recompute=rc),  # K, V: 2 × their mean width
            "ring attention K, V and dK, dV"))
    if u > 1:
        terms.append(Term(a2a, "all-to-all", calls * ulysses_comm_bytes_per_layer(
            s, b, model.q_dim / t, kv, c, u, ab, recompute=rc, v_dim=v, o_dim=model.o_dim / t),
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
