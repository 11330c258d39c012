"""What each accelerator generation can run: one table for the attention kernels, with the FP8
recipes' own (`fp8.Fp8Recipe.architectures`), checked once per plan, estimate or export
(`check`), so a kernel chosen (`--attention`, `--fp8`) is refused where it cannot run
instead of planned and marked †; a stack's default kernel stands as the stack is modelled.

Generations are `hardware.generation`'s (ampere, hopper, blackwell, cdna3, tpu); an
accelerator file takes its `calibrated_as` preset's generation, and one without it runs only
the kernels every generation runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.errors import ShardwiseError

if TYPE_CHECKING:
    from shardwise.fp8 import Fp8Recipe
    from shardwise.hardware import Accelerator
    from shardwise.layout import TrainSpec

__all__ = ["ANY", "ATTENTION", "attention_runs", "check"]

ANY = "any"

# attention kernel → the generations that run it (`stacks.stack.ATTENTION_KERNELS`):
# - fa3: FlashAttention-3 (Shah et al. 2024) is written for Hopper's WGMMA and TMA: the
#   flash-attention repository's hopper/README.md, "Requirements: H100 / H800 GPU, CUDA ≥
#   12.3" (setup.py builds sm90a only); Ampere, Blackwell and AMD parts do not run it.
# - fa2: flash-attn 2.x (README "FlashAttention-2 with CUDA": Ampere, Ada or Hopper; the ROCm
#   composable-kernel backend: MI200/MI300; 2.8 builds sm100 for Blackwell); no TPU build.
# - cudnn: cuDNN's fused SDPA (Transformer Engine's "fused" backend) needs sm80+ (cuDNN
#   frontend docs, "Scaled dot product attention": Ampere and later); Transformer Engine on
#   ROCm maps it to its CK/aotriton fused attention; no TPU build.
# - flex, triton, math: compiled by Triton / PyTorch for whatever the device is.
ATTENTION: dict[str, tuple[str, ...]] = {
    "fa3": ("hopper",),
    "fa2": ("ampere", "hopper", "blackwell", "cdna3"),
    "cudnn": ("ampere", "hopper", "blackwell", "cdna3"),
    "flex": (ANY,),
    "triton": (ANY,),
    "math": (ANY,),
}

_TITLES = {"fa3": "FlashAttention-3", "fa2": "FlashAttention-2", "cudnn": "cuDNN fused attention"}


def attention_runs(kernel: str, generation: str) -> bool:
    """Whether accelerators of `generation` run the attention `kernel`."""
    where = ATTENTION.get(kernel, (ANY,))
    return ANY in where or generation in where


def check(train: TrainSpec, accelerator: Accelerator, generation: str) -> Fp8Recipe | None:
    """`train`'s kernels against `accelerator` (of `generation`): its attention kernel
    (`ATTENTION`) and FP8 recipe (`estimate.kernels.fp8_on`); one line naming the generations
    that run it and what would run here. Returns the FP8 recipe (None in bf16)."""
    settings = train.settings()
    kernel = settings.attention
    # a stack's default kernel (not chosen) stands: it is how the stack is modelled everywhere
    if "attention" not in settings.assumed and not attention_runs(kernel, generation):
        fits = [k for k in settings.stack.attention
                if k != "math" and attention_runs(k, generation)]
        other = f"; use --attention {' or '.join(fits)}" if fits else ""
        raise ShardwiseError(
            f"--attention {kernel} ({_TITLES.get(kernel, kernel)}) runs on "
            f"{', '.join(ATTENTION[kernel])} GPUs, not {accelerator.name} ({generation})"
            f"{other}")
    return fp8_on(train, accelerator, generation)


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
