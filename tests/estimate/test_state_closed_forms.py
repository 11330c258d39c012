"""Persistent training state (estimate/state.py) against its published sources: bytes per
parameter per dtype and optimizer (Rajbhandari et al. 2020 §3: 2 + 2 + K with K = 12 for mixed-
precision Adam; torch's fp64 Adam; bitsandbytes' 8-bit moments; DeepSeek-V3 §3.3.3's BF16
moments), the ZeRO paper's Figure 1 (Ψ = 7.5B on 64 GPUs: 120, 31.4, 16.6, 1.88 GB) and its
§7 traffic (stage 3 = 1.5× data parallelism), and the KV cache per token of Llama 3 8B and
DeepSeek-V3 (DeepSeek-V2 Table 1: MLA caches (d_c + d_h^R) elements per layer)."""

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.state import (
    StateBytes,
    bytes_per_param_training,
    kv_cache_bytes_per_token,
    train_state_bytes,
    training_memory_bytes,
    zero_memory_per_device,
    zero_stage_table,
    zero_state_bytes,
)
from shardwise.layout import TrainSpec


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (("bf16",), {}, (2, 2, 4, 8)),  # Rajbhandari et al.: 2 + 2 + 12
    (("bf16", "fp32"), {}, (2, 4, 4, 8)),  # Megatron's fp32 main_grad: 18
    (("fp16", None, "adam-8bit"), {}, (2, 2, 4, 2)),  # two int8 moments: 10
    (("fp32",), {}, (4, 4, 0, 8)),  # fp32 weights are their own master
    (("fp64",), {}, (8, 8, 0, 16)),  # torch's Adam keeps its moments in fp64
    (("fp64", None, "sgd-momentum"), {}, (8, 8, 0, 8)),  # one fp64 momentum buffer
    (("fp64", None, "sgd"), {}, (8, 8, 0, 0)),
    (("bf16", None, "sgd-momentum"), {}, (2, 2, 4, 4)),
    (("bf16", None, "adafactor"), {}, (2, 2, 4, 0.5)),
    # DeepSeek-V3 §3.3.3: BF16 moments, FP32 master, fp32 gradients: 2 + 4 + 4 + 2 + 2
    (("bf16", "fp32"), {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, (2, 4, 4, 4)),
    (("bf16",), {"exp_avg_dtype": "bf16"}, (2, 2, 4, 6)),  # the other moment stays fp32
    (("bf16",), {"exp_avg_sq_dtype": "fp8"}, (2, 2, 4, 5)),
    (("bf16",), {"main_params_dtype": "fp16"}, (2, 2, 2, 8)),
    (("fp32",), {"main_params_dtype": "fp16"}, (4, 4, 0, 8)),  # no master to narrow
    (("fp64", None, "adam"), {"exp_avg_dtype": "bf16"}, (8, 8, 0, 6)),
])
def test_bytes_per_parameter_of_each_state_class(args, kwargs, expected):
    state = bytes_per_param_training(*args, **kwargs)
    assert (state.weight, state.grad, state.master, state.moments) == expected
    assert state.optimizer == expected[2] + expected[3]
    assert state.total == sum(expected)


