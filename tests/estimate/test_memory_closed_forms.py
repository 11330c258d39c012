"""Per-GPU memory (estimate/memory.py, SPEC §4) term by term on tiny-deepseek (MLA with V
narrower than Q/K, a dense first layer, a shared expert) under tp·ep·pp > 1 and ZeRO-3, each
term worked out by hand: the state classes sharded over dp (experts over the expert-data-
parallel group), the last stage's fp32 logits and final-norm input, ZeRO-3's two gathered
layers, 1F1B's in-flight micro-batches; and the peak's rule on breakdowns written here."""

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import (
    MemoryBreakdown,
    activation_bytes_per_layer,
    stage_layers,
    stage_memory,
    training_memory_per_gpu,
)
from shardwise.layout import Layout, TrainSpec

DS = get_model("tiny-deepseek")  # 3 layers, h 64, V 256; layer 0 dense, 1-2 MoE (8 experts)
F64 = 8
TRAIN = TrainSpec(seq_len=32, global_batch=16, dtype="fp64", impl="shardwise")
# per rank at tp = 2, ep = 2 (tests/estimate/test_geometry_closed_forms.py derives them):
ATTN = 64 * 32 + 64 * 24 + 48 + (32 * 96 + 16 * 128 + 64 * 64) / 2 + 128
DENSE = ATTN + 3 * 64 * 128 / 2
MOE = ATTN + 8 * 64 + 3 * 64 * 32 / 2
EXPERTS = 8 * 3 * 64 * 32 / 4


def test_state_logits_and_gather_buffers_of_each_stage():
    """pp = 2 (stage 0: the embedding and layers 0-1; stage 1: layer 2, the norm, the head),
    tp = 2 with SP, ep = 2 over dp = 4, ZeRO-3: every dense class ÷ 4, the experts' ÷ the
    expert-data-parallel group tp·dp/(etp·ep) = 2; fp64 weights and gradients, two fp64
    Adam moments and no master (16 + 8 + 8 B per parameter)."""
    layout = Layout.parse("tp=2,sp=1,ep=2,dp=4,pp=2,zero=3")
    stages = training_memory_per_gpu(DS, layout, TRAIN)
    for i, stage in enumerate(stages):
        layers = stage_layers(DS, layout, i)  # the partition's split (not at stake here)
        moe = sum(DS.is_moe_layer(k) for k in layers)
        dense = ((len(layers) - moe) * DENSE + moe * MOE + (256 * 64 / 2 if i == 0 else 0)
                 + (64 + 256 * 64 / 2 if i == 1 else 0))
        experts = moe * EXPERTS
        assert stage.layers == len(layers)
        assert stage.weights == pytest.approx(F64 * (dense / 4 + experts / 2))
        assert stage.grads == pytest.approx(F64 * (dense / 4 + experts / 2))
        assert stage.optimizer == pytest.approx(16 * (dense / 4 + experts / 2))
        # ZeRO-3: the layer in use and the prefetched one, the largest layer, gathered
        assert stage.workspace == pytest.approx(2 * max(DENSE, MOE + EXPERTS) * F64)
    first, last = stages
    # m = 16 / (dp 4 · mb 1) = 4 micro-batches: 1F1B holds min(p - i, m) = 2 and 1
    assert (first.in_flight, last.in_flight) == (2, 1)
    # the last stage's fp32 logits for the loss, (s·b, V/t) of one micro-batch
    assert (first.logits, last.logits) == (0.0, 32 * 256 * 4 / 2)


def test_activations_add_the_final_norm_input_on_the_last_stage():
    """A stage's activations = in-flight micro-batches × its layers' saved bytes (each layer's
    own count, `activation_bytes_per_layer`); the last stage adds the final norm's input and
    the head's (the norm's output), two (s·b, h) at 8 B ÷ t under SP, for the one micro-batch
    whose loss runs at once."""
    layout = Layout.parse("tp=2,sp=1,pp=2,dp=1")
    stages = training_memory_per_gpu(DS, layout, TRAIN)
    for i, stage in enumerate(stages):
        layers = stage_layers(DS, layout, i)
        saved = sum(activation_bytes_per_layer(DS, 32, 1, tp=2, sp=True, flash=True,
                                               dtype="fp64", moe=DS.is_moe_layer(k))
                    for k in layers)
        norm = 2 * 32 * 64 * F64 / 2 if i == 1 else 0.0
        assert stage.in_flight == (2, 1)[i]
        assert stage.activations == pytest.approx(stage.in_flight * saved + norm)
        assert stage.total == pytest.approx(stage.state + stage.activations + stage.logits)


