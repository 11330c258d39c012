"""FP8 training recipes as the frameworks run them (docs/concepts/fp8-offload.md).

A recipe keeps the weights, gradients and optimizer state of bf16 mixed precision and runs the
GEMMs of the linear layers in FP8: before each GEMM its bf16 operands are quantised (an amax
reduction where the scale is computed from the tensor itself, a cast to 1-byte values, on
Hopper a transposed copy for the backward's TN-only FP8 GEMMs), and the GEMM runs at the FP8
peak. Attention stays bf16 (Transformer Engine's `fp8_dpa` and Megatron's
`--fp8-dot-product-attention` are off by default), and so do the norms, the router and,
in Megatron-LM, the LM head (`GPTModel.output_layer` is megatron-core's own
`ColumnParallelLinear`, not a Transformer Engine module).

Recipes are named by their frameworks:

    framework "te": Transformer Engine through Megatron-LM's `--fp8-recipe`
        delayed      DelayedScaling: per-tensor scale from an amax history (the cast records
                     the amax on the fly: one pass)
        tensorwise   Float8CurrentScaling: per-tensor scale from the tensor itself (an amax
                     pass, then the cast)
        mxfp8        MXFP8BlockScaling: one E8M0 scale per 32 values, row- and column-wise
                     copies both quantised from bf16 (Blackwell)
        blockwise    Float8BlockScaling: 1×128 activation / 128×128 weight blocks, fp32
                     scales (DeepSeek-V3's scheme; Hopper, CUDA ≥ 12.9)
    framework "torchao": torchao.float8 / MX through torchtitan 0.3.0's converters
        rowwise, rowwise_with_gw_hp   `Float8LinearConverter.Config.recipe_name`
        mxfp8        `MXFP8LinearConverter` (SM100)

Bytes per element each recipe's casts move (bf16 in; ×1 per element of the tensor):

    Transformer Engine (quantizer.cpp @ TransformerEngine d0067d0, 2.20.0.dev0): read 2, write
    1, plus 1 for the transposed copy on Hopper (`nvte_is_non_tn_fp8_gemm_supported` is false
    before Blackwell); current scaling adds the amax pass (`nvte_compute_amax`, read 2);
    MXFP8 writes both directions and a 1-byte scale per 32; block scaling both directions and
    a 4-byte scale per 128. The input is cast in the forward, the output gradient in the
    backward; the weight once per step (Megatron-Core passes `is_first_microbatch`,
    extensions/transformer_engine.py @ 0.16.1, and TE caches the quantised weight in
    `_fp8_workspaces`), per micro-batch under FSDP (TE does not cache there).
    torchao (torchao/testing/training/roofline_utils.py @ 0.18.0,
    `get_tensor_memory_traffic_ovhd_s`, its own roofline of the compiled casts, not fused
    with the previous op): rowwise input and grad_output 8, weight 10; rowwise_with_gw_hp 3,
    3 and 6; mxfp8 (`mxfp8_cublas`) 6 each — every micro-batch, forward kernels in the
    forward, the rest in the backward.

What stays in memory: TE saves each linear input for the backward as its FP8 (column-wise)
copy (module/linear.py: `inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)`)
and holds the cached FP8 weights (row-wise, plus the transpose on Hopper); delayed scaling
keeps, per FP8 GEMM, an amax history of `AMAX_HISTORY` fp32 values for each of its five
scaled tensors (input, weight, output forward; output gradient, input gradient backward) and
their scales. torchao's autograd function saves the bf16 input and weight
(float8/float8_linear.py @ 0.18.0 `matmul_with_hp_or_float8_args`) and re-quantises in
backward: activations and weights as in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shardwise.errors import ShardwiseError

__all__ = ["AMAX_HISTORY", "RECIPES", "CastBytes", "Fp8Recipe", "get_recipe", "recipe_names"]

AMAX_HISTORY = 1024
"""Delayed scaling's amax history length: Transformer Engine's `DelayedScaling` default and
NeMo's recipes (Megatron-LM's `--fp8-amax-history-len` defaults to 1; `--emit megatron` writes
1024 with `--fp8-amax-compute-algo max`)."""

SCALED_TENSORS = 5
"""Tensors with a scale per FP8 GEMM in Transformer Engine's fp8_meta: input, weight, output
(forward), output gradient, input gradient (backward)."""


class CastBytes(NamedTuple):
    """Memory-bound bytes per element of each quantised tensor: the input (forward, backward),
    the output gradient (backward), the weight per micro-batch (forward, backward) and per
    step (a cached cast)."""

    input_fwd: float
    input_bwd: float
    grad_bwd: float
    weight_fwd: float
    weight_bwd: float
    weight_step: float


@dataclass(frozen=True)
class Fp8Recipe:
    """One framework's FP8 recipe and what it moves and keeps (the module docstring).

    `architectures`: the accelerator generations that run it (`estimate.uncertainty.generation`).
    `amax_pass`: an amax reduction pass before each cast (current scaling). `scale_bytes`:
    bytes of scale per element of a quantised copy. `both_directions`: row- and column-wise
    copies on every architecture (block scaling; per-tensor recipes need the second, a
    transpose, only before Blackwell). `weight_cached`: the weight is cast once per step and
    held.
    `saves_fp8_inputs`: linear inputs are kept for backward in FP8. `wgrad_fp8`: the
    weight-gradient GEMM in FP8 (`rowwise_with_gw_hp`: bf16). `head_fp8`, `experts_fp8`: the
    LM head / the routed experts' grouped GEMMs run in FP8. `history`: amax history length.
    `amax_reduction_tp`: a scalar all-reduce over the TP group per quantised sequence-parallel
    input (column-parallel) and output gradient (row-parallel) — TE's current scaling,
    module/linear.py `set_quantizer_amax_reduction_group`. `torchao_bytes`: the torchao
    roofline's bytes per element (input forward, input backward, output gradient, weight
    forward, weight backward)."""

    name: str
    framework: str
    title: str
    source: str
    architectures: tuple[str, ...]
    amax_pass: bool = False
    scale_bytes: float = 0.0
    both_directions: bool = False
    weight_cached: bool = True
    saves_fp8_inputs: bool = True
    wgrad_fp8: bool = True
    head_fp8: bool = False
    experts_fp8: bool = True
    history: int = 0
    amax_reduction_tp: bool = False
    torchao_bytes: tuple[float, float, float, float, float] | None = None

    def cast_bytes(self, generation: str, fsdp: bool = False) -> CastBytes:
        """The bytes per element each cast moves on `generation` (hopper, blackwell, …);
        `fsdp`: weights are sharded and gathered per layer (ZeRO-3), so TE re-casts them each
        micro-batch instead of once per step."""
        if self.torchao_bytes is not None:
            i_f, i_b, g_b, w_f, w_b = self.torchao_bytes
            return CastBytes(i_f, i_b, g_b, w_f, w_b, 0.0)
        copies = 2 if (self.both_directions or generation != "blackwell") else 1
        cast = 2.0 + copies * (1.0 + self.scale_bytes) + (2.0 if self.amax_pass else 0.0)
        if self.weight_cached and not fsdp:
            return CastBytes(cast, 0.0, cast, 0.0, 0.0, cast)
        return CastBytes(cast, 0.0, cast, cast, 0.0, 0.0)

    def weight_copy_bytes(self, generation: str, fsdp: bool = False) -> float:
        """Bytes held per element of an FP8 weight across the step (TE's cached workspaces;
        none under FSDP, nor in torchao)."""
        if not self.weight_cached or fsdp or self.torchao_bytes is not None:
            return 0.0
        copies = 2 if (self.both_directions or generation != "blackwell") else 1
        return copies * (1.0 + self.scale_bytes)

    def saved_input_bytes(self) -> float:
        """Bytes per element of a linear input saved for backward (0: kept in bf16)."""
        return 1.0 + self.scale_bytes if self.saves_fp8_inputs else 0.0

    def scaling_state_bytes(self) -> float:
        """fp32 bytes of scaling state per FP8 GEMM: amax history (delayed) and the scale and
        inverse scale of each of its `SCALED_TENSORS` tensors."""
        return SCALED_TENSORS * (self.history + 2) * 4.0 if self.framework == "te" else 0.0


_TE = "Transformer Engine 2.x (common/recipe/__init__.py, pytorch/csrc/quantizer.cpp @ d0067d0)"
_AO = ("torchao 0.18.0 (float8/config.py `Float8LinearRecipeName`, "
       "testing/training/roofline_utils.py) through torchtitan 0.3.0 "
       "(components/quantization/float8.py, mx.py)")
RECIPES: dict[tuple[str, str], Fp8Recipe] = {(r.framework, r.name): r for r in (
    Fp8Recipe("delayed", "te", "DelayedScaling (per-tensor, amax history)", _TE,
              ("hopper", "blackwell"), history=AMAX_HISTORY),
    Fp8Recipe("tensorwise", "te", "Float8CurrentScaling (per-tensor current scaling)", _TE,
              ("hopper", "blackwell"), amax_pass=True, amax_reduction_tp=True),
    Fp8Recipe("mxfp8", "te", "MXFP8BlockScaling (1×32 blocks, E8M0 scales)", _TE,
              ("blackwell",), scale_bytes=1 / 32, both_directions=True),
    Fp8Recipe("blockwise", "te", "Float8BlockScaling (1×128 / 128×128 blocks)", _TE,
              ("hopper",), scale_bytes=4 / 128, both_directions=True),
    # torchtitan converts every Linear whose dims are multiples of 16, the LM head included
    # (Float8LinearConverter.Config.filter_fqns defaults to []); GroupedExperts need a
    # separate converter (Float8GroupedExpertsConverter), so routed experts stay bf16
    Fp8Recipe("rowwise", "torchao", "float8 rowwise (axiswise scales, e4m3)", _AO,
              ("hopper", "blackwell", "cdna3"), weight_cached=False,
              saves_fp8_inputs=False, head_fp8=True, experts_fp8=False,
              torchao_bytes=(5.0, 3.0, 8.0, 3.0, 7.0)),
    Fp8Recipe("rowwise_with_gw_hp", "torchao",
              "float8 rowwise, weight gradient in bf16", _AO,
              ("hopper", "blackwell", "cdna3"), weight_cached=False,
              saves_fp8_inputs=False, wgrad_fp8=False, head_fp8=True, experts_fp8=False,
              torchao_bytes=(3.0, 0.0, 3.0, 3.0, 3.0)),
    Fp8Recipe("mxfp8", "torchao", "MX float8 (1×32 blocks)", _AO, ("blackwell",),
              weight_cached=False, saves_fp8_inputs=False, head_fp8=True,
              experts_fp8=False, torchao_bytes=(3.0, 3.0, 6.0, 3.0, 3.0)),
)}


def recipe_names(framework: str | None = None) -> tuple[str, ...]:
    """The recipes' names (of one framework), without repeats."""
    return tuple(dict.fromkeys(name for fw, name in RECIPES if framework in (None, fw)))


def get_recipe(framework: str, name: str) -> Fp8Recipe:
    """The recipe `name` of `framework` ("te" or "torchao")."""
    recipe = RECIPES.get((framework, name))
    if recipe is None:
        raise ShardwiseError(f"no FP8 recipe {name!r} in {framework}; valid: "
                             f"{', '.join(recipe_names(framework)) or 'none'}")
    return recipe
