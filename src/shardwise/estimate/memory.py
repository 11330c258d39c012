"""Training memory: persistent state (SPEC §2), activations (§3) and the per-GPU total (§4).

All functions return bytes. Per-GPU memory = model-parallel shard of the parameters
(÷ tp·pp, experts also ÷ ep) × bytes per parameter, each state class divided by the ZeRO degree
according to the stage, plus the activations of the micro-batches in flight on the stage, the
fp32 logits on the last stage and ZeRO-3's gather buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise import validate
from shardwise.arch import ModelSpec, count_params
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import dp_step_comm_bytes
from shardwise.layout import Layout, TrainSpec
from shardwise.units import dtype_bytes

__all__ = [
    "MemoryBreakdown",
    "StateBytes",
    "activation_bytes_per_layer",
    "bytes_per_param_training",
    "count_params",
    "in_flight_per_stage",
    "korthikanti_activation_bytes",
    "kv_cache_bytes_per_token",
    "peak_memory_per_gpu",
    "saved_tensors_per_layer",
    "stage_layers",
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
MOMENT_BYTES = {"adam": 8.0, "sgd-momentum": 4.0, "sgd": 0.0, "adam-8bit": 2.0,
                "adafactor": 0.5}


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


def zero_state_bytes(n_params: float, n: int, stage: int,
                     state: StateBytes | None = None) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per device under ZeRO over `n` ranks.

    stage 0: nothing sharded (`16P`); 1: optimizer sharded (`4P + 12P/N`);
    2: + gradients (`2P + 14P/N`); 3: + weights (`16P/N`) — Rajbhandari et al. 2020, Fig. 1.
    """
    if stage not in (0, 1, 2, 3):
        raise ShardwiseError(f"zero stage must be 0, 1, 2 or 3, got {stage}")
    if n < 1:
        raise ShardwiseError(f"ZeRO needs ≥ 1 rank, got {n}")
    state = state or bytes_per_param_training()
    p = n_params
    return (
        p * state.weight / (n if stage >= 3 else 1),
        p * state.grad / (n if stage >= 2 else 1),
        p * state.optimizer / (n if stage >= 1 else 1),
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
    """Inference KV cache: `2 · L · a_kv · d · bytes` per token."""
    return 2 * model.n_layers * model.kv_dim * dtype_bytes(dtype)


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


def saved_tensors_per_layer(model: ModelSpec, seq_len: int, micro_batch: int, *, tp: int = 1,
                            sp: bool = False, cp: int = 1, flash: bool = False,
                            selective: bool = False, dtype_bytes_: float = 2,
                            moe: bool = False) -> dict[str, float]:
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
    `max(a_kv/t, 1)` heads per rank. Everything is ÷c under context parallelism.
    With MHA, GELU, f = 4h, LayerNorm, dropout and 2-byte activations the non-statistic items
    sum to Korthikanti's `s·b·h·(34 + 5·a·s/h)`.
    """
    ab = dtype_bytes_
    s, b, h = seq_len / cp, micro_batch, model.d_model
    sb = s * b
    rep = tp if sp else 1  # replicated tensors are split only by sequence parallelism
    kv_heads = max(model.n_kv_heads // tp, 1)
    kv = kv_heads * model.head_dim
    heads = model.n_heads / tp
    fp32 = max(4.0, ab)  # statistics are kept in at least fp32
    stats = fp32 * (1 if model.norm == "rmsnorm" else 2)  # per row: rstd (and mean)
    out = {
        "norm1_input": sb * h * ab / rep,
        "norm1_stats": sb * stats / rep,
        "qkv_input": sb * h * ab / rep,
        "q": sb * h * ab / tp,
        "k": sb * kv * ab,
        "v": sb * kv * ab,
    }
    if not (flash or selective):
        # s/c query rows against all s keys per rank.
        scores = heads * sb * seq_len
        out["softmax_output"] = scores * ab
        if model.dropout:
            out["attention_dropout_mask"] = scores * 1
            out["attention_dropout_output"] = scores * ab
    elif flash and not selective:  # selective recompute re-runs the core, lse included
        out["flash_logsumexp"] = heads * sb * fp32
    out["attention_output"] = sb * h * ab / tp
    if model.dropout:
        out["attention_residual_dropout_mask"] = sb * h / rep
    out["norm2_input"] = sb * h * ab / rep
    out["norm2_stats"] = sb * stats / rep
    out["mlp_input"] = sb * h * ab / rep
    if moe:
        out.update(_moe_saved(model, sb, tp, ab))
    else:
        out.update(_mlp_saved(model, sb, model.d_ff / tp, ab, "mlp"))
    if model.dropout:
        out["mlp_residual_dropout_mask"] = sb * h / rep
    return out


def _mlp_saved(model: ModelSpec, tokens: float, f: float, ab: float, prefix: str
               ) -> dict[str, float]:
    if model.gated_mlp:  # fused SwiGLU saves gate and up; the down projection saves silu(g)·u
        return {f"{prefix}_gate": tokens * f * ab, f"{prefix}_up": tokens * f * ab,
                f"{prefix}_down_input": tokens * f * ab}
    return {f"{prefix}_activation_input": tokens * f * ab,
            f"{prefix}_down_input": tokens * f * ab}


def _moe_saved(model: ModelSpec, tokens: float, tp: int, ab: float) -> dict[str, float]:
    """Router probabilities (fp32) and, per routed copy (top_k per token, balanced routing),
    the expert's input, its hidden activations and its output (kept for the gate product)."""
    h, k = model.d_model, model.top_k
    out = {"router_probs": tokens * model.n_experts * max(4.0, ab),
           "expert_inputs": k * tokens * h * ab}
    out.update(_mlp_saved(model, k * tokens, model.expert_d_ff / tp, ab, "expert"))
    out["expert_outputs"] = k * tokens * h * ab
    if model.n_shared_experts:
        shared = _mlp_saved(model, tokens, model.expert_d_ff / tp, ab, "shared")
        out.update({name: model.n_shared_experts * v for name, v in shared.items()})
    return out


def activation_bytes_per_layer(model: ModelSpec, seq_len: int, micro_batch: int = 1, *,
                               tp: int = 1, sp: bool = False, cp: int = 1,
                               recompute: str = "none", flash: bool = False,
                               dtype: str = "bf16", formula: str = "generalised",
                               moe: bool | None = None) -> float:
    """Bytes one layer keeps for backward per micro-batch, per rank.

    `formula="korthikanti"`: the paper's closed form (see `korthikanti_activation_bytes`, which
    assumes MHA, GELU f=4h, dropout, 2-byte activations); `"generalised"`: the sum of
    `saved_tensors_per_layer` for the actual architecture. Full recompute keeps only the layer
    input `s·b·h·bytes` (÷t with SP). Context parallelism divides by `c`.
    """
    if recompute not in ("none", "selective", "full"):
        raise ShardwiseError(f"recompute must be none, selective or full; got {recompute!r}")
    if formula == "korthikanti":
        return korthikanti_activation_bytes(seq_len, micro_batch, model.d_model, model.n_heads,
                                            tp, sp, recompute, flash) / cp
    if formula != "generalised":
        raise ShardwiseError(f"formula must be 'generalised' or 'korthikanti', got {formula!r}")
    ab = dtype_bytes(dtype)
    if recompute == "full":
        return seq_len / cp * micro_batch * model.d_model * ab / (tp if sp else 1)
    saved = saved_tensors_per_layer(
        model, seq_len, micro_batch, tp=tp, sp=sp, cp=cp, flash=flash,
        selective=recompute == "selective", dtype_bytes_=ab,
        moe=model.is_moe if moe is None else moe,
    )
    return sum(saved.values())


# ------------------------------------------------------------------------------ §4 per GPU
def in_flight_per_stage(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """Peak micro-batches (interleaved: micro-batch-chunks) whose activations a stage holds.

    GPipe holds all `m`; 1F1B and ZB-H1 stage `i` hold `min(p - i, m)` (Narayanan et al. 2021;
    Qi et al. 2023 keep 1F1B's memory); interleaved 1F1B stage `i` holds Megatron's warm-up
    `(p-i-1)·2 + (v-1)·p` chunks plus one, at most `m·v` — stage 0 then holds
    `L·(1 + (p-1)/(p·v))` layers' worth (Korthikanti et al. 2022).
    """
    validate.degree(p, "p (stages)")  # a list of p entries is built: capped
    validate.degree(v, "v (chunks)")
    validate.positive_int(m, "m (micro-batches)")
    if schedule == "gpipe":
        return [m] * p
    if schedule in ("1f1b", "zb-h1"):
        return [min(p - i, m) for i in range(p)]
    if schedule == "interleaved":
        return [min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) for i in range(p)]
    raise ShardwiseError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of one pipeline stage."""

    stage: int
    layers: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float = 0.0
    workspace: float = 0.0
    in_flight: int = 0

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.logits + self.workspace

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits,
                "workspace": self.workspace, "total": self.total}


def stage_layers(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """Layer indices held by `stage`: chunk c holds virtual stage `c·p + stage`."""
    per_chunk = model.n_layers // (layout.pp * layout.chunks)
    return [
        (chunk * layout.pp + stage) * per_chunk + j
        for chunk in range(layout.chunks)
        for j in range(per_chunk)
    ]


def _is_moe_layer(model: ModelSpec, index: int) -> bool:
    return model.is_moe and index % model.moe_every == model.moe_every - 1


def _attention_params_per_rank(model: ModelSpec, tp: int) -> float:
    h = model.d_model
    kv = max(model.n_kv_heads // tp, 1) * model.head_dim
    return 2 * h * h / tp + 2 * h * kv


def _layer_params(model: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    """Per rank: a dense layer, an MoE layer without its experts, one MoE layer's experts."""
    t = layout.tp
    attention = _attention_params_per_rank(model, t) + 2 * model.norm_params()
    dense_layer = attention + model.mlp_params() / t
    moe_layer = (attention + model.router_params()
                 + model.n_shared_experts * model.mlp_params(model.expert_d_ff) / t)
    expert_layer = model.n_experts / layout.ep * model.mlp_params(model.expert_d_ff) / t
    return dense_layer, moe_layer, expert_layer


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of pipeline `stage` holds (SPEC §4): its layers with
    dense weights ÷ tp (norms and router replicated; K, V at `max(a_kv/t, 1)` heads) and
    experts ÷ (tp·ep); the first stage adds the vocabulary-parallel embedding `V·h/t`, the
    last the final norm and the head `V·h/t` (a tied head is a second copy when pp > 1)."""
    t, h = layout.tp, model.d_model
    dense_layer, moe_layer, expert_layer = _layer_params(model, layout)
    layers = stage_layers(model, layout, stage)
    moe_layers = sum(_is_moe_layer(model, i) for i in layers)
    dense = (len(layers) - moe_layers) * dense_layer + moe_layers * moe_layer
    if stage == 0:
        dense += model.vocab * h / t + model.learned_positions * h
    if stage == layout.pp - 1:
        dense += model.norm_params()
        if not model.tie_embeddings or layout.pp > 1:
            dense += model.vocab * h / t
    return dense, moe_layers * expert_layer


def training_memory_per_gpu(model: ModelSpec, layout: Layout, train: TrainSpec | None = None,
                            *, formula: str = "generalised") -> list[MemoryBreakdown]:
    """Per-GPU memory of every pipeline stage for `layout` training `model` (SPEC §4).

    Parameters: dense layers ÷ tp (norms replicated), experts ÷ (tp·ep); the first stage holds
    the embedding (vocab-parallel, ÷tp), the last the head (÷tp; a tied head is a second copy
    when pp > 1) and the final norm. ZeRO divides each state class by `dp·cp` (or the hybrid
    shard group) per stage, expert state by `dp·cp/ep`. Activations: per-layer bytes × layers on
    the stage × micro-batches in flight (`in_flight_per_stage`); the first stage adds the
    embedding's dropout mask (its output is layer 0's saved norm input, counted there), the
    last stage the final norm's input and fp32 logits `s·b·V·4/t` for the loss. ZeRO-3 adds a
    workspace of two gathered layers (the one in use and the prefetched one).
    """
    train = (train or TrainSpec()).validate()
    layout.validate(model, train=train)
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    t, p, c = layout.tp, layout.pp, layout.cp
    ab = dtype_bytes(train.dtype)
    m = layout.microbatches(train)
    in_flight = in_flight_per_stage(layout.schedule, p, m, layout.chunks)
    s, b, h = train.seq_len, layout.micro_batch, model.d_model
    zero_n = layout.zero_degree
    expert_zero_n = max(zero_n // layout.ep, 1)
    flash = train.flash_attention

    def act(moe: bool) -> float:
        return activation_bytes_per_layer(
            model, s, b, tp=t, sp=layout.sp, cp=c, recompute=layout.recompute, flash=flash,
            dtype=train.dtype, formula=formula, moe=moe)

    dense_act, moe_act = act(False), (act(True) if model.is_moe else 0.0)
    dense_layer, moe_layer, expert_layer = _layer_params(model, layout)
    stages = []
    for stage in range(p):
        layers = stage_layers(model, layout, stage)
        moe_layers = sum(_is_moe_layer(model, i) for i in layers)
        dense_params, expert_params = stage_params(model, layout, stage)
        first, last = stage == 0, stage == p - 1
        w, g, o = zero_state_bytes(dense_params, zero_n, layout.zero, state)
        we, ge, oe = zero_state_bytes(expert_params, expert_zero_n, layout.zero, state)
        per_micro_batch = ((len(layers) - moe_layers) * dense_act + moe_layers * moe_act) / (
            layout.chunks)
        activations = in_flight[stage] * per_micro_batch
        sb = s / c * b
        if first and model.dropout:
            activations += in_flight[stage] * sb * h / (t if layout.sp else 1)
        logits = 0.0
        if last:  # the loss runs right after the last forward except under GPipe
            last_in_flight = m if layout.schedule == "gpipe" else 1
            activations += last_in_flight * 2 * sb * h * ab / (t if layout.sp else 1)
            logits = last_in_flight * sb * model.vocab * 4 / t
        workspace = 0.0
        if layout.zero == 3:
            biggest = max(dense_layer, moe_layer + expert_layer)
            workspace = 2 * biggest * state.weight
        stages.append(MemoryBreakdown(stage, len(layers), w + we, g + ge, o + oe, activations,
                                      logits, workspace, in_flight[stage]))
    return stages


def peak_memory_per_gpu(model: ModelSpec, layout: Layout, train: TrainSpec | None = None,
                        **kwargs: str) -> MemoryBreakdown:
    """The stage with the largest total: what must fit in one GPU."""
    return max(training_memory_per_gpu(model, layout, train, **kwargs), key=lambda m: m.total)
