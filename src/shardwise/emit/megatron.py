"""Megatron-LM main (d98e8a6) `pretrain_gpt.py`: a shell script with the environment, a
`torchrun` line and every argument the plan assumes (model shape, vocabulary, degrees, virtual
stages or an explicit pipeline layout, SP, recompute, ZeRO as the distributed optimizer or
Megatron-FSDP and their shard groups, precision and gradient dtype, the stack's overlap
settings, attention backend, and the run settings of `emit.megatron_run`: dispatcher,
MoE overlap, capacity, recompute modules or share, precision-aware optimizer, activation
offloading, CUDA graphs); MLA and DeepSeekMoE; Qwen3's per-head QK-norm, SmolLM3's layers
without RoPE. Tested against Megatron-LM's own parser (tests/integration/test_megatron.py,
test_emit_fields.py)."""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.emit.common import (
    Emitted,
    _checked,
    _header,
    _launched,
    _vocab_divisor,
)
from shardwise.emit.megatron_oss import all_biases, gpt_oss_args
from shardwise.emit.megatron_run import megatron_run_settings
from shardwise.emit.models import nope_every
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules.registry import get_schedule

# `Stack.settings().attention` as Megatron's --attention-backend (megatron-core
# transformer/enums.py AttnBackend): Transformer Engine's cuDNN fused attention is "fused",
# FlashAttention "flash" (TE runs FA3 on Hopper when flash-attn 3 is installed, else FA2), the
# materialised softmax "unfused".
_MEGATRON_ATTENTION = {"cudnn": "fused", "fa2": "flash", "fa3": "flash", "math": "unfused"}


def _megatron_partition(model: ModelSpec, layout: Layout) -> list[str]:
    """Uneven stages: `--decoder-first/last-pipeline-num-layers` when the middle stages are
    equal (per stage over its chunks), else `--pipeline-model-parallel-layout` with every
    virtual stage's layers (megatron-core transformer/pipeline_parallel_layer_layout.py: stages
    in virtual-stage order `c·pp + i`, `E` the embedding on the first, `L` the loss on the
    last)."""
    parts = layout.stage_layers(model.n_layers)
    if len(set(parts)) == 1 and not layout.virtual_stages:
        return []
    first, *middle, last = parts
    # megatron-core 0.16.1 refuses a first/last stage of 0 layers by these flags
    # (TransformerConfig: "must be larger than 0"); its layout string takes an empty end
    if len(set(middle)) <= 1 and not layout.virtual_stages and min(first, last) > 0:
        return [f"--decoder-first-pipeline-num-layers {first}",
                f"--decoder-last-pipeline-num-layers {last}"]
    sizes = layout.stage_sizes(model.n_layers)
    stages = [f"t*{n}" if n else "" for n in sizes]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return [f"--pipeline-model-parallel-layout '{'|'.join(stages)}'"]


# `Layout.cp_kind` as Megatron-Core's `cp_comm_type` (transformer_config.py, 0.16.1): ring
# attention "p2p", Ulysses "a2a", the hybrid "a2a+p2p" (all-to-all inside, ring across).
_MEGATRON_CP = {"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p", "allgather": "all_gather"}


