"""Compute time of one Transformer layer (dense or MoE), the LM head, the embedding and the
optimizer step, per rank and micro-batch (SPEC §7): the GEMMs through `estimate.kernels`
(roofline at a shape-dependent efficiency, FP8 with a recipe), the attention core at the
fitted kernel's efficiency (FlashAttention skips the causal half), memory-bound kernels at
HBM speed, the host's launches (`estimate.host`); recomputation (Korthikanti et al. 2022)
before the backward. Array-polymorphic in the layout quantities (`t`, `c`, `b`, `sp`, `rc`):
the scalar `estimate_step` and the vectorised planner call the very same code.
Derivation: docs/concepts/step-time.md ("Compute").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.host import (
    _OPS_HEAD,
    _OPS_LAYER,
    _with_host,
    dispatch_sync,
    expert_host,
    host_ops,
    host_overhead,
    optimizer_host_ops,
)
from shardwise.estimate.kernels import (
    ComputeContext,
    Gemms,
    _sat,
    attention_efficiency,
    fp8_on,
    gemm_efficiency,
    linear,
    matmul_efficiency,
    matmul_time,
    memory_time,
)
from shardwise.layout import RECOMPUTE
from shardwise.placement import expert_tp_degree

__all__ = [  # with the names of `estimate.kernels` and `estimate.host` it re-exports
    "RC_CODES",
    "_OPS_LAYER",
    "ComputeContext",
    "Gemms",
    "LayerCost",
    "attention_efficiency",
    "embedding_cost",
    "fp8_on",
    "gemm_efficiency",
    "head_cost",
    "host_ops",
    "host_overhead",
    "layer_cost",
    "layer_model_flops",
    "linear",
    "matmul_efficiency",
    "matmul_time",
    "memory_time",
    "optimizer_host_ops",
    "optimizer_time",
    "selective_recompute",
]

RC_CODES = {name: code for code, name in enumerate(RECOMPUTE)}  # none 0, selective 1, full 2
"""Recompute policy as an integer code (arrays of layouts carry codes, not strings)."""


class LayerCost(NamedTuple):
    """Seconds of compute per rank for one layer and one micro-batch.

    `fwd`, `bwd` (the whole backward, input and weight gradients), `wgrad` (the weight-gradient
    part of `bwd`: what zero-bubble schedules defer), `recompute` (added before the backward),
    `attn_fwd`/`attn_bwd` (the attention core, which context parallelism overlaps with its ring
    transfers), `fp8_weights` (elements of the FP8 weights whose casts run once per step,
    `Gemms.weights`).
    """

    fwd: Any
    bwd: Any
    wgrad: Any
    recompute: Any
    attn_fwd: Any
    attn_bwd: Any
    fp8_weights: Any = 0.0


def _kv_heads(model: ModelSpec, t: Any) -> Any:
    """K/V heads per rank: `a_kv/t`, or one replicated head when `t > a_kv`."""
    return np.maximum(model.n_kv_heads // t, 1)


def _attention_core(ctx: ComputeContext, t: Any, c: Any, b: Any) -> tuple[Any, Any]:
    """Forward and backward time of the attention core (scores, softmax, dropout, `P·V`) on one
    rank for one micro-batch (its kernels are counted by `host_ops`).

    Flash (also whenever c > 1: ring attention merges blocks with the online softmax):
    forward FLOPs `4·(s/c·b)·s·(h/t)·½` (causal), backward 2.5 ×, at the calibration's
    `attention_kernel` curve (`attention_efficiency`, causal, blocks of `s/c`; without one:
    `attention_efficiency·d/(d+d½)` of peak both ways). Materialised (c = 1): batched GEMMs `QKᵀ`
    `(s×d)·(d×s)` and `P·V` `(s×s)·(s×d)` over `b·a/t` heads, softmax over `b·(a/t)·s²` scores
    (read + write), with dropout another read, write and a 1-byte mask; backward 2 × the GEMMs,
    softmax backward 3 accesses, dropout backward 2 + mask.

    Scores run at the query/key head width `d`, P·V at the value width `d_v` (= d but for
    MLA: `d_nope + d_R` and `d_v`): flash forward FLOPs `2·(s/c·b)·s·(d + d_v)·(a/t)·½`.
    """
    model, s, ab = ctx.model, ctx.seq_len, ctx.act_bytes
    d, d_v = model.head_dim, model.value_head_dim
    heads = model.n_heads / t
    cal = ctx.calibration
    # keys per query, mean over layers: s/2 causal, less under windows/chunks (attention_keys)
    flops = 2.0 * (s / c * b) * model.attention_keys(s) * (d + d_v) * heads
    kernel, factor = cal.attention_curve(ctx.attention)
    if kernel:
        def eff(backward: bool) -> Any:
            return factor[backward] * attention_efficiency(
                kernel, d, s / c, True, ctx.accelerator, backward=backward, calibration=cal)
        flash_fwd = flops / (ctx.rate * eff(False))
        flash_bwd = 2.5 * flops / (ctx.rate * eff(True))
    else:
        flash_fwd = flops / (ctx.rate * cal.attention_efficiency * _sat(d, cal.matmul_half_dim))
        flash_bwd = 2.5 * flash_fwd
    if ctx.flash:
        return flash_fwd, flash_bwd
    batch = b * heads
    gemms = matmul_time(ctx, s, d, s, batch) + matmul_time(ctx, s, s, d_v, batch)
    scores = batch * s * s
    fwd_bytes = 2 * ab * scores + ((2 * ab + 1) * scores if model.dropout else 0.0)
    bwd_bytes = 3 * ab * scores + ((2 * ab + 1) * scores if model.dropout else 0.0)
    fwd = gemms + memory_time(ctx, fwd_bytes)
    bwd = 2 * gemms + memory_time(ctx, bwd_bytes)
    # Ring attention (c > 1) always runs the online-softmax (flash-style) kernel.
    materialised = c == 1
    return np.where(materialised, fwd, flash_fwd), np.where(materialised, bwd, flash_bwd)


def _mla_projections(ctx: ComputeContext, t: Any, tokens: Any, sp: Any) -> tuple[Gemms, Any]:
    """(GEMMs, memory-bound bytes) of MLA's projections on one rank, forward: the
    down-projections `(T' × h)·(h × r_q)` and `(T' × h)·(h × (r_kv + d_R))` replicated over tp
    (`T' = T/t` with sequence parallelism: Megatron-Core runs them on the sequence shard, else
    every tp rank repeats them), the up-projections `(T × r_q)·(r_q × a/t·d_qk)` (or
    `(T × h)·(h × a/t·d_qk)` without a q latent) and `(T × r_kv)·(r_kv × a/t·(d_nope + d_v))`,
    the output `(T × a/t·d_v)·(a/t·d_v × h)`; bytes: the latent norms (read + write
    `r_q + r_kv` per down row), the RoPE and concatenations into q, k, v (read + write
    `a/t·(2·d_qk + d_v)` per row) and the attention output (read + write `a/t·d_v`)."""
    model, ab, h = ctx.model, ctx.act_bytes, ctx.model.d_model
    heads = model.n_heads / t
    d, d_v = model.head_dim, model.value_head_dim
    r_q, r_kv, d_r = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    down = tokens / np.where(sp, t, 1)
    mm = linear(ctx, down, h, r_kv + d_r)
    mm = mm + linear(ctx, tokens, r_kv, heads * (model.qk_nope_head_dim + d_v))
    if r_q:
        mm = mm + linear(ctx, down, h, r_q) + linear(ctx, tokens, r_q, heads * d)
    else:
        mm = mm + linear(ctx, tokens, h, heads * d)
    mm = mm + linear(ctx, tokens, heads * d_v, h)
    mem = 2 * ab * (down * (r_q + r_kv) + tokens * heads * (2 * d + d_v)
                    + tokens * heads * d_v)
    return mm, mem


def layer_cost(ctx: ComputeContext, t: Any, c: Any, b: Any, sp: Any, rc: Any,
               moe: bool = False, ep: Any = 1, etp: Any = 0) -> LayerCost:
    """Compute time of one layer (dense, or MoE when `moe`) for one micro-batch on one rank.

    Per rank the GEMMs see `T = s·b/c` token rows (sequence parallelism gathers the sequence
    before each GEMM) and tensor-parallel shards of the weights:

        QKV       (T × h)·(h × (a·d/t + 2·kv_r))   kv_r = max(a_kv/t, 1)·d per rank
        out-proj  (T × a·d/t)·(a·d/t × h)         (a·d = h unless the config names d_head)
        MLP in    (T × h)·(h × n_in·f/t)            n_in = 2 gated (SwiGLU), 1 otherwise
        MLP out   (T × f/t)·(f/t × h)

    MLA layers replace QKV and out-proj by `_mla_projections`. MoE layers replace the MLP by
    a router `(T × h)·(h × E)` and `E/ep` local experts of `T·top_k·ep/E · etp/t` rows each
    at `f/etp` (balanced routing; the all-to-alls are communication, step.py; `etp` the
    expert-tensor-parallel degree, 0 for t: each rank then runs its share of the routed rows,
    `T·k·f/t` per rank whatever etp), plus shared experts on all `T` rows at `f/t`. With the routing of a run (`TrainSpec.expert_load`
    λ, `experts_active` a: the busiest ep rank's rows ÷ `T·top_k`, and the share of its
    experts that receive rows), `a·E/ep` experts run `λ/a` times those rows each, and the
    expert activations move λ times the bytes. Memory-bound work per layer forward, in bytes
    (`R = T·h`, ÷t under sequence parallelism, else every TP rank repeats it): two norms
    `4R·ab`, two residual adds `6R·ab` (+ `2R` dropout masks), QKV post-processing (bias, RoPE,
    head split) `2·ab·T·(q + 2kv)/t`, the activation `2·ab·T·f/t` (GELU) or `3·ab·T·f/t`
    (SwiGLU); backward moves twice the forward's bytes. The linear layers run through
    `linear` (FP8 with a recipe: its GEMMs and cast bytes; the router stays bf16, routed
    experts follow `Fp8Recipe.experts_fp8`).
    """
    model, ab, h = ctx.model, ctx.act_bytes, ctx.model.d_model
    tokens = ctx.seq_len / c * b
    replicated = tokens * h / np.where(sp, t, 1)
    kv = _kv_heads(model, t) * model.head_dim
    q = model.q_dim / t  # a·d: ≠ h where the config names d_head (Qwen3-MoE, Gemma)
    n_in = 2 if model.gated_mlp else 1

    mem = (4 * ab + 6 * ab + (2 if model.dropout else 0)) * replicated
    if model.is_mla:
        mm, mla_mem = _mla_projections(ctx, t, tokens, sp)
        mem = mem + mla_mem
    else:
        mm = linear(ctx, tokens, h, q + 2 * kv) + linear(ctx, tokens, q, h)
        mem = mem + 2 * ab * tokens * (q + 2 * kv) + 2 * ab * tokens * q  # QKV in, attn out
    if moe:
        e, k_top = model.n_experts, model.top_k
        load, active = ctx.expert_load, ctx.experts_active
        expert_tp = expert_tp_degree(etp, t)
        f = model.expert_d_ff / expert_tp
        share = expert_tp / t  # of the tp group's routed rows, what one etp group runs
        rows = tokens * k_top * ep / e * share * load / active  # per expert that runs
        local = e / ep * active  # experts that run
        experts_fp8 = ctx.fp8 is not None and ctx.fp8.experts_fp8
        mm = mm + linear(ctx, tokens, h, e, fp8=False)
        experts = local * (linear(ctx, rows, h, n_in * f, fp8=experts_fp8)
                           + linear(ctx, rows, f, h, fp8=experts_fp8))
        mm = mm + experts
        f_shared = model.expert_d_ff / t
        if model.n_shared_experts:
            mm = mm + model.n_shared_experts * (linear(ctx, tokens, h, n_in * f_shared)
                                                + linear(ctx, tokens, f_shared, h))
        routed = tokens * k_top * share
        permute = 4 * ab * routed * h  # into and out of expert order
        # the MLP activation's rows: routed copies at f, shared experts' at f_shared
        mlp_elements = routed * load * f + model.n_shared_experts * tokens * f_shared
        # op-sac (torchtitan 0.3.0 `SelectiveAC`) runs again: every routed-expert GEMM (their
        # `aten._grouped_mm` is in neither its save list nor torch's compute-intensive ops),
        # the router gate (`force_recompute_mm_shapes_by_fqns`), the shared experts' w3
        sac_mm = (linear(ctx, tokens, h, e, fp8=False).fwd
                  + local * (linear(ctx, rows, h, n_in * f, fp8=experts_fp8).fwd
                             + linear(ctx, rows, f, h, fp8=experts_fp8).fwd)
                  + model.n_shared_experts * linear(ctx, tokens, h, f_shared).fwd)
    else:
        f = model.d_ff / t
        mm = mm + linear(ctx, tokens, h, n_in * f) + linear(ctx, tokens, f, h)
        permute, mlp_elements = 0.0, tokens * f
        sac_mm = linear(ctx, tokens, h, f).fwd
    if ctx.traffic is None:  # fused kernels: the bytes each kernel above moves
        mem_f = mem + (n_in + 1) * ab * mlp_elements + permute
        mem_b = 2 * mem_f
    else:  # eager or compiled: the stack's measured (or the fusion rule's) bytes per token
        (fh, fqk, ff), (bh, bqk, bf) = ctx.traffic
        scale = ab / 2  # the tables are bf16 bytes
        mem_f = scale * (fh * replicated + fqk * tokens * (q + kv) + ff * mlp_elements) + permute
        mem_b = scale * (bh * replicated + bqk * tokens * (q + kv) + bf * mlp_elements) + permute
    mem_f, mem_b = mem_f + mm.cast_fwd, mem_b + mm.cast_bwd  # FP8 quantisation (0 in bf16)
    attn_fwd, attn_bwd = _attention_core(ctx, t, c, b)
    ops_fwd, ops_bwd = host_ops(ctx, t, c, sp, moe, ep)
    dev_f = mm.fwd + attn_fwd + memory_time(ctx, mem_f)
    dev_b = mm.dgrad + mm.wgrad + attn_bwd + memory_time(ctx, mem_b)
    fwd, bwd = _with_host(ctx, dev_f, ops_fwd), _with_host(ctx, dev_b, ops_bwd)
    if (moe and ctx.traffic is None and ctx.calibration.op_count == "fused"
            and "moe" not in ctx.cuda_graph):
        # the dispatcher's blocking copy of the routing counts (`host.dispatch_sync`) drains
        # the device: the host launches the experts one by one (`host.expert_host`) only
        # after the layer's first part has run; the backward has no such sync
        host_f, host_b = expert_host(ctx, local)
        expert_f = experts.fwd + memory_time(ctx, experts.cast_fwd)
        fwd = _with_host(ctx, dev_f - expert_f, ops_fwd) + np.maximum(expert_f, host_f)
        bwd = np.maximum(dev_b, host_overhead(ctx, ops_bwd) + host_b)
    if moe:
        fwd = fwd + dispatch_sync(ctx)
    # recompute before the backward: selective the attention core, full the whole forward,
    # op-sac (torchtitan) what it does not save: wo, the third MLP matmul (MoE: the routed
    # experts' and the router's too) and every memory-bound op
    # (`arch.ModelSpec.op_sac_recomputed_flops`)
    out_proj = linear(ctx, tokens, model.n_heads / t * model.value_head_dim, h).fwd
    op_sac = out_proj + sac_mm + memory_time(ctx, mem_f)
    if moe:
        # the MoE layer's forward less the attention block's (`moe`), the routed experts'
        # activation (`moe_act`: read gate and up rows, write), the shared experts' (`shared_experts`)
        shared = (model.n_shared_experts * (linear(ctx, tokens, h, n_in * f_shared).fwd
                                            + linear(ctx, tokens, f_shared, h).fwd)
                  if model.n_shared_experts else 0.0)
        parts = {"moe": experts.fwd + linear(ctx, tokens, h, e, fp8=False).fwd + shared
                 + memory_time(ctx, permute + (n_in + 1) * ab * mlp_elements),
                 "moe_act": memory_time(ctx, (n_in + 1) * ab * routed * load * f),
                 "shared_experts": shared}
    else:
        parts = {"mlp": linear(ctx, tokens, h, n_in * f).fwd + linear(ctx, tokens, f, h).fwd
                 + memory_time(ctx, (n_in + 1) * ab * mlp_elements)}
    selective = selective_recompute(ctx, t, tokens, replicated, attn_fwd, parts)
    recompute = np.where(rc == 2, ctx.recompute_share * fwd, np.where(rc == 1, selective,
                                                np.where(rc == 3, op_sac, 0.0)))
    return LayerCost(fwd, bwd, mm.wgrad, recompute, attn_fwd, attn_bwd,
                     mm.weights + 0.0 * fwd)


def selective_recompute(ctx: ComputeContext, t: Any, tokens: Any, replicated: Any,
                        attn_fwd: Any, parts: dict[str, Any]) -> Any:
    """Seconds selective recompute replays before a layer's backward: the forward of each
    module in `ctx.recompute_modules` (megatron-core 0.16.1 `--recompute-modules`, default
    core_attn): core_attn the attention core (`attn_fwd`); layernorm the two norms
    (transformer_layer.py `recompute_input_layernorm` / `recompute_pre_mlp_layernorm`: read and
    write `R = T·h` each, ÷t under sequence parallelism: `4·ab·R`); mla_up_proj MLA's q and kv
    up-projections and RoPE (multi_latent_attention.py `qkv_up_proj_and_rope_apply`); mlp, moe,
    moe_act, shared_experts from `parts` (those the layer has; moe_act: experts.py
    `activation_checkpoint`)."""
    model, ab, modules = ctx.model, ctx.act_bytes, ctx.recompute_modules
    out = attn_fwd * ("core_attn" in modules)
    if "layernorm" in modules:
        out = out + memory_time(ctx, 4 * ab * replicated)
    if "mla_up_proj" in modules and model.is_mla:
        heads = model.n_heads / t
        d, d_v = model.head_dim, model.value_head_dim
        q_in = model.q_lora_rank or model.d_model
        up = (linear(ctx, tokens, q_in, heads * d).fwd
              + linear(ctx, tokens, model.kv_lora_rank, heads * (model.qk_nope_head_dim + d_v)).fwd)
        out = out + up + memory_time(ctx, 2 * ab * tokens * heads * (2 * d + d_v))
    for name, seconds in parts.items():
        if name in modules:
            out = out + seconds
    return out


def head_cost(ctx: ComputeContext, t: Any, c: Any, b: Any, sp: Any) -> tuple[Any, Any, Any]:
    """(forward, backward, weight-grad) seconds of the final norm, the vocabulary-parallel LM
    head `(T × h)·(h × V/t)` (FP8 when the recipe quantises it, `Fp8Recipe.head_fp8`) and the
    fp32 cross-entropy over `T·V/t` logits: bytes per logit
    fused (Megatron's vocab-parallel kernel: read the logits, write fp32 probabilities)
    `ab + 12`, backward `ab + 4`; eager (`F.cross_entropy(logits.float())`, counted on CPU:
    18 and 26 at bf16) `ab + 16`, `ab + 24`; compiled (one fused pass each way) `2·ab`."""
    model, ab, h = ctx.model, ctx.act_bytes, ctx.model.d_model
    tokens = ctx.seq_len / c * b
    vocab = model.vocab / t
    mm = linear(ctx, tokens, h, vocab, fp8=ctx.fp8 is not None and ctx.fp8.head_fp8)
    norm = 4 * ab * tokens * h / np.where(sp, t, 1)
    per_logit = {"fused": (ab + 12, ab + 4), "eager": (ab + 16, ab + 24),
                 "compiled": (2 * ab, 2 * ab)}[ctx.kernels]
    fwd = mm.fwd + memory_time(ctx, norm + per_logit[0] * tokens * vocab + mm.cast_fwd)
    bwd = (mm.dgrad + mm.wgrad
           + memory_time(ctx, 2 * norm + per_logit[1] * tokens * vocab + mm.cast_bwd))
    ops = _OPS_HEAD / 3 if ctx.calibration.op_count == "runtime" else 4
    overhead = host_overhead(ctx, ops)
    return fwd + overhead, bwd + 2 * overhead, mm.wgrad


def embedding_cost(ctx: ComputeContext, t: Any, c: Any, b: Any) -> tuple[Any, Any]:
    """(forward, backward) of the embedding lookup: a gather of `T` rows of `h` (read + write),
    backward a scatter-add into the (vocab-parallel) table."""
    tokens = ctx.seq_len / c * b
    rows = 2 * ctx.act_bytes * tokens * ctx.model.d_model
    overhead = ctx.calibration.kernel_overhead
    return memory_time(ctx, rows) + overhead, memory_time(ctx, 2 * rows) + overhead


def optimizer_time(ctx: ComputeContext, params: Any, grad_bytes: float, weight_bytes: float,
                   master_bytes: float, moment_bytes: float) -> Any:
    """The optimizer step, memory-bound: per parameter it reads the gradient, reads and writes
    the fp32 master and the moments, writes the new weight, plus one more gradient read for the
    global-norm clipping: `2g + w + 2·(master + moments)` bytes (Adam, bf16: 4 + 2 + 24 = 30 B/param)."""
    per_param = 2 * grad_bytes + weight_bytes + 2 * (master_bytes + moment_bytes)
    return memory_time(ctx, params * per_param) + 3 * ctx.calibration.kernel_overhead


def layer_model_flops(model: ModelSpec, seq_len: int, micro_batch: int = 1,
                      causal: bool = True) -> float:
    """Model FLOPs of one dense layer's forward for one micro-batch (all ranks together):
    `2·T·(matmul params) + 4·T·k·h`, `T = s·b`, `k` keys per query (`attention_keys`: `s`,
    `s/2` causal, less under windows) (SPEC §1)."""
    tokens = seq_len * micro_batch
    attention = 4 * tokens * model.attention_keys(seq_len, causal) * model.d_model
    matmul = model.attention_params() + model.mlp_params()
    return 2 * tokens * matmul + attention

