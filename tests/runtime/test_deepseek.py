"""The runtime's DeepSeek blocks (multi-head latent attention, DeepSeekMoE) against
transformers' own `DeepseekV3DecoderLayer` / `DeepseekV2DecoderLayer` on the same weights in
float64 (outputs, input and weight gradients), the bytes they save against SPEC §3's count, and
`tiny-deepseek` trained and checked on real ranks.

HF's float32 islands: in a float64 model transformers' RMSNorm casts to float32, the router
computes its logits in float32 and the eager attention's softmax runs in float32; the tests run
HF's own code with its module's `torch.float32` meaning float64 (`_F64`), and pass it the RoPE
tables computed in float64. DeepSeek-V2's rotary multiplies complex numbers built with
`Tensor.float()`, an island no module attribute reaches: that case compares within fp32
rounding (1e-5 relative).
"""

from __future__ import annotations

import math
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import transformers.models.deepseek_v2.modeling_deepseek_v2 as hf_v2  # noqa: E402
import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf_v3  # noqa: E402
from tests.cli_helpers import assert_one_line_error, shardwise  # noqa: E402

from shardwise.arch import from_hf_dict, get_model  # noqa: E402
from shardwise.estimate.check import CheckRow, merge_rows  # noqa: E402
from shardwise.estimate.memory import saved_tensors_per_layer  # noqa: E402
from shardwise.layout import Layout  # noqa: E402
from shardwise.runtime.launch import spawn  # noqa: E402
from shardwise.runtime.measure import LayerRecorder, check_layout  # noqa: E402
from shardwise.runtime.model import Block, Transformer, rotary_tables  # noqa: E402
from shardwise.runtime.parallelize import runtime_problems  # noqa: E402
from shardwise.runtime.train import TrainConfig  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=2, n_routed_experts=8, kv_lora_rank=12, qk_rope_head_dim=8,
             v_head_dim=6, qk_nope_head_dim=10, num_experts_per_tok=3, first_k_dense_replace=1,
             rms_norm_eps=1e-5, max_position_embeddings=64)
