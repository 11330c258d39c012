"""One prepared run that checks shardwise's CUDA and NCCL path and calibrates the GPU (issue 38).

    PYTHONPATH=src python benchmarks/gpu_check.py OUT            # a GPU machine: ~4-5 min
    PYTHONPATH=src python benchmarks/gpu_check.py --dry-run OUT  # any CPU: tiny sizes, gloo

writes OUT/gpu_check.json, OUT/summary.md and OUT/calibration-<accelerator>.json, rewritten
after every step; each step runs on fresh ranks with its own timeout inside a global budget.
Modules: `config` (sizes, tolerances), `notebook`, one per section (`correctness`, `kernels`,
`memory`, `calibration`, `multigpu`), `steps` (`STEPS`), `report`, `main` (`run`, `main`).
What each figure means, the tolerances and the steps' budget: docs/howto/gpu-check.md.
"""

from gpu_check.calibration import (
    SHIPPED,
    attention_rank,
    fit_calibration,
    flex_rank,
    gemm_rank,
    hbm_rank,
)
from gpu_check.config import (
    DRY,
    DRY_BUDGET_S,
    GLOBAL_BUDGET_S,
    GPU,
    LLAMA3_8B,
    MIN_STEP_S,
    PROFILE_TARGET,
    SCHEMA,
    TOLERANCE,
    Context,
    Sizes,
    U,
)
from gpu_check.correctness import compare_train, env_rank, reference_rank, train_rank
from gpu_check.kernels import SDPA_KERNELS, kernels_rank
from gpu_check.main import PRELOAD, main, run
from gpu_check.memory import (
    _layer_model,
    hf_checks,
    hf_layers_rank,
    layer_memory_rank,
    memory_checks,
    tiny_memory_rank,
)
from gpu_check.multigpu import COLLECTIVES, collective_checks, collectives_rank
from gpu_check.notebook import Notebook, check_item
from gpu_check.report import MEMORY_FIGURES, Report, accelerator_label, summary_markdown
from gpu_check.steps import STEPS, Step, StepFailed, StepSkipped, on_ranks, then
from shardwise.arch import get_model

__all__ = ["COLLECTIVES", "DRY", "DRY_BUDGET_S", "GLOBAL_BUDGET_S", "GPU", "LLAMA3_8B",
           "MEMORY_FIGURES", "MIN_STEP_S", "PRELOAD", "PROFILE_TARGET", "SCHEMA",
           "SDPA_KERNELS", "SHIPPED", "STEPS", "TOLERANCE", "Context", "Notebook",
           "Report", "Sizes", "Step", "StepFailed", "StepSkipped", "U", "_layer_model",
           "accelerator_label", "attention_rank", "check_item", "collective_checks",
           "collectives_rank", "compare_train", "env_rank", "fit_calibration",
           "flex_rank", "gemm_rank", "get_model", "hbm_rank", "hf_checks",
           "hf_layers_rank", "kernels_rank", "layer_memory_rank", "main",
           "memory_checks", "on_ranks", "reference_rank", "run", "summary_markdown",
           "then", "tiny_memory_rank", "train_rank"]
