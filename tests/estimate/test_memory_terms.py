"""`training_memory_per_gpu` terms against hand closed forms where each factor is
distinguishable: the FP8 weight copies Transformer Engine caches (none under ZeRO-3's FSDP),
the experts' FP8 copies sharded by etp ≠ tp, a dense model's MTP module, and a model that is
not a `ModelSpec`."""

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.activations import activation_bytes_per_layer
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.layout import Layout, TrainSpec

TINY = get_model("tiny")  # 4 layers, h 64, d_ff 128 (gated), 4 query heads, 2 kv heads of 16


def test_fp8_weight_copies_are_cached_except_under_fsdp():
    """Float8CurrentScaling on Hopper caches each FP8 weight with its transpose: 2 bytes per
    element of every linear weight (QKV h·(q+2kv)/t, out q·h/t, gated MLP 3·h·d_ff/t), none
    under ZeRO-3 (FSDP casts per micro-batch); the scaling state stays: 4 GEMMs per layer."""
    train = TrainSpec(seq_len=64, global_batch=8, fp8="tensorwise").validate()
    recipe = train.stack.fp8_recipe("tensorwise")
    h, q, kv, ff, t, layers = 64, 64, 32, 128, 2, 4
    linear = h * (q + 2 * kv) / t + q * h / t + 3 * h * ff / t
    fp8 = {z: training_memory_per_gpu(TINY, Layout(tp=t, dp=2, zero=z), train)[0].fp8
           for z in (1, 3)}
    scaling = recipe.scaling_state_bytes() * 4 * layers
    assert fp8[1] == pytest.approx(2 * layers * linear + scaling, rel=1e-12)
    assert fp8[3] == pytest.approx(scaling, rel=1e-12)


def test_expert_fp8_copies_follow_the_expert_tensor_parallel_degree():
    """tiny-deepseek (2 MoE layers, 8 experts of d_ff 32, gated): with ep = 2 a rank holds 4
    experts, each 3·h·d_e/etp FP8 weights; etp = 1 against etp = tp = 2 doubles them, 2 bytes
    each (the rest of the stage is the same)."""
    model = get_model("tiny-deepseek")
    train = TrainSpec(seq_len=64, global_batch=8, fp8="tensorwise").validate()

    def fp8(etp: int) -> float:
        return training_memory_per_gpu(model, Layout(tp=2, dp=2, ep=2, etp=etp), train)[0].fp8

    experts = 2 * (8 // 2) * 3 * model.d_model * model.expert_d_ff
    assert fp8(1) - fp8(0) == pytest.approx(2 * experts * (1 / 1 - 1 / 2), rel=1e-12)


def test_a_dense_models_mtp_module_holds_a_dense_layer_and_its_inputs():
    """One MTP module on a dense model (pp = 1, its one stage holds the head): one more dense
    layer's activations and eh_proj's 2h input, enorm, hnorm and the final norm (5·s·b·h at
    2 bytes) per micro-batch in flight (1)."""
    s, b = 64, 1
    layout = Layout(dp=1, micro_batch=b)
    base, mtp = (TrainSpec(seq_len=s, global_batch=4, mtp_layers=n).validate() for n in (0, 1))
    layer = activation_bytes_per_layer(TINY, s, b, flash=base.flash_attention, impl=base.profile)
    extra = (training_memory_per_gpu(TINY, layout, mtp)[0].activations
             - training_memory_per_gpu(TINY, layout, base)[0].activations)
    assert extra == pytest.approx(layer + 5 * s * b * TINY.d_model * 2, rel=1e-12)


def test_a_model_that_is_not_a_spec_is_one_clear_error():
    with pytest.raises(ShardwiseError, match="model must be a ModelSpec"):
        training_memory_per_gpu("llama3-8b", Layout())


def test_a_tie_between_the_two_moments_names_the_forward_to_backward_one():
    """`MemoryBreakdown.peak` is the larger of two moments: forward-to-backward (state +
    activations + logits + the largest transient) and the optimizer step (state + its
    buffer). At an exact tie the peak is that number either way and the forward-to-backward
    moment is named (the optimizer step only when it holds strictly more); one byte more
    in the step's buffer names the step."""
    from shardwise.estimate.memory import MemoryBreakdown

    weights, grads, optimizer, activations, logits, loss = 7.0, 3.0, 11.0, 40.0, 5.0, 6.0
    tied_step = activations + logits + loss  # the two moments hold the same bytes
    for step, transient in ((tied_step, "loss buffer"), (tied_step + 1, "optimizer step")):
        stage = MemoryBreakdown(0, 1, weights, grads, optimizer, activations, logits,
                                transients=(("loss buffer", loss), ("optimizer step", step)))
        assert stage.peak == weights + grads + optimizer + max(tied_step, step)
        assert stage.peak_transient == transient
        assert stage.peak_term == ("activations" if transient == "loss buffer"
                                   else "optimizer step")
