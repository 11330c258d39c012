"""The single-device model: gradients of its hand-written autograd functions, and the bytes it
saves for backward against SPEC §3's generalised count."""

import pytest
import torch

from shardwise.arch import ModelSpec
from shardwise.estimate.memory import saved_tensors_per_layer
from shardwise.runtime.measure import saved_bytes_per_layer
from shardwise.runtime.model import (
    AttentionFunction,
    RMSNormFunction,
    RotaryFunction,
    SwiGLUFunction,
    Transformer,
    rotary_tables,
)

SPEC = ModelSpec("test", 2, 32, 4, 2, 48, 64, max_seq=16)


def _double(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_autograd_functions_match_numerical_gradients():
    torch.manual_seed(0)
    x, w = _double(2, 3, 8), _double(8)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-5), (x, w))
    cos, sin = rotary_tables(torch.arange(3), 4)
    y = _double(2, 3, 2, 4)
    assert torch.autograd.gradcheck(
        lambda a: RotaryFunction.apply(a, cos[:, None], sin[:, None]), (y,))
    g, u = _double(2, 3, 5), _double(2, 3, 5)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (g, u))
    q, k, v = _double(2, 5, 4, 3), _double(2, 5, 2, 3), _double(2, 5, 2, 3)
    for causal in (False, True):
        for flash in (False, True):
            assert torch.autograd.gradcheck(
                lambda a, b, c, causal=causal, flash=flash: AttentionFunction.apply(
                    a, b, c, causal, flash), (q, k, v))


def test_attention_equals_pytorch_sdpa():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 6, heads, 4, dtype=torch.float64) for heads in (4, 2, 2))
    ours = AttentionFunction.apply(q, k, v, True, True)
    # Reference: PyTorch's attention with the kv heads repeated for each query group.
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("wide", [False, True])  # True: head_dim 32 ≠ h/a = 8, q/k/v biases
def test_saved_bytes_equal_generalised_count(flash, wide):
    spec = SPEC.with_(d_head=32, qkv_bias=True) if wide else SPEC
    model = Transformer(spec, flash=flash)
    batch, seq = 3, 16
    tokens = torch.randint(0, spec.vocab, (batch, seq))
    measured = saved_bytes_per_layer(model, list(model.blocks), lambda: model(tokens))
    predicted = sum(saved_tensors_per_layer(spec, seq, batch, flash=flash,
                                            dtype_bytes_=8).values())
    assert measured == [predicted] * spec.n_layers


def test_model_trains_and_loss_starts_near_log_vocab():
    model = Transformer(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (2, 16))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