CASES = {
    # V3: q latent, sigmoid scores + correction bias, 1 of 2 groups, gates renormalised × 2.5
    "v3": (hf_v3, "DeepseekV3Config", dict(q_lora_rank=20, n_group=2, topk_group=1,
                                           routed_scaling_factor=2.5)),
    # V3 without a q latent, RoPE not interleaved, no groups, gates neither renormalised nor
    # scaled
    "v3-plain": (hf_v3, "DeepseekV3Config", dict(q_lora_rank=None, rope_interleave=False,
                                                 n_group=1, topk_group=1, norm_topk_prob=False,
                                                 routed_scaling_factor=1.0)),
    # V2: softmax scores, group-limited greedy (a group's best score), gates × 1.5
    "v2": (hf_v2, "DeepseekV2Config", dict(q_lora_rank=None, topk_method="group_limited_greedy",
                                           n_group=4, topk_group=2, routed_scaling_factor=1.5)),
}
_HF_NAMES = {  # runtime name ← HF name inside a decoder layer
    "attention_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight", "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


class _F64:
    """`torch` with `torch.float` and `torch.float32` meaning float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


def _runtime_layout(hf: dict[str, torch.Tensor], f: int, shared: int
                    ) -> dict[str, torch.Tensor]:
    """An HF decoder layer's tensors (weights or their gradients) under the runtime's names and
    layouts: the router (E, h) → (h, E), the fused experts `gate_up_proj` (E, 2f, h) and
    `down_proj` (E, h, f) → (E, h, f) and (E, f, h), the shared experts' one MLP of width S·f
    → S experts."""
    out = {ours: hf[theirs] for ours, theirs in _HF_NAMES.items() if theirs in hf}
    if "mlp.gate.weight" in hf:
        gate_up = hf["mlp.experts.gate_up_proj"]
        out |= {"mlp.router": hf["mlp.gate.weight"].T, "mlp.w_gate": gate_up[:, :f].mT,
                "mlp.w_up": gate_up[:, f:].mT, "mlp.w_down": hf["mlp.experts.down_proj"].mT}
        rows = [slice(i * f, (i + 1) * f) for i in range(shared)]
        out |= {f"mlp.shared_{w}": torch.stack([hf[f"mlp.shared_experts.{w}_proj.weight"][r].T
                                                for r in rows]) for w in ("gate", "up")}
        out["mlp.shared_down"] = torch.stack(
            [hf["mlp.shared_experts.down_proj.weight"][:, r].T for r in rows])
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer", [0, 1], ids=["dense", "moe"])
def test_layer_equals_transformers_fp64(case, layer):
    module, config_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**SMALL, **extra)
    config._attn_implementation = "eager"
    spec = from_hf_dict(config.to_dict(), case)
    torch.manual_seed(0)
    cls = getattr(module, config_cls.replace("Config", "DecoderLayer"))
    hf = cls(config, layer).to(torch.float64)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.3)
        if hasattr(hf.mlp, "gate") and hasattr(hf.mlp.gate, "e_score_correction_bias"):
            hf.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    b, s = 2, 16
    x = torch.randn(b, s, config.hidden_size, dtype=torch.float64)
    grad = torch.randn_like(x)
    positions = torch.arange(s)
    cos, sin = rotary_tables(positions, spec.rope_dim, spec.rope_theta, torch.float64)
    if case == "v2":  # complex rotation factors, position · θ^(-2i/d) in float64
        inv_freq = spec.rope_theta ** (-torch.arange(0, spec.rope_dim, 2,
                                                     dtype=torch.float64) / spec.rope_dim)
        angles = positions[:, None].to(torch.float64) * inv_freq
        tables = torch.polar(torch.ones_like(angles), angles)[None]
    else:
        tables = (cos[None], sin[None])
    mask = torch.full((s, s), -math.inf, dtype=torch.float64).triu(1)[None, None]
    x_hf = x.clone().requires_grad_()
    with mock.patch.object(module, "torch", _F64()):
        y_hf = hf(x_hf, attention_mask=mask, position_embeddings=tables)
        (y_hf * grad).sum().backward()
    named = dict(hf.named_parameters())
    layout = (config.moe_intermediate_size, config.n_shared_experts)
    hf_weights = _runtime_layout(named, *layout)
    hf_grads = _runtime_layout({n: p.grad for n, p in named.items()}, *layout)
    tol = dict(rtol=1e-5, atol=1e-7) if case == "v2" else dict(rtol=1e-12, atol=1e-12)
    for flash in (True, False):
        ours = Block(spec, flash, torch.float64, moe=spec.is_moe_layer(layer))
        params = dict(ours.named_parameters())
        assert set(params) == set(hf_weights)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(hf_weights[name])
            if getattr(ours.mlp, "score_bias", None) is not None:
                ours.mlp.score_bias.copy_(hf.mlp.gate.e_score_correction_bias)
        x_ours = x.clone().requires_grad_()
        y = ours(x_ours, cos, sin)
        (y * grad).sum().backward()
        torch.testing.assert_close(y, y_hf, **tol)
        torch.testing.assert_close(x_ours.grad, x_hf.grad, **tol)
        for name, p in params.items():
            torch.testing.assert_close(p.grad, hf_grads[name], **tol, msg=name)


# ------------------------------------------------------------------- saved for backward
@pytest.mark.parametrize("flash", [True, False])
def test_tiny_deepseek_saves_the_count(flash):
    """Every layer of `tiny-deepseek` (MLA with a q latent and V narrower than Q/K; a dense
    first layer, then MoE with a shared expert) saves exactly SPEC §3's MLA count
    (`estimate.profiles`), fused kernel or materialised softmax, on one rank: all the
    routed rows run here, so the count holds whatever the routing."""
    spec = get_model("tiny-deepseek")
    model = Transformer(spec, flash=flash)
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    recorder = LayerRecorder(model, lambda t: t.untyped_storage().data_ptr() in state)
    tokens = torch.randint(0, spec.vocab, (2, 32))
    with recorder:
        model.loss(tokens, tokens).backward()
    assert [c.layer for c in recorder.calls] == [0, 1, 2]
    for call in recorder.calls:
        moe = spec.is_moe_layer(call.layer)
        expected = saved_tensors_per_layer(spec, 32, 2, flash=flash, dtype_bytes_=8, moe=moe)
        assert "kv_latent_input" in expected and (("expert_inputs" in expected) == moe)
        assert call.saved + (call.moe or 0) == sum(expected.values()), call


# ---------------------------------------------------------------------- on real ranks
def _check(layouts: list[str]) -> list[list[CheckRow]]:
    return [check_layout(TrainConfig(get_model("tiny-deepseek"), Layout.parse(text), steps=2,
                                     seq_len=32, global_batch=4, dtype="fp64"), 2)
            for text in layouts]


@pytest.mark.slow
def test_tiny_deepseek_check_on_two_ranks():
    """`check` on tiny-deepseek: with ep every row meets its target (DeepSeek's routing
    dispatched by all-to-all); with tp the MLA traffic — f/g and the replicated latents'
    gradient all-reduce — and MLA's saved bytes are exact, and the MoE rows miss as for every
    MoE model under tp here (the runtime replicates MoE layers over tp), saying so."""
    results = spawn(_check, 2, ["dp=2,ep=2", "tp=2"], timeout_s=300)
    ep, tp = ({(r.stage, r.item, r.what): r for r in merge_rows([rank[i] for rank in results])}
              for i in range(2))
    assert all(row.ok for row in ep.values()), [r for r in ep.values() if not r.ok]
    assert ep[(0, "comm", "ep all-to-all")].error == 0
    tp_comm = tp[(0, "comm", "tp all-reduce")]
    assert tp_comm.error == 0 and "MLA" in tp_comm.note
    for layer in ("layer 0", "layer 1 attention", "layer 2 attention"):
        assert tp[(0, "activations", layer)].error == 0
    missed = [r for r in tp.values() if not r.ok]
    assert missed and all("replicated over tp" in r.note for r in missed)


def test_what_the_runtime_cannot_run_is_refused_in_one_line():
    spec = get_model("tiny-deepseek")
    assert runtime_problems(Layout(tp=2, sp=True), spec) == [
        "sequence parallelism with multi-head latent attention is not supported by the "
        "training runtime (its latents would be gathered, not the hidden state); use sp=0"]
    assert "v_head_dim=16 ≠ q/k head width 24" in runtime_problems(Layout(cp=2), spec)[0]
    assert runtime_problems(Layout(cp=2), spec.with_(v_head_dim=24)) == []
    assert "etp=1 ≠ tp=2" in runtime_problems(Layout(tp=2, dp=2, ep=2, etp=1), spec)[0]
    assert_one_line_error(shardwise("train", "--model", "tiny-deepseek", "--tp", "2", "--sp",
                                    check=False), "sequence parallelism with multi-head latent")
