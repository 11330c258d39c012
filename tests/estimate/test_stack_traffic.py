"""Each stack's time behaviours against its own code, counted on CPU.

* Memory-bound traffic: one decoder layer of torchtitan 0.3.0 (its Llama 3 block) and of
  Hugging Face transformers 5.24.0 (LlamaDecoderLayer, SDPA) runs forward and backward under a
  `TorchDispatchMode` that adds up the bytes read and written by every op that is neither a
  GEMM nor attention nor a view — the passes an eager stack makes over HBM. The stack's table
  (`Stack.elementwise`, fitted on other shapes) must give the same bytes at a shape it was not
  fitted on. torchtitan's `nn.RMSNorm` calls `F.rms_norm`, which torch 2.13 routes to the fused
  `_fused_rms_norm` kernel on CUDA (aten/src/ATen/native/layer_norm.cpp) but decomposes on
  CPU: the count charges it as that one kernel (read x and the weight, write y and rstd;
  backward read dy, x, rstd and the weight, write dx and dweight).
* Per-op SAC: torchtitan's `SelectiveAC` policy is run on its own block; the outputs it decides
  to keep (MUST_SAVE) are what `estimate.profiles.op_sac_saved` counts.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from shardwise.arch import ModelSpec  # noqa: E402
from shardwise.estimate.profiles import op_sac_saved  # noqa: E402
from shardwise.stacks import get_stack  # noqa: E402

_COMPUTE = {"mm", "addmm", "bmm", "linear", "matmul",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward"}
_NO_TRAFFIC = {"view", "_unsafe_view", "transpose", "t", "expand", "permute", "select", "slice",
               "split", "unsqueeze", "squeeze", "as_strided", "detach", "alias",
               "view_as_complex", "view_as_real", "_reshape_alias", "split_with_sizes",
               "unbind", "lift_fresh", "empty", "empty_like", "zeros", "ones", "new_empty",
               "new_zeros", "zeros_like", "ones_like", "empty_strided", "scalar_tensor",
               "_local_scalar_dense", "arange", "_conj", "resolve_conj"}
SHAPE = (384, 12, 4, 1152, 96, 2)  # h, heads, kv heads, ffn, seq, batch: not a fitted shape


class _Traffic(TorchDispatchMode):
    """Bytes in + out of every memory-bound op (tensors of more than 16 elements)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops = 0
        self.muted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.muted or name in _COMPUTE or name in _NO_TRAFFIC:
            return out
        tensors = [x for x in tree_flatten((args, kwargs, out))[0]
                   if isinstance(x, torch.Tensor) and x.numel() > 16]
        self.bytes += sum(x.numel() * x.element_size() for x in tensors)
        self.ops += 1
        return out


def _fused_rms_norm(active: dict[str, _Traffic]):
    """`F.rms_norm` as CUDA runs it: one kernel each way, counted as such on the counter
    active when it runs (`active["now"]`: the forward's, then the backward's)."""

    class FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            counter = active["now"]
            counter.muted += 1
            try:
                xf = x.float()
                rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                y = (xf * rstd).to(x.dtype) * weight
            finally:
                counter.muted -= 1
            ctx.save_for_backward(x, weight, rstd)
            counter.bytes += 2 * x.numel() * x.element_size() + rstd.numel() * 4
            counter.ops += 1
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensors
            counter = active["now"]
            with torch.enable_grad():
                xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
                counter.muted += 1
                try:
                    y = (xd.float() * rstd).to(x.dtype) * wd
                    dx, dw = torch.autograd.grad(y, (xd, wd), dy)
                finally:
                    counter.muted -= 1
            counter.bytes += 3 * x.numel() * x.element_size() + rstd.numel() * 4
            counter.ops += 1
            return dx, dw, None

    return lambda x, shape, weight=None, eps=None: FusedRMSNorm.apply(
        x, weight, 1e-6 if eps is None else eps)