def _breakdown(step, **kw):
    return MemoryBreakdown(0, 1, 10.0, 10.0, 40.0, 30.0, 5.0, kw.get("workspace", 0.0), 1,
                           (("loss buffer", 5.0), ("attention workspace", 7.0),
                            ("ZeRO-3 gather", kw.get("workspace", 0.0)),
                            ("gradient bucket", 3.0), ("optimizer step", step)),
                           fp8=kw.get("fp8", 0.0))


def test_peak_is_the_larger_of_backward_and_the_optimizer_step():
    # backward: state 60 + activations 30 + logits 5 + the largest transient (7) = 102
    during = _breakdown(20.0)
    assert (during.total, during.peak) == (95.0, 102.0)
    assert (during.peak_term, during.peak_transient) == ("optimizer", "attention workspace")
    # the step: state 60 + its 50 = 110 > 102
    step = _breakdown(50.0)
    assert (step.peak, step.peak_term, step.peak_transient) == (110.0, "optimizer step",
                                                                "optimizer step")
    # ZeRO-3's gathered layers and FP8 copies count in both the total and the backward peak
    z3 = _breakdown(20.0, workspace=25.0, fp8=45.0)
    assert z3.total == 95.0 + 25.0 + 45.0 and z3.peak == 102.0 + 25.0 + 45.0
    assert z3.peak_term == "fp8 weights"
    assert z3.peak_dict() == {"peak": 172.0, "peak_term": "fp8 weights",
                              "peak_transient": "attention workspace",
                              "transients": dict(z3.transients)}
    # no transients: the peak is what the stage holds
    bare = MemoryBreakdown(0, 1, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1, fp8=7.0, host=9.0)
    assert bare.peak == bare.total == 28.0 and bare.state == 6.0
    assert bare.as_dict() == {"weights": 1.0, "grads": 2.0, "optimizer": 3.0, "fp8": 7.0,
                              "activations": 4.0, "logits": 5.0, "workspace": 6.0,
                              "total": 28.0, "host": 9.0}


def test_peak_with_few_transients():
    held = dict(weights=10.0, grads=10.0, optimizer=40.0)

    def stage(transients, workspace=0.0):
        return MemoryBreakdown(0, 1, *held.values(), 0.0, 0.0, workspace, 1, transients)

    # no optimizer-step buffer recorded: the backward peak, its one transient
    one = stage((("loss buffer", 0.5),))
    assert (one.peak, one.peak_transient) == (60.5, "loss buffer")
    # only the optimizer step's buffer: no backward transient, the step's peak
    step = stage((("optimizer step", 2.0),))
    assert (step.peak, step.peak_transient, step.peak_term) == (62.0, "optimizer step",
                                                                "optimizer")
    # ZeRO-3's gathered layers as the largest term
    z3 = stage((("loss buffer", 0.5), ("ZeRO-3 gather", 50.0)), workspace=50.0)
    assert (z3.peak, z3.peak_term) == (110.5, "ZeRO-3 gather")


def test_training_memory_arguments():
    tiny = get_model("tiny")
    with pytest.raises(ShardwiseError) as err:
        training_memory_per_gpu("tiny", Layout())
    assert str(err.value) == ("model must be a ModelSpec (shardwise.get_model), got 'tiny'")
    # train may be left out: the default TrainSpec
    assert training_memory_per_gpu(tiny, Layout(dp=2)) == training_memory_per_gpu(
        tiny, Layout(dp=2), TrainSpec())


def test_mtp_module_on_the_head_stage_with_its_embedding_copy():
    """DeepSeek-V3's MTP module (one MoE layer + eh_proj 2h → h + three norms, tp = ep = 1:
    19,632 + 49,152 + 8,192 + 192 parameters) sits on the stage holding the head; with pp > 1
    that stage keeps its own copy of the embedding (V·h = 16,384)."""
    module = DS_MOE1 + 8 * 3 * 64 * 32 + 2 * 64 * 64 + 3 * 64

    def weights(layout, mtp):
        train = TrainSpec(seq_len=32, global_batch=8, dtype="fp64", impl="shardwise",
                          mtp_layers=mtp)
        return [s.weights for s in training_memory_per_gpu(DS, Layout.parse(layout), train)]

    one, plain = weights("dp=1", 1), weights("dp=1", 0)
    assert one[0] - plain[0] == F64 * module
    two, plain2 = weights("pp=2", 1), weights("pp=2", 0)
    assert two[0] == plain2[0] and two[1] - plain2[1] == F64 * (module + 256 * 64)


DS_MOE1 = 12848 + 2 * 64 + 8 * 64 + 3 * 64 * 32  # tp = 1: attention, norms, router, shared


