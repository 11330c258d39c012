"""Pipeline parallelism: run a schedule's action lists with real send/recv (SPEC §6, §8).

Modules: `stages` (virtual stages, the `StageModel` protocol, `PipelineModel`), `deferral`
(ZB-H1: B defers the weight gradients, W computes them), `executor` (`run_pipeline`,
`measured_timeline`). Schedules (GPipe, 1F1B, interleaved, ZB-H1), messages, memory and
the agreement check: docs/concepts/runtime.md#pipeline-parallelism.
"""

from shardwise.runtime.pipeline.deferral import (
    GradTarget,
    SavedOp,
    accumulate_grad,
    backward_input,
    backward_weight,
    defer_linears,
    deferred_ops,
    deferring_weight_grads,
    replay_contexts,
)
from shardwise.runtime.pipeline.executor import (
    PipelineResult,
    _check_agreement,
    measured_timeline,
    run_pipeline,
)
from shardwise.runtime.pipeline.stages import (
    PipelineModel,
    StageModel,
    VirtualStage,
    virtual_stages,
)

__all__ = [
    "GradTarget",
    "PipelineModel",
    "PipelineResult",
    "SavedOp",
    "StageModel",
    "VirtualStage",
    "_check_agreement",
    "accumulate_grad",
    "backward_input",
    "backward_weight",
    "defer_linears",
    "deferred_ops",
    "deferring_weight_grads",
    "measured_timeline",
    "replay_contexts",
    "run_pipeline",
    "virtual_stages",
]
