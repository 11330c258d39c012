"""Training memory: persistent state (SPEC §2), activations (§3) and the per-GPU total (§4).

All functions return bytes. Per-GPU memory = model-parallel shard of the parameters
(÷ tp·pp, experts also ÷ ep) × bytes per parameter, each state class divided by the ZeRO degree
according to the stage, plus the activations of the micro-batches in flight on the stage, the
fp32 logits on the last stage and ZeRO-3's gather buffers. What a layer saves depends on whose
code trains it: `TrainSpec.impl` names an implementation profile (`estimate.profiles`;
"shardwise" is SPEC §3's count). Each stage also lists its transient buffers and the peak they
make (`MemoryBreakdown.peak`, `peak_term`).

One model, array-generic: the functions below take the layout's degrees as Python numbers or as
NumPy arrays of many layouts (the planner evaluates millions at once through `stage_memory` and
`peak_stage_memory`; `training_memory_per_gpu` calls the same code with one layout's numbers).
Layout-valued arguments use `Layout`'s field names, with `schedule` and `recompute` as integer
codes (`Layout.codes()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec, count_params
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import dp_step_comm_bytes
from shardwise.estimate.offload import offload_state
from shardwise.estimate.profiles import fused_attention, layer_bytes, saved_tensors
from shardwise.fp8 import Fp8Recipe
from shardwise.layout import (
    CP_KINDS,
    RECOMPUTE,
    Layout,
    Partition,
    TrainSpec,
    check_specs,
    chunk_span,
    stage_totals,
    ulysses_degree,
)
from shardwise.placement import expert_tp_degree
from shardwise.schedules.actions import Placement
from shardwise.schedules.registry import get_schedule, select
from shardwise.units import dtype_bytes

__all__ = [
    "ACTIVATION_FORMULAS",
    "MemoryBreakdown",
    "StateBytes",
    "activation_bytes_per_layer",
    "bytes_per_param_training",
    "candidate_stages",
    "count_params",
    "fp8_linear_params",
    "gathered_kv_bytes",
    "in_flight_per_stage",
    "korthikanti_activation_bytes",
    "kv_cache_bytes_per_token",
    "largest_stage_memory",
    "layer_params",
    "moe_layers_on_stage",
    "peak_stage_memory",
    "peak_stage_total",
    "placement_of",
    "saved_tensors_per_layer",
    "stage_layer_count",
    "stage_layers",
    "stage_memory",
    "stage_param_counts",
    "stage_params",
    "training_memory_bytes",
    "training_memory_per_gpu",
    "zero_memory_per_device",
    "zero_stage_table",
    "zero_state_bytes",
]

# Optimizer moment bytes per parameter: Adam m and v in fp32; SGD momentum one fp32 buffer;
# bitsandbytes 8-bit Adam two int8 moments (Dettmers et al. 2022); Adafactor's factored
# second moment is O(rows + cols) per matrix, ~0.5 B/param as an order of magnitude.
ACTIVATION_FORMULAS = ("generalised", "korthikanti")  # `activation_bytes_per_layer(formula=…)`
MOMENT_BYTES = {"adam": 8.0, "sgd-momentum": 4.0, "sgd": 0.0, "adam-8bit": 2.0,
                "adafactor": 0.5}


def _plain(value: Any) -> Any:
    """A Python float for one layout (JSON, exact comparisons), the array for many."""
    return value if np.ndim(value) else float(value)


# ---------------------------------------------------------------------------------- §2 state
@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each persistent state class."""

    weight: float
    grad: float
    master: float
    moments: float

    @property
    def optimizer(self) -> float:
        """Master weights + moments: what ZeRO-1 shards."""
        return self.master + self.moments

    @property
    def total(self) -> float:
        return self.weight + self.grad + self.optimizer


