"""Training memory per GPU (SPEC §4): each pipeline stage's persistent state, activations,
logits, workspace and transient buffers, in bytes.

Per-GPU memory = the stage's parameters (`estimate.geometry`: its layers ÷ tp, experts also
÷ ep) × bytes per parameter, each state class ÷ the ZeRO degree (`estimate.state`), plus the
activations (`estimate.activations`, the implementation profile's count) of the micro-batches
in flight, the fp32 logits on the last stage and ZeRO-3's gather buffers. Array-generic: the
planner evaluates millions of layouts at once through `stage_memory` and `peak_stage_memory`
(layout fields as `Layout.codes()`); `training_memory_per_gpu` runs the same code for one.
This module re-exports the names of the split modules. docs/concepts/memory.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from shardwise.arch import ModelSpec, count_params
from shardwise.estimate.activations import (
    ACTIVATION_FORMULAS,
    activation_bytes_per_layer,
    gathered_kv_bytes,
    korthikanti_activation_bytes,
    saved_tensors_per_layer,
)
from shardwise.estimate.geometry import (
    StageGeometry,
    candidate_stages,
    distinct_geometries,
    distinct_stages,
    fp8_linear_params,
    in_flight_per_stage,
    layer_params,
    moe_layers_on_stage,
    mtp_params,
    placement_of,
    stage_layer_count,
    stage_layers,
    stage_param_counts,
    stage_params,
)
from shardwise.estimate.offload import offload_state
from shardwise.estimate.profiles import fused_attention
from shardwise.estimate.rows import equal_rows
from shardwise.estimate.state import (
    MOMENT_BYTES,
    StateBytes,
    ZeroRow,
    bytes_per_param_training,
    kv_cache_bytes_per_token,
    train_state_bytes,
    training_memory_bytes,
    zero_memory_per_device,
    zero_stage_table,
    zero_state_bytes,
)
from shardwise.layout import Layout, Partition, TrainSpec, check_specs, ulysses_degree
from shardwise.placement import expert_tp_degree
from shardwise.units import dtype_bytes

__all__ = [
    "ACTIVATION_FORMULAS",
    "MemoryBreakdown",
    "StateBytes",
    "ZeroRow",
    "activation_bytes_per_layer",
    "bytes_per_param_training",
    "candidate_stages",
    "count_params",
    "distinct_geometries",
    "distinct_stages",
    "fp8_linear_params",
    "gathered_kv_bytes",
    "in_flight_per_stage",
    "korthikanti_activation_bytes",
    "kv_cache_bytes_per_token",
    "largest_stage_memory",
    "layer_params",
    "moe_layers_on_stage",
    "mtp_params",
    "peak_stage_memory",
    "peak_stage_total",
    "placement_of",
    "saved_tensors_per_layer",
    "stage_layer_count",
    "stage_layers",
    "stage_memory",
    "stage_param_counts",
    "stage_params",
    "train_state_bytes",
    "training_memory_bytes",
    "training_memory_per_gpu",
    "zero_memory_per_device",
    "zero_stage_table",
    "zero_state_bytes",
]


TRANSIENTS = ("loss buffer", "attention workspace", "ZeRO-3 gather", "gradient bucket",
              "optimizer step")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of one pipeline stage.

    `total` is what the stage holds across the step (state, an FP8 recipe's weight copies and
    scaling state (`fp8`), the in-flight activations, the last stage's fp32 logits, ZeRO-3's
    two gathered layers): the planner's fit figure; `host` is what offload keeps in host
    memory instead (`estimate.offload`). `transients`
    are buffers that live only for a moment, `(name, bytes)` in `TRANSIENTS` order:

        loss buffer          last stage: the loss's fp32 softmax / gradient buffer, one
                             logits-sized fp32 tensor `s·b·V·4/t` beside the held logits
        attention workspace  backward of one layer's attention: FlashAttention-2's fp32 `dq`
                             accumulator `s·b·a·d·4/t` (`a·d = h` but for `d_head` or
                             MLA); materialised attention: the fp32
                             gradient of the scores `a·s²·b·4/t`
        ZeRO-3 gather        the two gathered layers (= `workspace`, already in `total`)
        gradient bucket      ZeRO-2/3: one layer's unsharded gradients before the
                             reduce-scatter; 0 for ZeRO-0/1 (Megatron's contiguous gradient
                             buffer, DDP's `gradient_as_bucket_view`: buckets are the grads)
        optimizer step       after backward, activations freed: torch's foreach Adam
                             (`_foreach_sqrt(exp_avg_sq)`) allocates one fp32 buffer per
                             parameter the rank steps on; 0 for SGD (fused Adam: none either)

    `peak` = max(forward-to-backward: `total` + the largest of loss buffer, attention
    workspace and gradient bucket; optimizer step: state + its buffer), so `peak ≥ total`. `peak_term` names the single largest
    term of that peak. A model, not a measurement: on CPU the allocator cannot report it; on a
    GPU compare with `torch.cuda.max_memory_allocated` (`shardwise check`'s peak row).
    """

    stage: int
    layers: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float = 0.0
    workspace: float = 0.0
    in_flight: int = 0
    transients: tuple[tuple[str, float], ...] = ()
    fp8: float = 0.0  # an FP8 recipe's held weight copies and scaling state
    host: float = 0.0  # offloaded state in host memory (not in `total`)

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return (self.state + self.fp8 + self.workspace) + (self.activations + self.logits)

    def _peak_parts(self) -> dict[str, float]:
        """The terms of the peak moment: state classes, activations, logits, one transient."""
        during = {name: v for name, v in self.transients
                  if name not in ("optimizer step", "ZeRO-3 gather")}
        step = dict(self.transients).get("optimizer step", 0.0)
        name, transient = max(during.items(), key=lambda kv: kv[1], default=("", 0.0))
        held = {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer}
        if self.fp8:
            held["fp8 weights"] = self.fp8
        forward_backward = held | {"activations": self.activations, "logits": self.logits}
        if self.workspace:  # gathered during every layer's forward and backward
            forward_backward["ZeRO-3 gather"] = self.workspace
        if name:
            forward_backward[name] = transient
        if sum(held.values()) + step > sum(forward_backward.values()):
            return held | {"optimizer step": step}
        return forward_backward

    @property
    def peak(self) -> float:
        return sum(self._peak_parts().values()) if self.transients else self.total

    @property
    def peak_term(self) -> str:
        """The largest single term of the peak (weights, grads, optimizer, activations, logits
        or a transient's name)."""
        parts = self._peak_parts()
        return max(parts, key=lambda k: parts[k])

    @property
    def peak_transient(self) -> str:
        """The transient the peak adds to what the stage holds."""
        parts = self._peak_parts()
        return next((name for name in TRANSIENTS if name in parts and name != "ZeRO-3 gather"),
                    "")

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "fp8": self.fp8, "activations": self.activations, "logits": self.logits,
                "workspace": self.workspace, "total": self.total, "host": self.host}

    def peak_dict(self) -> dict[str, object]:
        """`peak`, `peak_term`, `peak_transient` and every transient, for JSON."""
        return {"peak": self.peak, "peak_term": self.peak_term,
                "peak_transient": self.peak_transient, "transients": dict(self.transients)}



