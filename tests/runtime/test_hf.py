"""The runtime model is the model a Hugging Face config describes: parameter counts and logits
against transformers' own LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM (fp64), and
HF checkpoints in and out through `shardwise train --model DIR --save-hf OUT`.

HF's fp32 islands: in a float64 model, `LlamaRMSNorm` casts to float32 and the rotary
embedding computes its inverse frequencies and angles in float32 (`.float()`), so HF's own
fp64 logits carry ~1e-7 errors. `_fp64_islands` removes exactly those casts: RMSNorm runs HF's
formula in the input dtype, and the rotary module's `inv_freq` is recomputed by HF's own
`ROPE_INIT_FUNCTIONS` with its default-RoPE helper evaluated in float64, the angles
`position · inv_freq` in float64. The inverse frequencies are also compared with HF's fp32
ones directly (≤ 1e-6 relative, fp32 rounding). Attention runs HF's SDPA path (its eager
path's softmax is another float32 island).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import modeling_rope_utils  # noqa: E402

from shardwise.arch import from_hf_config, from_hf_dict  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.runtime import hf  # noqa: E402
from shardwise.runtime.model import Transformer, inverse_frequencies  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    # the issue's repro: explicit head_dim 32 ≠ 64/4, θ 5e5, ε 1e-6; with Llama 3.1 scaling
    "llama-head_dim-llama3": ("LlamaConfig", "LlamaForCausalLM",
                              dict(head_dim=32, rms_norm_eps=1e-6,
                                   rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5})),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6})),
    "qwen2-biases-tied": ("Qwen2Config", "Qwen2ForCausalLM",
                          dict(rms_norm_eps=1e-6, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def hf_model(case: str, seed: int = 0):
    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**TINY, **extra, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float64).eval()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


class _Float64Torch:
    """`torch` with `torch.float` meaning float64 (for HF's inverse-frequency functions)."""

    def __getattr__(self, name: str):
        return torch.float64 if name == "float" else getattr(torch, name)


def _fp64_islands(model) -> None:
    """Remove HF's float32 casts (module docstring) in place."""
    def norm_forward(self, x):  # LlamaRMSNorm.forward without `.to(torch.float32)`
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = norm_forward.__get__(module)
    rotary = model.model.rotary_emb
    rope_type = model.config.rope_parameters["rope_type"]
    init = (rotary.compute_default_rope_parameters if rope_type == "default" else
            modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type])
    modules = [modeling_rope_utils, sys.modules[type(rotary).__module__]]
    with pytest.MonkeyPatch.context() as patch:  # HF's own code, `torch.float` → float64
        for module in modules:
            patch.setattr(module, "torch", _Float64Torch())
        inv_freq, scale = init(model.config)
    assert inv_freq.dtype == torch.float64

    def rotary_forward(x, position_ids):  # the same formula, float64 angles
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = rotary_forward


def runtime_from(model) -> Transformer:
    spec = from_hf_dict(model.config.to_dict(), "hf")
    ours = Transformer(spec, dtype=torch.float64)
    with torch.no_grad():
        hf_params = dict(model.named_parameters())
        for name, p in ours.named_parameters():
            p.copy_(hf_params[hf.to_hf_name(name)])
    return ours


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_matches_hf(case):
    model = hf_model(case)
    spec = from_hf_dict(model.config.to_dict(), case)
    hf_count = sum(p.numel() for p in model.parameters())  # tied: counted once
    assert spec.count_params().total == hf_count
    assert sum(p.numel() for p in Transformer(spec).parameters()) == hf_count


def test_issue_repro_head_dim_and_count():
    """The issue's LlamaConfig: HF builds head_dim 32 and 229,952 parameters."""
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, rope_theta=5e5,
                                      rms_norm_eps=1e-6)
    spec = from_hf_dict(config.to_dict(), "repro")
    assert (spec.head_dim, spec.rope_theta, spec.norm_eps) == (32, 5e5, 1e-6)
    small = config.to_dict() | {"vocab_size": 256, "intermediate_size": 96,
                                "num_hidden_layers": 2}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    assert from_hf_dict(small, "s").count_params().total == sum(
        p.numel() for p in model.parameters())