def bytes_per_param_training(dtype: str = "bf16", grad_dtype: str | None = None,
                             optimizer: str = "adam") -> StateBytes:
    """Weight + gradient + fp32 master (when weights are not fp32) + optimizer moments.

    bf16 weights and grads with Adam: `2 + 2 + 4 + 4 + 4 = 16` B/param (Rajbhandari et al.
    2020); Megatron's fp32 gradient accumulation makes it 18; 8-bit moments make it 10.
    Moments are kept in at least fp32: weights wider than fp32 (fp64) keep Adam's and
    momentum's buffers in their own dtype, as torch's optimizers do (fp64 Adam: 8+8+0+16).
    """
    if optimizer not in MOMENT_BYTES:
        raise ShardwiseError(f"optimizer {optimizer!r} unknown; valid: {', '.join(MOMENT_BYTES)}")
    weight = dtype_bytes(dtype)
    grad = dtype_bytes(grad_dtype or dtype)
    master = 0.0 if weight >= 4 else 4.0
    moments = MOMENT_BYTES[optimizer]
    if optimizer in ("adam", "sgd-momentum") and weight > 4:
        moments *= weight / 4  # one (momentum) or two (Adam) buffers of the weight dtype
    return StateBytes(weight, grad, master, moments)


def training_memory_bytes(n_params: float, state: StateBytes | None = None) -> dict[str, float]:
    """Unsharded training state: weights, grads, optimizer (master + moments), total."""
    state = state or bytes_per_param_training()
    parts = {"weights": n_params * state.weight, "grads": n_params * state.grad,
             "optimizer": n_params * state.optimizer}
    return parts | {"total": sum(parts.values())}


def zero_state_bytes(n_params: Any, n: Any, stage: Any,
                     state: StateBytes | None = None) -> tuple[Any, Any, Any]:
    """(weights, grads, optimizer) bytes per device under ZeRO over `n` ranks (numbers or
    arrays).

    stage 0: nothing sharded (`16P`); 1: optimizer sharded (`4P + 12P/N`);
    2: + gradients (`2P + 14P/N`); 3: + weights (`16P/N`) — Rajbhandari et al. 2020, Fig. 1.
    """
    if np.ndim(stage) == 0 and stage not in (0, 1, 2, 3):
        raise ShardwiseError(f"zero stage must be 0, 1, 2 or 3, got {stage}")
    if np.ndim(n) == 0 and n < 1:
        raise ShardwiseError(f"ZeRO needs ≥ 1 rank, got {n}")
    state = state or bytes_per_param_training()
    p = n_params
    return (
        _plain(p * state.weight / np.where(stage >= 3, n, 1)),
        _plain(p * state.grad / np.where(stage >= 2, n, 1)),
        _plain(p * state.optimizer / np.where(stage >= 1, n, 1)),
    )


def zero_memory_per_device(n_params: float, n: int, stage: int,
                           state: StateBytes | None = None) -> float:
    """Total persistent bytes per device under ZeRO `stage` over `n` ranks."""
    return sum(zero_state_bytes(n_params, n, stage, state))


@dataclass(frozen=True)
class ZeroRow:
    stage: int
    sharded: str
    bytes_per_device: float
    comm_bytes_per_step: float


def zero_stage_table(n_params: float, n: int, state: StateBytes | None = None) -> list[ZeroRow]:
    """SPEC §2's table for a model: per-device bytes and per-rank traffic for stages 0..3."""
    state = state or bytes_per_param_training()
    sharded = ("nothing", "optimizer states", "+ gradients", "+ weights")
    return [
        ZeroRow(stage, sharded[stage], zero_memory_per_device(n_params, n, stage, state),
                dp_step_comm_bytes(n_params, n, stage, state.grad, state.weight))
        for stage in range(4)
    ]


def kv_cache_bytes_per_token(model: ModelSpec, dtype: str = "bf16") -> float:
    """Inference KV cache per token: `L · (a_kv·d + a_kv·d_v) · bytes` (`2·L·a_kv·d·bytes` for
    standard attention); MLA caches its kv latent and RoPE key only, `L · (r_kv + d_R) ·
    bytes` (DeepSeek-V2, arXiv:2405.04434 §2.1.3 and Table 1: `(d_c + d_h^R)·l` elements)."""
    width = (model.kv_lora_rank + model.qk_rope_head_dim if model.is_mla
             else model.kv_dim + model.v_dim)
    return model.n_layers * width * dtype_bytes(dtype)


