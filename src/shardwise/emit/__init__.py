"""Launch configuration of a layout for a real framework: go from the plan to a run.

    emit(framework, model, layout, train, gpus_per_node=8, cluster=None) -> Emitted(text, notes)

The plan's stack (`TrainSpec.impl`) must be the framework's (`Stack.export`): the search
already took only what that stack runs. One module per framework, each targeting one pinned
version and tested against that version's own parser (tests/integration): `megatron`,
`torchtitan`, `deepspeed`; `common` holds the shared checks. Exact or refused: the
configuration runs every planned value, or `ShardwiseError` says in one line what the framework
cannot run, the nearest layout it runs and that layout's predicted step time (`nearest`).
docs/howto/export.md lists what each export runs and refuses.
"""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.emit.common import (
    FRAMEWORKS,
    VERSIONS,
    Emitted,
    _refusals,
    framework_stack,
    layout_text,
    model_refusal,
    nearest,
    unrunnable,
)
from shardwise.emit.deepspeed import deepspeed_config
from shardwise.emit.megatron import megatron_args
from shardwise.emit.torchtitan import torchtitan_args
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec

__all__ = ["FRAMEWORKS", "VERSIONS", "Emitted", "_refusals", "deepspeed_config", "emit",
           "framework_stack", "layout_text", "megatron_args", "model_refusal", "nearest",
           "torchtitan_args", "unrunnable"]


def emit(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec,
         gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """The launch configuration of `layout` for `framework` (one of `FRAMEWORKS`), whose stack
    `train` must name; `cluster` prices the nearest layout of a refusal (default: H100s)."""
    table = {"megatron": megatron_args, "torchtitan": torchtitan_args,
             "deepspeed": deepspeed_config}
    key = framework.lower()
    if key not in table:
        raise ShardwiseError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    if gpus_per_node < 1:
        raise ShardwiseError(f"gpus_per_node must be ≥ 1, got {gpus_per_node}")
    return table[key](model, layout, train, gpus_per_node, cluster)
