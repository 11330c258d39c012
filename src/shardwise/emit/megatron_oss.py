"""gpt-oss's block as Megatron-LM main d98e8a6 flags over megatron-core 0.16.1 fields: attention
sinks (`--softmax-type learnable`), alternating sliding windows (`--window-size`,
`--window-attn-skip-freq`), the clamped SwiGLU (`--quick-geglu --glu-linear-offset 1
--activation-func-clamp-value L`) and every linear layer's bias (Megatron's `add_bias_linear`
default: QKV, out-proj, experts, router). What megatron-core 0.16.1 lacks is one line
(`megatron_lacks`): YaRN on standard attention, other multipliers, chunked attention.
Sources per function; tests/integration/test_megatron_gpt_oss.py reads the flags back.
"""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec
from shardwise.placement import expert_tp_degree

QUICK_GELU_ALPHA = 1.702
"""megatron-core 0.16.1 `activations.quick_gelu` (and fusions/fused_bias_geglu.py): `x·σ(1.702 x)`,
a fixed constant; gpt-oss's `swiglu_alpha` (transformers 5.24 GptOssConfig default 1.702)."""
_MULTIPLIERS = {"swiglu_alpha", "swiglu_limit"}


def all_biases(model: ModelSpec) -> bool:
    """Every linear layer has a bias (Megatron's `add_bias_linear`: linear_qkv, linear_proj,
    linear_fc1/fc2 of dense and expert MLPs, and the router's `TopKRouter.bias`,
    transformer/moe/router.py)."""
    return bool(model.bias) or (model.qkv_bias and model.out_bias and model.mlp_bias
                                and (model.router_bias or not model.is_moe))


def window_args(model: ModelSpec) -> list[str] | None:
    """Sliding windows as megatron-core 0.16.1 builds them, None where it cannot: one window
    `w` on "sliding" layers, full attention on the others. `--window-size w-1,0`: TE's
    `window_size=(left, right)` lets query `i` see keys `[i-left, i+right]` inclusive, `w`
    keys as transformers' `sliding_window_overlay` (`kv > q - w`); `--window-attn-skip-freq`:
    1-based layer `n` is windowed where `n % N != 0` (transformer/utils.py
    `is_layer_window_attention`), else a list pattern, 1 = windowed. [] without windows."""
    kinds = [model.layer_kind(i) for i in range(model.n_layers)]
    if "chunked" in kinds:
        return None
    if "sliding" not in kinds:
        return []
    args = [f"--window-size {model.sliding_window - 1},0"]
    windowed = [kind == "sliding" for kind in kinds]
    every = next((n for n in range(2, model.n_layers + 1)
                  if windowed == [(i + 1) % n != 0 for i in range(model.n_layers)]), 0)
    if all(windowed):
        return args
    if every:
        return [*args, f"--window-attn-skip-freq {every}"]
    return [*args, "--window-attn-skip-freq '[" + ",".join(str(int(w)) for w in windowed)
            + "]'"]


def megatron_builds(model: ModelSpec) -> set[str]:
    """Of `model.runtime_variants()`, those this export writes as Megatron flags."""
    multipliers = dict(model.multipliers)
    out = {"attention sinks"}
    if model.gated_act == "swiglu_clamp" and multipliers.get(
            "swiglu_alpha", QUICK_GELU_ALPHA) == QUICK_GELU_ALPHA:
        out.add("swiglu_clamp MLP")
        if set(multipliers) <= _MULTIPLIERS:
            out.add("scalar multipliers")
    if all_biases(model):
        out |= {"MLP biases", "a router bias"}
    return out


def megatron_lacks(model: ModelSpec) -> str | None:
    """What megatron-core 0.16.1 has no field for, in one line: YaRN on standard attention
    (its TransformerConfig has no `yarn_*` fields — GPTModel reads them with getattr — and
    Megatron-LM's `core_transformer_config_from_args` asserts rope_type "rope" outside MLA);
    other RoPE scalings than Llama 3.1's."""
    if not model.is_mla and model.rope_type not in ("default", "llama3"):
        return (f"{model.name} scales RoPE with {model.rope_type}; megatron-core 0.16.1 "
                "scales standard attention's RoPE as Llama 3.1 only (--use-rope-scaling) and "
                "builds YaRN for multi-latent attention only (MLATransformerConfig; "
                "TransformerConfig has no yarn_* fields, Megatron-LM asserts rope_type rope): "
                "it would train another model")
    return None


def gpt_oss_args(model: ModelSpec, layout: Layout, train: TrainSpec) -> list[str]:
    """The flags of `megatron_builds` and `window_args` for `model` (none for Llama's block).
    Refused in one line: sinks on a FlashAttention backend (Transformer Engine runs
    `softmax_type` learnable in its fused cuDNN and unfused backends only, megatron-core
    extensions/transformer_engine.py needing TE ≥ 2.8) or with context parallelism other than
    all-to-all (TE's CP runs sinks and sliding windows with cp_comm_type a2a only); biased
    experts split by expert tensor parallelism (megatron-core asserts etp = 1)."""
    args: list[str] = []
    windows = window_args(model) or []
    if model.attention_sinks:
        args.append("--softmax-type learnable")
    if model.attention_sinks or windows:
        if train.settings().attention in ("fa2", "fa3") and model.attention_sinks:
            raise ShardwiseError("Transformer Engine runs attention sinks (--softmax-type "
                                 "learnable) in its cuDNN and unfused attention only: plan "
                                 "with --attention cudnn")
        if layout.cp > 1 and layout.cp_kind != "ulysses":
            raise ShardwiseError(f"Transformer Engine's context parallelism runs attention "
                                 f"sinks and sliding windows with cp_comm_type a2a only, not "
                                 f"cp_kind {layout.cp_kind}: plan with --cp-kind ulysses")
    args += windows
    if model.gated_act == "swiglu_clamp":
        limit = dict(model.multipliers).get("swiglu_limit")
        args += ["--quick-geglu", "--glu-linear-offset 1"]
        if limit is not None:
            args.append(f"--activation-func-clamp-value {limit:g}")
    if all_biases(model) and model.is_moe:
        if expert_tp_degree(layout.etp, layout.tp) != 1:  # TransformerConfig.__post_init__
            raise ShardwiseError("megatron-core 0.16.1 builds biased experts with expert "
                                 "tensor parallelism 1 only (\"Bias in Moe is only supported "
                                 f"when ETP==1\"), not etp={expert_tp_degree(layout.etp, layout.tp)}:"
                                 " plan with --etp 1")
        # TEGroupedMLP asserts no bias-dropout fusion with add_bias_linear (moe/experts.py)
        args.append("--no-bias-dropout-fusion")
    return args
