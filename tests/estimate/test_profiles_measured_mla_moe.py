"""The `shardwise` profile against what PyTorch saves for shardwise's own runtime layer
(autograd's saved-tensor hooks, `runtime.measure.saved_bytes_per_layer`), for the layer kinds
the Hugging Face measurements do not cover: MLA with d_k (16) ≠ d_v (8), q and kv latents of
their own widths, and an MoE block with two shared experts (top 2 of 4, expert width ≠ the
dense width), fp64, flash and materialised attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardwise.arch import ModelSpec  # noqa: E402
from shardwise.estimate.profiles import saved_tensors  # noqa: E402
from shardwise.runtime.measure import saved_bytes_per_layer  # noqa: E402
from shardwise.runtime.model import Transformer  # noqa: E402

SPEC = ModelSpec("mla-moe", 2, 64, 4, 4, 96, 64, max_seq=32, n_experts=4, top_k=2,
                 d_ff_expert=40, n_shared_experts=2, q_lora_rank=24, kv_lora_rank=16,
                 qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("flash", [True, False])
def test_mla_moe_layer_equals_what_torch_saves(flash):
    torch.manual_seed(0)
    model = Transformer(SPEC, flash=flash)  # fp64
    batch, seq = 3, 32
    tokens = torch.randint(0, SPEC.vocab, (batch, seq))
    measured = saved_bytes_per_layer(model, list(model.blocks), lambda: model(tokens))
    saved = saved_tensors("shardwise", SPEC, seq, batch, flash=flash, moe=True,
                          dtype_bytes_=8)
    predicted = sum(saved.values())
    # the runtime's router also keeps one fp64 per expert for its load-balancing statistics
    # (a per-layer vector, not per token); the smallest per-token tensor, a norm's rstd, is
    # 96 rows · 8 B = 768 B
    for layer in measured:
        assert 0 <= layer - predicted <= 8 * SPEC.n_experts
