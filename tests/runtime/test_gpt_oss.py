"""The runtime runs transformers' gpt-oss (`gpt_oss`): a tiny config written by
`GptOssConfig` (sliding layers with window 4 < sequence 12 alternating with a full one,
nonzero attention sinks, 4 experts with top-2 routing — a softmax over the top-k logits —
router and expert biases, the clamped SwiGLU with a limit that bites, YaRN RoPE, Q/K/V/O
biases), saved by `save_pretrained` (gate and up interleaved), loaded through the HF
checkpoint path: logits and every parameter's gradient equal `GptOssForCausalLM`'s in
float64 (its float32 islands removed: `hf_variant_models`), fused kernel and materialised
softmax; each layer saves SPEC §3's count; config and tensors round-trip.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.runtime.hf_variant_models import SEQ, hf_model, tokens  # noqa: E402
from tests.runtime.test_gemma3 import (  # noqa: E402
    checkpoint_round_trip,
    compare_logits_and_grads,
    loaded,
)

from shardwise.arch import from_hf_dict  # noqa: E402
from shardwise.arch.variants import runtime_lacks  # noqa: E402
from shardwise.estimate.memory import saved_tensors_per_layer  # noqa: E402
from shardwise.layout import Layout  # noqa: E402
from shardwise.ops.swiglu import gated  # noqa: E402
from shardwise.runtime.measure import LayerRecorder  # noqa: E402
from shardwise.runtime.parallelize import runtime_problems  # noqa: E402

KIND = "gpt_oss"


def test_config_is_non_degenerate():
    spec = from_hf_dict(hf_model(KIND).config.to_dict(), "o")
    assert spec.layer_types == ("sliding", "full", "sliding") and spec.sliding_window < SEQ
    assert spec.n_experts >= 4 and spec.top_k >= 2 and spec.attention_sinks
    assert spec.rope_type == "yarn" and runtime_lacks(spec) == []


@pytest.mark.parametrize("flash", [True, False, "reference"])
def test_logits_and_grads_equal_transformers_fp64(tmp_path, monkeypatch, flash):
    """"reference": the fused path's kernels off the CPU (`block_forward`/`block_backward`
    with the window's mask), run here on the CPU."""
    if flash == "reference":
        import shardwise.ops.attention as ops_attention

        monkeypatch.setattr(ops_attention, "fused_kernel", lambda q: False)
    model, _, ours = loaded(tmp_path, KIND, flash=bool(flash))
    assert all(p.abs().min() > 0 for n, p in model.named_parameters() if n.endswith("sinks"))
    compare_logits_and_grads(model, ours)


def test_clamped_swiglu_matches_autograd():
    """`gated(…, "swiglu_clamp")`'s hand-written backward against autograd through
    transformers' own `GptOssExperts._apply_gate`, with values on both sides of the limit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(transformers.GptOssConfig(swiglu_limit=1.0, num_local_experts=1))
    g = (torch.randn(64, 8, dtype=torch.float64) * 2).requires_grad_()
    u = (torch.randn(64, 8, dtype=torch.float64) * 2).requires_grad_()
    assert (g > 1).any() and (u.abs() > 1).any() and (g < 1).any()
    theirs = experts._apply_gate(torch.stack([g, u], dim=-1).flatten(-2))
    mine = gated(g, u, "swiglu_clamp", experts.alpha, experts.limit)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-15)
    dy = torch.randn_like(mine)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-14) for a, b in zip(
        torch.autograd.grad(mine, (g, u), dy), torch.autograd.grad(theirs, (g, u), dy),
        strict=True))


@pytest.mark.parametrize("flash", [True, False])
def test_each_layer_saves_the_count(tmp_path, flash):
    """Sliding and full layers save SPEC §3's count: sinks and windows keep nothing more; all
    routed rows run on the one rank, so the MoE count holds whatever the routing."""
    _, _, ours = loaded(tmp_path, KIND, flash=flash)
    state = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    recorder = LayerRecorder(ours, lambda t: t.untyped_storage().data_ptr() in state)
    x = tokens()
    with recorder:
        ours.loss(x, x).backward()
    expected = saved_tensors_per_layer(ours.spec, SEQ, 2, flash=flash, dtype_bytes_=8,
                                       moe=True)
    assert [c.layer for c in recorder.calls] == [0, 1, 2]
    for call in recorder.calls:
        assert call.saved + (call.moe or 0) == sum(expected.values()), call


def test_checkpoint_round_trip(tmp_path):
    checkpoint_round_trip(tmp_path, KIND)


def test_unsupported_parallelism_is_refused():
    spec = from_hf_dict(hf_model(KIND).config.to_dict(), "o")
    assert runtime_problems(Layout(dp=2), spec, SEQ) == []
    for layout in (Layout(tp=2), Layout(dp=2, ep=2), Layout(cp=2)):
        problems = runtime_problems(layout, spec, SEQ)
        assert problems and "attention sinks" in problems[0], layout


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_inverse_frequencies_match_hf(kind):
    """YaRN (gpt-oss) and linear scaling (Gemma 3's global layers) against transformers'
    own float32 functions (≤ 1e-6 relative: fp32 rounding), and YaRN's cos/sin factor."""
    from transformers import modeling_rope_utils

    from shardwise.runtime.model import inverse_frequencies
    from shardwise.runtime.model.layers import rope_attention_factor

    if kind == "yarn":
        config = hf_model(KIND).config
    else:
        config = transformers.LlamaConfig(head_dim=8, rope_parameters={
            "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6})
    spec = from_hf_dict(config.to_dict(), kind)
    theirs, factor = modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind](config)
    ours = inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert not torch.allclose(ours, inverse_frequencies(spec.head_dim, spec.rope_theta))
    torch.testing.assert_close(ours, theirs.to(torch.float64), rtol=1e-6, atol=0)
    assert rope_attention_factor(spec.rope_scaling) == pytest.approx(factor, rel=1e-12)
