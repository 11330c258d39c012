"""Activations (SPEC §3): the bytes one layer saves for backward per micro-batch, per rank.

Korthikanti et al. 2022's closed form (`korthikanti_activation_bytes`) and the generalised
count of an implementation profile's saved tensors (`estimate.profiles`), array-generic in the
layout's degrees. Derivation: docs/concepts/memory.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.choices import CP_KINDS, RECOMPUTE
from shardwise.errors import ShardwiseError
from shardwise.estimate.profiles import layer_bytes, saved_tensors
from shardwise.layout import TrainSpec
from shardwise.units import dtype_bytes

ACTIVATION_FORMULAS = ("generalised", "korthikanti")  # `activation_bytes_per_layer(formula=…)`


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
                            a2a: Any = 1, routed_load: float = 1.0
                            ) -> dict[str, Any]:
    """The generalised count: every tensor one layer saves for backward, in bytes per rank.

    Walks the layer as Korthikanti et al. do, for the actual architecture: GQA widths for K and
    V, gated (SwiGLU: gate, up and their product) or plain MLP with the real `f`, RMSNorm (one
    statistic per row) or LayerNorm (two), dropout masks only with dropout, attention scores
    (softmax output, plus mask and dropout output with dropout) only without FlashAttention or
    selective recompute, FlashAttention's log-sum-exp (not with selective recompute, which
    re-runs the whole attention core in backward). MoE layers save the router's
    probabilities and, per routed copy (× `routed_load`), the expert input, hidden and output.
    Statistics, log-sum-exp and router probabilities are kept in at least fp32.

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
                         a2a=a2a, routed_load=routed_load)