def _megatron_deepseek(model: ModelSpec, train: TrainSpec, notes: list[str]) -> list[str]:
    """Multi-head latent attention and DeepSeekMoE as Megatron-LM arguments (MLATransformerConfig
    and TransformerConfig fields of megatron-core 0.16.1, their flags in Megatron-LM's
    arguments.py): `--multi-latent-attention`, the latent ranks and head widths (Megatron's
    `qk_head_dim` is the no-RoPE part, `qk_pos_emb_head_dim` the RoPE part), the latent norms
    (`--qk-layernorm`: MLA's up-projections fuse them), YaRN (`--rotary-scaling-factor`,
    `--mscale`, `--mscale-all-dim`; its other constants are MLATransformerConfig's defaults,
    DeepSeek's), the dense first layers (`--moe-layer-freq` as a pattern), shared experts (one
    MLP of `n_shared · f`), the router (score function; expert bias for sigmoid; scaling;
    group-limited top-k) and `--mtp-num-layers` (`TrainSpec.mtp_layers`, else the model's).
    Refused in one line: what Megatron's router
    cannot compute (sigmoid gates left unnormalised: it normalises top-k > 1)."""
    args: list[str] = []
    if model.is_mla:
        args += ["--multi-latent-attention", f"--kv-lora-rank {model.kv_lora_rank}",
                 f"--qk-head-dim {model.qk_nope_head_dim}",
                 f"--qk-pos-emb-head-dim {model.qk_rope_head_dim}",
                 f"--v-head-dim {model.value_head_dim}", "--qk-layernorm"]
        if model.q_lora_rank:
            args.append(f"--q-lora-rank {model.q_lora_rank}")
        rope = dict(model.rope_scaling)
        if model.rope_type == "yarn":
            if (rope.get("beta_fast", 32), rope.get("beta_slow", 1),
                    rope.get("original_max_position_embeddings", 4096)) != (32, 1, 4096):
                raise ShardwiseError(
                    f"{model.name}'s YaRN beta_fast/beta_slow/original_max_position_embeddings "
                    "differ from Megatron-LM's fixed MLA defaults (32, 1, 4096), which it "
                    "has no flags for")
            args += ["--rope-type yarn", f"--rotary-scaling-factor {rope.get('factor', 1.0):g}",
                     f"--mscale {rope.get('mscale', 1.0):g}",
                     f"--mscale-all-dim {rope.get('mscale_all_dim', 0.0):g}"]
        elif model.rope_type != "default":
            raise ShardwiseError(f"Megatron-LM's MLA has no {model.rope_type} RoPE scaling "
                                 "(rope or yarn)")
        else:
            args.append("--rope-type rope")
    if model.is_moe and (model.first_dense_layers or model.moe_every > 1):
        pattern = ",".join(str(int(model.is_moe_layer(i))) for i in range(model.n_layers))
        args.append(f"--moe-layer-freq '[{pattern}]'")
    if model.n_shared_experts:
        args.append("--moe-shared-expert-intermediate-size "
                    f"{model.n_shared_experts * model.expert_d_ff}")
    if model.is_moe and model.router_score == "sigmoid":
        if not model.norm_topk and model.top_k > 1:
            raise ShardwiseError("Megatron-LM normalises sigmoid top-k gates (moe_utils."
                                 "topk_routing_with_score_function); this model leaves them "
                                 "unnormalised (norm_topk_prob false)")
        args += ["--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias"]
    elif model.is_moe and not model.norm_topk:
        args.append("--moe-router-pre-softmax")  # softmax over all experts, then top-k
    if model.is_moe and model.routed_scaling != 1.0:
        args.append(f"--moe-router-topk-scaling-factor {model.routed_scaling:g}")
    if model.is_moe and model.expert_groups > 1:
        args += [f"--moe-router-num-groups {model.expert_groups}",
                 f"--moe-router-group-topk {model.topk_groups}"]
    mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
    if mtp:
        args.append(f"--mtp-num-layers {mtp}")
        notes.append(f"--mtp-num-layers {mtp}: Megatron trains the multi-token-prediction "
                     "module(s) on the last stage; the plan counts their memory there "
                     "(parameters, activations, logits: estimate.memory) but not their time")
    return args