# ----------------------------------------------------------------------------- §3 activations
def korthikanti_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int,
                                 tp: int = 1, sp: bool = False, recompute: str = "none",
                                 flash: bool = False) -> float:
    """Korthikanti et al. 2022 (16-bit activations, MHA, GELU MLP f=4h, dropout), one layer:

        no parallelism      s·b·h·(34 + 5·a·s/h)
        tensor parallel     s·b·h·(10 + 24/t + 5·a·s/(h·t))
        + sequence parallel s·b·h·(34/t + 5·a·s/(h·t))
        selective recompute or FlashAttention drop the `5·a·s/h` term;
        full recompute keeps the layer input, `2·s·b·h` (÷t with SP).
    """
    sbh = seq_len * micro_batch * hidden
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    scores = 0.0 if (flash or recompute == "selective") else 5 * heads * seq_len / hidden / tp
    if sp:
        return sbh * (34 / tp + scores)
    return sbh * (10 + 24 / tp + scores)


def saved_tensors_per_layer(model: ModelSpec, seq_len: int, micro_batch: Any, *, tp: Any = 1,
                            sp: Any = False, cp: Any = 1, flash: bool = False,
                            selective: Any = False, dtype_bytes_: float = 2,
                            moe: bool = False, impl: str = "shardwise", etp: Any = 0,
                            a2a: Any = 1
                            ) -> dict[str, Any]:
    """The generalised count: every tensor one layer saves for backward, in bytes per rank.

    Walks the layer as Korthikanti et al. do, for the actual architecture: GQA widths for K and
    V, gated (SwiGLU: gate, up and their product) or plain MLP with the real `f`, RMSNorm (one
    statistic per row) or LayerNorm (two), dropout masks only with dropout, attention scores
    (softmax output, plus mask and dropout output with dropout) only without FlashAttention or
    selective recompute, FlashAttention's log-sum-exp (not with selective recompute, which
    re-runs the whole attention core in backward). MoE layers save the router's
    probabilities and, per routed copy, the expert input, hidden and output. Statistics,
    log-sum-exp and router probabilities are kept in at least fp32.

    Replicated tensors (norm inputs, the inputs of QKV and of the MLP, dropout masks) are ÷t
    only with sequence parallelism; head- or f-sharded ones are always ÷t. K and V hold
    `max(a_kv/t, 1)` heads per rank. Everything is ÷c under context parallelism; with
    Ulysses (`a2a` > 1, the all-to-all degree) a fused kernel's output is kept twice, head- and
    sequence-sharded (docs/concepts/context-parallel.md). With MHA, GELU, f = 4h, LayerNorm, dropout and 2-byte activations the non-statistic items
    sum to Korthikanti's `s·b·h·(34 + 5·a·s/h)`.

    `impl` names the implementation profile (`estimate.profiles`): "shardwise" (the default)
    is this count, what shardwise's runtime saves; "hf-sdpa", "megatron-te"… list what that
    code keeps for the same layer.
    """
    return saved_tensors(impl, model, seq_len, micro_batch, tp=tp, sp=sp, cp=cp, flash=flash,
                         selective=selective, dtype_bytes_=dtype_bytes_, moe=moe, etp=etp,
                         a2a=a2a)