def test_inverse_frequencies_match_hf_llama3():
    config = transformers.LlamaConfig(**TINY, head_dim=32,
                                      rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5})
    theirs, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config)  # float32
    spec = from_hf_dict(config.to_dict(), "l3")
    ours = inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert not torch.allclose(ours, inverse_frequencies(32, 5e5), rtol=1e-3)  # scaling bites
    torch.testing.assert_close(ours, theirs.to(torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_fp64(case):
    model = hf_model(case)
    _fp64_islands(model)
    ours = runtime_from(model)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        mine = ours(tokens)
    assert (mine - theirs).abs().max().item() <= 1e-12


# --------------------------------------------------------------- checkpoints in and out
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True,
                          text=True, timeout=600)


def _save(case: str, where: Path) -> Path:
    model = hf_model(case)
    model.save_pretrained(where, safe_serialization=True)
    return where


def _hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="sdpa").eval()
    _fp64_islands(model)
    with torch.no_grad():
        return model(tokens).logits


def test_load_and_save_in_process(tmp_path):
    """load_hf_weights → the HF model's logits; hf_config → a config transformers reads."""
    src = _save("llama-head_dim-llama3", tmp_path / "src")
    spec = from_hf_config(src)
    ours = Transformer(spec, dtype=torch.float64)
    hf.load_hf_weights(ours, src)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens) - _hf_logits(src, tokens)).abs().max().item() <= 1e-12
    again = from_hf_dict(json.loads(json.dumps(hf.hf_config(spec))), spec.name)
    assert again == spec


@pytest.mark.slow
def test_cli_round_trip_and_one_step_on_dp2_tp2(tmp_path, case="qwen2-biases-tied"):
    """`shardwise train --model DIR --save-hf OUT`: with 0 steps OUT is the original model;
    one step on dp2×tp2 writes the same model as one step on one rank. (Qwen2: biases split
    over tp, tied embeddings; the Llama/Mistral weights load in-process above.)"""
    src = _save(case, tmp_path / "src")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    common = ["train", "--model", str(src), "--dtype", "fp64", "--seq", "16",
              "--global-batch", "4", "--quiet"]
    out0 = tmp_path / "zero"
    run = _cli(*common, "--steps", "0", "--save-hf", str(out0))
    assert run.returncode == 0, run.stderr
    assert (_hf_logits(out0, tokens) - _hf_logits(src, tokens)).abs().max().item() <= 1e-12
    one, par = tmp_path / "one", tmp_path / "par"
    for out, layout in ((one, []), (par, ["--dp", "2", "--tp", "2"])):
        run = _cli(*common, "--steps", "1", "--save-hf", str(out), *layout)
        assert run.returncode == 0, run.stderr
    single, parallel = _hf_logits(one, tokens), _hf_logits(par, tokens)
    assert (single - _hf_logits(src, tokens)).abs().max().item() > 1e-6  # it trained
    assert (parallel - single).abs().max().item() <= 1e-12


