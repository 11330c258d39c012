"""The stacks (`STACKS`): each fact names the code it was read from, at the stack's pinned
version; tests/integration check them against that code. docs/concepts/stacks.md explains how
each behaviour enters the step-time model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardwise.schedules.registry import SCHEDULE_CODES
from shardwise.stacks.stack import STACKS, Offload, Rule, Stack, Traffic

_MEGATRON = "megatron-core 0.16.1; Megatron-LM main d98e8a6"
_MDS = "Megatron-DeepSpeed 4efb479"  # github.com/deepspeedai/Megatron-DeepSpeed, 2025-07-16
_NEOX = "gpt-neox ea7aefd"  # github.com/EleutherAI/gpt-neox, 2026-05-19 (pins DeeperSpeed)
# Counted with a TorchDispatchMode over one decoder layer's forward and backward on CPU in bf16
# (tests/estimate/test_stack_traffic.py recounts them): bytes read + written per token by the
# ops that are neither GEMMs nor attention, fitted as (h, q + kv, f) coefficients over five
# shapes (within 1 %); kernels: those ops' count. One table per block variant (RoPE, gated
# MLP): the Llama block as the stack writes it; without its rotary embedding (learned or no
# positions: GPT-2/3, MPT); with `w2(gelu(w1 x))` for SwiGLU (MPT, GPT-2/3, BLOOM).
TORCHTITAN_TRAFFIC: tuple[tuple[tuple[bool, bool], Traffic], ...] = (
    ((True, True), ((15.8, 27.9, 10.29), (27.4, 27.7, 18.86))),
    ((False, True), ((16.0, 8.0, 10.01), (28.0, 8.0, 18.01))),
    ((True, False), ((15.8, 27.9, 4.29), (21.4, 27.7, 6.86))),
    ((False, False), ((16.0, 8.0, 4.01), (22.0, 8.0, 6.01))),
)
TORCHTITAN_KERNELS = (((True, True), (15.0, 18.0)), ((False, True), (9.0, 10.0)),
                      ((True, False), (14.0, 15.0)), ((False, False), (8.0, 7.0)))
HF_TRAFFIC: tuple[tuple[tuple[bool, bool], Traffic], ...] = (
    ((True, True), ((89.4, 19.5, 9.79), (224.9, 32.0, 17.97))),
    ((False, True), ((87.4, 0.0, 9.79), (224.6, 0.0, 17.97))),
    ((True, False), ((89.4, 19.5, 3.79), (218.9, 32.0, 5.97))),
    ((False, False), ((87.4, 0.0, 3.79), (218.6, 0.0, 5.97))),
)
HF_KERNELS = (((True, True), (40.0, 57.0)), ((False, True), (20.0, 41.0)),
              ((True, False), (39.0, 54.0)), ((False, False), (19.0, 38.0)))
# pytorch-fsdp's blocks: Llama (RoPE) as IBM fms-fsdp writes it, whose RMSNorm is composite in
# eager (foundation-model-stack fms/modules/layernorm.py LayerNormParameterized: pow, mean,
# rsqrt, mul, type_as, weight mul) — HF's counted LlamaDecoderLayer, the same composite norm
# (fms's complex-number RoPE moves about as much as HF's rotate-half); without RoPE as
# llm-foundry's MPT (fused F.layer_norm, GeLU) — torchtitan's table.
FSDP_TRAFFIC = tuple(r for r in HF_TRAFFIC if r[0][0]) + tuple(
    r for r in TORCHTITAN_TRAFFIC if not r[0][0])
FSDP_KERNELS = tuple(r for r in HF_KERNELS if r[0][0]) + tuple(
    r for r in TORCHTITAN_KERNELS if not r[0][0])


# DeepSpeed's pipeline engine (the same lines in GPT-NeoX's DeeperSpeed 91d1c55, :78 and :81)
def _none(v: Any, key: str) -> np.ndarray:
    """No layout of `v` refused (a rule whose setting this run does not use), in the shape of
    field `key`: the rule's fields are then not combined."""
    return np.zeros(np.shape(v[key]), dtype=bool)


