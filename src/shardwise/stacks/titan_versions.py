"""torchtitan's earlier release as a second stack version: `torchtitan@0.1.0` (`--impl
torchtitan@0.1.0`; `--impl torchtitan` stays 0.3.0). v0.1.0 (2025-06-17) is the first tagged
release and the one nearest the published torchtitan runs of 2024-25 (spring-2024 docs, the
AWS blog of 2024-10, torchao's float8 tables on 0.0.2 and 2c8b5947): like them it attends with
`F.scaled_dot_product_attention` whose flash backend (FlashAttention-2) it puts first on
Ampere and Hopper, and trains FP8 with torchao's tensorwise recipe by default. v0.2.0 already
puts cuDNN attention first and adds MoE. Each fact cites torchtitan's code at tag v0.1.0
(github.com/pytorch/torchtitan); benchmarks/torchtitan_v0.1.0_facts.json holds those read
by scripts/torchtitan_facts.py, which tests/test_stacks_titan_versions.py checks the stack
against. It has no export: its TOML sections differ from 0.3.0's ConfigManager, so
`--emit torchtitan` refuses it. docs/concepts/stacks.md, "Stack versions"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardwise.choices import RECOMPUTE
from shardwise.schedules.registry import SCHEDULE_CODES
from shardwise.stacks.definitions import TORCHTITAN_KERNELS, TORCHTITAN_TRAFFIC
from shardwise.stacks.stack import STACKS, Offload, Rule, Stack

TITAN_010 = "torchtitan@0.1.0"
_AT = "@v0.1.0"


def _flex(train: Any) -> bool:
    return getattr(train, "attention", None) == "flex"


def _selective(v: Mapping[str, Any], train: Any) -> Any:
    """activation_checkpoint.mode "selective": per-op SAC, or layer SAC (a share of the
    layers under full recompute: `TrainSpec.recompute_share` < 1)."""
    rc = np.asarray(v["recompute"])
    share = getattr(train, "recompute_share", 1.0)
    return (rc == RECOMPUTE.index("op-sac")) | ((rc == RECOMPUTE.index("full")) & (share < 1))


STACKS[TITAN_010] = Stack(
    TITAN_010, "torchtitan 0.1.0 (SDPA)", "torchtitan 0.1.0",
    "torchtitan/config_manager.py (training.compile False; enable_async_tensor_parallel False, "
    "needs compile; activation_checkpoint.mode 'selective', selective_ac_option '2'; "
    "float8.recipe_name None = tensorwise), models/attention.py (ScaledDotProductAttention: "
    "flash, efficient, math; cuDNN first on sm100 only), models/llama3/model/args.py "
    "(use_flex_attn False) " + _AT,
    profile="torchtitan", kernels="eager", compile=(False, True),
    # parallelize.py:51 "Async TP requires --training.compile"
    tp_overlap=("none", "async"), dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False,
    # SDPA under sdpa_kernel([FLASH, EFFICIENT, MATH], set_priority=True): FlashAttention-2 on
    # sm80/sm90 whatever torch's own order (cuDNN first on H100 in torch 2.5.0, pytorch#125343,
    # opt-in again from 2.5.1, pytorch#138522, preferred on sm90/sm100 again from 2.9,
    # pytorch#162073, with cuDNN > 9.15.0); on sm100 cuDNN goes first (attention.py:206),
    # timed there with the accelerator's default curve. FlexAttention: a flavor with
    # use_flex_attn=True (args.py:36), refused with selective AC and with CP (rules)
    attention=("fa2", "flex"),
    # activation_checkpoint.mode none | full | selective, selective_ac_option "op" (per-op SAC)
    # or a digit n: layer SAC, every n-th block under checkpoint_wrapper (parallelize.py:
    # _apply_ac_to_transformer_block) = full recompute of a share of the layers
    recompute=("none", "full", "op-sac"),
    # FSDP2 as in 0.3.0: fsdp_reshard_after_forward default|always|never, HSDP with
    # data_parallel_replicate_degree (config_manager.py:258-284); ZeRO-0 is DDP (rule)
    zero=(0, 2, 3), zero_hybrid=(2, 3),
    # parallelism.context_parallel_rotate_method "allgather" (default) | "alltoall": PyTorch's
    # context_parallel over SDPA, K/V all-gathered or passed round the ring
    # (config_manager.py:358); its backward gathers K/V again (not kept)
    cp_kinds=("allgather", "ring"), cp_overlap=True, cp_gather_kept=False,
    # no expert_parallel_degree in config_manager.py: MoE only under experiments/ (llama4,
    # deepseek_v3), not in the core llama3 the stack times
    axes=("tp", "pp", "cp"), pipeline_engine="torchtitan", p2p_overlap="always",
    # training.mixed_precision_param bfloat16 | float32, mixed_precision_reduce float32 only
    dtypes=("bf16", "fp32"), grad_dtypes=(("bf16", ("fp32",)), ("fp32", ("fp32",))),
    export=None,
    # distributed/pipeline.py generate_split_points: L + input + output weights spread
    # evenly, the extra units on the first stages (as 0.3.0)
    split="torchtitan",
    rules=(
        Rule(lambda v, train: _flex(train) & (np.asarray(v["cp"]) > 1),
             "has no context parallelism (cp={cp}) with FlexAttention; use attention fa2 "
             "(SDPA)", "torchtitan/models/llama3/model/args.py:51 " + _AT),
        Rule(lambda v, train: _flex(train) & _selective(v, train),
             "runs FlexAttention without selective activation checkpointing (per-op or layer "
             "SAC) only; use attention fa2 (SDPA) or recompute none / full",
             "torchtitan/models/llama3/model/args.py:45 " + _AT),
        # zero=0 is DDP (dp_replicate, no dp_shard), only where FSDP is off (no CP)
        Rule(lambda v, train: (np.asarray(v["zero"]) == 0) & (np.asarray(v["dp"]) > 1)
             & (np.asarray(v["cp"]) == 1)
             & ((np.asarray(v["tp"]) > 1) | (np.asarray(v["pp"]) > 1)),
             "replicates without sharding (zero=0: DDP) on a one-dimensional mesh only: "
             "tp={tp}, pp={pp} need zero 2 or 3",
             "torchtitan/models/llama3/infra/parallelize.py:112 " + _AT),
        Rule(lambda v, train: (np.asarray(v["zero"]) == 0) & (np.asarray(v["cp"]) > 1),
             "shards the weights over the context-parallel ranks whenever cp > 1 (FSDP over "
             "dp_shard·cp): cp={cp} needs zero 2 or 3",
             "torchtitan/models/llama3/infra/parallelize.py:82 " + _AT),
        # only ScheduleZBVZeroBubble gets the V stage placement (style "v"), any other
        # multi-stage class is looped
        Rule(lambda v, train: (np.asarray(v["pp"]) > 1)
             & (np.asarray(v["schedule"]) == SCHEDULE_CODES["dualpipev"]),
             "places only ZBVZeroBubble's stages in a V, not DualPipeV's",
             "torchtitan/models/llama3/infra/pipeline.py:143 " + _AT),
    ),
    elementwise=TORCHTITAN_TRAFFIC, eager_kernels=TORCHTITAN_KERNELS,
    notes=("Llama 3 block as in 0.3.0 (nn.RMSNorm, complex RoPE), counted eagerly",),
    # components/quantization/float8.py: recipe_name None → tensorwise (optionally with
    # float8 all-gather), rowwise, rowwise_with_gw_hp; mx.py: MXFP8 (recipe_name "mxfp8")
    fp8=("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"), fp8_framework="torchao",
    # training.enable_cpu_offload: FSDP2's CPUOffloadPolicy (config_manager.py:216)
    offloads=(Offload("params", (3,), "torch-adamw-fused", "none",
                      "--training.enable_cpu_offload"),),
).validate()
