"""Which models each framework's export runs, whatever the layout (`model_refusal`): the models
torchtitan ships, what Megatron-LM's and Megatron-DeepSpeed's blocks cannot express, and
Megatron-DeepSpeed's DeepSpeed-MoE."""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.emit.megatron_oss import megatron_builds, megatron_lacks, window_args
from shardwise.layout import TrainSpec

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
VERSIONS = {"megatron": "Megatron-LM main d98e8a6", "torchtitan": "torchtitan 0.3.0",
            "deepspeed": "DeepSpeed 0.19.8 with Megatron-DeepSpeed 4efb479"}

# torchtitan ships these models as `--module M --config C` (models/*/config_registry.py);
# each has the preset's shape (tests/integration/test_torchtitan.py and test_emit_models.py
# build them on the meta device and compare). Its deepseek_v3 flavors "16B" (DeepSeek-V2-
# Lite's shape: hf_assets deepseek-moe-16b-base) and "671B" precompute RoPE for 4096·4
# positions (models/deepseek_v3/__init__.py `_16b`, `_671b`: max_seq_len), qwen3 "30B-A3B"
# for 40960 and gpt_oss for 131072 (models/qwen3/__init__.py `_30b_a3b`, models/gpt_oss/
# __init__.py `_20b`, `_120b`), and Decoder.update_from_config refuses a longer seq_len.
# Its qwen3 dense configs are 0.6B, 1.7B, 14B, 32B (8B only under NVFP4), its kimi_k2_7
# matches no preset; it has no llama4, gemma, phi3, olmo2, granite, smollm3 or glm4_moe.
_TITAN_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b"), "llama3-70b": ("llama3", "llama3_70b"),
                  "llama3-405b": ("llama3", "llama3_405b"),
                  "deepseek-v2-lite": ("deepseek_v3", "deepseek_v3_16b"),
                  "deepseek-v3": ("deepseek_v3", "deepseek_v3_671b"),
                  "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b"),
                  "gpt-oss-20b": ("gpt_oss", "gpt_oss_20b"),
                  "gpt-oss-120b": ("gpt_oss", "gpt_oss_120b")}
_TITAN_MAX_SEQ = {"deepseek_v3_16b": 16384, "deepseek_v3_671b": 16384,
                  "qwen3_30b_a3b": 40960, "gpt_oss_20b": 131072, "gpt_oss_120b": 131072}
# the attention backend each module's configs build (model_registry's attn_backend default:
# gpt_oss "varlen", the others "flex"), as the stack names it (stacks.definitions)
TITAN_ATTENTION = {"gpt_oss": "fa3"}


def titan_model_refusal(model: ModelSpec, train: TrainSpec) -> str | None:
    """What no layout fixes: torchtitan 0.3.0 ships no such model, or trains it otherwise."""
    if model.name not in _TITAN_CONFIGS:
        return (f"torchtitan 0.3.0 ships no {model.name} model (its configs fit "
                f"{', '.join(_TITAN_CONFIGS)}); plan with --impl megatron-te for Megatron-LM")
    module = _TITAN_CONFIGS[model.name][0]
    if module in TITAN_ATTENTION and train.settings().attention != TITAN_ATTENTION[module]:
        return (f"torchtitan 0.3.0's {module} configs build its varlen attention (Flash"
                f"Attention-3 with the sliding window and sinks; models/{module}/__init__.py "
                f"model_registry attn_backend), not {train.settings().attention}: plan with "
                f"--attention {TITAN_ATTENTION[module]}")
    config = _TITAN_CONFIGS[model.name][1]
    if train.seq_len > _TITAN_MAX_SEQ.get(config, train.seq_len):
        return (f"torchtitan 0.3.0's {config} precomputes RoPE for "
                f"{_TITAN_MAX_SEQ[config]} positions and refuses a longer seq_len "
                f"(models/common/decoder.py update_from_config); plan with --seq ≤ "
                f"{_TITAN_MAX_SEQ[config]}, or with --impl megatron-te for Megatron-LM")
    if model.name == "llama3-405b" and train.fp8 != "rowwise":
        return ("torchtitan 0.3.0's llama3_405b config trains its linear layers in Float8 "
                "(rowwise) under torch.compile (models/llama3/config_registry.py): plan it "
                "with --fp8 rowwise --compile, or with --impl megatron-te for Megatron-LM")
    return None