PIPE_ZERO = Rule(lambda v, train: (np.asarray(v["pp"]) > 1) & (np.asarray(v["zero"]) >= 2),
                 "runs ZeRO-{zero} without pipeline parallelism only (pp={pp}): its pipeline "
                 "engine asserts ZeRO < 2", "deepspeed/runtime/pipe/engine.py:76 @0.19.8")
# it turns `enable_backward_allreduce` off and reduces after the last backward
# (`_exec_reduce_grads`): an asked-for overlap is a no-op there, said rather than timed
PIPE_DP_OVERLAP = Rule(lambda v, train: np.asarray(v["pp"]) > 1
                       if getattr(train, "dp_overlap", None) is True else _none(v, "pp"),
                       "reduces gradients after the last backward under its pipeline engine "
                       "(pp={pp}): DP overlap has no effect there; drop --dp-overlap",
                       "deepspeed/runtime/pipe/engine.py:80 @0.19.8")


def _zb_h1(v: Mapping[str, Any]) -> Any:
    return (np.asarray(v["pp"]) > 1) & (np.asarray(v["schedule"]) == SCHEDULE_CODES["zb-h1"])


# Each fact names the code it was read from, in the stack's pinned version (Megatron-LM
# paths at d98e8a6, its own megatron/core); tests/integration check them against that code.
STACKS.update({s.name: s.validate() for s in (
    Stack(
        "megatron-te", "Megatron-LM + Transformer Engine", _MEGATRON,
        "megatron/training/arguments.py (--overlap-grad-reduce, --overlap-param-gather default "
        "off; --no-overlap-p2p-communication: on, reset to off without a virtual pipeline), "
        "megatron/core/model_parallel_config.py (tp_comm_overlap: False), transformer_config.py "
        "(recompute_granularity full|selective, attention_backend auto → TE's cuDNN fused "
        "attention on Hopper)",
        profile="megatron-te", kernels="fused", compile=(False,),
        tp_overlap=("none", "bulk"), dp_overlap_zero=(), dp_overlap_settable=True,
        attention=("cudnn", "fa2", "fa3", "math"), recompute=("none", "selective", "full"),
        # ZeRO-1: the distributed optimizer, in groups with --num-distributed-optimizer-
        # instances (core/parallel_state.py:922); ZeRO-2/3: Megatron-FSDP's optim_grads /
        # optim_grads_params, in groups as HSDP when there are several instances
        # (core/distributed/fsdp/mcore_fsdp_adapter.py:346, outer group no_shard)
        zero=(0, 1, 2, 3), zero_hybrid=(1, 2, 3),
        # --cp-comm-type p2p | a2a | a2a+p2p (training/arguments.py --cp-comm-type)
        # context_parallel.py AttnFuncWithCPAndKVAllGather: K/V gathered forward and again
        # backward (it saves the rank's own), dK/dV reduce-scattered
        cp_kinds=("ring", "ulysses", "hybrid", "allgather"),
        cp_overlap=True, axes=("tp", "pp", "cp", "ep"), pipeline_engine="megatron",
        p2p_overlap="interleaved", dtypes=("bf16", "fp16", "fp32"), export="megatron",
        # transformer_config.py fp8_recipe: tensorwise | delayed | mxfp8 | blockwise; the
        # optimizer offload: --optimizer-cpu-offload (with --use-precision-aware-optimizer and
        # the distributed optimizer; torch.optim.AdamW(fused=True) on the CPU,
        # core/optimizer/__init__.py `optimizer_defaults`;
        # HybridDeviceOptimizer pipelines D2H, step and H2D with
        # --overlap-cpu-optimizer-d2h-h2d; --optimizer-offload-fraction keeps a share on GPU)
        fp8=("delayed", "tensorwise", "mxfp8", "blockwise"), fp8_framework="te",
        offloads=(Offload("optimizer", (1,), "torch-adamw-fused", "pipelined",
                          "--optimizer-cpu-offload", fraction=True),),
        # bf16: --grad-reduce-in-bf16 or fp32 (validate_args sets accumulate_allreduce_grads_
        # in_fp32 for bf16 unless --grad-reduce-in-bf16); fp16: fp16 or
        # --accumulate-allreduce-grads-in-fp32; Megatron-FSDP: --megatron-fsdp-main-grads-dtype
        grad_dtypes=(("bf16", ("bf16", "fp32")), ("fp16", ("fp16", "fp32")),
                     ("fp32", ("fp32",))),
        # --pipeline-model-parallel-layout gives any layers per (virtual) stage
        # (training/arguments.py, core/transformer/pipeline_parallel_layer_layout.py)
        split="any",
        rules=(
            Rule(lambda v, train: (np.asarray(v["zero_group"]) > 0) & (np.asarray(v["ep"]) > 1)
                 & ((np.asarray(v["dp"]) * v["cp"] // v["ep"])
                    % np.maximum(np.asarray(v["dp"]) * v["cp"]
                                 // np.maximum(v["zero_group"], 1), 1) != 0),
                 "shards experts' ZeRO state over the expert data-parallel ranks dp·cp/ep: "
                 "with ep={ep} they must hold whole zero_group={zero_group} groups",
                 "megatron/core/parallel_state.py:1447 @d98e8a6"),
            Rule(lambda v, train: np.asarray(v["zero"]) == 0 if any(
                     getattr(train, name, None) not in (None, "fp32") for name in
                     ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"))
                 else _none(v, "zero"),
                 "runs the precision-aware optimizer (moments or master weights below fp32) "
                 "with the distributed optimizer only, not zero={zero}",
                 "megatron/core/optimizer/optimizer_config.py, megatron-core 0.16.1"),
            # validate_args turns SP off without TP, then asserts SP under --tp-comm-overlap
            Rule(lambda v, train: (np.asarray(v["tp"]) > 1) & (np.asarray(v["sp"]) == 0)
                 if getattr(train, "tp_overlap", None) == "bulk" else _none(v, "tp"),
                 "overlaps TP communication with GEMMs (--tp-comm-overlap, TP overlap bulk) "
                 "only with sequence parallelism: tp={tp} needs sp=1 or --tp-overlap none",
                 "Megatron-LM megatron/training/arguments.py:1441 @d98e8a6"),
        )),
    Stack(
        "megatron-deepspeed", "Megatron-DeepSpeed (DeepSpeed's pipeline engine and ZeRO)",
        f"DeepSpeed 0.19.8; {_MDS}",
        "deepspeed/runtime/zero/config.py (overlap_comm defaults to stage == 3), "
        "deepspeed/runtime/pipe/schedule.py (TrainSchedule: 1F1B), Megatron-DeepSpeed "
        "megatron/arguments.py (--use-flash-attn-v2 off by default, --ds-sequence-parallel-size,"
        " --enable-zbh1-pipeline)",
        profile="megatron-te", kernels="fused", compile=(False,), tp_overlap=("none",),
        dp_overlap_zero=(3,), dp_overlap_settable=True, attention=("math", "fa2"),
        recompute=("none", "selective", "full"),
        # ZeRO 0-3 (deepspeed/runtime/zero/config.py); no shard groups: MiCS is gone from
        # 0.19 and ZeRO++'s hpZ (zero_hpz_partition_size) only keeps a secondary copy of
        # ZeRO-3 weights per group, the optimizer state stays sharded over all replicas
        zero=(0, 1, 2, 3), zero_hybrid=(),
        # --ds-sequence-parallel-size is DeepSpeed-Ulysses (deepspeed/sequence/layer.py)
        # ep: DeepSpeed-MoE (deepspeed/moe, --moe-expert-parallel-size), exported dropless
        cp_kinds=("ulysses",), cp_overlap=False, axes=("tp", "pp", "cp", "ep"),
        pipeline_engine="deepspeed", p2p_overlap="never", dtypes=("bf16", "fp16", "fp32"),
        export="deepspeed",
        # ZeRO-Offload (zero_optimization.offload_optimizer, stages 1-3: DeepSpeedCPUAdam;
        # gradients copied to the host as their buckets reduce) and ZeRO-Infinity's parameter
        # offload (offload_param, stage 3 only); deepspeed/runtime/zero/offload_config.py
        offloads=(Offload("optimizer", (1, 2, 3), "deepspeed-cpu-adam", "backward",
                          "offload_optimizer"),
                  Offload("params", (3,), "deepspeed-cpu-adam", "backward",
                          "offload_param")),
        # data_types.grad_accum_dtype: the model dtype, or fp32 with ZeRO (rule below)
        grad_dtypes=(("bf16", ("bf16", "fp32")), ("fp16", ("fp16", "fp32")),
                     ("fp32", ("fp32",))),
        split="deepspeed", pipe_costs="deepspeed",
        rules=(
            PIPE_ZERO, PIPE_DP_OVERLAP,
            Rule(lambda v, train: (np.asarray(v["cp"]) > 1)
                 & ((np.asarray(v["tp"]) > 1) | (np.asarray(v["pp"]) > 1)),
                 "runs its sequence parallelism (cp={cp}) without tensor and pipeline "
                 "parallelism only (tp={tp}, pp={pp})",
                 "Megatron-DeepSpeed megatron/core/parallel_state.py:146 @4efb479"),
            Rule(lambda v, train: _zb_h1(v) & (np.asarray(v["sp"]) > 0),
                 "runs ZB-H1 without sequence parallelism only",
                 "Megatron-DeepSpeed megatron/arguments.py:81 @4efb479"),
            Rule(lambda v, train: np.asarray(v["zero"]) == 0 if (
                     train is not None and (train.grad_dtype or train.dtype) != train.dtype)
                 else _none(v, "zero"),
                 "without ZeRO accumulates gradients in the model dtype only",
                 "deepspeed/runtime/engine.py:2313 @0.19.8"),
            # DeepSpeed-MoE carves its expert-parallel groups out of Megatron-DeepSpeed's
            # data-parallel group, which excludes the sequence-parallel (cp) ranks
            Rule(lambda v, train: np.asarray(v["dp"]) % np.asarray(v["ep"]) != 0,
                 "forms expert-parallel groups inside the data-parallel group only: ep={ep} "
                 "must divide dp={dp}", "deepspeed/utils/groups.py:634 @0.19.8"),
            Rule(lambda v, train: (np.asarray(v["ep"]) > 1) & (np.asarray(v["zero"]) == 3),
                 "runs DeepSpeed-MoE (ep={ep}) without ZeRO-3 only",
                 "deepspeed/runtime/engine.py:2215 @0.19.8"),
        )),
    Stack(
        "gpt-neox", "GPT-NeoX (DeepSpeed's pipeline engine, ZeRO, Megatron-style TP)",
        f"DeeperSpeed 91d1c55; {_NEOX}",
        "megatron/neox_arguments/neox_args.py (pipe_partition_method 'type:transformer|mlp', "
        "checkpoint_activations False, the softmax / bias-GeLU / bias-dropout / RoPE fusions "
        "False, attention_config [[['global'], L]]: its own baddbmm + softmax, 'flash' "
        "flash-attn 2), arguments.py (ZERO_DEFAULTS stage 0, overlap_comm False), "
        "megatron/training.py (PipelineEngine whenever pipe_parallel_size >= 1; the "
        "attention mask sent with each activation)",
        profile="megatron-te", kernels="fused", compile=(False,), tp_overlap=("none",),
        dp_overlap_zero=(), dp_overlap_settable=True, attention=("math", "fa2"),
        recompute=("none", "full"), zero=(0, 1, 2, 3), zero_hybrid=(), cp_kinds=(),
        cp_overlap=False, axes=("tp", "pp"), pipeline_engine="neox", p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        # data_types.grad_accum_dtype unset: the model dtype (arguments.py warns that bf16
        # with ZeRO-1 under the pipeline needs "fp32"); precision unset: fp32
        grad_dtypes=(("bf16", ("bf16", "fp32")), ("fp16", ("fp16", "fp32")),
                     ("fp32", ("fp32",))),
        split="neox", pipe_costs="deepspeed-neox",
        rules=(PIPE_ZERO, PIPE_DP_OVERLAP),
        notes=("its unfused defaults (bias_gelu_fusion, softmax fusions False) are timed as "
               "fused kernels: no eager table is counted on its layer code",)),
    Stack(
        "torchtitan", "torchtitan", "torchtitan 0.3.0",
        "torchtitan/config/configs.py (CompileConfig.enable False, enable_async_tensor_parallel "
        "False and needs compile; fsdp_reshard_after_forward 'default'), "
        "distributed/activation_checkpoint.py (FullAC; SelectiveAC: save compute/comm op outputs "
        "except every second matmul), models/llama3 (attn_backend 'flex')",
        profile="torchtitan", kernels="eager", compile=(False, True),
        tp_overlap=("none", "async"), dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False,
        # a language model's attention is flex, flex_flash or varlen; SDPA is refused ("sdpa
        # is no longer supported for language models", models/common/config_utils.py
        # get_attention_config); its llama3 configs use flex. "fa3": the varlen backend
        # (models/common/attention.py VarlenAttention: torch's varlen_attn with FA3 activated
        # on Hopper, FA4 on Blackwell, PyTorch's default FlashAttention-2 before, tools/utils.py
        # get_cuda_flash_attention_impl), set in a config function (model_registry(flavor,
        # attn_backend="varlen")), not on the command line; the fa3 curve times it (another
        # accelerator's default kernel where no fa3 curve is fitted, `attention_curve`)
        attention=("flex", "fa3"), recompute=("none", "full", "op-sac"),
        # FSDP2 on every run (models/llama3/parallelize.py apply_fsdp_to_decoder): replicate
        # only (ZeRO-0), reshard after forward "never" (ZeRO-2) or "always" (ZeRO-3), HSDP with
        # data_parallel_replicate_degree; no ZeRO-1 (nothing shards only optimizer states)
        zero=(0, 2, 3), zero_hybrid=(2, 3),
        # llama3's FlexAttention under CP all-gathers K/V (distributed/context_parallel/api.py
        # apply_cp_to_forward); ring attention needs an SDPA config none of its llama3 has
        cp_kinds=("allgather",), cp_overlap=True, cp_gather_kept=True,
        axes=("tp", "pp", "cp", "ep"), pipeline_engine="torchtitan", p2p_overlap="always",
        dtypes=("bf16", "fp32"), export="torchtitan",
        # FSDP's MixedPrecisionPolicy reduce_dtype: training.mixed_precision_reduce, which
        # accepts "float32" only (config/configs.py)
        grad_dtypes=(("bf16", ("fp32",)), ("fp32", ("fp32",))),
        split="torchtitan",
        rules=(
            Rule(lambda v, train: (np.asarray(v["ep"]) > 1) & (
                     (np.where(np.asarray(v["zero"]) > 0,
                               np.where(np.asarray(v["zero_group"]) > 0, v["zero_group"],
                                        np.asarray(v["dp"]) * v["cp"]), v["cp"])
                      * np.asarray(v["tp"])) % np.maximum(v["ep"], 1) != 0),
                 "borrows expert-parallel ranks from FSDP, CP and TP: ep={ep} must divide "
                 "dp_shard·cp·tp", "torchtitan/config/configs.py expert_parallel_degree "
                 "@0.3.0"),
            Rule(lambda v, train: np.asarray(v["cp"]) > 1
                 if getattr(train, "attention", None) == "fa3" else _none(v, "cp"),
                 "has no context parallelism (cp={cp}) with its varlen attention (fa3); use "
                 "flex", "torchtitan/distributed/context_parallel/api.py:104 @0.3.0"),
        ),
        # its Llama 3 block counted eagerly, nn.RMSNorm as torch 2.13's fused CUDA kernel
        # (aten/src/ATen/native/layer_norm.cpp routes rms_norm to _fused_rms_norm)
        elementwise=TORCHTITAN_TRAFFIC, eager_kernels=TORCHTITAN_KERNELS,
        # components/quantization/float8.py (Float8LinearConverter recipe_name: rowwise |
        # rowwise_with_gw_hp) and mx.py (MXFP8LinearConverter); config/configs.py
        # training.enable_cpu_offload: FSDP2's CPUOffloadPolicy (parameters, gradients and
        # the optimizer, whose step then runs on the CPU: the default "fused" AdamW)
        fp8=("rowwise", "rowwise_with_gw_hp", "mxfp8"), fp8_framework="torchao",
        offloads=(Offload("params", (3,), "torch-adamw-fused", "none",
                          "--training.enable_cpu_offload"),)),
    Stack(
        "hf-sdpa", "Hugging Face transformers (SDPA attention) with DDP/FSDP",
        "transformers 5.24.0",
        "models/llama/modeling_llama.py, integrations/sdpa_attention.py; Trainer "
        "(gradient_checkpointing: full; torch_compile False)",
        profile="hf-sdpa", kernels="eager", compile=(False, True), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("fa2",),
        recompute=("none", "full"), zero=(0, 2, 3), zero_hybrid=(3,), cp_kinds=(),
        cp_overlap=False, axes=(), pipeline_engine=None, p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        elementwise=HF_TRAFFIC, eager_kernels=HF_KERNELS),
    Stack(
        "hf-eager", "Hugging Face transformers (eager attention) with DDP/FSDP",
        "transformers 5.24.0",
        "models/llama/modeling_llama.py eager_attention_forward (softmax materialised)",
        profile="hf-eager", kernels="eager", compile=(False, True), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("math",),
        recompute=("none", "full"), zero=(0, 2, 3), zero_hybrid=(3,), cp_kinds=(),
        cp_overlap=False, axes=(), pipeline_engine=None, p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        elementwise=HF_TRAFFIC, eager_kernels=HF_KERNELS),
    Stack(
        "pytorch-fsdp", "PyTorch FSDP training loops (llm-foundry/Composer, IBM fms-fsdp)",
        "torch 2.13",
        "torch.distributed.fsdp (FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD, backward and "
        "forward prefetch), eager decoder blocks with a FlashAttention-2 kernel (flash-attn or "
        "SDPA's flash backend) or flash-attn's Triton kernel (llm-foundry's attn_impl "
        "'triton'); no tensor, pipeline or context parallelism",
        profile="torchtitan", kernels="eager", compile=(False, True), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("fa2", "triton"),
        recompute=("none", "full"), zero=(0, 2, 3), zero_hybrid=(2, 3), cp_kinds=(),
        cp_overlap=False, axes=(), pipeline_engine=None, p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        elementwise=FSDP_TRAFFIC, eager_kernels=FSDP_KERNELS,
        # llm-foundry's FP8 runs (4952183768 scripts/train/benchmarking/submit_benchmarks.py:
        # precision amp_fp8 sets model.fc_type 'te'): MPT's Wqkv, out_proj, up and down
        # projections are te.Linear (llmfoundry/models/layers/fc.py), the tied LM head stays
        # bf16 (SharedEmbedding, F.linear), norms torch's; Composer's fp8_autocast recipe
        fp8=("delayed",), fp8_framework="composer"),
    Stack(
        "shardwise", "shardwise runtime", "shardwise 0.1.0",
        "shardwise.runtime (blocking collectives on gloo/NCCL; bucketed gradient reducer)",
        profile="shardwise", kernels="eager", compile=(False,), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("fa2", "math"),
        recompute=("none", "selective", "full"), zero=(0, 1, 2, 3), zero_hybrid=(0, 1, 2, 3),
        cp_kinds=("ring", "ulysses", "hybrid"), cp_overlap=False, axes=("tp", "pp", "cp", "ep"),
        pipeline_engine="shardwise", p2p_overlap="never", dtypes=("fp32", "bf16", "fp16", "fp64"),
        export=None),
)})