def _torchtitan_block(h, a, kv, f):
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers

    config = _build_llama3_layers(
        n_layers=1, dim=h, n_heads=a, n_kv_heads=kv, hidden_dim=f, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=h // a, max_seq_len=4096, theta=500000))[0]
    block = config.build().train()
    for module in block.modules():
        if hasattr(module, "_init_self_buffers"):
            module._init_self_buffers(buffer_device=torch.device("cpu"))
    for p in block.parameters():
        p.data = p.data.to(torch.bfloat16)
    return block


def _sdpa(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
    """FlexAttention's core as SDPA (torch 2.13 has no FlexAttention backward on CPU)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=enable_gqa)  # (B, N, L, H) → back to (B, L, N, H)
    return out.transpose(1, 2)


VARIANTS = [(True, True), (False, True), (True, False), (False, False)]  # (RoPE, gated MLP)


def _spec(rope: bool, gated: bool) -> ModelSpec:
    h, a, kv, f, _, _ = SHAPE
    return ModelSpec("block", 1, h, a, kv, f, 64, gated_mlp=gated,
                     learned_positions=0 if rope else 4096)


def _predicted(stack: str, rope: bool, gated: bool, tokens):
    h, a, kv, f, _, _ = SHAPE
    ((fh, fqk, ff), (bh, bqk, bf)), kernels = get_stack(stack).eager_traffic(_spec(rope, gated))
    q, k = h, kv * (h // a)
    return (tokens * (fh * h + fqk * (q + k) + ff * f),
            tokens * (bh * h + bqk * (q + k) + bf * f)), kernels


def _measure(run, x):
    forward, backward = _Traffic(), _Traffic()
    with forward:
        y = run(x)
    y = y[0] if isinstance(y, tuple) else y
    with backward:
        y.sum().backward()
    return forward, backward


@pytest.mark.parametrize(("rope", "gated"), VARIANTS)
def test_torchtitan_eager_traffic_is_its_blocks(monkeypatch, rope, gated):
    """Its Llama 3 block, and the same block without RoPE (its rotary embedding an identity)
    and with `w2(gelu(w1 x))` for SwiGLU: the variants of learned-position and GeLU models."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.feed_forward import FeedForward

    monkeypatch.setattr(FlexAttention, "forward", _sdpa)
    if not gated:
        monkeypatch.setattr(FeedForward, "forward",
                            lambda self, x: self.w2(torch.nn.functional.gelu(self.w1(x))))
    h, a, kv, f, s, b = SHAPE
    block = _torchtitan_block(h, a, kv, f)
    if not rope:
        for module in block.modules():
            if hasattr(module, "rope"):
                monkeypatch.setattr(module.rope, "forward", lambda xq, xk, *_, **__: (xq, xk))
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    forward, backward = _Traffic(), _Traffic()
    active = {"now": forward}
    monkeypatch.setattr(torch.nn.functional, "rms_norm", _fused_rms_norm(active))
    with forward:
        y = block(x, None)
    active["now"] = backward  # the norms' backward kernels count there (autograd keeps
    with backward:            # the forward's Function)
        y.sum().backward()
    predicted, kernels = _predicted("torchtitan", rope, gated, b * s)
    # the table is fitted within 1 % (stacks.definitions) on other shapes
    assert forward.bytes == pytest.approx(predicted[0], rel=0.01)
    assert backward.bytes == pytest.approx(predicted[1], rel=0.01)
    # and the kernels it launches besides GEMMs and attention
    assert (forward.ops, backward.ops) == kernels


def _hf_measured(monkeypatch, rope: bool, gated: bool, kv: int):
    """(forward, backward) `_Traffic` of one transformers LlamaDecoderLayer at SHAPE with
    `kv` KV heads: without RoPE its rotary embedding skipped, without a gate `w2(gelu(w1 x))`."""
    transformers = pytest.importorskip("transformers")
    import transformers.models.llama.modeling_llama as modeling_llama

    h, a, _, f, s, b = SHAPE
    if not rope:
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                            lambda q, k, *_, **__: (q, k))
    config = transformers.LlamaConfig(
        hidden_size=h, num_attention_heads=a, num_key_value_heads=kv, intermediate_size=f,
        num_hidden_layers=1, vocab_size=64, attn_implementation="sdpa")
    model = transformers.LlamaModel(config).to(torch.bfloat16).train()
    layer, rotary = model.layers[0], model.rotary_emb
    if not gated:
        mlp = layer.mlp
        monkeypatch.setattr(mlp, "forward", lambda x: mlp.down_proj(
            torch.nn.functional.gelu(mlp.gate_proj(x))))
    positions = torch.arange(s)[None]

    def run(x):
        embedding = rotary(x, positions) if rope else (None, None)
        return layer(x, position_embeddings=embedding, attention_mask=None,
                     position_ids=positions)

    return _measure(run, torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True))