def _megatron_fp8_offload(train: TrainSpec) -> list[str]:
    """`--fp8-format hybrid --fp8-recipe R` (delayed: the amax history the plan assumes) and
    the optimizer offload (`--optimizer-cpu-offload`, which needs
    `--use-precision-aware-optimizer`; `--overlap-cpu-optimizer-d2h-h2d`, the pipelining the
    plan assumes; `--optimizer-offload-fraction`). A recipe or offload Megatron-LM does not
    have: one line (`Stack.fp8_recipe`, `Stack.offload_support`)."""
    args: list[str] = []
    if train.fp8 is not None:
        recipe = train.stack.fp8_recipe(train.fp8)
        args += ["--fp8-format hybrid", f"--fp8-recipe {recipe.name}"]
        if recipe.history:
            args += [f"--fp8-amax-history-len {recipe.history}", "--fp8-amax-compute-algo max"]
    if train.stack.offload_support(train.offload) is not None:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                 "--overlap-cpu-optimizer-d2h-h2d"]
        if train.offload_fraction < 1:
            args.append(f"--optimizer-offload-fraction {train.offload_fraction:g}")
    return args


def megatron_args(model: ModelSpec, layout: Layout, train: TrainSpec,
                  gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """Megatron-LM main `pretrain_gpt.py` launch script for `layout`.

    ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's `optim_grads` /
    `optim_grads_params` (it trains fp16 too; `--use-torch-fsdp2` would refuse fp16, pipeline
    parallelism and tied embeddings). Shard groups: `--num-distributed-optimizer-instances`
    (dp·cp / group), HSDP under Megatron-FSDP. Gradients: the distributed optimizer reduces
    bf16 in fp32 unless `--grad-reduce-in-bf16`, fp16 in fp16 unless
    `--accumulate-allreduce-grads-in-fp32`; Megatron-FSDP takes `--megatron-fsdp-main-grads-
    dtype`.
    """
    gb, grad = _checked("megatron", model, layout, train, cluster, gpus_per_node)
    notes: list[str] = []
    args = [f"--num-layers {model.n_layers}", f"--hidden-size {model.d_model}",
            f"--ffn-hidden-size {model.d_ff}", f"--num-attention-heads {model.n_heads}"]
    if model.d_head and model.d_head != model.d_model // model.n_heads:
        args.append(f"--kv-channels {model.d_head}")
    if model.n_kv_heads != model.n_heads:
        args += ["--group-query-attention", f"--num-query-groups {model.n_kv_heads}"]
    if model.gated_mlp and model.gated_act != "swiglu_clamp":  # that one: gpt_oss_args
        args.append("--swiglu")
    args.append("--normalization " + ("RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"))
    if model.norm_eps != 1e-5:  # Megatron-LM's --norm-epsilon default
        args.append(f"--norm-epsilon {model.norm_eps:g}")
    if model.qk_norm == "head" and not model.is_mla:  # Qwen3: the norm over each head's d
        args.append("--qk-layernorm")  # (megatron-core gpt_layer_specs q/k_layernorm)
    if model.learned_positions:
        args.append("--position-embedding-type learned_absolute")
    else:
        args += ["--position-embedding-type rope", f"--rotary-base {int(model.rope_theta)}"]
        if model.rotary_percent != 1.0:
            args.append(f"--rotary-percent {model.rotary_percent:g}")
        if model.nope_layers:  # every N-th layer without RoPE (emit.models.nope_every)
            args.append(f"--no-rope-freq {nope_every(model)}")
        if model.rope_type == "llama3":  # Llama 3.1's frequency scaling, factor 8
            args += ["--use-rope-scaling",
                     f"--rope-scaling-factor {dict(model.rope_scaling)['factor']:g}"]
    args += [f"--vocab-size {model.vocab}",
             f"--make-vocab-size-divisible-by {_vocab_divisor(model, layout.tp)}"]
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not all_biases(model):
        args.append("--disable-bias-linear")
        if model.qkv_bias:
            args.append("--add-qkv-bias")
    if not model.dropout:
        args += ["--attention-dropout 0.0", "--hidden-dropout 0.0"]
    if model.is_moe:
        args += [f"--num-experts {model.n_experts}", f"--moe-router-topk {model.top_k}",
                 f"--moe-ffn-hidden-size {model.expert_d_ff}"]
    args += _megatron_deepseek(model, train, notes)
    args += gpt_oss_args(model, layout, train)
    args += [f"--seq-length {train.seq_len}",
             f"--max-position-embeddings {max(train.seq_len, model.max_seq)}",
             f"--micro-batch-size {layout.micro_batch}", f"--global-batch-size {gb}",
             f"--tensor-model-parallel-size {layout.tp}",
             f"--pipeline-model-parallel-size {layout.pp}"]
    partition = _megatron_partition(model, layout)
    args += partition
    explicit = any(a.startswith("--pipeline-model-parallel-layout") for a in partition)
    if layout.pp > 1 and get_schedule(layout.schedule).chunked and not explicit:
        args.append(f"--num-virtual-stages-per-pipeline-rank {layout.chunks}")
    if layout.cp > 1:  # Megatron-LM arguments.py: --cp-comm-type, and a2a+p2p's group sizes
        args += [f"--context-parallel-size {layout.cp}",
                 f"--cp-comm-type {_MEGATRON_CP[layout.cp_kind]}"]
        if layout.cp_kind == "hybrid":
            args.append(f"--hierarchical-context-parallel-sizes {layout.ulysses} "
                        f"{layout.cp // layout.ulysses}")
    if layout.ep > 1:
        args.append(f"--expert-model-parallel-size {layout.ep}")
    if layout.etp and layout.etp != layout.tp:  # Megatron's default is tp (etp = 0)
        args.append(f"--expert-tensor-parallel-size {layout.etp}")
    if layout.sp:
        args.append("--sequence-parallel")
    settings = train.settings()
    if settings.tp_overlap == "bulk" and layout.tp > 1:  # TE userbuffers; Megatron requires SP
        if layout.sp:
            args.append("--tp-comm-overlap")
        else:
            notes.append("TP overlap applies with --sequence-parallel only (training/arguments."
                         "py); as planned, this layout's TP communication is charged exposed")
    fsdp = layout.zero >= 2
    overlap = ["--overlap-grad-reduce"] if settings.dp_overlapped(layout.zero) else []
    overlap_both = overlap + (["--overlap-param-gather"] if overlap else [])
    instances = (layout.dp * layout.cp // layout.zero_group) if layout.zero_group else 1
    if layout.zero == 0:
        args += overlap
    elif layout.zero == 1:
        args += ["--use-distributed-optimizer", *overlap_both]
    else:
        strategy = "optim_grads" if layout.zero == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}",
                 "--ckpt-format fsdp_dtensor", *overlap_both]
    if instances > 1:  # ZeRO-1 in groups; Megatron-FSDP: HSDP, replicas across the groups
        args.append(f"--num-distributed-optimizer-instances {instances}")
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[train.dtype]
    if fsdp:
        args.append(f"--megatron-fsdp-main-grads-dtype {grad}")
    elif train.dtype == "bf16" and grad == "bf16":
        args.append("--grad-reduce-in-bf16")
    elif train.dtype == "fp16" and grad == "fp32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    args.append(f"--attention-backend {_MEGATRON_ATTENTION[settings.attention]}")
    args += _megatron_fp8_offload(train)
    args += megatron_run_settings(model, layout, train, notes,
                                  offloaded="--optimizer-cpu-offload" in args)
    # Megatron orders TP/CP communication before compute with one hardware queue; FSDP
    # asserts it is not set (training/arguments.py validate_args)
    env = ["CUDA_DEVICE_MAX_CONNECTIONS=1"] if (layout.tp > 1 or layout.cp > 1) and not fsdp \
        else []
    if train.offload_modules:  # TE ≥ 2.10 would offload weights too (arguments.py:1935-1940)
        env.append("NVTE_CPU_OFFLOAD_V1=1")
    text, launch = _launched(_header("megatron", model, layout, train, gb), env,
                             ("pretrain_gpt.py",), args, layout, gpus_per_node)
    return Emitted("megatron", text, tuple(notes), launch)


