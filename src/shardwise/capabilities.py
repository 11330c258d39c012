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
    from shardwise.estimate.kernels import fp8_on

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
