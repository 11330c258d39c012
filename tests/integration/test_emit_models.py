"""Exports of the newer model types (issue 51 item 4), read back by the frameworks' own code as
test_torchtitan.py and test_megatron*.py read the others: torchtitan 0.3.0's qwen3 30B-A3B and
gpt_oss 20b/120b configs (built on the meta device: the plan's parameter total, its windows,
sinks and router), Megatron-LM's Qwen3, SmolLM3 and GLM-4.5 (`--qk-layernorm`, `--no-rope-freq`,
`--kv-channels`, `--norm-epsilon` as megatron-core's TransformerConfig and Megatron-LM's parser
take them),
and the one-line refusals of what neither framework builds."""

import pytest

from shardwise.arch import get_model
from tests.integration.conftest import Emit, require
from tests.integration.test_megatron import _config
from tests.integration.test_megatron import reads_back as megatron_reads_back
from tests.integration.test_megatron_lm import megatron_lm_args
from tests.integration.test_torchtitan import parse
from tests.integration.test_torchtitan import reads_back as titan_reads_back

pytestmark = pytest.mark.integration

TITAN = {
    # its 30B-A3B over ep=8 inside FSDP; with tp and pp
    "qwen3-ep8": ["qwen3-30b-a3b", "--gpus", "64", "--seq", "4096", "--global-batch", "256",
                  "--layout", "ep=8,zero=3,recompute=full"],
    "qwen3-tp2-pp2": ["qwen3-30b-a3b", "--gpus", "32", "--seq", "8192", "--global-batch",
                      "64", "--layout", "tp=2,sp=1,pp=2,ep=4,zero=3,recompute=full"],
    # gpt_oss under its varlen attention (--attention fa3), windows shorter than --seq
    "gpt-oss-120b-ep8": ["gpt-oss-120b", "--gpus", "64", "--seq", "8192", "--global-batch",
                         "128", "--attention", "fa3", "--layout", "ep=8,zero=3,recompute=full"],
    "gpt-oss-20b-tp2": ["gpt-oss-20b", "--gpus", "16", "--seq", "4096", "--global-batch", "64",
                        "--attention", "fa3", "--layout", "tp=2,sp=1,ep=4,zero=3,"
                                                      "recompute=op-sac"],
}


@pytest.mark.parametrize("run", list(TITAN))
def test_torchtitan_reads_back_the_new_models(capsys, run):
    require("torchtitan")
    out = Emit(capsys, TITAN[run], "torchtitan")
    assert out.code == 0, out.err
    model = get_model(TITAN[run][0])
    titan_reads_back(out, model)  # shape, parameter total, router, degrees, batch, …
    assert len(out.notes) == 1 and "load_balance_coeff" in out.notes[0]
    _, words = out.command()
    spec = parse(words[words.index("-m") + 2:]).model_spec.model
    for i, layer in enumerate(spec.layers):
        attention = layer.attention
        if model.attention_sinks:  # gpt_oss: a window on the sliding layers, sinks on all
            span = model.attention_span(i)
            assert attention.sliding_window_size == (span or None)
            assert 0 < span < int(out.plan["seq_len"]) or model.layer_kind(i) == "full"
        else:  # qwen3: QK-norm over each head's d
            assert attention.qk_norm.normalized_shape == model.head_dim
        assert attention.head_dim == model.head_dim
        assert (attention.n_heads, attention.n_kv_heads) == (model.n_heads, model.n_kv_heads)


def test_torchtitan_refuses_gpt_oss_under_flex_and_qwen3_past_its_rope_cache(capsys):
    """gpt_oss's configs build varlen attention only, so a flex plan is refused; qwen3's 30B-A3B
    keeps RoPE for 40960 positions: torchtitan's own update_from_config refuses 65536, and so
    does the export, each in one line."""
    require("torchtitan")
    flex = Emit(capsys, ["gpt-oss-120b", "--gpus", "64", "--seq", "8192", "--global-batch",
                         "128", "--impl", "torchtitan", "--layout", "ep=8,zero=3"], "torchtitan")
    assert flex.code == 2 and len(flex.err.splitlines()) == 1 and "--attention fa3" in flex.err
    long = Emit(capsys, ["qwen3-30b-a3b", "--gpus", "64", "--seq", "65536", "--global-batch",
                         "64", "--impl", "torchtitan", "--layout", "ep=8,cp=4,zero=3"],
                "torchtitan")
    assert long.code == 2 and len(long.err.splitlines()) == 1 and "40960 positions" in long.err
    config = parse(["--module", "qwen3", "--config", "qwen3_30b_a3b",
                    "--training.seq_len", "65536"])
    with pytest.raises(ValueError, match="exceeds attention RoPE maximum"):
        config.model_spec.model.update_from_config(config=config)


