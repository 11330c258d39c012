"""Stage geometry: which layers, parameters and in-flight micro-batches one pipeline stage
holds (SPEC §4), asked of the layout once (`StageGeometry`) for one layout or arrays of them.

A stage's layers come from its partition (`shardwise.partition.chunk_span`), its in-flight
micro-batch-chunks from the schedule's registry rule (`schedules.registry`), its parameters
from `layer_params` per layer kind; the first stage holds the embedding, the schedule's last
stage (`ScheduleInfo.last_stage`) the head and the loss. A bidirectional schedule (DualPipe)
puts stage `i` of one direction and `p-1-i` of the other on rank `i`: two stages' layers, and
the embedding and head at both ends. Derivation: docs/concepts/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.fp8 import Fp8Recipe
from shardwise.layout import Layout
from shardwise.partition import Balanced, Partition, chunk_span, stage_totals
from shardwise.placement import expert_tp_degree
from shardwise.schedules.actions import Placement
from shardwise.schedules.registry import get_schedule, select


def in_flight_per_stage(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """Peak micro-batch-chunks (a chunk holds `1/v` of the stage's layers; micro-batches when
    `v = 1`) whose activations a stage holds.

    Each schedule's registry rule (`schedules.registry`): GPipe holds all `m`; 1F1B and ZB-H1
    stage `i` hold `min(p - i, m)` (Narayanan et al. 2021; Qi et al. 2023 keep 1F1B's
    memory); interleaved 1F1B stage `i` holds Megatron's warm-up
    `(p-i-1)·2 + (v-1)·p` chunks plus one, at most `m·v` — stage 0 then holds
    `L·(1 + (p-1)/(p·v))` layers' worth (Korthikanti et al. 2022); ZBV every stage `2p`
    chunks (`p` micro-batches' worth) once `m ≥ 2p-1`; DualPipeV every stage `2p + 1`.
    """
    validate.degree(p, "p (stages)")  # a list of p entries is built: capped
    validate.degree(v, "v (chunks)")
    validate.positive_int(m, "m (micro-batches)")
    code = get_schedule(schedule).code
    return [int(_in_flight(code, p, m, v, i)) for i in range(p)]


def _in_flight(schedule: Any, p: Any, m: Any, v: Any, stage: Any) -> Any:
    return select(schedule, lambda info: info.in_flight(p, m, v, stage))



def stage_layers(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """Layer indices held by `stage`: chunk c holds virtual stage `c·p + stage`; an uneven
    partition (`Layout.stage_partition`) holds a contiguous run."""
    out: list[int] = []
    if get_schedule(layout.schedule).bidirectional:  # DualPipe: stages i and p-1-i
        for one in (stage, layout.pp - 1 - stage):
            start, count = chunk_span(model.n_layers, layout.pp, 1, one, 0, layout.partition)
            out.extend(range(int(start), int(start) + int(count)))
        return out
    for chunk in range(layout.chunks):
        start, count = chunk_span(model.n_layers, layout.pp, layout.chunks, stage, chunk,
                                  layout.partition, layout.placement)
        out.extend(range(int(start), int(start) + int(count)))
    return out


def stage_layer_count(model: ModelSpec, pp: Any, chunks: Any, stage: Any,
                      partition: Partition = (), placement: Placement = "loop") -> Any:
    """How many layers `stage` holds over all its chunks (`Layout.stage_layers`)."""
    if isinstance(partition, tuple) and partition:
        return np.asarray(stage_totals(pp, chunks, partition, placement))[stage]
    return chunk_span(model.n_layers, pp, chunks, stage, 0, partition)[1] * chunks


def placement_of(schedule: Any, partition: Partition = ()) -> Any:
    """The placement ("loop" or "v", `actions.virtual_stage`) of each layout's `schedule`
    code: which virtual stage each chunk runs, for even and explicit partitions alike
    (ZBV and DualPipeV put chunks `i` and `2p-1-i` on stage `i`). A `Placement` for one code,
    an array of them for an array of codes. `partition` is not read (kept for callers)."""
    if np.ndim(schedule) == 0:
        return get_schedule(int(schedule)).placement
    return np.where(select(schedule, lambda info: info.placement == "v"), "v", "loop")


def moe_layers_on_stage(model: ModelSpec, pp: Any, chunks: Any, stage: Any,
                        partition: Partition = (), placement: Placement = "loop") -> Any:
    """How many of `stage_layers(stage)` are MoE layers (layer `k ≥ F` is when
    `k % q == q - 1`, `q = moe_every`, `F = first_dense_layers`): chunk `c` holds layers
    `[start, start + n)` (`layout.chunk_span`), of which `max(start + n, F)//q -
    max(start, F)//q` are MoE."""
    if not model.is_moe:
        return 0 * pp
    q, f = model.moe_every, model.first_dense_layers
    total = 0 * pp
    for chunk in range(int(np.max(chunks))):
        start, n = chunk_span(model.n_layers, pp, chunks, stage, chunk, partition, placement)
        moe = np.maximum(start + n, f) // q - np.maximum(start, f) // q
        total = total + np.where(chunk < chunks, moe, 0)
    return total


def layer_params(model: ModelSpec, tp: Any, ep: Any, etp: Any = 0) -> tuple[Any, Any, Any]:
    """Per rank: a dense layer, an MoE layer without its experts, one MoE layer's experts.
    Dense weights ÷ tp (norms, router and an O bias replicated; K, V at `max(a_kv/t, 1)`
    heads; MLA's down-projections and latent norms replicated, `ModelSpec.mla_params`),
    shared experts ÷ tp, routed experts ÷ (etp·ep) — `etp` the expert-tensor-parallel degree,
    0 for tp (Megatron-Core's default, `ModelParallelConfig.expert_tensor_parallel_size`)."""
    h = model.d_model
    etp = expert_tp_degree(etp, tp)
    norms = 2 * model.norm_params() + model.latent_norm_params()
    if model.is_mla:
        replicated, split = model.mla_params()
        attention = replicated + split / tp + norms
    else:
        kv = np.maximum(model.n_kv_heads // tp, 1) * model.head_dim
        q = model.q_dim  # a·d: h unless the config names head_dim
        attention = (2 * h * q / tp + 2 * h * kv + norms
                     + model.qkv_bias * (q / tp + 2 * kv) + model.out_bias * h  # biases
                     + model.attention_sinks * model.n_heads / tp)  # gpt-oss: a logit per head
    dense_layer = attention + model.mlp_params() / tp
    moe_layer = (attention + model.router_params()
                 + model.n_shared_experts * model.mlp_params(model.expert_d_ff) / tp)
    expert_layer = (model.n_experts / ep * model.mlp_params(model.expert_d_ff) / etp
                    if model.is_moe else 0 * tp)
    return dense_layer, moe_layer, expert_layer


def mtp_params(model: ModelSpec, tp: Any, ep: Any, etp: Any = 0) -> tuple[Any, Any]:
    """(dense, expert) parameters per rank of one multi-token-prediction module (DeepSeek-V3
    §2.2, `num_nextn_predict_layers`; Megatron's `--mtp-num-layers`, megatron-core 0.16.1
    transformer/multi_token_prediction.py): a Transformer layer of the model's last kind (MoE
    for an MoE model), `eh_proj` (2h → h, column-parallel ÷ tp) and its enorm, hnorm and final
    norm: `ModelSpec.mtp_params` per module, sharded as `layer_params`. The embedding and the
    head are the main model's: the stage holding them keeps another copy of the embedding when
    that is not stage 0 (GPTModel builds it where `mtp_process`)."""
    dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
    h = model.d_model
    extra = 2 * h * h / tp + 3 * model.norm_params()
    if model.is_moe:
        return moe_layer + extra, expert_layer
    return dense_layer + extra, 0 * expert_layer


def fp8_linear_params(model: ModelSpec, recipe: Fp8Recipe, tp: Any, ep: Any, etp: Any = 0
                      ) -> tuple[Any, Any, Any, Any]:
    """Per rank, what an FP8 recipe quantises: (weights of a dense layer's linear layers, of an
    MoE layer's, FP8 GEMMs of a dense layer, of an MoE layer). The linear layers are
    `layer_params` without the norms and the router (bf16 in both frameworks); routed experts
    count when the recipe runs them in FP8 (`Fp8Recipe.experts_fp8`: Transformer Engine's
    grouped GEMMs, one FP8 GEMM per local expert and projection). GEMMs: QKV and out-proj
    (MLA: q or q-down and q-up, kv-down, kv-up, out-proj), fc1 and fc2."""
    dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
    norms = 2 * model.norm_params() + model.latent_norm_params()
    attention_gemms = ((5 if model.q_lora_rank else 4) if model.is_mla else 2)
    dense = dense_layer - norms
    moe = moe_layer - norms - model.router_params()
    moe_gemms = attention_gemms + 2 * model.n_shared_experts
    if recipe.experts_fp8 and model.is_moe:
        moe = moe + expert_layer
        moe_gemms = moe_gemms + 2 * model.n_experts / ep
    return dense, moe, attention_gemms + 2, moe_gemms


def stage_param_counts(model: ModelSpec, *, tp: Any, pp: Any, ep: Any, chunks: Any,
                       stage: Any, partition: Partition = (), etp: Any = 0,
                       last: Any = None, placement: Placement = "loop",
                       geometry: StageGeometry | None = None) -> tuple[Any, Any]:
    """(dense, expert) parameters one rank of pipeline `stage` holds (SPEC §4): its layers
    (`layer_params`); the first stage adds the vocabulary-parallel embedding `V·h/t`, the
    stage `last` holding the head (default `pp-1`; 0 in the V of ZBV and DualPipeV,
    `ScheduleInfo.last_stage`) the final norm and the head `V·h/t` (a tied head is a second
    copy when that is not stage 0). `geometry`: the stage's, when already built
    (`param_geometry`)."""
    if geometry is None:
        geometry = param_geometry(model, pp, chunks, stage, partition, last, placement)
    return geometry.params(model, tp, ep, etp)


def param_geometry(model: ModelSpec, pp: Any, chunks: Any, stage: Any,
                   partition: Partition = (), last: Any = None, placement: Any = "loop"
                   ) -> StageGeometry:
    """The `StageGeometry` that `stage_param_counts` reads (`last`: the stage holding the
    head, default `pp-1`; `placement` a `Placement` or an array of them; nothing in
    flight)."""
    last = pp - 1 if last is None else last
    layers = stage_layer_count(model, pp, chunks, stage, partition, placement)
    moe_layers = moe_layers_on_stage(model, pp, chunks, stage, partition, placement)
    return StageGeometry(stage, layers, moe_layers, chunks, 0, 0, stage == 0, stage == last,
                         last, placement)


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> tuple[float, float]:
    """`stage_param_counts` of one layout: (dense, expert) parameters on one rank of `stage`
    (DualPipe: both directions' stages, `StageGeometry.of`)."""
    geometry = (StageGeometry.of_layout(model, layout, 1, stage)  # params read no in_flight
                if get_schedule(layout.schedule).bidirectional else None)
    dense, expert = stage_param_counts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep,
                                       chunks=layout.chunks, stage=stage,
                                       partition=layout.partition, etp=layout.etp,
                                       last=get_schedule(layout.schedule).last_stage(layout.pp),
                                       placement=layout.placement, geometry=geometry)
    return float(dense), float(expert)



@dataclass(frozen=True)
class StageGeometry:
    """What one pipeline stage holds, asked of the layout once (numbers for one layout, NumPy
    arrays for many): its `layers` over all `chunks`, `moe_layers` of them, the micro-batch
    chunks `in_flight` (the schedule's registry rule; a chunk holds `1/chunks` of the layers),
    the micro-batches whose loss waits (`last_in_flight`: 1, or `m` when the schedule defers
    the loss), whether it holds the embedding (`first`) and the head and loss (`last`, stage
    `last_stage`: `pp-1`, or 0 in the V of ZBV and DualPipeV), and the `placement` of an
    explicit partition's virtual stages."""

    stage: Any
    layers: Any
    moe_layers: Any
    chunks: Any
    in_flight: Any
    last_in_flight: Any
    first: Any
    last: Any
    last_stage: Any
    placement: Placement = "loop"

    @classmethod
    def of(cls, model: ModelSpec, *, pp: Any, chunks: Any, stage: Any, schedule: Any, m: Any,
           partition: Partition = ()) -> StageGeometry:
        """Stage `stage` of layouts given as `stage_memory`'s codes (`schedule` a registry
        code)."""
        placement = placement_of(schedule, partition)
        last_stage = select(schedule, lambda info: info.last_stage(pp))
        layers = stage_layer_count(model, pp, chunks, stage, partition, placement)
        moe_layers = moe_layers_on_stage(model, pp, chunks, stage, partition, placement)
        first, last = stage == 0, stage == last_stage
        dual = select(schedule, lambda info: info.bidirectional)
        if np.any(dual):  # DualPipe: stages i and p-1-i of a p-way split, both ends' ends
            if isinstance(partition, tuple) and partition and len(partition) != np.max(pp):
                raise ShardwiseError(f"DualPipe's partition gives one count per stage of one "
                                     f"direction ({np.max(pp)}), got {len(partition)}")
            both = (stage, pp - 1 - stage)
            layers = np.where(dual, sum(stage_layer_count(model, pp, 1, i, partition)
                                        for i in both), layers)
            moe_layers = np.where(dual, sum(moe_layers_on_stage(model, pp, 1, i, partition)
                                            for i in both), moe_layers)
            ends = (stage == 0) | (stage == pp - 1)
            first, last = np.where(dual, ends, first), np.where(dual, ends, last)
            last_stage = np.where(dual, pp - 1, last_stage)  # each head apart from its embedding
        return cls(stage=stage, layers=layers, moe_layers=moe_layers,
                   chunks=chunks, in_flight=_in_flight(schedule, pp, m, chunks, stage),
                   last_in_flight=select(schedule, lambda info: m if info.loss_waits else 1),
                   first=first, last=last, last_stage=last_stage,
                   placement=placement)

    @classmethod
    def of_layout(cls, model: ModelSpec, layout: Layout, m: int, stage: int) -> StageGeometry:
        """Stage `stage` of one `layout` running `m` micro-batches."""
        codes = layout.codes()
        return cls.of(model, pp=layout.pp, chunks=layout.chunks, stage=stage,
                      schedule=codes["schedule"], m=m, partition=layout.partition)

    def take(self, index: Any) -> StageGeometry:
        """The geometry of layouts `index` of these (1-D arrays; numbers stay)."""
        return replace(self, **{f: np.asarray(v)[index] for f, v in vars(self).items()
                                if np.ndim(v) == 1})

    @property
    def dense_layers(self) -> Any:
        return self.layers - self.moe_layers

    def per_layer_kind(self, dense: Any, moe: Any) -> Any:
        """`dense` per dense layer plus `moe` per MoE layer, summed over the stage's layers."""
        return self.dense_layers * dense + self.moe_layers * moe

    def params(self, model: ModelSpec, tp: Any, ep: Any, etp: Any = 0) -> tuple[Any, Any]:
        """(dense, expert) parameters on one rank of this stage (`stage_param_counts`)."""
        h = model.d_model
        dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
        dense = self.per_layer_kind(dense_layer, moe_layer)
        dense = dense + np.where(self.first, model.vocab * h / tp + model.learned_positions * h,
                                 0.0)
        head = np.where(np.logical_or(not model.tie_embeddings, self.last_stage != 0),
                        model.vocab * h / tp, 0.0)
        dense = dense + np.where(self.last, model.norm_params() + head, 0.0)
        return dense, self.moe_layers * expert_layer


def candidate_stages(model: ModelSpec, pp: Any) -> list[Any]:
    """The pipeline stages that can hold the most (`peak_stage_memory`'s reasoning): the
    first, the second and the last (arrays of stage indices for arrays of `pp`), or every stage
    of an MoE model with `moe_every > 1` or dense first layers."""
    if model.is_moe and (model.moe_every > 1 or model.first_dense_layers):
        return [np.minimum(i, pp - 1) for i in range(int(np.max(pp)))]
    return [0 * pp, np.minimum(1, pp - 1), pp - 1]


def distinct_stages(model: ModelSpec, pp: Any, stages: list[Any], *, chunks: Any, schedule: Any,
                    m: Any, partition: Partition = ()) -> list[Any]:
    """Of `stages` (`candidate_stages`), the ones whose `stage_memory` total can be the largest,
    as fewer arrays (the geometry's shape; a row's list padded with its first stage).

    Exact: `stage_memory` sees the stage only through `StageGeometry` — `layers`,
    `moe_layers`, `first`, `last` (the composition) and `in_flight`; `chunks`, `last_stage`
    and `last_in_flight` are the layout's — and its total is nondecreasing in `in_flight`
    (activations `in_flight·(per micro-batch + first·dropout mask)`, both ≥ 0; float
    products and sums are monotone). So of the stages of one composition the one with the
    most in flight (the earliest on ties) holds at least as much as any other, and the largest
    total over these representatives is bit-identical to that over every stage. The
    geometry is worked out once per distinct (pp, chunks, schedule, m, partition)."""
    if len(stages) <= 1:
        return stages
    balanced = isinstance(partition, Balanced)
    ends = (partition.first_less, partition.last_less) if isinstance(partition, Balanced) else ()
    inputs = [pp, chunks, schedule, m, *ends]
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
    if not shape or (isinstance(partition, tuple) and partition):
        return _distinct(model, pp, stages, chunks, schedule, m, partition)
    columns = [np.broadcast_to(np.asarray(x, dtype=np.int64), shape).ravel() for x in inputs]
    at, inverse = _unique_rows(columns)
    u = [column[at] for column in columns]
    stage_u = [np.broadcast_to(stage, shape).ravel()[at] for stage in stages]  # of pp only
    part_u: Partition = Balanced(u[4], u[5]) if balanced else ()
    reps = _distinct(model, u[0], stage_u, u[1], u[2], u[3], part_u)
    inverse = inverse.ravel()
    return [np.asarray(rep)[inverse].reshape(shape) for rep in reps]


def distinct_geometries(model: ModelSpec, pp: Any, stages: list[Any], *, chunks: Any,
                        schedule: Any, m: Any, partition: Partition = ()
                        ) -> list[StageGeometry]:
    """The `StageGeometry` of each of `distinct_stages`, worked out once per distinct (pp,
    chunks, schedule, m, partition) and spread back to the arrays' shape (the same numbers
    as `StageGeometry.of` on the arrays)."""
    reps = distinct_stages(model, pp, stages, chunks=chunks, schedule=schedule, m=m,
                           partition=partition)
    balanced = isinstance(partition, Balanced)
    ends = (partition.first_less, partition.last_less) if isinstance(partition, Balanced) else ()
    inputs = [pp, chunks, schedule, m, *ends]
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs), *(np.shape(r) for r in reps))
    if not shape or (isinstance(partition, tuple) and partition):
        return [StageGeometry.of(model, pp=pp, chunks=chunks, stage=rep, schedule=schedule,
                                 m=m, partition=partition) for rep in reps]
    columns = [np.broadcast_to(np.asarray(x, dtype=np.int64), shape).ravel()
               for x in (*inputs, *reps)]
    at, inverse = _unique_rows(columns)
    u = [column[at] for column in columns]
    part_u: Partition = Balanced(u[4], u[5]) if balanced else ()
    inverse = np.asarray(inverse).reshape(shape)
    return [StageGeometry.of(model, pp=u[0], chunks=u[1], stage=u[len(inputs) + k],
                             schedule=u[2], m=u[3], partition=part_u).take(inverse)
            for k in range(len(reps))]


def _unique_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(axis=0, return_index, return_inverse)` of the rows of `columns` (non-negative
    int64), through one mixed-radix code per row (falls back to `np.unique` if it would not fit
    in 62 bits)."""
    radix = [int(column.max()) + 1 for column in columns]
    if min(int(column.min()) for column in columns) < 0 or math.prod(radix) >= 1 << 62:
        _, at, inverse = np.unique(np.stack(columns, axis=1), axis=0, return_index=True,
                                   return_inverse=True)
        return at, inverse
    code = np.zeros(len(columns[0]), dtype=np.int64)
    for column, base in zip(columns, radix, strict=True):
        code = code * base + column
    _, at, inverse = np.unique(code, return_index=True, return_inverse=True)
    return at, inverse


def _distinct(model: ModelSpec, pp: Any, stages: list[Any], chunks: Any, schedule: Any,
              m: Any, partition: Partition) -> list[Any]:
    geos = [StageGeometry.of(model, pp=pp, chunks=chunks, stage=stage, schedule=schedule, m=m,
                             partition=partition) for stage in stages]
    shape = np.broadcast_shapes(*(np.shape(x) for g in geos
                                  for x in (g.stage, g.layers, g.moe_layers, g.first, g.last,
                                            g.in_flight)))

    def grid(field: str) -> np.ndarray:
        return np.stack([np.broadcast_to(np.asarray(getattr(g, field), dtype=np.int64), shape)
                         for g in geos])

    key = ((grid("layers") * (model.n_layers + 1) + grid("moe_layers")) * 2
           + grid("first")) * 2 + grid("last")
    flight = grid("in_flight")
    needed = np.ones(key.shape, dtype=bool)
    for i in range(len(geos)):  # stage i is dominated by an earlier or fuller one of its kind
        same = key == key[i]
        beaten = same & ((flight > flight[i]) | ((flight == flight[i])
                                                  & (np.arange(len(geos)) < i).reshape(
                                                      (-1,) + (1,) * len(shape))))
        needed[i] = ~beaten.any(axis=0)
    count = needed.sum(axis=0)
    order = np.argsort(~needed, axis=0, kind="stable")[:int(count.max())]
    order = np.where(np.arange(len(order)).reshape((-1,) + (1,) * len(shape)) < count,
                     order, order[:1])
    index = grid("stage")
    return [np.take_along_axis(index, order[k:k + 1], axis=0)[0] for k in range(len(order))]