def deepspeed_moe_refusal(model: ModelSpec) -> str | None:
    """What Megatron-DeepSpeed's MoE (DeepSpeed 0.19.8's `deepspeed.moe`, built by
    megatron/model/transformer.py:1066-1083 @4efb479) cannot train of `model` as planned:
    its `TopKGate` scores with a softmax over every expert, top-1 keeps the probability as the
    gate and top-k > 1 renormalises the k (sharded_moe.py `top1gating`, `top2gating`,
    `topkgating`); experts are `ParallelMLP`s of `--ffn-hidden-size`; every
    `--expert-interval`-th layer is MoE (transformer.py:1650 `get_num_experts_per_layer`)."""
    if model.n_shared_experts:
        return (f"{model.name} has {model.n_shared_experts} shared expert(s); DeepSpeed-MoE has "
                "none (its --mlp-type residual is PR-MoE's residual MLP mixed by a learned "
                "coefficient, another model)")
    if model.router_score != "softmax" or model.expert_groups > 1 or model.routed_scaling != 1:
        return (f"{model.name} routes with {model.router_score} scores"
                + (f" in {model.expert_groups} groups" if model.expert_groups > 1 else "")
                + (f" scaled by {model.routed_scaling:g}" if model.routed_scaling != 1 else "")
                + "; DeepSpeed-MoE's TopKGate takes the softmax over all experts, ungrouped "
                  "and unscaled (deepspeed/moe/sharded_moe.py)")
    if model.norm_topk != (model.top_k > 1):
        how = ("keeps the softmax probability as the top-1 gate" if model.top_k == 1 else
               f"renormalises the top-{model.top_k} gates to sum to 1")
        return (f"DeepSpeed-MoE {how} (deepspeed/moe/sharded_moe.py), which {model.name}'s "
                f"router (norm_topk={model.norm_topk}) does not")
    if model.n_dense_layers and model.expert_d_ff != model.d_ff:
        return (f"DeepSpeed-MoE's experts are Megatron-DeepSpeed ParallelMLPs of the dense "
                f"layers' --ffn-hidden-size ({model.d_ff}), not {model.expert_d_ff}")
    interval = model.moe_every
    if any(model.is_moe_layer(i) != ((i + 1) % interval == 0) for i in range(model.n_layers)):
        return (f"{model.name}'s first {model.first_dense_layers} layers are dense; "
                f"Megatron-DeepSpeed makes every {interval}-th layer MoE (--expert-interval, "
                "megatron/model/transformer.py:1650 @4efb479)")
    return None


def nope_every(model: ModelSpec) -> int:
    """N when exactly every N-th layer (1-based) skips RoPE, as megatron-core's `no_rope_freq`
    N builds it (transformer_config.py: pattern [0]·(N-1) + [1], N dividing the layers; read
    by attention.py per layer); else 0."""
    if not model.nope_layers:
        return 0
    every = model.nope_layers[0] + 1
    pattern = tuple(i for i in range(model.n_layers) if (i + 1) % every == 0)
    return every if model.n_layers % every == 0 and model.nope_layers == pattern else 0


def model_refusal(framework: str, model: ModelSpec, train: TrainSpec) -> str | None:
    """What no layout fixes: the framework does not run this model as planned (the stack's
    dtypes are checked by `TrainSpec.validate`)."""
    if framework == "torchtitan":
        return titan_model_refusal(model, train)
    if framework in ("megatron", "deepspeed"):
        name = VERSIONS[framework]
        if model.alibi:
            return (f"{model.name} adds ALiBi attention biases, which {name} has no option for "
                    "(its positions are learned or rotary): an export would train another model")
        variants = model.runtime_variants()  # QK-norm, sinks, sandwich norms, GeGLU, …
        if framework == "megatron":  # gpt-oss's block (emit.megatron_oss)
            variants = [v for v in variants if v not in megatron_builds(model)]
        if framework == "megatron" and model.qk_norm == "head":  # --qk-layernorm (Qwen3)
            variants.remove("QK-norm")
        elif model.qk_norm in ("full", "l2"):  # OLMo 2: one norm over all heads' a·d
            variants[variants.index("QK-norm")] = f"QK-norm over {model.qk_norm!r}"
        if framework == "megatron" and nope_every(model):  # --no-rope-freq N (SmolLM3)
            variants.remove("layers without RoPE")
        if variants:
            head = (" (its --qk-layernorm normalises each head alone)" if model.qk_norm
                    and framework == "megatron" else "")
            return (f"{model.name} has {', '.join(variants)}; {name} has no option this "
                    f"export has verified to build them{head}: it would train another model")
        if framework == "megatron" and (lacks := megatron_lacks(model)):
            return lacks
        if any(0 < model.attention_span(i) < train.seq_len for i in range(model.n_layers)) and (
                framework != "megatron" or window_args(model) is None):
            return (f"{model.name}'s attention is windowed or chunked below --seq "
                    f"{train.seq_len}; the export's attention is full causal attention: it "
                    "would train another model (use a sequence length within the window)")
        if model.parallel_residual:
            return (f"{model.name} runs attention and MLP side by side on one normalised input "
                    f"(GPT-NeoX's use_parallel_residual), which {name}'s block does not: an "
                    "export would train another model")
    if framework == "deepspeed" and model.is_moe:
        return deepspeed_moe_refusal(model)
    return None
