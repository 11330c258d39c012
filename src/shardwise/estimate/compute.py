"""Compute time of one Transformer layer, the LM head and the optimizer step, per rank (SPEC §7).

Every function here is *array-polymorphic*: the layout quantities (`t`, `c`, `b`, `sp`, `rc`)
may be Python numbers or NumPy arrays, and the result has their broadcast shape. The scalar
`estimate_step` and the vectorised planner call the very same code, so they cannot disagree.

Time of one matmul `(M×K)·(K×N)` (Williams et al. 2009, roofline):

    t = max( 2·M·K·N / (peak · e(M,K,N)),  bytes(M·K + K·N + M·N) / (HBM · η_hbm) )
    e(M,K,N) = e_max · M/(M+d½) · K/(K+d½) · N/(N+d½)

`e_max` is what cuBLAS reaches on large, well-shaped GEMMs; the saturating factors capture why
small per-rank matmuls (after tensor-parallel sharding, or attention's head-dim `K = d`) run
below it: the fixed prologue/epilogue of each output tile and tile/wave quantisation weigh more
when a dimension is short. The form is symmetric in `M, K, N`, so the two backward GEMMs
(`dX = dY·Wᵀ`, `dW = Xᵀ·dY`) take the forward's time each: backward = 2 × forward.

Memory-bound kernels (norms, activations, residual/dropout adds, softmax of materialised
attention, the optimizer step) cost `bytes / (HBM · η_hbm)`; each kernel launch costs a fixed
`kernel_overhead` (`host_overhead`: the host's dispatch + launch time per operation, which a
small model cannot hide behind the device's work). Attention with FlashAttention (Dao et al. 2022) is one fused kernel at
`attention_efficiency(kernel, d, s, causal)` of peak (below), its backward 2.5 × the forward's
FLOPs (it recomputes `QKᵀ`); causal masking halves the work (blocks above the diagonal are
skipped).
Without FlashAttention (Megatron-LM 2021) the scores are materialised: two batched GEMMs with
`K = d` and `K = s`, then scale-mask-softmax and dropout over `b·a·s²` elements in HBM, with
no causal saving (the masked half is computed, then masked).

Recomputation (Korthikanti et al. 2022): full repeats the layer's forward before its backward;
selective repeats only the attention core (scores, softmax, dropout, `P·V`).

FP8 (`TrainSpec.fp8`, `shardwise.fp8`): the linear layers' GEMMs (`linear`) run at the FP8
peak × `sustained_compute` × the same `e(M,K,N)` with 1-byte operands — all three of them, or
the weight gradient in bf16 (`rowwise_with_gw_hp`) — and each quantisation cast is
memory-bound work of the bytes its recipe moves (`Fp8Recipe.cast_bytes`): the input in the
forward, the output gradient in the backward, the weight per micro-batch or once per step
(`Gemms.weights`, charged by `estimate.step`). Attention, norms, the router and (in Megatron)
the LM head stay bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.errors import ShardwiseError
from shardwise.fp8 import Fp8Recipe
from shardwise.hardware import Accelerator, get_accelerator
from shardwise.layout import RECOMPUTE, TrainSpec
from shardwise.placement import expert_tp_degree
from shardwise.units import dtype_bytes

__all__ = [
    "RC_CODES",
    "ComputeContext",
    "Gemms",
    "LayerCost",
    "attention_efficiency",
    "embedding_cost",
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
    "optimizer_time",
]

RC_CODES = {name: code for code, name in enumerate(RECOMPUTE)}  # none 0, selective 1, full 2
"""Recompute policy as an integer code (arrays of layouts carry codes, not strings)."""

# Kernels launched per layer forward: QKV, out-proj, two MLP GEMMs (gate+up fused), two norms,
# two residual/dropout adds, activation, QKV post-processing; attention core 1 (flash) or 4
# (two batched GEMMs, softmax, dropout). Backward launches about twice as many.
_KERNELS_FWD = 10
_KERNELS_ATTN_FLASH = 1
_KERNELS_ATTN_MATERIALISED = 4

# The shardwise runtime's own count (`Calibration.op_count == "runtime"`): aten operations it
# dispatches per layer and micro-batch, forward + backward together (views, transposes and the
# autograd engine's gradient ops included), counted with a `TorchDispatchMode` on `tiny` and
# `tiny-moe` (fp32, torch's fused CPU flash attention; tests/runtime/test_host_ops.py recounts
# them on the runtime): a dense layer 190; tensor parallelism's f/g functions +6; sequence
# parallelism's gathers/scatters +48 more; ring attention +99, and +106 per extra ring step
# (c − 1: 395 at c = 2, 607 at c = 4, mean over ranks); an MoE layer (router, top-k, dispatch,
# combine, aux loss) 261, + 31 per local expert that receives rows (its SwiGLU; an expert
# without rows launches nothing: `ops.moe`), and under expert parallelism +16 (the count
# exchange, the all-to-alls' autograd functions) and +5 more per such expert (its rows cut
# and joined per source rank) — counted 385 with 4 experts on one rank and 349 with 2 per
# rank under ep = 2, every expert receiving rows; one `moe_layer` call alone gives 31 per
# expert, `run_local_experts` 36. Embedding, LM head and loss add 64 per micro-batch. On a
# CPU with a small model each costs the host's ~µs regardless of its size — `shardwise
# calibrate` measures that cost per op.
_OPS_LAYER = 190
_OPS_MOE_LAYER = 261
_OPS_EXPERT = 31
_OPS_EP = 16
_OPS_EP_EXPERT = 5
_OPS_TP = 6
_OPS_SP = 48
_OPS_CP = 99
_OPS_RING_STEP = 106
_OPS_HEAD = 64


# Memory-bound traffic of one layer per token, bytes at bf16 activations, as coefficients of
# (h, q + kv, f): h the norms and residual adds (÷t only under sequence parallelism), q + kv
# the attention's per-head work (RoPE on q and k, layout copies; q = a·d, kv = a_kv·d), f the
# MLP's activation (per expert row in MoE layers); forward, backward.
# "compiled": torch.compile's Inductor fuses every chain of pointwise ops and reductions
# between two GEMMs / attention calls into one kernel that reads its inputs and writes its
# outputs once: RMSNorm (read x, write y) 4h, residual add fused with the next norm 8h, the
# closing residual 6h, RoPE on q and k 4(q + kv), silu(gate)·up 6f; backward the matching
# gradient kernels, 32h + 4(q + kv) + 10f (derived from the fusion rule, not measured here).
# Eager stacks carry their own measured table (`Stack.elementwise`).
_COMPILED_TRAFFIC = ((18.0, 4.0, 6.0), (32.0, 4.0, 10.0))
# Kernels per layer forward (backward: `_KERNELS_BWD`) besides GEMMs and attention:
# compiled, about one per fused region above (norm, RoPE, add+norm, activation, add).
_KERNELS_COMPILED = 5


@dataclass(frozen=True)
class ComputeContext:
    """Everything the per-rank cost formulas need that does not depend on the layout:
    `kernels` and `traffic` (memory-bound bytes per token: None for the fused count of
    `layer_cost`) and `host_ops` (kernels per layer forward, backward) follow the stack
    (`shardwise.stacks`), `attention` is the attention kernel."""

    model: ModelSpec
    accelerator: Accelerator
    calibration: Calibration
    seq_len: int
    act_bytes: float
    flash: bool
    peak: float
    expert_load: float = 1.0  # `TrainSpec.expert_load`, `experts_active`: balanced routing
    experts_active: float = 1.0
    kernels: str = "fused"
    traffic: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    layer_kernels: tuple[float, float] = (0.0, 0.0)
    attention: str = "fa2"
    fp8: Fp8Recipe | None = None  # `TrainSpec.fp8`'s recipe (None: bf16 GEMMs)
    fp8_peak: float = 0.0
    generation: str = "hopper"  # the accelerator's (`estimate.uncertainty.generation`)

    @classmethod
    def of(cls, model: ModelSpec, accelerator: Accelerator, train: TrainSpec,
           calibration: Calibration | None = None) -> ComputeContext:
        from shardwise.estimate.uncertainty import generation

        cal = calibration or default_calibration(accelerator.calibration_name)
        settings = train.settings()
        gen = generation(accelerator.calibration_name)
        recipe = fp8_on(train, accelerator, gen)
        mode = settings.kernels
        if mode == "compiled":
            traffic, kernels = _COMPILED_TRAFFIC, (1.0 * _KERNELS_COMPILED,
                                                   2.0 * _KERNELS_COMPILED)
        elif mode == "eager" and settings.stack.elementwise is not None:
            traffic, kernels = settings.stack.eager_traffic(model)
        else:  # fused kernels, or the shardwise runtime (whose traffic `calibrate` times per op)
            mode, traffic, kernels = "fused", None, (0.0, 0.0)
        return cls(model, accelerator, cal, train.seq_len, dtype_bytes(train.dtype),
                   settings.attention != "math", accelerator.peak_flops(train.dtype),
                   train.expert_load, train.experts_active, mode, traffic,
                   kernels, settings.attention, recipe,
                   accelerator.peak_flops("fp8") if recipe else 0.0, gen)

    @property
    def rate(self) -> float:
        """The tensor cores' rate a training job sustains: the datasheet peak (`peak`, which
        MFU divides by) × `Calibration.sustained_compute`."""
        return self.peak * self.calibration.sustained_compute

    @property
    def fp8_rate(self) -> float:
        """The same at the datasheet FP8 peak (an FP8 recipe's GEMMs), × the share of it FP8
        GEMMs reach relative to BF16 ones on this part (`calibration.points.
        fp8_gemm_ratio`: 0.88 on H100, 0.98 on B200, from the MAMF measurements)."""
        from shardwise.calibration.points import fp8_gemm_ratio

        return (self.fp8_peak * self.calibration.sustained_compute
                * fp8_gemm_ratio(self.accelerator.calibration_name))

    @property
    def hbm(self) -> float:
        """Achievable HBM bandwidth (bytes/s)."""
        return self.accelerator.hbm_bandwidth * self.calibration.hbm_efficiency


def fp8_on(train: TrainSpec, accelerator: Accelerator, gen: str) -> Fp8Recipe | None:
    """`train`'s FP8 recipe, checked against the accelerator: one line where its generation
    does not run it (TE: `check_fp8_support` Hopper+, `check_mxfp8_support` Blackwell,
    `check_fp8_block_scaling_support` sm90 + CUDA 12.9; torchtitan: SM89+ or MI300) or it has
    no FP8 peak figure."""
    if train.fp8 is None:
        return None
    recipe: Fp8Recipe = train.stack.fp8_recipe(train.fp8)
    if gen not in recipe.architectures:
        raise ShardwiseError(f"--fp8 {recipe.name} ({recipe.title}) runs on "
                             f"{', '.join(recipe.architectures)} GPUs, not {accelerator.name} "
                             f"({gen})")
    if accelerator.peak_fp8 is None:
        raise ShardwiseError(f"{accelerator.name} has no FP8 peak figure (peak_fp8); give one "
                             "in a --gpu FILE")
    return recipe


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


@dataclass(frozen=True)
class Gemms:
    """Seconds of linear-layer GEMMs of one pass, forward / input gradient / weight gradient,
    and the bytes their FP8 casts move in the forward and backward and the weight elements
    whose casts run once per step (all 0 in bf16). Sums with `+`, scales with `*`."""

    fwd: Any = 0.0
    dgrad: Any = 0.0
    wgrad: Any = 0.0
    cast_fwd: Any = 0.0
    cast_bwd: Any = 0.0
    weights: Any = 0.0
    __array_ufunc__ = None  # `array * Gemms` defers to `__rmul__`

    def __add__(self, other: Gemms) -> Gemms:
        return Gemms(*(a + b for a, b in zip(_values(self), _values(other))))

    def __mul__(self, k: Any) -> Gemms:
        return Gemms(*(a * k for a in _values(self)))

    __rmul__ = __mul__


def _values(g: Gemms) -> tuple[Any, ...]:
    """The fields of `g` in order."""
    return (g.fwd, g.dgrad, g.wgrad, g.cast_fwd, g.cast_bwd, g.weights)


def linear(ctx: ComputeContext, m: Any, k: Any, n: Any, batch: Any = 1, fp8: bool = True
           ) -> Gemms:
    """A linear layer `(m×k)·(k×n)` (`batch` of them): forward, input- and weight-gradient
    GEMMs (each `matmul_time` of the same shape, the roofline being symmetric), in FP8 when
    the context has a recipe and `fp8` (the layer is one the recipe quantises), with the
    recipe's cast bytes: input `m·k` and output gradient `m·n` elements, weight `k·n`."""
    bf16 = matmul_time(ctx, m, k, n, batch)
    recipe = ctx.fp8 if fp8 else None
    if recipe is None:
        return Gemms(bf16, bf16, bf16)
    t8 = matmul_time(ctx, m, k, n, batch, fp8=True)
    cast = recipe.cast_bytes(ctx.generation)
    weight = batch * k * n
    return Gemms(t8, t8, t8 if recipe.wgrad_fp8 else bf16,
                 batch * cast.input_fwd * m * k + cast.weight_fwd * weight,
                 batch * (cast.input_bwd * m * k + cast.grad_bwd * m * n)
                 + cast.weight_bwd * weight, weight)


def _sat(dim: Any, half: float) -> Any:
    return dim / (dim + half)


def matmul_efficiency(ctx: ComputeContext, m: Any, k: Any, n: Any) -> Any:
    """`gemm_efficiency` with the context's calibration."""
    return gemm_efficiency(ctx.calibration, m, k, n)


def gemm_efficiency(cal: Calibration, m: Any, k: Any, n: Any) -> Any:
    """`e_max · Π d/(d + d½)` over the three GEMM dimensions (`matmul_efficiency`,
    `matmul_half_dim`; fitted on published GEMM sweeps, `benchmarks/fit_components.py`)."""
    half = cal.matmul_half_dim
    return cal.matmul_efficiency * _sat(m, half) * _sat(k, half) * _sat(n, half)


def attention_efficiency(kernel: str, head_dim: Any, seq: Any, causal: Any,
                         accelerator: Accelerator | str, *, backward: bool = False,
                         calibration: Calibration | None = None) -> Any:
    """Fraction of the accelerator's peak a fused attention kernel reaches (FlashAttention's
    FLOP count: forward `4·s²·d` per head, halved when causal; backward 2.5 × forward):

        e = e_k · d/(d + d½) · s'/(s' + s½) · (r_b if backward),   s' = s·(½ if causal)

    `e_k`, `d½`, `s½`, `r_b` per kernel ("fa2", "fa3", "cudnn", "math": PyTorch's SDPA math
    path) and accelerator, fitted on the kernels' published benchmarks
    (`benchmarks/fit_components.py`; FlashAttention-2 and -3 papers' figures): short
    sequences and narrow heads leave the tensor cores idle, a causal sequence has half the
    blocks of a full one. Array-polymorphic in `head_dim`, `seq`, `causal`; capped at 1."""
    acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    cal = calibration or default_calibration(acc.calibration_name)
    params = cal.attention_kernels.get(kernel)
    if params is None:
        raise ShardwiseError(f"no fitted attention kernel {kernel!r} for {acc.name}; fitted: "
                             f"{', '.join(cal.attention_kernels) or 'none'}")
    s_eff = seq * np.where(causal, 0.5, 1.0)
    eff = (params["efficiency"] * _sat(head_dim, params["half_dim"])
           * _sat(s_eff, params["half_seq"]) * (params["backward_ratio"] if backward else 1.0))
    return np.minimum(eff, 1.0)


def matmul_time(ctx: ComputeContext, m: Any, k: Any, n: Any, batch: Any = 1,
                fp8: bool = False) -> Any:
    """Roofline time of `batch` GEMMs `(m×k)·(k×n)`: compute at `peak·e(m,k,n)` or HBM traffic,
    whichever is slower; `fp8`: at the FP8 rate, the operands 1 byte each (the output in the
    activation dtype)."""
    flops = 2.0 * m * k * n * batch
    rate = ctx.fp8_rate if fp8 else ctx.rate
    compute = flops / (rate * matmul_efficiency(ctx, m, k, n))
    operand = 1.0 if fp8 else ctx.act_bytes
    traffic = batch * (operand * (m * k + k * n) + ctx.act_bytes * m * n) / ctx.hbm
    return np.maximum(compute, traffic)


def memory_time(ctx: ComputeContext, n_bytes: Any) -> Any:
    """`bytes / (HBM · η_hbm)`: a memory-bound kernel."""
    return n_bytes / ctx.hbm


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
    flops = 2.0 * (s / c * b) * s * (d + d_v) * heads * 0.5
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

        QKV       (T × h)·(h × (h + 2·kv_r)/t… )   kv_r = max(a_kv/t, 1)·d per rank
        out-proj  (T × h/t)·(h/t × h)
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
    q = h / t
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
        mm = mm + local * (linear(ctx, rows, h, n_in * f, fp8=experts_fp8)
                           + linear(ctx, rows, f, h, fp8=experts_fp8))
        f_shared = model.expert_d_ff / t
        if model.n_shared_experts:
            mm = mm + model.n_shared_experts * (linear(ctx, tokens, h, n_in * f_shared)
                                                + linear(ctx, tokens, f_shared, h))
        routed = tokens * k_top * share
        permute = 4 * ab * routed * h  # into and out of expert order
        # the MLP activation's rows: routed copies at f, shared experts' at f_shared
        mlp_elements = routed * load * f + model.n_shared_experts * tokens * f_shared
        # op-sac runs each running expert's (and shared expert's) third matmul again
        sac_mm = (local * linear(ctx, rows, h, f, fp8=experts_fp8).fwd
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
    fwd = _with_host(ctx, mm.fwd + attn_fwd + memory_time(ctx, mem_f), ops_fwd)
    bwd = _with_host(ctx, mm.dgrad + mm.wgrad + attn_bwd + memory_time(ctx, mem_b), ops_bwd)
    # recompute before the backward: selective the attention core, full the whole forward,
    # op-sac (torchtitan) what it does not save: wo, the third MLP matmul and every
    # memory-bound op (`arch.ModelSpec.op_sac_recomputed_flops`)
    out_proj = linear(ctx, tokens, model.n_heads / t * model.value_head_dim, h).fwd
    op_sac = out_proj + sac_mm + memory_time(ctx, mem_f)
    recompute = np.where(rc == 2, fwd, np.where(rc == 1, attn_fwd,
                                                np.where(rc == 3, op_sac, 0.0)))
    return LayerCost(fwd, bwd, mm.wgrad, recompute, attn_fwd, attn_bwd,
                     mm.weights + 0.0 * fwd)


def _with_host(ctx: ComputeContext, device: Any, ops: Any) -> Any:
    """A pass's time given its device time and the host's `ops` launches: on a GPU the host
    runs ahead of the device (launches are asynchronous), so the slower of the two; on the
    "this machine" preset the CPU does both, one after the other."""
    host = host_overhead(ctx, ops)
    if ctx.calibration.op_count == "runtime":
        return device + host
    return np.maximum(device, host)


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


def host_ops(ctx: ComputeContext, t: Any, c: Any, sp: Any, moe: bool = False, ep: Any = 1
             ) -> tuple[Any, Any]:
    """(forward, backward) operations one layer launches per micro-batch on one rank.

    `op_count == "fused"` (the built-in GPU presets): the kernels of a fused implementation
    (Megatron-LM's): 10 per layer forward (QKV, out-proj, two MLP GEMMs, two norms, two
    residual adds, the activation, QKV post-processing) plus the attention core (1 flash, 4
    materialised; MLA's extra projections and norms, `_mla_kernels`), the backward twice as
    many. `"runtime"` (the "this machine" preset, which
    runs shardwise's own runtime): the aten operations it dispatches (`_OPS_*` above), split
    ⅓ forward, ⅔ backward like the fused count; an MoE layer's experts count when they
    receive rows (`ComputeContext.experts_active` of the `E/ep` local ones).
    """
    if ctx.calibration.op_count == "runtime":
        running = ctx.model.n_experts / ep * ctx.experts_active  # local experts with rows
        layer = (_OPS_MOE_LAYER + _OPS_EXPERT * running
                 + np.where(ep > 1, _OPS_EP + _OPS_EP_EXPERT * running, 0) if moe
                 else _OPS_LAYER)
        total = layer + np.where(t > 1, _OPS_TP, 0)
        total = total + np.where(np.logical_and(sp, t > 1), _OPS_SP, 0)
        total = total + np.where(c > 1, _OPS_CP + _OPS_RING_STEP * (c - 1), 0)
        return total / 3, 2 * total / 3
    attention = _KERNELS_ATTN_FLASH if ctx.flash else _KERNELS_ATTN_MATERIALISED
    if ctx.traffic is None:
        fwd = _KERNELS_FWD + _mla_kernels(ctx.model) + attention
        return fwd, 2 * fwd
    # eager / compiled: the stack's kernels besides GEMMs and attention, its five GEMMs
    # (three per expert that runs in an MoE layer) and the attention core
    gemms = 2 + (3 * ctx.model.n_experts / ep * ctx.experts_active + 1 if moe else 3)
    return (ctx.layer_kernels[0] + _mla_kernels(ctx.model) + gemms + attention,
            ctx.layer_kernels[1] + _mla_kernels(ctx.model) + 2 * gemms + attention)


def _mla_kernels(model: ModelSpec) -> int:
    """Kernels MLA adds to a layer's forward: two down-projection GEMMs (one without a q
    latent), their latent norms, and a second up-projection GEMM (q and kv apart)."""
    return (5 if model.q_lora_rank else 3) if model.is_mla else 0


# The runtime's optimizer step, per parameter tensor on the rank (counted with a
# TorchDispatchMode on torch 2.13, CPU): AdamW(foreach=False) 10 aten ops, the global-norm
# terms 3 (vector_norm, square, add_), the clipping scale 1 — 14; tiny's 39 tensors ≈ 566 ops.
_OPS_OPT_TENSOR = 14


def optimizer_host_ops(ctx: ComputeContext, n_dense: Any, n_moe: Any, ep: Any, single: Any
                       ) -> Any:
    """Aten ops of the optimizer step on the busiest stage, "this machine" preset only
    (`op_count == "runtime"`; 0 for the fused GPU presets, whose optimizer is a few fused
    kernels): `_OPS_OPT_TENSOR` per parameter tensor — `n_dense` dense and `n_moe` MoE
    layers (norms, q/k/v/o, the MLP's 2-3 matrices, biases where the model has them; an MoE
    layer its router and local + shared experts' MLPs), the final norm and LM head, and the
    embedding with one stage (`single`)."""
    if ctx.calibration.op_count != "runtime":
        return 0.0 * n_dense
    model = ctx.model
    norm = 2 if model.norm == "layernorm" else 1
    mlp = (3 if model.gated_mlp else 2) * (2 if model.bias else 1)
    # q, k, v, o; MLA: q (or q-down, q-norm, q-up), kv-down, kv-norm, kv-up, o
    projections = (7 if model.q_lora_rank else 5) if model.is_mla else 4
    attn = 2 * norm + projections + 3 * model.qkv_bias + model.out_bias
    moe = attn + 1 + mlp * (model.n_experts / ep + model.n_shared_experts)
    ends = norm + (0 if model.tie_embeddings else 1) + np.where(single, 1, 0)
    return _OPS_OPT_TENSOR * (n_dense * (attn + mlp) + n_moe * moe + ends)


def host_overhead(ctx: ComputeContext, ops: Any) -> Any:
    """`ops · kernel_overhead`: the host's fixed cost per operation (Python, the dispatcher,
    autograd bookkeeping, the kernel launch). GPU presets: `kernel_overhead` = 5 µs
    (data/calibration.json; a CUDA launch plus framework dispatch is a few µs), with the fused
    kernel count; the "this machine" preset: the cost per aten op `shardwise calibrate`
    fits on the runtime's one-rank training steps, with the runtime's op count."""
    return ops * ctx.calibration.kernel_overhead


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
    `2·T·(matmul params) + 4·T·s·h·(½ if causal)`, `T = s·b` (SPEC §1)."""
    tokens = seq_len * micro_batch
    attention = 4 * tokens * seq_len * model.d_model * (0.5 if causal else 1.0)
    matmul = model.attention_params() + model.mlp_params()
    return 2 * tokens * matmul + attention
