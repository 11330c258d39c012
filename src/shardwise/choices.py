"""The vocabulary of a layout: the parallel axes and the named choices a `Layout` takes
(recompute policy, context-parallel kind) and a `TrainSpec`'s optimizers.

One home for these names, shared by `layout`, `partition`, `layout_checks`, the planner's
arrays (as indices: `Layout.codes()`), the CLI and the web API.
"""

from __future__ import annotations

from typing import Any

import numpy as np

AXES: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
"""The parallel axes, spelled the same everywhere: `Layout` fields, CLI options (`--tp`), layout
text (`tp=8`), JSON keys, the planner's arrays and the runtime mesh's axis names."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
RECOMPUTE = ("none", "selective", "full", "op-sac")
RECOMPUTE_LIGHTEST_FIRST = ("none", "selective", "op-sac", "full")
"""Recompute policies by how much they recompute (and save), least first."""
CP_KINDS = ("ring", "ulysses", "hybrid", "allgather")
"""How context parallelism splits attention (`Layout.cp_kind`; docs/concepts/context-parallel.md):
ring attention (K/V blocks around the cp group), DeepSpeed-Ulysses (all-to-all over heads),
their hybrid (Ulysses inside groups of `Layout.ulysses` ranks, a ring across the groups), or
K and V all-gathered before the attention (torchtitan's FlexAttention CP)."""
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
"""Megatron's `--recompute-modules` (with `--recompute-granularity selective`; megatron-core
0.16.1 transformer/transformer_config.py `recompute_modules`, default ["core_attn"])."""
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                   "expert_fc1", "moe_act")
"""Megatron's `--offload-modules` (with `--fine-grained-activation-offloading`; megatron-core
0.16.1 transformer_config.py `offload_modules`): whose inputs move to host memory."""
MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
"""Megatron's precision-aware optimizer: `--exp-avg-dtype`/`--exp-avg-sq-dtype` choices
(megatron-core 0.16.1 optimizer/optimizer_config.py; TE's FusedAdam); master weights
`--main-params-dtype` fp32 or fp16."""
OPTIMIZERS = ("adam", "sgd-momentum", "sgd", "adam-8bit", "adafactor")


def ulysses_degree(cp: Any, cp_kind: Any, ulysses: Any) -> Any:
    """Ranks each all-to-all over heads spans, for layouts as numbers or arrays (`cp_kind` as
    its code in `CP_KINDS`): 1 for ring attention and the all-gather, `cp` for Ulysses,
    `ulysses` for the hybrid."""
    if type(cp) is int and type(cp_kind) is int and type(ulysses) is int:  # one layout
        return cp if cp_kind == 1 else max(ulysses, 1) if cp_kind == 2 else 1
    return np.where(cp_kind == 1, cp, np.where(cp_kind == 2, np.maximum(ulysses, 1), 1))