def test_transient_buffers_and_mtp_activations_by_hand():
    """tiny at tp = 2, s 32, b 1: the loss's fp32 buffer s·b·V·4/t = 16,384 B; the attention
    workspace FlashAttention's fp32 dq s·b·h·4/t = 4,096 B, or without it the fp32 gradient of
    the scores a/t·s²·b·4 = 8,192 B."""
    tiny = get_model("tiny")
    for flash, workspace in ((True, 4096.0), (False, 8192.0)):
        train = TrainSpec(seq_len=32, global_batch=8, dtype="fp64", impl="shardwise",
                          flash_attention=flash)
        (stage,) = training_memory_per_gpu(tiny, Layout.parse("tp=2"), train)
        transients = dict(stage.transients)
        assert (transients["loss buffer"], transients["attention workspace"]) == (
            16384.0, workspace)
        assert stage.logits == 16384.0  # (s·b, V/t) fp32 for the micro-batch at the loss
    # the MTP module's activations: its MoE layer, eh_proj's 2h input and three norms (5·s·b·h)
    def last(mtp):
        train = TrainSpec(seq_len=32, global_batch=8, dtype="fp64", impl="shardwise",
                          mtp_layers=mtp)
        return training_memory_per_gpu(DS, Layout.parse("dp=1"), train)[0]

    layer = activation_bytes_per_layer(DS, 32, 1, flash=True, dtype="fp64", moe=True)
    assert last(1).activations - last(0).activations == pytest.approx(
        layer + 5 * 32 * 64 * F64)
    assert last(1).logits == 2 * last(0).logits  # the MTP head's logits beside the model's


def test_stage_terms_at_their_defaults_and_edges():
    """`stage_memory`'s expert-TP default is Megatron-Core's (etp = tp, here 2), not 1; plain
    SGD in fp32 holds no optimizer state, so its step takes no buffer and the peak stays
    finite; ZeRO-3 without an FP8 recipe holds no FP8 copy, not a byte of it."""
    codes = Layout.parse("tp=2,ep=2,dp=2").codes()
    del codes["etp"]
    at = dict(codes, m=4, stage=0)
    default = stage_memory(DS, TRAIN, **at)
    assert default["weights"] == stage_memory(DS, TRAIN, **at, etp=2)["weights"]
    assert default["weights"] < stage_memory(DS, TRAIN, **at, etp=1)["weights"]
    sgd = TrainSpec(seq_len=32, global_batch=16, dtype="fp32", optimizer="sgd",
                    impl="shardwise")
    bare = training_memory_per_gpu(DS, Layout.parse("tp=2,ep=2,dp=2"), sgd)[0]
    assert bare.optimizer == 0.0 and dict(bare.transients)["optimizer step"] == 0.0
    assert bare.peak == bare.total + max(v for k, v in bare.transients
                                         if k in ("loss buffer", "attention workspace"))
    z3 = training_memory_per_gpu(DS, Layout.parse("tp=2,ep=2,dp=2,zero=3"), TRAIN)[0]
    assert z3.fp8 == 0.0


def test_the_peak_names_the_gradients_when_they_are_its_largest_term():
    grads = MemoryBreakdown(0, 1, 10.0, 50.0, 20.0, 5.0, 0.0, 0.0, 1, (("loss buffer", 1.0),))
    assert (grads.peak, grads.peak_term) == (86.0, "grads")


def test_the_peak_names_the_weights_when_they_are_its_largest_term():
    weights = MemoryBreakdown(0, 1, 60.0, 10.0, 20.0, 5.0, 0.0, 0.0, 1, (("loss buffer", 1.0),))
    assert (weights.peak, weights.peak_term) == (96.0, "weights")


def test_the_gradient_bucket_holds_the_largest_layer_with_its_experts_split_by_etp():
    """ZeRO-2's gradient bucket: the largest layer's gradients (fp64), the MoE layer with its
    local experts, which etp = 1 leaves whole (8/ep = 4 of d_ff 32; tp = 2 splits only the
    shared expert and attention)."""
    layout = Layout.parse("tp=2,ep=2,etp=1,dp=4,zero=2")
    stage = training_memory_per_gpu(DS, layout, TRAIN)[0]
    experts = 8 / 2 * 3 * 64 * 32  # ÷ ep only
    assert dict(stage.transients)["gradient bucket"] == max(DENSE, MOE + experts) * F64


def test_a_layout_the_training_spec_refuses_is_refused():
    """The global batch (16) is no multiple of dp·micro_batch = 3·1: refused with the
    training spec's reason, not estimated."""
    with pytest.raises(ShardwiseError, match="global batch 16 is not a multiple"):
        training_memory_per_gpu(get_model("tiny"), Layout(dp=3), TRAIN)
