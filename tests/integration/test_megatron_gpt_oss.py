"""gpt-oss through `--emit megatron` (emit.megatron_oss), read back by Megatron-LM's own parser
(rebuilt from its table, `test_megatron_lm._parse`) into megatron-core 0.16.1's
`TransformerConfig` the way `core_transformer_config_from_args` builds it, and checked against
transformers 5.24's gpt-oss: the same layers windowed with the same window, the clamped SwiGLU
of `GptOssExperts._apply_gate` equal to megatron-core's fused quick-GEGLU, sinks, biases. What
megatron-core lacks (YaRN outside MLA) and what Transformer Engine does not run (sinks on
FlashAttention, sinks under ring context parallelism) are one line each."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.arch.hf import from_hf_dict
from shardwise.emit.models import model_refusal
from shardwise.layout import TrainSpec
from tests.integration.conftest import Emit, require
from tests.integration.test_megatron_lm import megatron_lm_args

pytestmark = pytest.mark.integration

PLAN = ["gpt-oss-20b", "--gpus", "16", "--seq", "4096", "--layout", "ep=8,tp=2,etp=1,sp=true",
        "--attention", "cudnn"]


def _core_config(args):
    """megatron-core 0.16.1's TransformerConfig as Megatron-LM's
    `core_transformer_config_from_args` (training/arguments.py @d98e8a6) fills it: every
    dataclass field the namespace holds, then its renames; `--window-size` through Megatron-LM's
    `tuple_type` ("127,0" → (127, 0)), `--window-attn-skip-freq` through `moe_freq_type`
    (an integer here)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_geglu import quick_gelu  # Megatron-LM's import
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    ns = vars(args)
    wanted = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "kv_channels", "softmax_type", "glu_linear_offset", "activation_func_clamp_value",
              "add_bias_linear", "add_qkv_bias", "bias_dropout_fusion", "moe_ffn_hidden_size",
              "moe_router_topk", "moe_grouped_gemm", "tensor_model_parallel_size",
              "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
              "normalization")
    kw = {k: ns[k] for k in wanted}
    kw.update(num_moe_experts=ns["num_experts"], num_query_groups=ns["num_query_groups"],
              bf16=ns["bf16"],
              params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
              bias_activation_fusion=ns["bias_gelu_fusion"],
              attention_backend=AttnBackend[ns["attention_backend"]],
              window_size=tuple(int(i) for i in ns["window_size"].strip("()").split(",")),
              window_attn_skip_freq=int(ns["window_attn_skip_freq"]))
    assert ns["quick_geglu"] and not ns["swiglu"]
    kw.update(gated_linear_unit=True, activation_func=quick_gelu)
    config = TransformerConfig(**kw)  # __post_init__'s rules
    assert config.activation_func is not F.silu
    return config


def test_megatron_reads_back_gpt_oss_as_transformers_builds_it(capsys):
    require("megatron")
    torch = pytest.importorskip("torch")
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl
    from megatron.core.transformer.utils import is_layer_window_attention
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    out = Emit(capsys, PLAN, "megatron")
    args = megatron_lm_args(out)
    config = _core_config(args)
    hf = GptOssConfig(num_hidden_layers=24, num_local_experts=32, hidden_size=2880,
                      intermediate_size=2880)
    # attention: sinks (one learnable logit per head), the window on the sliding layers only
    assert config.softmax_type == "learnable"
    windowed = [is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n)
                for n in range(1, 25)]
    assert windowed == [kind == "sliding_attention" for kind in hf.layer_types]
    assert any(windowed) and not all(windowed)
    left, right = config.window_size  # TE: query i sees keys [i-left, i+right], inclusive
    assert (left + 1, right) == (hf.sliding_window, 0)  # transformers: kv > q - window
    # every linear layer biased (router, experts: fc2's bias scaled by the gate, as HF)
    assert config.add_bias_linear and not config.bias_dropout_fusion
    # the clamped SwiGLU: megatron-core's fused quick-GEGLU against GptOssExperts._apply_gate
    torch.manual_seed(0)
    gate, up = (12 * torch.randn(64, 16, dtype=torch.float64) for _ in range(2))
    assert (gate > hf.swiglu_limit).any() and (up < -hf.swiglu_limit).any()
    ours = weighted_bias_quick_geglu_impl(torch.cat([gate, up], -1), None,
                                          torch.ones(64, 1, dtype=torch.float64), False,
                                          config.glu_linear_offset,
                                          config.activation_func_clamp_value)
    experts = GptOssExperts(hf)
    interleaved = torch.stack([gate, up], -1).reshape(64, 32)  # HF: gate ::2, up 1::2
    assert torch.allclose(ours, experts._apply_gate(interleaved))
    # the MoE shape and the head
    assert (args.num_experts, args.moe_router_topk, args.kv_channels) == (32, 4, 64)
    assert args.untie_embeddings_and_output_weights


@pytest.mark.parametrize(("extra", "says"), [
    (["--attention", "fa3"], "--softmax-type learnable"),
    (["--layout", "ep=8,cp=2,cp_kind=ring", "--attention", "cudnn"], "cp_comm_type a2a"),
    (["--layout", "ep=8,tp=2,sp=true", "--attention", "cudnn"], "--etp 1"),
])
def test_what_transformer_engine_does_not_run_is_one_line(capsys, extra, says):
    out = Emit(capsys, ["gpt-oss-20b", "--gpus", "16", "--seq", "4096", *extra], "megatron")
    assert out.code == 2 and len(out.err.splitlines()) == 1 and says in out.err


def test_yarn_outside_mla_is_what_megatron_core_lacks():
    """gpt-oss as its config.json describes it (transformers 5.24 rope_parameters: YaRN ×32
    from 4096): megatron-core 0.16.1 has no YaRN for standard attention."""
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0}
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
           "vocab_size": 201088, "sliding_window": 128, "rope_parameters": rope}
    refusal = model_refusal("megatron", from_hf_dict(cfg, "gpt-oss-yarn"), TrainSpec())
    assert refusal is not None and "megatron-core 0.16.1" in refusal and "yarn" in refusal
    assert model_refusal("megatron", get_model("gpt-oss-20b"), TrainSpec()) is None


def test_a_window_on_every_layer_is_megatrons_window_size(tmp_path, capsys):
    """Mistral-7B's config (a 4096-key window on every layer) below --seq 8192: one window on
    every layer (no skip frequency), 4095 keys back plus the query's own, as transformers'
    `sliding_window_overlay`; the DeepSpeed export still refuses it (test_model_types)."""
    import json
    from pathlib import Path

    require("megatron")
    from megatron.core.transformer.utils import is_layer_window_attention

    cfg = json.loads((Path(__file__).parents[1] / "fixtures" / "hf" / "mistral-7b"
                      / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = Emit(capsys, [str(tmp_path / "config.json"), "--gpus", "16", "--seq", "8192"],
               "megatron")
    args = megatron_lm_args(out)
    window = tuple(int(i) for i in args.window_size.split(","))
    assert window == (cfg["sliding_window"] - 1, 0) and args.window_attn_skip_freq is None
    assert all(is_layer_window_attention(window, None, n) for n in range(1, 33))
