"""pytorch-fsdp's eager memory-bound traffic per block, and every compiling stack's eager vs
compiled traffic (`Stack.eager_traffic`, `estimate.kernels.compiled_traffic`).

pytorch-fsdp's Llama blocks are IBM fms-fsdp's: foundation-model-stack's LLaMABlock norms are
`LayerNormParameterized(..., use_high_precision_pow=True)` (fms/modules/layernorm.py), a
composite RMSNorm in eager — transcribed below op for op and counted on CPU with the same
dispatch counter as the stacks' tables; it must move what transformers' LlamaRMSNorm (whose
counted layer the stack's RoPE rows reuse) moves, and several times the fused kernel.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardwise.arch import ModelSpec  # noqa: E402
from shardwise.estimate.kernels import compiled_traffic  # noqa: E402
from shardwise.stacks import STACKS, get_stack  # noqa: E402
from tests.estimate.test_stack_traffic import VARIANTS, _measure, _spec  # noqa: E402

H, T = 384, 192  # hidden, tokens


def _fms_norm(weight, eps=1e-6):
    """fms LayerNormParameterized.forward, elementwise_scale, no shift, no mean, high-precision
    pow (foundation-model-stack fms/modules/layernorm.py)."""
    def norm(x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.type_as(x)
    return norm


def test_fms_rmsnorm_moves_what_hf_rmsnorm_moves():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = llama.LlamaRMSNorm(H).to(torch.bfloat16)
    weight = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16))
    x = torch.randn(2, T // 2, H, dtype=torch.bfloat16, requires_grad=True)
    fms_f, fms_b = _measure(_fms_norm(weight), x)
    hf_f, hf_b = _measure(hf, x)
    assert fms_f.bytes == pytest.approx(hf_f.bytes, rel=0.1)
    assert fms_b.bytes == pytest.approx(hf_b.bytes, rel=0.1)
    fused = 2 * T * H * 2  # one kernel: read x, write y (bf16)
    assert fms_f.bytes > 4 * fused


@pytest.mark.parametrize(("rope", "gated"), VARIANTS)
def test_pytorch_fsdp_blocks_plumbing(rope, gated):
    """Plumbing: Llama (RoPE) blocks take the composite-norm table, MPT-like blocks
    torchtitan's fused-norm one."""
    model = _spec(rope, gated)
    donor = "hf-sdpa" if rope else "torchtitan"
    assert get_stack("pytorch-fsdp").eager_traffic(model) == get_stack(donor).eager_traffic(model)


@pytest.mark.parametrize(("rope", "gated"), VARIANTS)
def test_compile_moves_less_than_eager_on_every_compiling_stack(rope, gated):
    """Contract: Inductor's fused passes never move more than the stack's eager ops, at
    Llama-2-7B widths (h 4096, q + kv 8192, f 11008)."""
    model = ModelSpec("m", 1, 4096, 32, 32, 11008, 64, gated_mlp=gated,
                      learned_positions=0 if rope else 4096)
    widths = (4096, 8192, 11008)
    (cf, cb), _ = compiled_traffic(model)
    compiling = [s for s in STACKS.values() if True in s.compile and s.elementwise]
    assert compiling
    for stack in compiling:
        (ef, eb), _ = stack.eager_traffic(model)
        for eager, compiled in ((ef, cf), (eb, cb)):
            assert sum(c * w for c, w in zip(compiled, widths)) < sum(
                e * w for e, w in zip(eager, widths)), stack.name