# ------------------------------------------------------------------------------- Mixtral
MIXTRAL = dict(TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
               rms_norm_eps=1e-6, router_jitter_noise=0.0,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def mixtral_model(seed: int = 0):
    """A tiny `MixtralForCausalLM` in float64, its fp32 islands removed (HF's router takes
    `softmax(logits.float())`; here the same softmax, top-k and renormalisation in float64)."""
    config = transformers.MixtralConfig(**MIXTRAL, attn_implementation="sdpa",
                                        experts_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    _fp64_router(model)
    return model


def _fp64_router(model) -> None:
    def router_forward(self, hidden_states):  # MixtralTopKRouter.forward without `.float()`
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    for module in model.modules():
        if type(module).__name__ == "MixtralTopKRouter":
            module.forward = router_forward.__get__(module)
    _fp64_islands(model)


# The Mixtral expert layouts transformers 5 loads (runtime/hf.py docstring): the one
# `save_pretrained` writes by default (per expert), the fused one (`save_original_format=False`),
# and each with the other module prefix (renamed from those two).
MIXTRAL_LAYOUTS = {
    "per-expert": (True, None, "block_sparse_moe.experts.0.w1.weight"),
    "fused": (False, None, "mlp.experts.gate_up_proj"),
    "per-expert under mlp": (True, (".block_sparse_moe.", ".mlp."), "mlp.experts.0.w1.weight"),
    "fused under block_sparse_moe": (False, (".mlp.", ".block_sparse_moe."),
                                     "block_sparse_moe.experts.gate_up_proj"),
}


def _mixtral_checkpoint(model, where: Path, layout: str) -> Path:
    """`model` saved by transformers in one of MIXTRAL_LAYOUTS."""
    from safetensors.torch import load_file, save_file

    original_format, rename, key = MIXTRAL_LAYOUTS[layout]
    model.save_pretrained(where, safe_serialization=True, save_original_format=original_format)
    path = str(where / "model.safetensors")
    tensors = load_file(path)
    if rename is not None:
        tensors = {k.replace(*rename): v for k, v in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
    assert f"model.layers.0.{key}" in tensors  # the layout this case is about
    return where


def _hf_mixtral(directory: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="sdpa",
        experts_implementation="eager").eval()  # (its default grouped GEMM has no float64)
    _fp64_router(model)
    return model


@pytest.mark.parametrize("layout", list(MIXTRAL_LAYOUTS))
def test_mixtral_checkpoint_layouts_load_like_hf(tmp_path, layout):
    """Each expert layout transformers 5 loads, saved by transformers: its own
    `from_pretrained` and `load_hf_weights` both give the original model's logits (fp64)."""
    model = mixtral_model()
    src = _mixtral_checkpoint(model, tmp_path / "src", layout)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = Transformer(from_hf_config(src), dtype=torch.float64)
    hf.load_hf_weights(ours, src)
    with torch.no_grad():
        theirs = model(tokens).logits
        assert (_hf_mixtral(src)(tokens).logits - theirs).abs().max().item() <= 1e-12
        assert (ours(tokens) - theirs).abs().max().item() <= 1e-12


@pytest.mark.parametrize("change, message", [
    ({"model.layers.0.mlp.experts.gate_up_bias": torch.zeros(4, 96)},
     "model.safetensors: checkpoint tensor 'model.layers.0.mlp.experts.gate_up_bias' is not a "
     "Llama/Mistral/Qwen2/Mixtral weight shardwise knows"),
    ({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 90, 64)},
     r"gate_up_proj has shape \(4, 90, 64\), config.json implies \(4, 96, 64\)"),
    ({"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.zeros(64, 48)},
     "experts.1.w2.weight holds weights already read from model.layers.0.mlp.experts.down_proj"
     "|down_proj holds weights already read from model.layers.0.block_sparse_moe.experts.1.w2"),
    ({"model.layers.1.mlp.experts.down_proj": None},
     r"lacks model.layers.1.block_sparse_moe.experts.0.w2.weight, .* \(or the fused"),
])
def test_mixtral_checkpoint_errors_are_one_line(tmp_path, change, message):
    """A fused checkpoint with an unknown, misshapen, doubled or missing expert tensor: one
    ShardwiseError line naming the tensor (the CLI prints it from the rank)."""
    from safetensors.torch import load_file, save_file

    src = _mixtral_checkpoint(mixtral_model(), tmp_path / "src", "fused")
    tensors = load_file(str(src / "model.safetensors")) | change
    save_file({k: v for k, v in tensors.items() if v is not None},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ShardwiseError, match=message) as info:
        hf.load_hf_weights(Transformer(from_hf_config(src), dtype=torch.float64), src)
    assert "\n" not in str(info.value)
    with pytest.raises(ShardwiseError, match=message):  # the same from the headers alone
        hf.check_hf_weights(from_hf_config(src), src)


def test_a_bad_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    """`train` / `check --model DIR`: the checkpoint's headers are checked on the launcher,
    so a misshapen tensor or an unreadable file is one line and exit code 2 (not a rank's
    failure, exit 1)."""
    from safetensors.torch import load_file, save_file
    from tests.cli_helpers import assert_one_line_error, shardwise

    src = _mixtral_checkpoint(mixtral_model(), tmp_path / "src", "fused")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 90, 64)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    for command in ("train", "check"):
        result = shardwise(command, "--model", str(src), "--steps", "1", check=False)
        assert_one_line_error(result, "gate_up_proj has shape (4, 90, 64), config.json "
                                      "implies (4, 96, 64)")
        assert "rank 0" not in result.stderr
    (src / "model.safetensors").write_bytes(b"not a safetensors file")
    assert_one_line_error(shardwise("train", "--model", str(src), check=False),
                          "not a readable safetensors file")


def test_mixtral_weights_load_and_save_like_hf(tmp_path):
    """A Mixtral checkpoint (block_sparse_moe.gate, experts.N.w1/w2/w3) loads into the
    runtime's MoE layers: logits equal HF's in fp64; written back (to_hf_tensors, hf_config),
    transformers reads the same model."""
    model = mixtral_model()
    src = tmp_path / "src"
    model.save_pretrained(src, safe_serialization=True)
    spec = from_hf_config(src)
    assert (spec.n_experts, spec.top_k, spec.expert_d_ff) == (4, 2, 48)
    ours = Transformer(spec, dtype=torch.float64)
    hf.load_hf_weights(ours, src)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        assert (ours(tokens) - theirs).abs().max().item() <= 1e-12
    from safetensors.torch import save_file

    out = tmp_path / "out"
    out.mkdir()
    save_file({k: v.contiguous() for n, p in ours.named_parameters()
               for k, v in hf.to_hf_tensors(n, p.detach()).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf.hf_config(spec)), encoding="utf-8")
    with torch.no_grad():
        assert (_hf_mixtral(out)(tokens).logits - theirs).abs().max().item() <= 1e-12


@pytest.mark.slow
def test_cli_mixtral_round_trip_and_one_step_on_dp2_ep2(tmp_path):
    """`shardwise train --model DIR --save-hf OUT` on a Mixtral checkpoint in transformers 5's
    fused layout: 0 steps on dp2×ep2 (experts split over ep as they load) writes the original
    model back (in the per-expert layout `save_pretrained` writes); one step on dp2×ep2 writes
    the same model as one step on one rank."""
    model = mixtral_model()
    src = _mixtral_checkpoint(model, tmp_path / "src", "fused")
    hf_saved = _mixtral_checkpoint(model, tmp_path / "hf", "per-expert")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))

    def logits(directory: Path) -> torch.Tensor:
        with torch.no_grad():
            return _hf_mixtral(directory)(tokens).logits

    common = ["train", "--model", str(src), "--dtype", "fp64", "--seq", "16",
              "--global-batch", "4", "--quiet"]
    ep = ["--dp", "2", "--ep", "2"]
    for out, steps, layout in (("zero", "0", ep), ("one", "1", []), ("par", "1", ep)):
        run = _cli(*common, "--steps", steps, "--save-hf", str(tmp_path / out), *layout)
        assert run.returncode == 0, run.stderr
    original = logits(src)
    assert (logits(tmp_path / "zero") - original).abs().max().item() <= 1e-12

    def shapes(directory: Path) -> dict[str, tuple[int, ...]]:
        from safetensors.torch import load_file

        return {k: tuple(v.shape) for k, v in load_file(directory / "model.safetensors").items()}

    assert shapes(tmp_path / "zero") == shapes(hf_saved)  # the tensors save_pretrained writes
    single = logits(tmp_path / "one")
    assert (single - original).abs().max().item() > 1e-6  # it trained
    assert (logits(tmp_path / "par") - single).abs().max().item() <= 1e-12