@pytest.mark.parametrize(("rope", "gated"), VARIANTS)
def test_hf_eager_traffic_is_its_layers(monkeypatch, rope, gated):
    h, a, kv, f, s, b = SHAPE
    forward, backward = _hf_measured(monkeypatch, rope, gated, kv)
    predicted, kernels = _predicted("hf-sdpa", rope, gated, b * s)
    assert forward.bytes == pytest.approx(predicted[0], rel=0.03)
    assert backward.bytes == pytest.approx(predicted[1], rel=0.03)
    assert (forward.ops, backward.ops) == kernels
    # the eager stacks move several times the fused count: compile has something to win
    fused = b * s * (28 * h + 8 * kv * (h // a) + 6 * f)
    assert forward.bytes > (2 if rope else 1.5) * fused


@pytest.mark.parametrize("gated", [True, False])
def test_hf_eager_traffic_without_rope_is_blind_to_the_kv_heads(monkeypatch, gated):
    """Without RoPE no memory-bound op of the layer touches a q- or kv-shaped tensor (SDPA
    reads K and V as the projections write them), so 4 or 12 KV heads move the same bytes,
    counted; the table's q + kv coefficients are 0 both ways."""
    kv = SHAPE[2]
    few = _hf_measured(monkeypatch, False, gated, kv)
    many = _hf_measured(monkeypatch, False, gated, 3 * kv)
    assert [x.bytes for x in many] == [x.bytes for x in few]
    ((_, fqk, _), (_, bqk, _)), _ = get_stack("hf-sdpa").eager_traffic(_spec(False, gated))
    assert (fqk, bqk) == (0.0, 0.0)


def test_torchtitan_op_sac_keeps_what_the_profile_counts(monkeypatch):
    pytest.importorskip("torchtitan")
    import torchtitan.distributed.activation_checkpoint as titan_ac
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.setattr(FlexAttention, "forward", _sdpa)
    kept: list[tuple[str, int]] = []  # (op, output bytes) of every MUST_SAVE decision
    original = titan_ac.create_selective_checkpoint_contexts

    def spy(policy, *args, **kwargs):
        def recording(ctx, func, *fargs, **fkwargs):
            decision = policy(ctx, func, *fargs, **fkwargs)
            if not ctx.is_recompute and decision.name == "MUST_SAVE":
                a, w = fargs[0], fargs[1]  # aten.mm: (M × K)·(K × N)
                kept.append((str(func), a.shape[0] * w.shape[1] * a.element_size()))
            return decision
        return original(recording, *args, **kwargs)

    monkeypatch.setattr(titan_ac, "create_selective_checkpoint_contexts", spy)
    h, a, kv, f, s, b = SHAPE
    block = _torchtitan_block(h, a, kv, f)
    wrapped = titan_ac.SelectiveAC(titan_ac.SelectiveAC.Config())._wrap_block(
        block, base_fqn="layers.0")
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    wrapped(x, None)
    # of qkv, wo, w1, w3, w2 it keeps every second matmul's output: qkv, w1, w2
    assert [op for op, _ in kept] == ["aten.mm.default"] * 3
    spec = ModelSpec("tt", 1, h, a, kv, f, 64)
    predicted = op_sac_saved(spec, s, b, dtype_bytes_=2)
    assert [n for _, n in kept] == [predicted["qkv_output"], predicted["mlp_w1_output"],
                                    predicted["mlp_w2_output"]]
    # the attention kernel's outputs are kept too on CUDA (torch's CPU SDPA op is not in its
    # list; the flash and cuDNN ops are)
    save_ops = titan_ac._get_default_save_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in save_ops
    assert torch.ops.aten._scaled_dot_product_cudnn_attention.default in save_ops
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in save_ops