def test_train_state_bytes_reads_the_precision_aware_optimizer_fields():
    train = TrainSpec(seq_len=4096, global_batch=8, dtype="bf16", grad_dtype="fp32",
                      exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", main_params_dtype="fp32")
    assert train_state_bytes(train).total == 14  # DeepSeek-V3's 2 + 4 + 4 + 2 + 2
    sgd = TrainSpec(seq_len=4096, global_batch=8, dtype="fp32", optimizer="sgd-momentum")
    assert train_state_bytes(sgd) == StateBytes(4, 4, 0, 4)


def test_unknown_optimizer_is_one_line():
    with pytest.raises(ShardwiseError) as err:
        bytes_per_param_training("bf16", None, "lion")
    assert str(err.value) == ("optimizer 'lion' unknown; valid: adam, sgd-momentum, sgd, "
                              "adam-8bit, adafactor")


GB = 1e9
PSI, N = 7.5e9, 64  # the ZeRO paper's Figure 1


@pytest.mark.parametrize(("stage", "gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.875)])
def test_zero_paper_figure_1(stage, gb):
    assert zero_memory_per_device(PSI, N, stage) / GB == pytest.approx(gb, abs=0.05)


def test_zero_state_bytes_per_class_and_stage():
    # per class: which one each stage divides by N (weights 2Ψ, gradients 2Ψ, optimizer 12Ψ)
    w, g, o = 2 * PSI, 2 * PSI, 12 * PSI
    assert zero_state_bytes(PSI, N, 0) == (w, g, o)
    assert zero_state_bytes(PSI, N, 1) == (w, g, o / N)
    assert zero_state_bytes(PSI, N, 2) == (w, g / N, o / N)
    assert zero_state_bytes(PSI, N, 3) == (w / N, g / N, o / N)
    assert all(type(x) is float for x in zero_state_bytes(PSI, N, 2))
    # arrays of layouts: each element as the scalar call
    stages, ranks = np.array([0, 1, 2, 3, 3]), np.array([8, 8, 4, 2, 1])
    arrays = zero_state_bytes(PSI, ranks, stages, StateBytes(2, 4, 4, 8))
    for i, (stage, n) in enumerate(zip(stages, ranks)):
        one = zero_state_bytes(PSI, int(n), int(stage), StateBytes(2, 4, 4, 8))
        assert [a[i] for a in arrays] == pytest.approx(list(one))
    for bad, message in (((PSI, 8, 4), "zero stage must be 0, 1, 2 or 3, got 4"),
                         ((PSI, 0, 1), "ZeRO needs ≥ 1 rank, got 0")):
        with pytest.raises(ShardwiseError) as err:
            zero_state_bytes(*bad)
        assert str(err.value) == message
    assert zero_state_bytes(PSI, 1, 3) == (w, g, o)  # one rank: nothing to shard


def test_zero_stage_table_memory_and_traffic():
    """Per stage: what it shards, Figure 1's bytes, and §7's traffic per rank — stages 0-2 a
    gradient all-reduce's 2(N−1)/N·Ψ elements, stage 3 1.5× that (weights all-gathered in
    the forward and the backward, gradients reduce-scattered)."""
    rows = zero_stage_table(PSI, N)
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    assert [r.sharded for r in rows] == ["nothing", "optimizer states", "+ gradients",
                                         "+ weights"]
    assert [r.bytes_per_device / GB for r in rows] == pytest.approx([120, 31.4, 16.6, 1.875],
                                                                    abs=0.05)
    ring = 2 * (N - 1) / N * PSI * 2  # bf16 gradients
    assert [r.comm_bytes_per_step for r in rows] == pytest.approx([ring, ring, ring, 1.5 * ring])


def test_unsharded_training_memory():
    out = training_memory_bytes(1e9)
    assert out == {"weights": 2e9, "grads": 2e9, "optimizer": 12e9, "total": 16e9}
    out = training_memory_bytes(1e9, StateBytes(4, 4, 0, 8))
    assert out == {"weights": 4e9, "grads": 4e9, "optimizer": 8e9, "total": 16e9}


def test_kv_cache_per_token():
    # Llama 3 8B: 32 layers × (8 kv heads × 128) for K and for V × 2 B = 128 KiB
    assert kv_cache_bytes_per_token(get_model("llama3-8b")) == 32 * 2 * 8 * 128 * 2 == 131072
    assert kv_cache_bytes_per_token(get_model("llama3-8b"), "fp8") == 65536
    # DeepSeek-V3: 61 layers × (d_c 512 + d_h^R 64) elements
    assert kv_cache_bytes_per_token(get_model("deepseek-v3")) == 61 * (512 + 64) * 2
    # tiny-deepseek: K and V widths differ (24 and 16 per head), the cache is the latent's
    assert kv_cache_bytes_per_token(get_model("tiny-deepseek"), "fp32") == 3 * (16 + 8) * 4


def test_precision_aware_fields_read_from_any_train_object():
    """`train_state_bytes` reads the optional fields where the object has them (a TrainSpec)
    and takes the defaults where it does not (an object with the three basic fields)."""
    from types import SimpleNamespace

    plain = SimpleNamespace(dtype="bf16", grad_dtype="fp32", optimizer="adam")
    assert train_state_bytes(plain) == StateBytes(2, 4, 4, 8)
    narrow = TrainSpec(seq_len=4096, global_batch=8, dtype="bf16", grad_dtype="fp32",
                       main_params_dtype="fp16")
    assert train_state_bytes(narrow) == StateBytes(2, 4, 2, 8)  # an fp16 master copy
    sq = TrainSpec(seq_len=4096, global_batch=8, dtype="bf16", grad_dtype="fp32",
                   exp_avg_sq_dtype="bf16")
    assert train_state_bytes(sq) == StateBytes(2, 4, 4, 6)


def test_zero_memory_and_table_with_their_own_state_bytes():
    """fp32 weights with bf16 gradients (4 + 2 + 0 + 8): the table's bytes and traffic follow
    the state given — stages 1-2 reduce-scatter the 2-byte gradients and all-gather the
    4-byte weights once, (N−1)/N·Ψ·(2 + 4); stage 3 gathers them twice, (N−1)/N·Ψ·(2 + 2·4);
    stage 0's all-reduce 2(N−1)/N·Ψ·2."""
    state = StateBytes(4, 2, 0, 8)
    assert zero_memory_per_device(PSI, N, 1, state) == pytest.approx(4 * PSI + 2 * PSI
                                                                     + 8 * PSI / N)
    rows = zero_stage_table(PSI, N, state)
    assert [r.bytes_per_device for r in rows] == pytest.approx(
        [14 * PSI, 6 * PSI + 8 * PSI / N, 4 * PSI + 10 * PSI / N, 14 * PSI / N])
    ring = (N - 1) / N * PSI
    assert [r.comm_bytes_per_step for r in rows] == pytest.approx(
        [2 * ring * 2, ring * (2 + 4), ring * (2 + 4), ring * (2 + 2 * 4)])