def stage_memory(model: ModelSpec, train: TrainSpec, *, tp: Any, pp: Any, cp: Any, ep: Any,
                 dp: Any, zero: Any, zero_group: Any, sp: Any, schedule: Any, chunks: Any,
                 recompute: Any, micro_batch: Any, m: Any, stage: Any,
                 act: dict[str, Any] | None = None, formula: str = "generalised",
                 partition: Partition = (), etp: Any = 0, cp_kind: Any = 0, ulysses: Any = 0,
                 generation: str = "hopper", geometry: StageGeometry | None = None
                 ) -> dict[str, Any]:
    """Bytes on one GPU of pipeline `stage` (SPEC §4), for one layout or arrays of layouts:
    weights, grads, optimizer, fp8, activations, logits, workspace, in_flight, total and host.

    Parameters: `stage_param_counts`. ZeRO divides each state class by `dp·cp` (or the hybrid
    shard group) per stage, expert state by the expert-data-parallel group `tp·dp·cp/(etp·ep)`
    (`dp·cp/ep` when etp = tp). Activations: per-layer bytes × layers on
    the stage × micro-batches in flight (the schedule's registry rule); the first stage adds
    the embedding's dropout mask (its output is layer 0's saved norm input, counted there), the
    stage running the last virtual stage (`pp-1`; stage 0 in the V of ZBV and DualPipeV) the
    final norm's input and fp32 logits `s·b·V·4/t` for the loss. ZeRO-3 adds a
    workspace of two gathered layers (the one in use and the prefetched one). `act` may carry
    the per-layer activation bytes (`{"dense": …, "moe": …}`) already evaluated (for the
    layouts' `cp_kind` and `ulysses`: `layout.ulysses_degree`), `geometry` the stage's
    `StageGeometry` (`distinct_geometries`).

    With an FP8 recipe (`TrainSpec.fp8`, `shardwise.fp8`) the state classes are bf16 mixed
    precision's; `fp8` adds the held FP8 weight copies (`Fp8Recipe.weight_copy_bytes` on the
    accelerator `generation`, e.g. "hopper": with transposes) of the stage's FP8 linear
    layers (`fp8_linear_params`; never the LM head's: torchao keeps no copy) and their scaling
    state; the linear inputs are saved at the recipe's width (`fp8_inputs` of
    `activation_bytes_per_layer`). With host offload (`TrainSpec.offload`) the offloaded
    state leaves the GPU for `host` (`estimate.offload.offload_state`).
    """
    state = train_state_bytes(train)
    recipe = train.stack.fp8_recipe(train.fp8) if train.fp8 else None
    s = train.seq_len
    if act is None:
        def per_layer(moe: bool) -> Any:
            return activation_bytes_per_layer(
                model, s, micro_batch, tp=tp, sp=sp, cp=cp, recompute=recompute,
                flash=train.flash_attention, dtype=train.dtype, formula=formula, moe=moe,
                impl=train.profile, etp=etp, a2a=ulysses_degree(cp, cp_kind, ulysses),
                fp8_inputs=recipe.saved_input_bytes() if recipe else 0.0,
                modules=train.recompute_modules, act_fp8_store=train.act_fp8_store,
                offload_modules=train.offload_modules, routed_load=train.routed_load,
                full_share=train.recompute_share)
        act = {"dense": per_layer(False), "moe": per_layer(True) if model.is_moe else 0.0}
    geo = geometry if geometry is not None else StageGeometry.of(
        model, pp=pp, chunks=chunks, stage=stage, schedule=schedule, m=m, partition=partition)
    held = _zero_held(train, _StageParams.of(model, train, geo, tp, ep, etp), tp=tp, ep=ep,
                      etp=etp, dp=dp, cp=cp, zero=zero, zero_group=zero_group,
                      generation=generation)
    activations, logits = _held_activations(model, train, geo, act, tp=tp, cp=cp, sp=sp,
                                            chunks=chunks, micro_batch=micro_batch,
                                            cp_kind=cp_kind, recompute=recompute)
    sb, last = s / cp * micro_batch, geo.last
    in_flight = geo.in_flight
    dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
    fp8, workspace = held["fp8"], held["workspace"]
    parts = {"weights": held["weights"], "grads": held["grads"],
             "optimizer": held["optimizer"], "fp8": fp8, "activations": activations,
             "logits": logits, "workspace": workspace, "host": held["host"]}
    # held per row, then per activation column (the planner's grid adds them in this order)
    parts["total"] = ((parts["weights"] + parts["grads"] + parts["optimizer"] + fp8 + workspace)
                      + (activations + logits))
    # Transient buffers (see `MemoryBreakdown`): they set the peak, not the held total.
    dq = sb * model.q_dim * 4 / tp  # FlashAttention-2's fp32 dq accumulator (a·d: h, or MLA's)
    stepped = parts["optimizer"] / state.optimizer if state.optimizer else 0.0
    parts |= {
        "loss buffer": np.where(last, sb * model.vocab * 4 / tp, 0.0),  # one micro-batch
        "attention workspace": (dq if fused_attention(train.profile, train.flash_attention)
                                else model.n_heads / tp * sb * s * 4),
        "ZeRO-3 gather": workspace,
        "gradient bucket": np.where(zero >= 2, np.maximum(dense_layer, moe_layer + expert_layer)
                                    * state.grad, 0.0),
        "optimizer step": (4.0 * stepped if state.moments >= MOMENT_BYTES["adam"]
                           else 0.0 * stepped),
    }
    return parts | {"in_flight": in_flight, "stage": stage + 0 * pp}


