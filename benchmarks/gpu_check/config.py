"""The run's budget, tolerances and sizes (`GPU`, `DRY`), and the `Context` every step gets.
The tolerances' derivation: docs/howto/gpu-check.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GLOBAL_BUDGET_S = 450.0  # one GPU: 7.5 minutes, inside the 8
DRY_BUDGET_S = 170.0  # a stop, not a target: 60–107 s measured on 2 cores at load 12–18
MIN_STEP_S = 8.0  # a step given less is skipped ("global budget spent")
SCHEMA = 1

# Tolerances (relative), from the unit roundoff u of the dtype (fp32 2^-24, bf16 2^-8); the
# docs page derives them. `train`: loss and gradient norm of every step against the fp64 run
# from the same initial weights. `kernels`: ‖x − x_ref‖/‖x_ref‖ of the output and of every
# gradient, against fp64 on the same (rounded) inputs and weights.
U = {"fp32": 2.0**-24, "bf16": 2.0**-8}
TOLERANCE = {
    ("loss", "fp32"): 2**6 * U["fp32"],  # 3.8e-6: ~u per op, no TF32 (a TF32 GEMM: ~1e-3)
    ("grad_norm", "fp32"): 2**8 * U["fp32"],  # 1.5e-5
    ("loss", "bf16"): U["bf16"] / 4,  # 9.8e-4: the mean of B·s tokens' roundings
    ("grad_norm", "bf16"): 4 * U["bf16"],  # 1.6e-2: ≤ 4 roundings on a gradient's path
    ("kernel", "fp32"): 2**10 * U["fp32"],  # 6.1e-5: √K·u for inner sums K ≤ 2^10, ×4
    ("kernel", "bf16"): 4 * U["bf16"],  # 1.6e-2: forward ~u, backward ≤ 4 roundings
    ("module", "fp32"): 2**10 * U["fp32"],  # a layer (MoE, MLA): as a kernel in fp32,
    ("module", "bf16"): 8 * U["bf16"],  # 3.1e-2: twice a kernel's chain of bf16 roundings
}
PROFILE_TARGET = 0.01  # saved bytes of transformers' layers against their profile (as on CPU)


@dataclass(frozen=True)
class Sizes:
    """What each step runs: `GPU` on a device, `DRY` on a CPU (tiny, seconds)."""

    train_runs: tuple[tuple[str, str], ...]  # (model preset, dtype) of `train`
    train_steps: int
    train_seq: int
    kernel_seq: int
    moe_tokens: int
    layer_seq: int  # the Llama-3-8B layer
    layer_shape: tuple[int, int, int, int, int]  # (h, heads, kv heads, f, vocab)
    memory_models: tuple[str, ...]  # tiny models through check_layout
    gemm_shapes: tuple[tuple[int, int, int], ...]  # (m, n, k)
    attention_seqs: tuple[int, ...]
    attention_dims: tuple[int, ...]
    attention_tokens: int  # batch × seq of every attention point (FlashAttention's 16k)
    attention_hidden: int  # heads × head dim (FlashAttention's benchmarks: 2048)
    flex_seqs: tuple[int, ...]
    flex_dims: tuple[int, ...]
    hbm_elements: tuple[int, ...]
    collective_sizes: tuple[int, ...]  # bytes
    multi_layouts: tuple[str, ...]  # `shardwise check` layouts
    timing_s: float  # seconds per timed point (`runtime.calibrate._seconds`' budget)


def _gemm_shapes(cubes: tuple[int, ...], wide: int, thin: tuple[int, ...],
                 tokens: int, projections: tuple[tuple[int, int], ...]
                 ) -> tuple[tuple[int, int, int], ...]:
    """Cubes, thin × wide × wide (small per-rank matmuls) and a Transformer's projections
    `(tokens × k) · (k × n)` — what `fit_gemm`'s `e_max·Π d/(d + d½)` is fitted over."""
    shapes = [(d, d, d) for d in cubes] + [(m, wide, wide) for m in thin]
    shapes += [(tokens, n, k) for k, n in projections]
    return tuple(dict.fromkeys(shapes))


LLAMA3_8B = (4096, 32, 8, 14336, 128256)
GPU = Sizes(
    train_runs=(("tiny", "fp32"), ("tiny-moe", "fp32"), ("tiny-deepseek", "fp32"),
                ("tiny", "bf16")),
    train_steps=4, train_seq=64, kernel_seq=256, moe_tokens=256,
    layer_seq=4096, layer_shape=LLAMA3_8B,
    memory_models=("tiny", "tiny-moe", "tiny-deepseek"),
    gemm_shapes=_gemm_shapes((256, 512, 1024, 2048, 4096, 8192), 8192, (16, 64, 128, 512),
                             4096, ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096),
                                    (4096, 7168), (7168, 4096), (4096, 512))),
    attention_seqs=(512, 1024, 2048, 4096, 8192), attention_dims=(64, 128),
    attention_tokens=16384, attention_hidden=2048,
    flex_seqs=(1024, 4096), flex_dims=(64, 128),
    hbm_elements=(2**26, 2**28),
    collective_sizes=tuple(2**e for e in range(10, 31, 4)),  # 1 KiB … 1 GiB
    multi_layouts=("dp2", "tp2", "pp2"), timing_s=0.05)
DRY = Sizes(  # MoE and MLA run in `kernels` (the CPU trains and checks them slowly)
    train_runs=(("tiny", "fp32"), ("tiny", "bf16")), train_steps=2, train_seq=32,
    kernel_seq=64, moe_tokens=64, layer_seq=128, layer_shape=(128, 4, 2, 256, 512),
    memory_models=("tiny",),
    gemm_shapes=_gemm_shapes((32, 64, 128), 128, (8, 16), 64, ((128, 64), (64, 128))),
    attention_seqs=(64, 128), attention_dims=(16, 32), attention_tokens=256,
    attention_hidden=64, flex_seqs=(64,), flex_dims=(16,), hbm_elements=(2**16, 2**18),
    collective_sizes=(2**10, 2**14), multi_layouts=("dp2",), timing_s=0.01)


@dataclass(frozen=True)
class Context:
    """What every step's ranks need (picklable): dry run or not, the sizes, the accelerator
    preset this GPU is fitted as, the folder of the steps' notebooks."""

    dry_run: bool
    sizes: Sizes
    accelerator: str | None  # None: a GPU no preset describes (the fit is skipped)
    scratch: str

    def device(self) -> Any:
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")


