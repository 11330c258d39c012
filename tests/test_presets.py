"""The hub presets (issue 51, issue 44): each is read from the config.json values it cites
(`presets.HUB_CONFIGS`), and its parameter count equals transformers 5.24's own model built
from those values on the meta device; the published totals and active counts of the checkpoints
added last (test_model_types.NEW_PRESETS runs memory and plan on them)."""

import pytest

from shardwise.arch import PRESETS
from shardwise.arch.presets import HUB_CONFIGS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_every_hub_preset_counts_what_transformers_builds(name):
    fields = dict(HUB_CONFIGS[name])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert PRESETS[name].count_params().total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "total", "active", "embedding_counted"), [
    # Llama 4 model card: 400 B total, 17 B active (the text model)
    ("llama4-maverick", 400, 17, True),
    # gpt-oss model card (arXiv:2508.10925) Table 1: 20.91 B total, 3.61 B active, its active
    # count without the embedding table (the unembedding counted): 120b 116.83 B / 5.13 B
    ("gpt-oss-20b", 20.91, 3.61, False), ("gpt-oss-120b", 116.83, 5.13, False)])
def test_published_totals_of_the_latest_presets(name, total, active, embedding_counted):
    model = PRESETS[name]
    counts = model.count_params()
    table = 0 if embedding_counted else model.vocab * model.d_model
    assert counts.total / 1e9 == pytest.approx(total, abs=1 if total == 400 else 0.005)
    # Meta's "400 B", "17 B" are rounded (400.7 B here); the gpt-oss card gives two decimals
    assert (counts.active - table) / 1e9 == pytest.approx(active, abs=0.5 if active == 17
                                                              else 0.005)


def test_maverick_alternates_dense_and_moe_layers_without_qk_norm():
    """Maverick's config.json: interleave_moe_layer_step 2 (layers 1, 3, … MoE), no QK-norm,
    no RoPE scaling; Scout's: every layer MoE, L2 QK-norm, llama3 scaling ×16."""
    maverick, scout = PRESETS["llama4-maverick"], PRESETS["llama4-scout"]
    assert [maverick.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert maverick.n_moe_layers == 24 and scout.n_moe_layers == 48
    assert (maverick.qk_norm, scout.qk_norm) == ("", "l2")
    assert (maverick.rope_type, scout.rope_type) == ("default", "llama3")


def test_gemma2_27b_slides_a_4096_token_window():
    """Gemma 2 report (Gemma Team 2024, Table 1): a sliding window of 4096 tokens on the
    local layers; transformers' Gemma2Config defaults to the same window."""
    assert PRESETS["gemma2-27b"].sliding_window == 4096 == transformers.Gemma2Config(
        ).sliding_window
