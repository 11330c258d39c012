"""Training stacks: the code a run uses, one value that decides memory, time, search and export.

A `Stack` names a training code at a pinned version and lists, as read from that code, what
decides a step's memory and time there: which tensors a layer keeps (its activation profile,
`estimate.profiles`), how many memory-bound passes a layer makes (fused kernels, eager PyTorch
or `torch.compile`), how TP, DP/FSDP and pipeline traffic overlap compute, which recompute
policies, attention kernels, ZeRO/FSDP forms, schedules and context-parallel kinds it has, and
which framework `--emit` writes for it. `TrainSpec.impl` holds the stack's name;
`resolve(train)` fills the choices a run did not state with the stack's defaults (the values
its argument parser or config class defaults to) and says which were assumed.

The type is `stacks.stack`, the per-stack facts and their sources `STACKS` in
`stacks.definitions` (an earlier torchtitan: `stacks.titan_versions`), the pipeline split
rules `stacks.splits`; this module is the registry.
docs/concepts/stacks.md explains how each behaviour enters the step-time model.
"""

from __future__ import annotations

import shardwise.stacks.definitions  # fills STACKS
import shardwise.stacks.titan_versions  # noqa: F401  (torchtitan@0.1.0)
from shardwise.stacks.splits import (
    SPLIT_RULES,
    balanced_ends,
    deepspeed_split,
    neox_split,
    neox_uniform,
    split_refuses,
    stack_split,
    titan_partition,
    titan_split,
)
from shardwise.stacks.stack import (
    ATTENTION_KERNELS,
    CP_KIND_TEXT,
    DEFAULT_STACK,
    OFFLOADS,
    SPLITS,
    STACKS,
    TP_OVERLAPS,
    Offload,
    Rule,
    Settings,
    Stack,
    get_stack,
    parse_impl,
    resolve,
    stack_names,
)

__all__ = [
    "ATTENTION_KERNELS",
    "CP_KIND_TEXT",
    "DEFAULT_STACK",
    "OFFLOADS",
    "SPLITS",
    "SPLIT_RULES",
    "STACKS",
    "TP_OVERLAPS",
    "Offload",
    "Rule",
    "Settings",
    "Stack",
    "balanced_ends",
    "deepspeed_split",
    "get_stack",
    "neox_split",
    "neox_uniform",
    "parse_impl",
    "resolve",
    "split_refuses",
    "stack_names",
    "stack_split",
    "titan_partition",
    "titan_split",
]