MEGATRON = {
    "qwen3-8b": ["qwen3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "128",
                 "--layout", "tp=2,sp=1,zero=1,recompute=selective"],
    "qwen3-30b-a3b": ["qwen3-30b-a3b", "--gpus", "64", "--seq", "4096", "--global-batch",
                      "256", "--layout", "tp=2,sp=1,ep=8,zero=1,recompute=full"],
    # every 4th layer without RoPE (--no-rope-freq 4), tied embeddings, no QK-norm
    "smollm3-3b": ["smollm3-3b", "--gpus", "16", "--seq", "4096", "--global-batch", "128",
                   "--layout", "tp=2,pp=2,zero=1,recompute=full"],
    # head_dim 128 ≠ 5120 / 96: --kv-channels; sigmoid router with expert bias, 3 dense layers
    "glm-4.5": ["glm-4.5", "--gpus", "512", "--seq", "4096", "--global-batch", "1024",
                "--layout", "tp=2,sp=1,pp=8,ep=32,zero=1,recompute=full"],
}


@pytest.mark.parametrize("run", list(MEGATRON))
def test_megatron_reads_back_qwen3_smollm3_and_glm(capsys, run):
    require("megatron")
    out = Emit(capsys, MEGATRON[run], "megatron")
    assert out.code == 0, out.err
    model = get_model(MEGATRON[run][0])
    megatron_reads_back(out, model)
    _, argv = out.command()
    _, config, _ = _config(argv)
    # per-head QK-norm and the heads' width as megatron-core holds them (the norms' epsilon
    # is Megatron-LM's --norm-epsilon, dest layernorm_epsilon: read by its parser below)
    assert config.qk_layernorm == (model.qk_norm == "head")
    # the layers megatron-core's attention runs without RoPE (no_rope_freq, per layer)
    assert [bool(x) for x in config.no_rope_freq or [0] * model.n_layers] == [
        i in model.nope_layers for i in range(model.n_layers)]
    assert config.kv_channels == model.head_dim  # h/a unless --kv-channels says otherwise
    assert config.add_qkv_bias == model.qkv_bias
    if model.is_moe:
        assert (config.moe_router_topk, config.moe_ffn_hidden_size) == (model.top_k,
                                                                         model.expert_d_ff)
        assert config.moe_router_score_function == model.router_score
        assert config.moe_router_pre_softmax == (not model.norm_topk)
        assert (config.moe_shared_expert_intermediate_size or 0) == (
            model.n_shared_experts * model.expert_d_ff)
    args = megatron_lm_args(out)  # Megatron-LM's parser and validate_args rules
    assert args.qk_layernorm == (model.qk_norm == "head")
    assert args.layernorm_epsilon == model.norm_eps
    assert args.untie_embeddings_and_output_weights == (not model.tie_embeddings)
    assert args.kv_channels == (model.head_dim if model.head_dim != model.d_model // model.n_heads
                                else None)


@pytest.mark.parametrize("model,phrase", [
    ("gemma3-27b", "sandwich-norm blocks"), ("gemma2-27b", "attention logit soft-capping"),
    ("olmo2-32b", "QK-norm over 'full'"), ("granite-3.3-8b", "scalar multipliers"),
    ("llama4-scout", "QK-norm over 'l2'")])  # gpt-oss: test_megatron_gpt_oss.py
def test_megatron_refuses_what_it_does_not_build_in_one_line(capsys, model, phrase):
    out = Emit(capsys, [model, "--gpus", "64", "--seq", "1024", "--global-batch", "64"],
               "megatron")
    assert out.code == 2 and len(out.err.splitlines()) == 1, out.err
    assert phrase in out.err and "Megatron-LM" in out.err


@pytest.mark.parametrize("model", ["gemma3-27b", "llama4-scout", "phi-4", "olmo2-32b",
                                   "granite-3.3-8b", "smollm3-3b", "glm-4.5", "qwen3-8b"])
def test_torchtitan_refuses_the_models_it_does_not_ship(capsys, model):
    require("torchtitan")
    import torchtitan.models as titan_models

    out = Emit(capsys, [model, "--gpus", "64", "--seq", "1024", "--global-batch", "64"],
               "torchtitan")
    assert out.code == 2 and len(out.err.splitlines()) == 1
    assert f"ships no {model} model" in out.err
    # torchtitan's own model packages: none of these types, and qwen3 without a bf16 8B config
    import pkgutil
    modules = {m.name for m in pkgutil.iter_modules(titan_models.__path__)}
    assert not modules & {"llama4", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3",
                          "glm4_moe"}
    from torchtitan.models.qwen3 import config_registry
    assert not hasattr(config_registry, "qwen3_8b")