def activation_bytes_per_layer(model: ModelSpec, seq_len: int, micro_batch: Any = 1, *,
                               tp: Any = 1, sp: Any = False, cp: Any = 1,
                               recompute: Any = "none", flash: bool = False,
                               dtype: str = "bf16", formula: str = "generalised",
                               moe: bool | None = None, impl: str = "shardwise",
                               etp: Any = 0, a2a: Any = 1, fp8_inputs: float = 0.0) -> Any:
    """Bytes one layer keeps for backward per micro-batch, per rank.

    `formula="korthikanti"`: the paper's closed form (see `korthikanti_activation_bytes`, which
    assumes MHA, GELU f=4h, dropout, 2-byte activations); `"generalised"`: the sum of the
    saved tensors of implementation profile `impl` (`estimate.profiles`; "shardwise", the
    default, is `saved_tensors_per_layer`, SPEC §3). Full recompute keeps only the layer
    input `s·b·h·bytes` (÷t with SP). Context parallelism divides by `c` (Ulysses, `a2a` > 1:
    the attention output twice, `saved_tensors_per_layer`). `fp8_inputs`: the bytes per
    element of the linear inputs an FP8 recipe saves (`fp8.Fp8Recipe.saved_input_bytes`; 0:
    bf16).

    `tp`, `cp`, `micro_batch`, `sp`, `a2a` and `recompute` may be NumPy arrays (`recompute`
    then holds codes: 0 none, 1 selective, 2 full, 3 op-sac) for the planner's vectorised
    evaluation.
    """
    if isinstance(recompute, str) and recompute not in RECOMPUTE:
        raise ShardwiseError(f"recompute must be one of {', '.join(RECOMPUTE)}; got "
                             f"{recompute!r}")
    rc = RECOMPUTE.index(recompute) if isinstance(recompute, str) else recompute
    selective, full = rc == RECOMPUTE.index("selective"), rc == RECOMPUTE.index("full")
    op_sac = rc == RECOMPUTE.index("op-sac")
    if formula == "korthikanti":  # one layout (a closed form for MHA/GELU models)
        name = recompute if isinstance(recompute, str) else RECOMPUTE[int(recompute)]
        return korthikanti_activation_bytes(seq_len, micro_batch, model.d_model, model.n_heads,
                                            tp, bool(sp), name, flash) / cp
    if formula != "generalised":
        raise ShardwiseError(f"formula must be 'generalised' or 'korthikanti', got {formula!r}")
    return layer_bytes(impl, model, seq_len, micro_batch, tp=tp, sp=sp, cp=cp, flash=flash,
                       selective=selective, full=full, op_sac=op_sac,
                       dtype_bytes_=dtype_bytes(dtype),
                       moe=model.is_moe if moe is None else moe, etp=etp, a2a=a2a,
                       fp8_inputs=fp8_inputs)


# ------------------------------------------------------------------------------ §4 per GPU
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
        return self.state + self.fp8 + self.activations + self.logits + self.workspace

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


def stage_layers(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """Layer indices held by `stage`: chunk c holds virtual stage `c·p + stage`; an uneven
    partition (`Layout.stage_partition`) holds a contiguous run."""
    out: list[int] = []
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


def gathered_kv_bytes(model: ModelSpec, train: TrainSpec, *, tp: Any, cp: Any, cp_kind: Any,
                      recompute: Any, micro_batch: Any) -> Any:
    """What all-gathered context parallelism (`cp_kind` "allgather") adds to one layer's saved
    bytes where the stack keeps the gathered K/V (`Stack.cp_gather_kept`: torchtitan's
    FlexAttention saves `cplib::flex_cp_allgather`'s outputs): the whole sequence's K and V
    instead of the rank's share, `(c-1)·(s/c)·b·kv_heads/t·(d_k + d_v)` more — without
    recompute; op-sac and full recompute gather them again in backward (the SAC policy saves
    no all-gather). Codes as `stage_memory`'s."""
    if not train.stack.cp_gather_kept:
        return 0.0
    kv = np.maximum(model.n_kv_heads // tp, 1) * (model.head_dim + model.value_head_dim)
    on = (np.asarray(cp_kind) == CP_KINDS.index("allgather")) & (np.asarray(recompute) == 0)
    return np.where(on, (cp - 1) * train.seq_len / cp * micro_batch * kv
                    * dtype_bytes(train.dtype), 0.0)


def placement_of(schedule: Any, partition: Partition) -> Placement:
    """The placement ("loop" or "v") that lays out one layout's explicit `partition` (its
    `schedule` code); "loop" for arrays of layouts, whose partitions are never explicit."""
    if isinstance(partition, tuple) and partition and np.ndim(schedule) == 0:
        return get_schedule(int(schedule)).placement
    return "loop"


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
                     + model.qkv_bias * (q / tp + 2 * kv) + model.out_bias * h)  # biases
    dense_layer = attention + model.mlp_params() / tp
    moe_layer = (attention + model.router_params()
                 + model.n_shared_experts * model.mlp_params(model.expert_d_ff) / tp)
    expert_layer = (model.n_experts / ep * model.mlp_params(model.expert_d_ff) / etp
                    if model.is_moe else 0 * tp)
    return dense_layer, moe_layer, expert_layer


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
                       last: Any = None, placement: Placement = "loop"
                       ) -> tuple[Any, Any]:
    """(dense, expert) parameters one rank of pipeline `stage` holds (SPEC §4): its layers
    (`layer_params`); the first stage adds the vocabulary-parallel embedding `V·h/t`, the
    stage `last` holding the head (default `pp-1`; 0 in the V of ZBV and DualPipeV,
    `ScheduleInfo.last_stage`) the final norm and the head `V·h/t` (a tied head is a second
    copy when that is not stage 0)."""
    h = model.d_model
    last = pp - 1 if last is None else last
    dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
    layers = stage_layer_count(model, pp, chunks, stage, partition, placement)
    moe_layers = moe_layers_on_stage(model, pp, chunks, stage, partition, placement)
    dense = (layers - moe_layers) * dense_layer + moe_layers * moe_layer
    dense = dense + np.where(stage == 0, model.vocab * h / tp + model.learned_positions * h, 0.0)
    head = np.where(np.logical_or(not model.tie_embeddings, last != 0), model.vocab * h / tp, 0.0)
    dense = dense + np.where(stage == last, model.norm_params() + head, 0.0)
    return dense, moe_layers * expert_layer


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> tuple[float, float]:
    """`stage_param_counts` of one layout: (dense, expert) parameters on one rank of `stage`."""
    dense, expert = stage_param_counts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep,
                                       chunks=layout.chunks, stage=stage,
                                       partition=layout.partition, etp=layout.etp,
                                       last=get_schedule(layout.schedule).last_stage(layout.pp),
                                       placement=layout.placement)
    return float(dense), float(expert)


