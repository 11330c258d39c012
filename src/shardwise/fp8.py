"""FP8 training recipes as the frameworks run them: `Fp8Recipe`, `RECIPES` (framework "te":
Transformer Engine through Megatron-LM's `--fp8-recipe` — delayed, tensorwise, mxfp8,
blockwise; "torchao": torchtitan 0.3.0's converters — rowwise, rowwise_with_gw_hp, mxfp8 — and
0.1.0's default tensorwise; "composer": Composer's `amp_fp8` over TE's `te.Linear`, llm-foundry's
`fc_type: te` — delayed), the bytes each recipe's casts move and what stays in memory. The
GEMMs of the linear layers run in FP8; attention, norms, router and (Megatron-LM) the LM head
stay bf16. The derivation and its sources (Transformer Engine d0067d0, torchao 0.18.0):
docs/concepts/fp8-offload.md, "FP8 recipes in the code".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from shardwise.errors import ShardwiseError

__all__ = ["AMAX_HISTORY", "COMPOSER_AMAX_HISTORY", "RECIPES", "CastBytes", "Fp8Recipe", "get_recipe", "recipe_names"]

AMAX_HISTORY = 1024
"""Delayed scaling's amax history length: Transformer Engine's `DelayedScaling` default and
NeMo's recipes (Megatron-LM's `--fp8-amax-history-len` defaults to 1; `--emit megatron` writes
1024 with `--fp8-amax-compute-algo max`)."""

COMPOSER_AMAX_HISTORY = 16
"""Composer's `amp_fp8` recipe when the run gives no `precision_config`:
`DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")`
(composer/core/precision.py `get_precision_context`, mosaicml 0.17.2 — llm-foundry 5e85bd62's
pin, its FP8 table's commit — through 0.21.3, 4952183768's)."""

TE_STATE_FRAMEWORKS = ("te", "composer")
"""The frameworks whose recipes keep Transformer Engine's fp8_meta scaling state."""

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
        return (SCALED_TENSORS * (self.history + 2) * 4.0
                if self.framework in TE_STATE_FRAMEWORKS else 0.0)


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
    # torchtitan 0.1.0's default (float8.recipe_name None: dynamic per-tensor scaling,
    # components/quantization/float8.py @v0.1.0; stacks.titan_versions); the roofline's
    # tensorwise branch: amax read, then one cast writing both float8 layouts
    Fp8Recipe("tensorwise", "torchao", "float8 tensorwise (dynamic per-tensor scales)", _AO,
              ("hopper", "blackwell", "cdna3"), weight_cached=False,
              saves_fp8_inputs=False, head_fp8=True, experts_fp8=False,
              torchao_bytes=(6.0, 0.0, 6.0, 5.0, 3.0)),
)}


# Composer + Transformer Engine 0.10 (llm-foundry's FP8 benchmarks): TE's delayed scaling with
# Composer's history; MPT calls te.Linear without `is_first_microbatch`, so TE 0.10
# (pytorch/module/linear.py: update_fp8_weights = is_first_microbatch is None or ...) casts
# and transposes each weight every micro-batch and keeps no FP8 weight cache
_DELAYED = RECIPES[("te", "delayed")]
RECIPES[("composer", "delayed")] = replace(
    _DELAYED, framework="composer",
    title="DelayedScaling (HYBRID, amax history 16, max) through Composer amp_fp8",
    source=("Composer 0.17.2-0.21.3 composer/core/precision.py; Transformer Engine v0.10 "
            "common/recipe.py, pytorch/module/linear.py; llm-foundry 4952183768 "
            "scripts/train/benchmarking/submit_benchmarks.py (fc_type 'te'), "
            "llmfoundry/models/layers/fc.py"),
    history=COMPOSER_AMAX_HISTORY, weight_cached=False)


def recipe_names(framework: str | None = None) -> tuple[str, ...]:
    """The recipes' names (of one framework), without repeats."""
    return tuple(dict.fromkeys(name for fw, name in RECIPES if framework in (None, fw)))


def get_recipe(framework: str, name: str) -> Fp8Recipe:
    """The recipe `name` of `framework` ("te", "torchao" or "composer")."""
    recipe = RECIPES.get((framework, name))
    if recipe is None:
        raise ShardwiseError(f"no FP8 recipe {name!r} in {framework}; valid: "
                             f"{', '.join(recipe_names(framework)) or 'none'}")
    return recipe