class _StageParams(NamedTuple):
    """What a stage's ZeRO-dependent bytes (`_zero_held`) take from its layout but the ZeRO
    stage and group: its dense and expert parameters (DeepSeek-V3's MTP modules on the stage
    holding the head, `mtp_params`), its largest layer's (ZeRO-3's gather), and with an FP8
    recipe its FP8 weights and GEMMs' scaling state (`fp8_linear_params`)."""

    dense: Any
    expert: Any
    layer_most: Any
    weights_fp8: Any = 0.0
    scaling: Any = 0.0

    @classmethod
    def of(cls, model: ModelSpec, train: TrainSpec, geo: StageGeometry, tp: Any, ep: Any,
           etp: Any) -> _StageParams:
        dense_params, expert_params = geo.params(model, tp, ep, etp)
        mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
        if mtp:
            mtp_dense, mtp_expert = mtp_params(model, tp, ep, etp)
            embedding = np.where(geo.last_stage != 0, model.vocab * model.d_model / tp, 0.0)
            dense_params = dense_params + np.where(geo.last, mtp * mtp_dense + embedding, 0.0)
            expert_params = expert_params + np.where(geo.last, mtp * mtp_expert, 0.0)
        dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
        out = cls(dense_params, expert_params, np.maximum(dense_layer, moe_layer + expert_layer))
        recipe = train.stack.fp8_recipe(train.fp8) if train.fp8 else None
        if recipe is None:
            return out
        lin_dense, lin_moe, gemm_dense, gemm_moe = fp8_linear_params(model, recipe, tp, ep, etp)
        # the head's FP8 weights are never held: only torchao quantises it, and torchao keeps
        # no FP8 copy (`Fp8Recipe.weight_copy_bytes` 0)
        return out._replace(weights_fp8=geo.per_layer_kind(lin_dense, lin_moe),
                            scaling=recipe.scaling_state_bytes()
                            * geo.per_layer_kind(gemm_dense, gemm_moe))

    def take(self, index: Any) -> _StageParams:
        """The fields of 2-D arrays at rows `index` (the planner's runs spread to their rows)."""
        return _StageParams(*(v[index] if np.ndim(v) == 2 else v for v in self))