def stage_memory(model: ModelSpec, train: TrainSpec, *, tp: Any, pp: Any, cp: Any, ep: Any,
                 dp: Any, zero: Any, zero_group: Any, sp: Any, schedule: Any, chunks: Any,
                 recompute: Any, micro_batch: Any, m: Any, stage: Any,
                 act: dict[str, Any] | None = None, formula: str = "generalised",
                 partition: Partition = (), etp: Any = 0, cp_kind: Any = 0, ulysses: Any = 0,
                 generation: str = "hopper"
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
    layouts' `cp_kind` and `ulysses`: `layout.ulysses_degree`).

    With an FP8 recipe (`TrainSpec.fp8`, `shardwise.fp8`) the state classes are bf16 mixed
    precision's; `fp8` adds the held FP8 weight copies (`Fp8Recipe.weight_copy_bytes` on the
    accelerator `generation`, e.g. "hopper": with transposes) of the stage's FP8 linear
    layers (`fp8_linear_params`; the LM head when the recipe quantises it) and their scaling
    state; the linear inputs are saved at the recipe's width (`fp8_inputs` of
    `activation_bytes_per_layer`). With host offload (`TrainSpec.offload`) the offloaded
    state leaves the GPU for `host` (`estimate.offload.offload_state`).
    """
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    recipe = train.stack.fp8_recipe(train.fp8) if train.fp8 else None
    ab = dtype_bytes(train.dtype)
    s, h = train.seq_len, model.d_model
    if act is None:
        def per_layer(moe: bool) -> Any:
            return activation_bytes_per_layer(
                model, s, micro_batch, tp=tp, sp=sp, cp=cp, recompute=recompute,
                flash=train.flash_attention, dtype=train.dtype, formula=formula, moe=moe,
                impl=train.profile, etp=etp, a2a=ulysses_degree(cp, cp_kind, ulysses),
                fp8_inputs=recipe.saved_input_bytes() if recipe else 0.0)
        act = {"dense": per_layer(False), "moe": per_layer(True) if model.is_moe else 0.0}
    gathered = gathered_kv_bytes(model, train, tp=tp, cp=cp, cp_kind=cp_kind,
                                 recompute=recompute, micro_batch=micro_batch)
    if np.any(gathered):
        act = {kind: saved + gathered for kind, saved in act.items()}
    zero_n = np.where(zero_group > 0, zero_group, dp * cp)
    last_stage = select(schedule, lambda info: info.last_stage(pp))  # head, loss, logits
    placement = placement_of(schedule, partition)
    dense_params, expert_params = stage_param_counts(model, tp=tp, pp=pp, ep=ep, chunks=chunks,
                                                     stage=stage, partition=partition,
                                                     etp=etp, last=last_stage,
                                                     placement=placement)
    w, g, o = zero_state_bytes(dense_params, zero_n, zero, state)
    expert_tp = expert_tp_degree(etp, tp)
    we, ge, oe = zero_state_bytes(expert_params,
                                  np.maximum(zero_n * tp // (expert_tp * ep), 1), zero, state)
    layers = stage_layer_count(model, pp, chunks, stage, partition, placement)
    moe_layers = moe_layers_on_stage(model, pp, chunks, stage, partition, placement)
    in_flight = _in_flight(schedule, pp, m, chunks, stage)
    per_micro_batch = (((layers - moe_layers) * act["dense"] + moe_layers * act["moe"])
                       if model.is_moe else layers * act["dense"]) / chunks
    activations = in_flight * per_micro_batch
    sb = s / cp * micro_batch
    rep = np.where(sp, tp, 1)
    first, last = stage == 0, stage == last_stage
    if model.dropout:
        activations = activations + np.where(first, in_flight * sb * h / rep, 0.0)
    # the loss runs right after the last forward except when the schedule makes it wait
    last_in_flight = select(schedule, lambda info: m if info.loss_waits else 1)
    activations = activations + np.where(last, last_in_flight * 2 * sb * h * ab / rep, 0.0)
    logits = np.where(last, last_in_flight * sb * model.vocab * 4 / tp, 0.0)
    dense_layer, moe_layer, expert_layer = layer_params(model, tp, ep, etp)
    workspace = np.where(zero == 3, 2 * np.maximum(dense_layer, moe_layer + expert_layer)
                         * state.weight, 0.0)
    fp8 = 0.0 * zero
    if recipe is not None:
        lin_dense, lin_moe, gemm_dense, gemm_moe = fp8_linear_params(model, recipe, tp, ep, etp)
        weights_fp8 = (layers - moe_layers) * lin_dense + moe_layers * lin_moe
        if recipe.head_fp8:
            weights_fp8 = weights_fp8 + np.where(last, model.vocab * h / tp, 0.0)
        copy = np.where(zero == 3, recipe.weight_copy_bytes(generation, fsdp=True),
                        recipe.weight_copy_bytes(generation))
        fp8 = (copy * weights_fp8 + recipe.scaling_state_bytes()
               * ((layers - moe_layers) * gemm_dense + moe_layers * gemm_moe))
    held = offload_state(train.offload, train.offload_fraction, w + we, g + ge, o + oe,
                         state.optimizer)
    parts = {"weights": held["weights"], "grads": held["grads"],
             "optimizer": held["optimizer"], "fp8": fp8, "activations": activations,
             "logits": logits, "workspace": workspace, "host": held["host"]}
    parts["total"] = (parts["weights"] + parts["grads"] + parts["optimizer"] + fp8
                      + activations + logits + workspace)
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


def candidate_stages(model: ModelSpec, pp: Any) -> list[Any]:
    """The pipeline stages that can hold the most (`peak_stage_memory`'s reasoning): the
    first, the second and the last (arrays of stage indices for arrays of `pp`), or every stage
    of an MoE model with `moe_every > 1` or dense first layers."""
    if model.is_moe and (model.moe_every > 1 or model.first_dense_layers):
        return [np.minimum(i, pp - 1) for i in range(int(np.max(pp)))]
    return [0 * pp, np.minimum(1, pp - 1), pp - 1]


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
    the planner ranks and prunes by, without `peak_stage_memory`'s per-part selection."""
    return np.max([stage_memory(model, train, pp=pp, stage=stage, **layout)["total"]
                   for stage in candidate_stages(model, pp)], axis=0)


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
