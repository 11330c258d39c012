"""Implementation profiles: what one Transformer layer of a given training code saves for
backward, by component, with their dtype, as read from that code — `shardwise` (SPEC §3's
generalised count, exact against the runtime), `megatron-te` (Megatron-Core 0.16.1 with
Transformer Engine), `torchtitan` (0.3.0), `hf-sdpa` and `hf-eager` (transformers 5.24.0),
MLA layers from Megatron-Core 0.16.1's `MLASelfAttention`. All share SPEC §3's rules for
parallelism and recompute. Plain arithmetic on Python scalars or NumPy arrays (the planner
evaluates millions of layouts at once); torch-free. Each profile, the code it was read from
and what was measured: docs/concepts/profiles.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.placement import expert_tp_degree

__all__ = ["DEFAULT_IMPL", "FP8_SAVED_INPUTS", "PROFILES", "Profile", "by_component", "component",
           "fp8_saved_delta", "fused_attention", "get_profile", "layer_bytes", "op_sac_saved",
           "profile_names", "saved_tensors"]


@dataclass(frozen=True)
class Profile:
    """How one implementation keeps a layer's activations.

    norm: "fused" (input, stats; the output is the next matmul's input), "hf" (fp32 upcast,
    stats, normalised rows in the input dtype, output) or "torch" (fp32 upcast, stats, fp32
    normalised rows, output). attention: "flag" (fused kernel with `flash`, else the
    materialised softmax in the activation dtype), "sdpa" (always fused), "flex" (fused + fp32
    row maxima) or "eager" (fp32 softmax + its cast, K/V repeated to all heads).
    mlp_keeps_activation: the gated MLP's act(gate) is saved apart from the product.
    residual_dropout: hidden dropout masks after attention and MLP (with `model.dropout`).
    routing_per_copy / routing_per_token: what an MoE router keeps besides its probabilities.
    """

    name: str
    title: str
    source: str
    verified: str
    norm: str
    attention: str
    mlp_keeps_activation: bool
    residual_dropout: bool
    routing_per_copy: float = 0.0  # MoE bookkeeping bytes per routed copy (indices, weights)
    routing_per_token: float = 0.0  # … and per token
    # routing weights applied inside the experts' activation (megatron-core 0.16.1
    # moe/experts.py TEGroupedMLP: `weighted_bias_swiglu_impl(fc1_output, bias, permuted_probs)`;
    # the dispatcher's unpermute takes no probs): the fp32 weight per routed copy is saved
    # instead of the expert's output
    probs_in_activation: bool = False

    def validate(self) -> Profile:
        if self.norm not in ("fused", "hf", "torch"):
            raise ShardwiseError(f"profile {self.name}: norm {self.norm!r} unknown")
        if self.attention not in ("flag", "sdpa", "flex", "eager"):
            raise ShardwiseError(f"profile {self.name}: attention {self.attention!r} unknown")
        return self


# transformers 5.24.0 models/mixtral/modeling_mixtral.py (MixtralTopKRouter, MixtralExperts):
# per routed copy four int64 indices (top-k index, the sort permutation and its inverse, the
# index_add target) and two fp32 weights (top-k value, the copy's weight); per token the fp32
# sum that renormalises the top-k weights.
_HF_ROUTING = (4 * 8 + 2 * 4, 4.0)

PROFILES: dict[str, Profile] = {p.name: p.validate() for p in (
    Profile("shardwise", "shardwise runtime (SPEC §3 generalised count)", "shardwise.runtime",
            "exact against the runtime (shardwise check)", "fused", "flag", False, True),
    Profile("megatron-te", "Megatron-Core + Transformer Engine",
            "Megatron-Core 0.16.1 (fused_bias_swiglu), Megatron-LM theoretical_memory_usage.py, "
            "Transformer Engine's layernorm_linear/attention (main branch)",
            "derived from the source, not measured (TE needs CUDA)", "fused", "flag", False, True,
            probs_in_activation=True),
    Profile("torchtitan", "torchtitan Llama 3 (FlexAttention)",
            "torchtitan 0.3.0 models/llama3, torch 2.13",
            "measured on CPU, attention core from the source (no FlexAttention backward on CPU)",
            "torch", "flex", True, False),
    Profile("hf-sdpa", "Hugging Face transformers, SDPA attention",
            "transformers 5.24.0 models/llama/modeling_llama.py",
            "measured on CPU within 1 %", "hf", "sdpa", True, False, *_HF_ROUTING),
    Profile("hf-eager", "Hugging Face transformers, eager attention",
            "transformers 5.24.0 models/llama/modeling_llama.py",
            "measured on CPU within 1 %", "hf", "eager", True, False, *_HF_ROUTING),
)}

# The default is what most large distributed pretraining runs use, and what the planner's
# published reference runs used: Megatron-Core with Transformer Engine (Megatron-LM, NeMo,
# Megatron-DeepSpeed). For dense layers it equals SPEC §3's count. Fine-tuning with Hugging Face
# code keeps more (about +45 % per Llama layer with SDPA, +150 % eager): choose `--impl hf-sdpa`.
DEFAULT_IMPL = "megatron-te"


def profile_names() -> tuple[str, ...]:
    """The implementation profiles' names, in the registry's order."""
    return tuple(PROFILES)


def get_profile(name: str) -> Profile:
    """The implementation profile `name`; a `ShardwiseError` naming the valid ones otherwise."""
    if name not in PROFILES:
        raise ShardwiseError(f"implementation profile {name!r} unknown; valid: "
                             f"{', '.join(PROFILES)}")
    return PROFILES[name]


_COMPONENTS = (  # name prefix → component; first match wins
    ("norm1", "norm"), ("norm2", "norm"), ("qkv_input", "QKV input"),
    ("q_latent", "MLA latents"), ("kv_latent", "MLA latents"), ("q", "q/k/v"),
    ("k", "q/k/v"), ("v", "q/k/v"), ("softmax", "attention internals"),
    ("attention_dropout", "attention internals"), ("flash", "attention internals"),
    ("flex", "attention internals"), ("attention_output", "output projection input"),
    ("mlp_input", "MLP input"), ("mlp", "MLP internals"), ("router", "MoE routing"),
    ("expert", "MoE experts"), ("shared", "MoE experts"),
)


def component(name: str) -> str:
    """The component a saved tensor belongs to: norm, QKV input, MLA latents, q/k/v, attention
    internals, output projection input, MLP input, MLP internals, MoE routing, MoE experts,
    dropout."""
    if "residual_dropout" in name:
        return "dropout"
    for prefix, comp in _COMPONENTS:
        if name == prefix or name.startswith(prefix + "_"):
            return comp
    return "other"


def by_component(saved: dict[str, Any]) -> dict[str, Any]:
    """Sum `saved_tensors`' entries per `component`, in walk order."""
    out: dict[str, Any] = {}
    for name, value in saved.items():
        out[component(name)] = out.get(component(name), 0.0) + value
    return out