def _zero_held(train: TrainSpec, params: _StageParams, *, tp: Any, ep: Any, etp: Any, dp: Any,
               cp: Any, zero: Any, zero_group: Any, generation: str) -> dict[str, Any]:
    """The bytes of a stage that depend on the ZeRO stage and group (`stage_memory`): weights,
    grads and optimizer on the GPU and on the host (`offload_state`), the FP8 weight copies
    (ZeRO-3's FSDP casts) and ZeRO-3's gather workspace."""
    state = train_state_bytes(train)
    zero_n = np.where(zero_group > 0, zero_group, dp * cp)
    w, g, o = zero_state_bytes(params.dense, zero_n, zero, state)
    expert_tp = expert_tp_degree(etp, tp)
    we, ge, oe = zero_state_bytes(params.expert,
                                  np.maximum(zero_n * tp // (expert_tp * ep), 1), zero, state)
    workspace = np.where(zero == 3, 2 * params.layer_most * state.weight, 0.0)
    fp8 = 0.0 * zero
    recipe = train.stack.fp8_recipe(train.fp8) if train.fp8 else None
    if recipe is not None:
        copy = np.where(zero == 3, recipe.weight_copy_bytes(generation, fsdp=True),
                        recipe.weight_copy_bytes(generation))
        fp8 = copy * params.weights_fp8 + params.scaling
    held = offload_state(train.offload, train.offload_fraction, w + we, g + ge, o + oe,
                         state.optimizer)
    return held | {"fp8": fp8, "workspace": workspace}


def _held_activations(model: ModelSpec, train: TrainSpec, geo: StageGeometry,
                      act: dict[str, Any], *, tp: Any, cp: Any, sp: Any, chunks: Any,
                      micro_batch: Any, cp_kind: Any, recompute: Any) -> tuple[Any, Any]:
    """(activations, logits) a stage holds (`stage_memory`): per-layer bytes `act` (with the
    gathered keys and values, `gathered_kv_bytes`) × its layers ÷ chunks × micro-batches in
    flight, the first stage's embedding dropout mask, the last's final-norm input, MTP
    modules and fp32 logits `(1 + mtp)·s·b·V·4/t`."""
    gathered = gathered_kv_bytes(model, train, tp=tp, cp=cp, cp_kind=cp_kind,
                                 recompute=recompute, micro_batch=micro_batch)
    if np.any(gathered):
        act = {kind: saved + gathered for kind, saved in act.items()}
    s, h, ab = train.seq_len, model.d_model, dtype_bytes(train.dtype)
    mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
    in_flight = geo.in_flight
    per_micro_batch = (geo.per_layer_kind(act["dense"], act["moe"]) if model.is_moe
                       else geo.layers * act["dense"]) / chunks
    activations = in_flight * per_micro_batch
    sb = s / cp * micro_batch
    rep = np.where(sp, tp, 1)
    first, last = geo.first, geo.last
    if model.dropout:
        activations = activations + np.where(first, in_flight * sb * h / rep, 0.0)
    # the loss runs right after the last forward except when the schedule makes it wait
    last_in_flight = geo.last_in_flight
    activations = activations + np.where(last, last_in_flight * 2 * sb * h * ab / rep, 0.0)
    logits = np.where(last, (1 + mtp) * last_in_flight * sb * model.vocab * 4 / tp, 0.0)
    if mtp:  # each MTP module: its layer, eh_proj's 2h input, enorm, hnorm, final norm
        mtp_act = (act["moe"] if model.is_moe else act["dense"]) + 5 * sb * h * ab / rep
        activations = activations + np.where(last, mtp * last_in_flight * mtp_act, 0.0)
    return activations, logits


def peak_stage_memory(model: ModelSpec, train: TrainSpec, *, pp: Any, stages: Any = None,
                      **layout: Any) -> dict[str, Any]:
    # `layout`: `stage_memory`'s keyword arguments (the layout's codes, `generation`, …)
    """`stage_memory` of the stage with the largest total, per layout (arrays). Dense models
    peak on the first, the second or the last stage (stage 0 holds the most in flight and the
    embedding, the last the head and the logits; with the balanced uneven default, stage 1
    holds one or two layers more than stage 0 and one micro-batch fewer in flight: Llama 3
    405B PP16 1F1B holds 8·15 layer activations there against 7·16 on stage 0; the same holds
    for the planner's other `Balanced` partitions, no middle stage above stage 1); MoE models
    with `moe_every > 1` or dense first layers are checked stage by stage."""
    best: dict[str, Any] | None = None
    for stage in candidate_stages(model, pp):
        parts = stage_memory(model, train, pp=pp, stage=stage, **layout)
        if best is None:
            best = parts
        else:
            take = parts["total"] > best["total"]
            best = {k: np.where(take, parts[k], best[k]) for k in best}
    assert best is not None
    return best


def peak_stage_total(model: ModelSpec, train: TrainSpec, *, pp: Any, **layout: Any) -> Any:
    """The largest `stage_memory` total over `candidate_stages`, per layout (arrays): what
    the planner ranks and prunes by, without `peak_stage_memory`'s per-part selection; only
    the stages of distinct composition are evaluated (`distinct_stages`, exact), their
    geometry once per distinct row (`distinct_geometries`)."""
    geos = distinct_geometries(model, pp, candidate_stages(model, pp), chunks=layout["chunks"],
                               schedule=layout["schedule"], m=layout["m"],
                               partition=layout.get("partition", ()))
    return np.max([stage_memory(model, train, pp=pp, stage=geo.stage, geometry=geo,
                                **layout)["total"] for geo in geos], axis=0)


def peak_stage_total_runs(model: ModelSpec, train: TrainSpec, *, first: Any, run: Any,
                          act: dict[str, Any], geometries: list[StageGeometry], zero: Any,
                          zero_group: Any, **layout: Any) -> Any:
    """`peak_stage_total` of rows × columns (the planner's grid) whose rows fall into runs
    that differ only in the ZeRO stage and group (`first`: one row of each run, `run`: each
    row's run), bit-identical and cheaper: `layout`'s fields are the runs' `(runs, 1)`, `sp`
    and `recompute` `(1, cols)`, `zero` and `zero_group` the rows' `(rows, 1)`; all but the
    ZeRO-dependent bytes (`_zero_held`) are evaluated once per run (`act`: the per-layer bytes
    of the runs × columns), those once per distinct row; the sum adds the same numbers in
    `stage_memory`'s order. `geometries`: the runs' `distinct_geometries` (fields
    `(runs, 1)`; `plan.evaluate.RunGeometries`)."""
    cols = np.shape(layout["sp"])[1]
    params = [_StageParams.of(model, train, geo, layout["tp"], layout["ep"], layout["etp"])
              for geo in geometries]
    # rows whose `_zero_held` inputs are equal on every stage: evaluated once, gathered (the
    # same bits)
    need, of_row = _same_state_rows(
        [*(field for stage in params for field in stage),
         *(layout[k] for k in ("tp", "ep", "etp", "dp", "cp"))], [zero, zero_group], first, run)
    at = run[need]  # (need,): the run of each row evaluated
    row = {k: layout[k][at] if np.ndim(layout[k]) == 2 else layout[k]
           for k in ("tp", "ep", "etp", "dp", "cp")} | {
        "zero": zero[need], "zero_group": zero_group[need],
        "generation": layout.get("generation", "hopper")}
    best = None
    for geo, stage in zip(geometries, params, strict=True):
        activations, logits = _held_activations(
            model, train, geo, act, **{k: layout[k] for k in (
                "tp", "cp", "sp", "chunks", "micro_batch", "cp_kind", "recompute")})
        held = _zero_held(train, stage.take(at), **row)
        held_row = (held["weights"] + held["grads"] + held["optimizer"] + held["fp8"]
                    + held["workspace"])  # (need, 1)
        # (rows, cols): per row its run's activations and logits, plus what it holds (`take`
        # of whole rows: several times numpy's fancy indexing of few columns)
        total = np.ascontiguousarray(np.broadcast_to(activations + logits, (len(first), cols))
                                     ).take(run, axis=0)
        np.add(total, held_row.take(of_row, axis=0), out=total)  # (rows, 1) broadcast
        best = total if best is None else np.maximum(best, total, out=best)
    return best


def _same_state_rows(per_run: list[Any], per_row: list[Any], first: np.ndarray,
                     run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows to evaluate, each row's index among them) where a row takes the bytes of a row
    with equal inputs: runs equal in every `per_run` value (numbers or `(runs, 1)` arrays)
    and in length (`rows.equal_rows`) list their ZeRO variants in one order, so a row of one
    reads the row at its offset in the other, where its `per_row` values (`(rows, 1)`) are
    the same."""
    rows, runs = len(run), len(first)
    length = np.diff(np.append(first, rows))
    columns = [np.broadcast_to(np.ravel(v), (runs,)) for v in per_run] + [length]
    one, group = equal_rows(columns)
    mapped = first[one[group]][run] + (np.arange(rows) - first[run])
    for value in per_row:
        value = np.asarray(value).reshape(-1)
        mapped = np.where(value[mapped] == value, mapped, np.arange(rows))
    present = np.zeros(rows, dtype=bool)
    present[mapped] = True
    return np.flatnonzero(present), (np.cumsum(present) - 1)[mapped]


def training_memory_per_gpu(model: ModelSpec, layout: Layout, train: TrainSpec | None = None,
                            *, formula: str = "generalised", generation: str = "hopper"
                            ) -> list[MemoryBreakdown]:
    """Per-GPU memory of every pipeline stage for `layout` training `model` (SPEC §4): see
    `stage_memory`, which this evaluates for each stage of one layout (`generation`: the
    accelerator's, for an FP8 recipe's weight copies)."""
    check_specs(model=model, layout=layout, train=train, optional=("train",))
    train = (train or TrainSpec()).validate()
    layout.validate(model, train=train)
    codes = layout.codes() | {"m": layout.microbatches(train), "partition": layout.partition}
    stages = []
    for stage in range(layout.pp):
        parts = stage_memory(model, train, **codes, stage=stage, formula=formula,
                             generation=generation)
        stages.append(MemoryBreakdown(
            stage, len(stage_layers(model, layout, stage)), float(parts["weights"]),
            float(parts["grads"]), float(parts["optimizer"]), float(parts["activations"]),
            float(parts["logits"]), float(parts["workspace"]), int(parts["in_flight"]),
            tuple((name, float(parts[name])) for name in TRANSIENTS),
            fp8=float(parts["fp8"]), host=float(parts["host"])))
    return stages


def largest_stage_memory(model: ModelSpec, layout: Layout, train: TrainSpec | None = None,
                         **kwargs: str) -> MemoryBreakdown:
    """The stage with the largest total: what must fit in one GPU."""
    return max(training_memory_per_gpu(model, layout, train, **kwargs), key=lambda m: m.total)