def activation_bytes_per_layer(model: ModelSpec, seq_len: int, micro_batch: Any = 1, *,
                               tp: Any = 1, sp: Any = False, cp: Any = 1,
                               recompute: Any = "none", flash: bool = False,
                               dtype: str = "bf16", formula: str = "generalised",
                               moe: bool | None = None, impl: str = "shardwise",
                               etp: Any = 0, a2a: Any = 1, fp8_inputs: float = 0.0,
                               modules: tuple[str, ...] | None = None,
                               act_fp8_store: bool = False,
                               offload_modules: tuple[str, ...] = (),
                               routed_load: float = 1.0, full_share: float = 1.0) -> Any:
    """Bytes one layer keeps for backward per micro-batch, per rank.

    `formula="korthikanti"`: the paper's closed form (see `korthikanti_activation_bytes`, which
    assumes MHA, GELU f=4h, dropout, 2-byte activations); `"generalised"`: the sum of the
    saved tensors of implementation profile `impl` (`estimate.profiles`; "shardwise", the
    default, is `saved_tensors_per_layer`, SPEC §3). Full recompute keeps only the layer
    input `s·b·h·bytes` (÷t with SP). Context parallelism divides by `c` (Ulysses, `a2a` > 1:
    the attention output twice, `saved_tensors_per_layer`). `fp8_inputs`: the bytes per
    element of the linear inputs an FP8 recipe saves (`fp8.Fp8Recipe.saved_input_bytes`; 0:
    bf16).

    `modules`: what selective recompute re-runs (`recompute_adjust`; None: the attention core,
    Megatron's default); `act_fp8_store`: the SwiGLU inputs kept in FP8; `offload_modules`:
    the module inputs moved to host memory (`OFFLOADED`); `routed_load`: the busiest expert
    rank's routed copies over balanced routing (`TrainSpec.routed_load`). `full_share`: under
    full recompute, the share of layers checkpointed (`TrainSpec.recompute_share`); the
    layer's mean is `share·full + (1 − share)·none`.

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
    moe = model.is_moe if moe is None else moe
    adjust = None
    if modules is not None or act_fp8_store or offload_modules:
        adjust = recompute_adjust(model, modules or ("core_attn",), moe, selective,
                                  dtype_bytes(dtype), act_fp8_store, offload_modules)
        if modules is not None and "core_attn" not in modules:
            selective = selective & False
    def saved(full: Any) -> Any:
        return layer_bytes(impl, model, seq_len, micro_batch, tp=tp, sp=sp, cp=cp, flash=flash,
                           selective=selective, full=full, op_sac=op_sac, adjust=adjust,
                           dtype_bytes_=dtype_bytes(dtype),
                           moe=moe, etp=etp, a2a=a2a, fp8_inputs=fp8_inputs,
                           routed_load=routed_load)

    if full_share == 1 or not np.any(full):
        return saved(full)
    kept = saved(full & False)  # the layers not checkpointed keep what `none` keeps
    return np.where(full, full_share * saved(full) + (1 - full_share) * kept, kept)


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



_GATE_UP = ("mlp_gate", "mlp_up", "expert_gate", "expert_up", "shared_gate", "shared_up")
_LATENTS = ("q_latent_normed", "kv_latent_normed")


def recompute_dropped(model: ModelSpec, modules: tuple[str, ...], moe: bool) -> set[str]:
    """The saved tensors (`estimate.profiles` names) that Megatron's selective recompute of
    `modules` frees in one layer (megatron-core 0.16.1, megatron/core/transformer/):

        layernorm       `CheckpointWithoutOutput` around a separate norm discards its output
                        and statistics (transformer_layer.py): the input norm in the MLA spec
                        (gpt_layer_specs.py; GPT's is fused into linear_qkv, an IdentityOp),
                        the pre-MLP norm of MoE models (`backend.layer_norm() if num_experts`)
        mla_up_proj     q, k and v, the up-projections' outputs (multi_latent_attention.py
                        `qkv_up_checkpoint.discard_output_and_register_recompute`)
        moe_act         the experts' SwiGLU output, fc2's input (moe/experts.py)
        moe             the whole MoE block (moe/moe_layer.py `tensor_parallel.checkpoint`):
                        router, experts, shared experts; its input is kept
        shared_experts  the shared experts (moe/moe_layer.py `shared_experts_recompute`)
        mlp             a dense layer's MLP (transformer_layer.py `recompute_mlp`), with the
                        fused pre-MLP norm of a dense model's linear_fc1
        core_attn       the attention core (`selective`, `estimate.profiles`)
    """
    drop: set[str] = set()
    if "layernorm" in modules:
        if model.is_mla:
            drop |= {"norm1_stats", "qkv_input"}
        if model.is_moe:
            drop |= {"norm2_stats", "mlp_input"}
    if "mla_up_proj" in modules and model.is_mla:
        drop |= {"q", "k", "v"}
    if moe:
        if "moe_act" in modules:
            drop.add("expert_down_input")
        if "shared_experts" in modules or "moe" in modules:
            drop |= {"shared_gate", "shared_up", "shared_down_input"}
        if "moe" in modules:
            drop |= {"router_probs", "router_indices_and_weights", "expert_inputs",
                     "expert_gate", "expert_up", "expert_down_input", "expert_outputs",
                     "expert_probs"}
    elif "mlp" in modules:
        drop |= {"mlp_gate", "mlp_up", "mlp_down_input"}
        if not model.is_moe:
            drop |= {"norm2_stats", "mlp_input"}
    return drop


# Megatron's --fine-grained-activation-offloading --offload-modules: the saved input each
# module's offload moves to host memory (megatron-core 0.16.1 transformer_config.py
# `offload_modules`; transformer_layer.py, attention.py, moe/experts.py `off_interface`)
OFFLOADED = {"attn_norm": ("norm1_input",), "qkv_linear": ("qkv_input",),
             "core_attn": ("q", "k", "v"), "attn_proj": ("attention_output",),
             "mlp_norm": ("norm2_input",), "expert_fc1": ("expert_inputs",),
             "moe_act": ("expert_gate", "expert_up")}


def recompute_adjust(model: ModelSpec, modules: tuple[str, ...], moe: bool, selective: Any,
                     dtype_bytes_: float, act_fp8_store: bool,
                     offload_modules: tuple[str, ...] = ()
                     ) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The rewrite of a layer's saved tensors (`profiles.layer_bytes(adjust=…)`) where
    `selective` holds (scalar or boolean array): `recompute_dropped` freed; under mla_up_proj
    the normed latents stay the checkpoint's bf16 inputs where selective holds (no FP8
    copy); `act_fp8_store`: the SwiGLU inputs (gate and up) at one byte
    (transformer_config.py `activation_func_fp8_input_store`, fused
    `bias_swiglu`/`weighted_bias_swiglu`);
    `offload_modules`: their `OFFLOADED` inputs leave the GPU (`min_offloaded_tensor_size`
    and the layer in flight on the GPU are not modelled)."""
    drop = recompute_dropped(model, modules, moe)
    offloaded = {name for module in offload_modules for name in OFFLOADED[module]}
    keep_latents = "mla_up_proj" in modules and model.is_mla

    def adjust(saved: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, value in saved.items():
            if act_fp8_store and name in _GATE_UP:
                value = value / dtype_bytes_
            if name in offloaded:
                value = 0.0 * value
            elif name in drop:
                value = np.where(selective, 0.0, value) if np.ndim(selective) else (
                    0.0 if selective else value)
            if keep_latents and name in _LATENTS:
                # where selective holds, a bf16 checkpoint input: out of FP8_SAVED_INPUTS
                if np.ndim(selective):  # an array of layouts: each by its own rule
                    out[f"{name}_checkpoint"] = np.where(selective, value, 0.0)
                    value = np.where(selective, 0.0, value)
                elif selective:
                    name = f"{name}_checkpoint"
            out[name] = value
        return out
    return adjust
