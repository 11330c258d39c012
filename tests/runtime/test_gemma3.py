"""The runtime runs transformers' Gemma 3 (`gemma3_text`): a tiny config written by
`Gemma3TextConfig` (sliding layers with window 4 < sequence 12 alternating with a global one,
local and global RoPE θ, QK-norm, sandwich norms with (1 + w), √h embeddings, GeGLU,
query_pre_attn_scalar ≠ d), saved by `save_pretrained`, loaded through the HF checkpoint path:
logits and every parameter's gradient equal `Gemma3ForCausalLM`'s in float64 (its float32
islands removed: `hf_variant_models`), fused kernel and materialised softmax; the bytes each
layer saves equal SPEC §3's count (`estimate.profiles`, which adds QK-norm and the sandwich
norms); config and tensors round-trip; `shardwise check` runs it.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.runtime.hf_variant_models import SEQ, hf_model, tokens  # noqa: E402

from shardwise.arch import from_hf_config, from_hf_dict  # noqa: E402
from shardwise.arch.variants import runtime_lacks  # noqa: E402
from shardwise.estimate.memory import saved_tensors_per_layer  # noqa: E402
from shardwise.layout import Layout  # noqa: E402
from shardwise.runtime import hf  # noqa: E402
from shardwise.runtime.measure import LayerRecorder  # noqa: E402
from shardwise.runtime.model import Transformer  # noqa: E402
from shardwise.runtime.parallelize import runtime_problems  # noqa: E402

KIND = "gemma3_text"


def loaded(tmp_path, kind: str = KIND, flash: bool = True):
    """(HF model, its checkpoint folder, the runtime model loaded from it)."""
    model = hf_model(kind)
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    spec = from_hf_config(tmp_path / "src")
    ours = Transformer(spec, dtype=torch.float64, flash=flash)
    hf.load_hf_weights(ours, tmp_path / "src")
    return model, tmp_path / "src", ours


def compare_logits_and_grads(model, ours) -> None:
    """Logits, the loss and every gradient (in HF's names and layouts) equal HF's."""
    x = tokens()
    theirs = model(x).logits
    mine = ours(x)
    assert (mine - theirs).abs().max().item() <= 1e-12
    targets = torch.roll(x, -1, dims=1)
    ce = torch.nn.functional.cross_entropy
    ce(theirs.flatten(0, 1), targets.flatten()).backward()
    ours.loss(x, targets).backward()
    grads = hf.hf_state({n: p.grad for n, p in ours.named_parameters()}, ours.spec)
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    if ours.spec.tie_embeddings:
        hf_grads.pop("lm_head.weight", None)
    assert grads.keys() == hf_grads.keys()
    for name, grad in grads.items():
        scale = hf_grads[name].abs().max().item()
        assert scale > 0, name  # every parameter matters here (no degenerate zero)
        assert (grad - hf_grads[name]).abs().max().item() <= 1e-10 * max(scale, 1), name


def test_config_is_non_degenerate():
    spec = from_hf_dict(hf_model(KIND).config.to_dict(), "g")
    assert spec.layer_types == ("sliding", "full", "sliding") and spec.sliding_window < SEQ
    assert spec.rope_local_theta != spec.rope_theta and spec.qk_norm == "head"
    assert runtime_lacks(spec) == []


@pytest.mark.parametrize("flash", [True, False])
def test_logits_and_grads_equal_transformers_fp64(tmp_path, flash):
    model, _, ours = loaded(tmp_path, flash=flash)
    compare_logits_and_grads(model, ours)


def test_window_changes_the_answer(tmp_path):
    """The window bites: with it widened to the sequence the logits differ."""
    _, _, ours = loaded(tmp_path)
    wide = Transformer(ours.spec.with_(sliding_window=SEQ), dtype=torch.float64)
    wide.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (wide(tokens()) - ours(tokens())).abs().max().item() > 1e-3


@pytest.mark.parametrize("flash", [True, False])
def test_each_layer_saves_the_count(tmp_path, flash):
    """Sliding and global layers alike save SPEC §3's count (a window keeps nothing more)."""
    _, _, ours = loaded(tmp_path, flash=flash)
    state = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    recorder = LayerRecorder(ours, lambda t: t.untyped_storage().data_ptr() in state)
    x = tokens()
    with recorder:
        ours.loss(x, x).backward()
    expected = saved_tensors_per_layer(ours.spec, SEQ, 2, flash=flash, dtype_bytes_=8)
    assert "q_norm_input" in expected and "post_mlp_norm_stats" in expected
    assert [c.layer for c in recorder.calls] == [0, 1, 2]
    for call in recorder.calls:
        assert call.saved == sum(expected.values()), call


def test_checkpoint_round_trip(tmp_path):
    checkpoint_round_trip(tmp_path, KIND)


def checkpoint_round_trip(tmp_path, kind: str) -> None:
    """hf_config reads back as the same spec (transformers accepts it), and the tensors the
    runtime would write are the file's."""
    from safetensors.torch import load_file

    _, src, ours = loaded(tmp_path, kind)
    config = hf.hf_config(ours.spec)
    assert from_hf_dict(json.loads(json.dumps(config)), ours.spec.name) == ours.spec
    getattr(transformers, config["architectures"][0]).config_class(**config)
    written = hf.hf_state(dict(ours.named_parameters()), ours.spec)
    on_disk = load_file(str(src / "model.safetensors"))
    assert written.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(written[name].detach(), tensor), name


def test_unsupported_parallelism_is_refused():
    spec = from_hf_dict(hf_model(KIND).config.to_dict(), "g")
    assert runtime_problems(Layout(dp=2, pp=1), spec, SEQ) == []
    for layout in (Layout(tp=2), Layout(cp=2)):
        problems = runtime_problems(layout, spec, SEQ)
        assert problems and "QK-norm" in problems[0] and "not supported" in problems[0]
    assert any("sliding-window" in p for p in runtime_problems(Layout(cp=2), spec, SEQ))


@pytest.mark.parametrize("flash", [True, False])
def test_mistral_window_shorter_than_the_sequence_equals_transformers(flash):
    """Mistral's window (every layer sliding) below the sequence: the runtime's banded core
    gives `MistralForCausalLM`'s logits (float64, `test_hf`'s islands removed)."""
    from tests.runtime.test_hf import TINY, _fp64_islands, runtime_from

    config = transformers.MistralConfig(**TINY, sliding_window=5, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).to(torch.float64).eval()
    _fp64_islands(model)
    ours = runtime_from(model)
    if not flash:
        ours = Transformer(ours.spec, dtype=torch.float64, flash=False).requires_grad_(False)
        ours.load_state_dict(runtime_from(model).state_dict())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - model(x).logits).abs().max().item() <= 1e-12


