"""What one kernel costs on one rank: the layout-independent `ComputeContext`, the roofline
time of a GEMM (`matmul_time`, `linear` with its FP8 casts), a fused attention kernel's
efficiency and a memory-bound kernel (SPEC §7):

    t = max( 2·M·K·N / (peak · e(M,K,N)),  bytes(M·K + K·N + M·N) / (HBM · η_hbm) )
    e(M,K,N) = e_max · M/(M+d½) · K/(K+d½) · N/(N+d½)

(Williams et al. 2009; the constants fitted on published GEMM and attention sweeps,
`benchmarks/fit_components.py`). Array-polymorphic. Derivation: docs/concepts/step-time.md
("Compute").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.capabilities import check, fp8_on
from shardwise.errors import ShardwiseError
from shardwise.fp8 import Fp8Recipe
from shardwise.hardware import Accelerator, get_accelerator
from shardwise.layout import TrainSpec
from shardwise.units import dtype_bytes

__all__ = ["ComputeContext", "Gemms", "attention_efficiency", "compiled_traffic", "fp8_on",
           "gemm_efficiency", "linear", "matmul_efficiency", "matmul_time", "memory_time"]


# Memory-bound traffic of one layer per token, bytes at bf16 activations, as coefficients of
# (h, q + kv, f): h the norms and residual adds (÷t only under sequence parallelism), q + kv
# the attention's per-head work (RoPE on q and k, layout copies; q = a·d, kv = a_kv·d), f the
# MLP's activation (per expert row in MoE layers); forward, backward.
# "compiled": `compiled_traffic` (the fusion rule, checked against Inductor's own kernels on
# CPU); eager stacks carry their own counted table (`Stack.elementwise`).
# Projections reading each norm's output in the blocks `--compile` runs: wq, wk, wv, then w1
# and w3 (w1 alone without a gated MLP) — torchtitan 0.3.0 models/common/attention.py
# `QKVLinear`, feed_forward.py; transformers 5.24.0 LlamaAttention q/k/v_proj, LlamaMLP.
_NORM_READERS_ATTN = 3


def compiled_traffic(model: ModelSpec) -> tuple[tuple[tuple[float, float, float],
                                                      tuple[float, float, float]],
                                                tuple[float, float]]:
    """torch.compile's memory-bound bytes per token of one layer as `(h, q + kv, f)`
    coefficients (forward, backward; bf16) and its kernels per layer (forward, backward).

    Inductor fuses every chain of pointwise ops and reductions between two GEMMs / attention
    calls into one kernel that reads its inputs and writes its outputs once, and recomputes a
    cheap value (the first residual sum) rather than writing it. Forward: norm 4h, residual
    add + norm 6h, closing residual 8h (18h); RoPE on q and k 4(q + kv); the activation 6f
    gated (read gate, up; write), 4f not. Backward, with `n_a` / `n_m` projections reading
    the two norms' outputs: each norm's input-gradient kernel reads the residual gradient,
    its `n` projections' input gradients and its recomputed input, and writes one gradient
    (6 + 2n_a, 8 + 2n_m); the norm weights' gradients reduce over tokens in a kernel of
    their own that reads those `n_a + n_m` gradients and the inputs again (4 + 2(n_a + n_m)):
    18 + 4(n_a + n_m) h (38h for Llama); RoPE 4(q + kv); the activation 10f gated, 6f not.
    Kernels: two norms, one closing add, one activation, two RoPE (q, k) forward; two norm
    gradients, one norm-weight reduction, one activation and two RoPE backward. Derivation
    and the kernels read: docs/concepts/stacks.md ("Kernels")."""
    rope = 0.0 if model.learned_positions else 1.0
    gated = bool(model.gated_mlp)
    readers = _NORM_READERS_ATTN + (2 if gated else 1)
    fwd = (18.0, 4.0 * rope, 6.0 if gated else 4.0)
    bwd = (18.0 + 4.0 * readers, 4.0 * rope, 10.0 if gated else 6.0)
    return (fwd, bwd), (4.0 + 2.0 * rope, 4.0 + 2.0 * rope)


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
    recompute_share: float = 1.0  # `TrainSpec.recompute_share`: layers full recompute replays
    cuda_graph: tuple[str, ...] = ()  # `TrainSpec.cuda_graph`: scopes the host replays as graphs
    # the MoE dispatcher blocks on the routing counts (`host.dispatch_sync`): not Megatron's
    # alltoall padded to capacity, whose sizes are static (`cuda_sync_point = "no_sync"`)
    counts_sync: bool = True
    # `TrainSpec.recompute_modules`: what selective recompute replays (megatron-core 0.16.1's
    # default `("core_attn",)`; `estimate.compute.selective_recompute`)
    recompute_modules: tuple[str, ...] = ("core_attn",)

    @classmethod
    def of(cls, model: ModelSpec, accelerator: Accelerator, train: TrainSpec,
           calibration: Calibration | None = None) -> ComputeContext:
        from shardwise.estimate.uncertainty import generation

        cal = calibration or default_calibration(accelerator.calibration_name)
        settings = train.settings()
        gen = generation(accelerator.calibration_name)

        recipe = check(train, accelerator, gen)  # attention kernel and FP8 recipe run here
        mode = settings.kernels
        if mode == "compiled":
            traffic, kernels = compiled_traffic(model)
        elif mode == "eager" and settings.stack.elementwise is not None:
            traffic, kernels = settings.stack.eager_traffic(model)
        else:  # fused kernels, or the shardwise runtime (whose traffic `calibrate` times per op)
            mode, traffic, kernels = "fused", None, (0.0, 0.0)
        return cls(model, accelerator, cal, train.seq_len, dtype_bytes(train.dtype),
                   settings.attention != "math", accelerator.peak_flops(train.dtype),
                   *_routing(train), mode, traffic,
                   kernels, settings.attention, recipe,
                   accelerator.peak_flops("fp8") if recipe else 0.0, gen,
                   train.recompute_share, train.cuda_graph, _counts_sync(train),
                   tuple(train.recompute_modules or ("core_attn",)))

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


def _counts_sync(train: TrainSpec) -> bool:
    """Whether the token dispatcher copies the routing counts to the host: every dropless one
    does; Megatron-Core 0.16.1's alltoall dispatcher padded to capacity
    (`--moe-pad-expert-input-to-capacity`, `drop_and_pad`) sizes everything from the capacity
    and sets `cuda_sync_point = "no_sync"` (token_dispatcher.py); allgather's `.cpu()` and
    DeepEP's host counts stay."""
    padded = train.moe_capacity is not None and train.impl == "megatron-te"
    return not (padded and (train.moe_dispatcher or "alltoall") == "alltoall")


def _routing(train: TrainSpec) -> tuple[float, float]:
    """(expert_load, experts_active) the experts' GEMMs see: the run's routing, or with a
    capacity factor padded to capacity (Megatron `--moe-pad-expert-input-to-capacity`: every
    expert runs `capacity = factor·T·k/E` rows, `moe_utils.get_capacity`), all of them."""
    return train.routed_load, 1.0 if train.moe_capacity is not None else train.experts_active


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