# ------------------------------------------------------------------ scalar/array helpers
def _pick(cond: Any, yes: Any, no: Any) -> Any:
    """`yes if cond else no`, elementwise when `cond` is an array."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, yes, no)
    return yes if cond else no


def _at_least_one(x: Any) -> Any:
    return np.maximum(x, 1) if isinstance(x, np.ndarray) else max(x, 1)


def _is_false(flag: Any) -> bool:
    return not isinstance(flag, np.ndarray) and not flag


def _is_true(flag: Any) -> bool:
    return not isinstance(flag, np.ndarray) and bool(flag)


def fused_attention(profile: Profile | str, flash: bool) -> bool:
    """Does this implementation run a fused attention kernel (no materialised scores)?"""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    return prof.attention in ("sdpa", "flex") or (prof.attention == "flag" and flash)


# ---------------------------------------------------------------------------- the walk
def saved_tensors(profile: Profile | str, model: ModelSpec, seq_len: int, micro_batch: Any, *,
                  tp: Any = 1, sp: Any = False, cp: Any = 1, flash: bool = False,
                  selective: Any = False, dtype_bytes_: float = 2, moe: bool = False,
                  etp: Any = 0, a2a: Any = 1, routed_load: float = 1.0) -> dict[str, Any]:
    """Bytes per rank of every tensor one layer saves for backward under `profile`.

    `tp`, `cp`, `micro_batch`, `a2a` may be arrays, `sp` and `selective` boolean arrays (then
    every entry is an array, 0 where it does not apply); with scalars only the tensors that
    exist are listed. For `shardwise` this is SPEC §3's generalised count (see
    `estimate.memory.saved_tensors_per_layer`). `a2a`: the context-parallel all-to-all
    (Ulysses) degree, `Layout.ulysses_degree`; above 1 the attention output is kept twice.
    `routed_load`: the routed copies' factor over balanced routing (`TrainSpec.routed_load`).
    """
    prof = get_profile(profile) if isinstance(profile, str) else profile
    ab = dtype_bytes_
    s, b, h = seq_len / cp, micro_batch, model.d_model
    sb = s * b
    rep = _pick(sp, tp, 1)  # replicated tensors are split only by sequence parallelism
    kv_heads = _at_least_one(model.n_kv_heads // tp)
    kv = kv_heads * model.head_dim
    heads = model.n_heads / tp
    fp32 = max(4.0, ab)  # statistics are kept in at least fp32
    stats = fp32 * (1 if model.norm == "rmsnorm" else 2)  # per row: rstd (and mean)
    out: dict[str, Any] = {}

    def add(name: str, value: Any, when: Any = True) -> None:
        if _is_false(when):
            return
        out[name] = value if _is_true(when) else _pick(when, value, 0.0)

    def norm(prefix: str, output: str, width: Any = h, kept: Any = None) -> None:
        """An RMSNorm/LayerNorm over `width` columns; `kept`: the width of the storage its
        input lives in when the fused norm keeps it (a view of a wider tensor)."""
        upcast = ab if prof.norm == "fused" else fp32
        held = kept if kept is not None and prof.norm == "fused" else width
        add(f"{prefix}_input", sb * held * upcast / rep)
        add(f"{prefix}_stats", sb * stats / rep)
        if prof.norm != "fused":  # the normalised rows the weight multiply keeps
            add(f"{prefix}_normalized", sb * width * (ab if prof.norm == "hf" else fp32) / rep)
        add(output, sb * width * ab / rep)

    norm("norm1", "qkv_input")
    if model.is_mla:
        # the latents leave the down-projections replicated over tp (÷t only with SP) and
        # pass their RMSNorms; W_DKV's output holds the kv latent and the RoPE key, and the
        # fused norm keeps that whole storage (its input is a view of it)
        if model.q_lora_rank:
            norm("q_latent", "q_latent_normed", model.q_lora_rank)
        norm("kv_latent", "kv_latent_normed", model.kv_lora_rank,
             model.kv_lora_rank + model.qk_rope_head_dim)
    not_selective = _pick(selective, False, True)
    fused = fused_attention(prof, flash)
    d_v = model.value_head_dim  # = d but for MLA
    add("q", sb * model.q_dim * ab / tp)  # a·d: h unless the config names head_dim
    if prof.attention == "eager":
        # repeat_kv copies K and V to all heads, unless one K/V head is left (the expand then
        # reshapes as a view); under selective recompute the core's own inputs, before the
        # repeat, are what the checkpoint keeps
        repeated = _pick(kv_heads == 1, kv_heads, heads)
        add("k", _pick(selective, sb * kv * ab, sb * repeated * model.head_dim * ab))
        add("v", _pick(selective, sb * kv_heads * d_v * ab, sb * repeated * d_v * ab))
    else:
        add("k", sb * kv * ab)
        add("v", sb * kv_heads * d_v * ab)
    scores = heads * sb * seq_len  # s/c query rows against all s keys per rank
    if fused:  # selective recompute re-runs the core, log-sum-exp included
        add("flash_logsumexp", heads * sb * fp32, not_selective)
        if prof.attention == "flex":
            add("flex_max_scores", heads * sb * fp32, not_selective)
    elif prof.attention == "eager":
        add("softmax_output", scores * fp32, not_selective)  # softmax(dtype=float32)
        if model.dropout:
            add("attention_dropout_mask", scores * 1, not_selective)
            add("attention_dropout_output", scores * ab, not_selective)
        elif ab != fp32:  # .to(query.dtype) is a copy unless the activations are fp32
            add("softmax_output_cast", scores * ab, not_selective)
    else:
        add("softmax_output", scores * ab, not_selective)
        if model.dropout:
            add("attention_dropout_mask", scores * 1, not_selective)
            add("attention_dropout_output", scores * ab, not_selective)
    add("attention_output", sb * model.n_heads * d_v * ab / tp)
    if fused:  # Ulysses: a fused kernel keeps its head-sharded output (b, s, a/(t·u), d_v),
        # the out-projection the sequence-sharded one the all-to-all returns: the same bytes
        # twice (TE's AttnFuncWithCPAndQKVOA2A saves `out` before its all-to-all); selective
        # recompute keeps neither, a materialised softmax keeps P, not the output
        add("attention_output_heads", sb * model.n_heads * d_v * ab / tp,
            _pick(a2a > 1, not_selective, False))
    if model.dropout and prof.residual_dropout:
        add("attention_residual_dropout_mask", sb * h / rep)
    norm("norm2", "mlp_input")
    if moe:
        out.update(_moe_saved(prof, model, sb, tp, ab, etp, routed_load))
    else:
        out.update(_mlp_saved(prof, model, sb, model.d_ff / tp, ab, "mlp"))
    if model.dropout and prof.residual_dropout:
        add("mlp_residual_dropout_mask", sb * h / rep)
    out.update(_variant_saved(prof, model, sb, tp, rep, ab, fp32, stats))
    return out


def _variant_saved(prof: Profile, model: ModelSpec, sb: Any, tp: Any, rep: Any, ab: float,
                   fp32: float, stats: float) -> dict[str, Any]:
    """What the block variants add (docs/concepts/attention.md): QK-norm keeps its inputs Q
    and K (head-sharded), one fp32 rstd per head row ("head") or per row ("full", OLMo 2) and,
    unfused, the normalised rows; Gemma's two more block norms ("sandwich") keep the same per
    row of h. Gemma's and OLMo 2's RMSNorms multiply the weight in fp32 (transformers 5.24
    Gemma3RMSNorm, Olmo2RMSNorm), so under the "hf" profile every norm of theirs keeps fp32
    normalised rows. Windows and chunks keep nothing more (a fused kernel keeps O and the
    log-sum-exp per query). Measured: tests/test_model_types.py."""
    out: dict[str, Any] = {}
    upcast = ab if prof.norm == "fused" else fp32
    rows = {"fused": 0.0, "hf": ab, "torch": fp32}[prof.norm]
    if prof.norm == "hf" and model.block_norms != "pre":
        rows = fp32
        out["norm_fp32_rows"] = 2 * sb * model.d_model * (fp32 - ab) / rep  # norm1, norm2
    widths = []
    if model.qk_norm in ("head", "full"):
        kv = _at_least_one(model.n_kv_heads // tp) * model.head_dim
        for name, width, heads in (("q_norm", model.q_dim / tp, model.n_heads / tp),
                                   ("k_norm", kv, kv / model.head_dim)):
            out[f"{name}_input"] = sb * width * upcast
            out[f"{name}_stats"] = sb * fp32 * (heads if model.qk_norm == "head" else 1)
            widths.append((name, width))
    if model.block_norms == "sandwich":
        for name in ("post_attention_norm", "post_mlp_norm"):
            out[f"{name}_input"] = sb * model.d_model * upcast / rep
            out[f"{name}_stats"] = sb * stats / rep
            widths.append((name, model.d_model / rep))
    for name, width in widths if rows else ():
        out[f"{name}_normalized"] = sb * width * rows
    return out


def _mlp_saved(prof: Profile, model: ModelSpec, tokens: Any, f: Any, ab: float, prefix: str
               ) -> dict[str, Any]:
    if model.gated_mlp:
        if prof.mlp_keeps_activation:  # down(act(gate(x)) · up(x)), unfused
            return {f"{prefix}_gate": tokens * f * ab,
                    f"{prefix}_activation_output": tokens * f * ab,
                    f"{prefix}_up": tokens * f * ab, f"{prefix}_down_input": tokens * f * ab}
        # fused SwiGLU saves gate and up; the down projection saves silu(g)·u
        return {f"{prefix}_gate": tokens * f * ab, f"{prefix}_up": tokens * f * ab,
                f"{prefix}_down_input": tokens * f * ab}
    return {f"{prefix}_activation_input": tokens * f * ab,
            f"{prefix}_down_input": tokens * f * ab}


def _moe_saved(prof: Profile, model: ModelSpec, tokens: Any, tp: Any, ab: float, etp: Any = 0,
               load: float = 1.0) -> dict[str, Any]:
    """Router probabilities (fp32) and, per routed copy (top_k per token, balanced routing),
    the expert's input, its hidden activations and its output (kept for the gate product; the
    fp32 weight instead where the profile applies it inside the activation).
    With expert tensor parallelism (`etp`, 0 for tp) a rank holds the routed copies of its etp
    group's share of the tp group's tokens, `etp/tp` of them, at `f/etp`; shared experts run
    every token at `f/tp`. `load`: the busiest rank holds `load` times the balanced copies
    (imbalanced routing, or padding to a capacity factor)."""
    h, k = model.d_model, model.top_k
    expert_tp = expert_tp_degree(etp, tp)
    copies = k * tokens * expert_tp / tp * load
    out = {"router_probs": tokens * model.n_experts * max(4.0, ab)}
    if prof.routing_per_copy or prof.routing_per_token:
        out["router_indices_and_weights"] = tokens * (k * prof.routing_per_copy
                                                      + prof.routing_per_token)
    out["expert_inputs"] = copies * h * ab
    out.update(_mlp_saved(prof, model, copies, model.expert_d_ff / expert_tp, ab, "expert"))
    if prof.probs_in_activation:
        out["expert_probs"] = copies * max(4.0, ab)
    else:
        out["expert_outputs"] = copies * h * ab
    if model.n_shared_experts:
        shared = _mlp_saved(prof, model, tokens, model.expert_d_ff / tp, ab, "shared")
        out.update({name: model.n_shared_experts * v for name, v in shared.items()})
    return out


def op_sac_saved(model: ModelSpec, seq_len: int, micro_batch: Any, *, tp: Any = 1,
                 sp: Any = False, cp: Any = 1, dtype_bytes_: float = 2, moe: bool = False
                 ) -> dict[str, Any]:
    """What torchtitan's per-op selective checkpointing keeps of one layer (torchtitan 0.3.0
    distributed/activation_checkpoint.py `SelectiveAC`): the block's input, and the outputs of
    its compute-intensive and reduce-scatter / all-to-all ops except every second matmul —
    with a block's matmuls qkv, wo, w1, w3, w2 (`FusedQKVLinear`, `FeedForward`), the qkv, w1
    and w2 outputs, the attention kernel's output and fp32 log-sum-exp; under sequence
    parallelism also w2's reduce-scatter output. MoE layers: the same rule on the routed
    copies (an approximation: expert GEMMs as w1/w2 of `top_k` tokens each)."""
    ab, fp32 = dtype_bytes_, max(4.0, dtype_bytes_)
    sb, h = seq_len / cp * micro_batch, model.d_model
    rep = _pick(sp, tp, 1)
    kv = _at_least_one(model.n_kv_heads // tp) * model.head_dim
    copies = model.top_k + model.n_shared_experts if moe else 1
    f = (model.expert_d_ff if moe else model.d_ff) / tp
    out = {"block_input": sb * h * ab / rep,
           "qkv_output": sb * (model.q_dim / tp + 2 * kv) * ab,
           "attention_output": sb * model.q_dim / tp * ab,
           "flash_logsumexp": model.n_heads / tp * sb * fp32,
           "mlp_w1_output": copies * sb * f * ab,
           "mlp_w2_output": copies * sb * h * ab}
    if moe:
        out["router_probs"] = sb * model.n_experts * fp32
    out["mlp_reduce_scatter_output"] = _pick(sp, sb * h * ab / rep, 0.0)
    return out


# The saved tensors a Transformer Engine linear layer keeps as its FP8 input copy under an FP8
# recipe (`fp8.Fp8Recipe.saves_fp8_inputs`): the fused-norm outputs of QKV and fc1
# (LayerNormLinear's ln_out), fc2's input, MLA's normed latents (their up-projections'
# ln_out), the experts' grouped-GEMM inputs. An MoE layer's `mlp_input` stays bf16 (its
# router keeps it); MLA's norm output feeds two down-projections, each saving its own copy.
FP8_SAVED_INPUTS = ("qkv_input", "mlp_input", "mlp_down_input", "q_latent_normed",
                    "kv_latent_normed", "expert_inputs", "expert_down_input",
                    "shared_down_input")


def fp8_saved_delta(saved: dict[str, Any], model: ModelSpec, fused: bool, fp8_inputs: float,
                    dtype_bytes_: float, moe: bool) -> Any:
    """Bytes an FP8 recipe that saves linear inputs at `fp8_inputs` bytes per element adds to
    `saved` (negative: saves): each `FP8_SAVED_INPUTS` tensor at `fp8_inputs` instead of
    `dtype_bytes_`; the attention output, which a fused attention kernel keeps in bf16 for
    its own backward, gains the out-projection's FP8 copy beside it."""
    per = fp8_inputs / dtype_bytes_
    delta = 0.0
    for name in FP8_SAVED_INPUTS:
        if name not in saved or (moe and name == "mlp_input"):
            continue
        copies = 2 if (model.is_mla and name == "qkv_input") else 1
        delta = delta + saved[name] * (copies * per - 1)
    if "attention_output" in saved:
        delta = delta + saved["attention_output"] * (per if fused else per - 1)
    return delta