def test_a_config_that_would_describe_another_model_is_refused():
    """hf_config writes only what reads back as the same model: a Gemma 3 spec without its
    QK-norm, or a Llama with one variant, is refused in one line, never saved as another."""
    from shardwise.errors import ShardwiseError

    spec = from_hf_dict(hf_model(KIND).config.to_dict(), "g")
    for other in (spec.with_(qk_norm=""), spec.with_(block_norms="pre", gated_act="silu")):
        with pytest.raises(ShardwiseError, match="Hugging Face format") as info:
            hf.hf_config(other)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_saves_the_count(tmp_path, mode):
    """Under full recompute each layer keeps its input alone, and the pass keeps both kinds'
    RoPE tables once (global and local: one (4, s, d) storage every checkpoint shares);
    under selective recompute each layer saves SPEC §3's count without the attention core's."""
    from shardwise.runtime.parallelize import apply_recompute

    _, _, ours = loaded(tmp_path)
    apply_recompute(ours, mode)
    state = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    recorder = LayerRecorder(ours, lambda t: t.untyped_storage().data_ptr() in state)
    x = tokens()
    with recorder:
        ours.loss(x, x).backward()
    spec = ours.spec
    if mode == "full":
        assert [c.saved for c in recorder.calls] == [SEQ * 2 * spec.d_model * 8] * 3
        assert recorder.shared == [4 * SEQ * spec.head_dim * 8]
    else:
        expected = saved_tensors_per_layer(spec, SEQ, 2, flash=True, dtype_bytes_=8,
                                           selective=True)
        assert [c.saved for c in recorder.calls] == [sum(expected.values())] * 3