def layer_bytes(profile: Profile | str, model: ModelSpec, seq_len: int, micro_batch: Any, *,
                tp: Any = 1, sp: Any = False, cp: Any = 1, flash: bool = False,
                selective: Any = False, full: Any = False, op_sac: Any = False,
                dtype_bytes_: float = 2, moe: bool = False, etp: Any = 0, a2a: Any = 1,
                fp8_inputs: float = 0.0, routed_load: float = 1.0,
                adjust: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Any:
    """Sum of `saved_tensors`; under full recompute (`full`, scalar or boolean array) the
    layer input only, `s/c·b·h·bytes` (÷t with SP) — every profile checkpoints the layer;
    under per-op SAC (`op_sac`) what `op_sac_saved` keeps. `fp8_inputs` > 0: an FP8 recipe
    keeps the linear inputs at that many bytes per element (`fp8_saved_delta`). `adjust`
    rewrites the saved tensors first (per-module recompute)."""
    saved = saved_tensors(profile, model, seq_len, micro_batch, tp=tp, sp=sp, cp=cp,
                          flash=flash, selective=selective, dtype_bytes_=dtype_bytes_, moe=moe,
                          etp=etp, a2a=a2a, routed_load=routed_load)
    if adjust is not None:  # what per-module recompute frees (`estimate.activations`)
        saved = adjust(saved)
    total = sum(saved.values())
    if fp8_inputs:
        total = total + fp8_saved_delta(saved, model, fused_attention(profile, flash),
                                        fp8_inputs, dtype_bytes_, moe)
    if not _is_false(op_sac):
        sac = sum(op_sac_saved(model, seq_len, micro_batch, tp=tp, sp=sp, cp=cp,
                               dtype_bytes_=dtype_bytes_, moe=moe).values())
        total = _pick(op_sac, sac, total)
    if _is_false(full):
        return total
    kept = seq_len / cp * micro_batch * model.d_model * dtype_bytes_ / _pick(sp, tp, 1)
    return _pick(full, kept, total)

