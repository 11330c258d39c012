"""`training_memory_per_gpu` (estimate/memory.py) term by term against hand counts: ZeRO-1
over the whole data-parallel group and over a hybrid shard group, the experts' state over
their expert-data-parallel group `tp·dp/(etp·ep)` (MLA with d_v ≠ d_k, a dense first layer,
a shared expert; tp = ep = 2, dp = 4), an MTP module with its own embedding copy on the last
stage, and, with tp = 2 and no sequence parallelism, the dropout mask, the loss's fp32 logits
and buffer, the math attention's fp32 scores and the optimizer step; `MemoryBreakdown.peak`
on parts written out."""

from shardwise.arch import get_model
from shardwise.estimate.memory import MemoryBreakdown, training_memory_per_gpu
from shardwise.layout import Layout, TrainSpec

DS8 = get_model("tiny-deepseek").with_(n_layers=8)  # layer 0 dense, 1-7 MoE; V 256, h 64
# per rank at tp = ep = 2 (test_geometry_stages.py works these out from the weights' shapes)
ATTN = 64 * 32 + 64 * 24 + 48 + (32 * 96 + 16 * 128 + 64 * 64) / 2 + 2 * 64
DENSE, MOE, EXPERTS = ATTN + 3 * 64 * 128 / 2, ATTN + 8 * 64 + 3 * 64 * 32 / 2, 8 * 3 * 64 * 32 / 4
EMBED = HEAD = 256 * 64 / 2
FIRST = (DENSE + 3 * MOE + EMBED, 3 * EXPERTS)  # layers 0-3 (dense, expert) parameters
LAST = (4 * MOE + HEAD + 64, 4 * EXPERTS)  # layers 4-7, the head and the final norm
TRAIN = TrainSpec(seq_len=128, global_batch=16)  # bf16 weights and grads, fp32 Adam (12 B)


def test_zero1_divides_dense_and_expert_optimizer_state_by_their_groups():
    layout = Layout.parse("pp=2,tp=2,ep=2,dp=4,zero=1,sp=1")
    stages = training_memory_per_gpu(DS8, layout, TRAIN)
    for stage, (dense, experts) in zip(stages, (FIRST, LAST), strict=True):
        assert stage.weights == stage.grads == 2 * (dense + experts)
        # dense over dp = 4; experts over tp·dp/(etp·ep) = 2·4/(2·2) = 2
        assert stage.optimizer == 12 * dense / 4 + 12 * experts / 2


def test_a_hybrid_shard_group_divides_the_state_instead_of_dp():
    layout = Layout.parse("pp=2,tp=2,ep=2,dp=4,zero=1,zero_group=2,sp=1")
    stages = training_memory_per_gpu(DS8, layout, TRAIN)
    for stage, (dense, experts) in zip(stages, (FIRST, LAST), strict=True):
        # dense over the group of 2; experts over 2·2/(2·2) = 1
        assert stage.optimizer == 12 * dense / 2 + 12 * experts / 1


def test_an_mtp_module_and_its_embedding_copy_on_the_last_stage():
    """DeepSeek-V3 §2.2: the module is an MoE layer, eh_proj (2h → h, ÷ tp) and three norms;
    the last stage (not stage 0) keeps its own copy of the embedding; the loss runs on the
    main and the MTP logits, fp32 s·b·V·4/tp each."""
    train = TrainSpec(seq_len=128, global_batch=16, mtp_layers=1)
    first, last = training_memory_per_gpu(DS8, Layout.parse("pp=2,tp=2,ep=2,dp=2,sp=1"), train)
    mtp = MOE + 2 * 64 * 64 / 2 + 3 * 64
    assert first.weights == 2 * sum(FIRST) and first.logits == 0
    assert last.weights == 2 * (LAST[0] + mtp + EMBED + LAST[1] + EXPERTS)
    assert last.logits == 2 * 128 * 256 * 4 / 2


def test_dropout_logits_and_workspaces_without_sequence_parallelism():
    """tiny with dropout, pp = 2, tp = 2 (sp off: nothing ÷ tp), full recompute (each layer
    keeps its bf16 input, 2·s·b·h bytes), 1F1B with 4 micro-batches (2 and 1 in flight)."""
    model = get_model("tiny").with_(dropout=True)  # 4 layers, h 64, 4 heads, V 256
    train = TrainSpec(seq_len=128, global_batch=4, flash_attention=False)
    first, last = training_memory_per_gpu(model, Layout.parse("pp=2,tp=2,recompute=full"),
                                          train)
    sbh = 128 * 64
    # stage 0: 2 in flight × 2 layers × 2·sbh, + the embedding's dropout mask (1 B each)
    assert (first.in_flight, first.activations) == (2, 2 * 2 * 2 * sbh + 2 * sbh)
    # the last stage: 1 in flight × 2 layers, + the final norm's two bf16 s·b·h tensors
    assert last.activations == 1 * 2 * 2 * sbh + 2 * sbh * 2
    assert (first.logits, last.logits) == (0, 128 * 256 * 4 / 2)
    for stage in (first, last):
        parts = dict(stage.transients)
        assert parts["loss buffer"] == (128 * 256 * 4 / 2 if stage is last else 0)
        assert parts["attention workspace"] == 4 / 2 * 128 * 128 * 4  # fp32 scores ÷ tp
        assert parts["optimizer step"] == 4 * stage.weights / 2  # fp32 per parameter


def _breakdown(transients, workspace=0.0, activations=30.0, logits=5.0):
    return MemoryBreakdown(0, 2, 10.0, 10.0, 20.0, activations, logits, workspace, 1,
                           tuple(transients))


def test_peak_on_parts_written_out():
    # the optimizer step alone: max(state + step, state + activations + logits)
    assert _breakdown([("optimizer step", 8.0)]).peak == 40 + 30 + 5
    assert _breakdown([("optimizer step", 50.0)]).peak == 40 + 50
    # no optimizer step: the largest other transient on top of the forward-backward
    assert _breakdown([("loss buffer", 0.5)], activations=0.0, logits=0.0).peak == 40 + 0.5
    # a ZeRO-3 workspace larger than any other term is the peak's largest
    big = _breakdown([("optimizer step", 1.0), ("ZeRO-3 gather", 100.0)], workspace=100.0)
    assert big.peak == 40 + 30 + 5 + 100 and big.peak_term == "ZeRO-3 gather"


def test_mtp_activations_with_full_recompute():
    """Sequence parallel at tp = 2 (s·b·h tensors ÷ 2), full recompute (a layer keeps its bf16
    input, 2·s·b·h bytes): stage 0 holds 2 in flight × 4 layers; the last stage 1 × 4 layers,
    the final norm's two tensors and the MTP module's layer input plus its eh_proj's 2h input,
    enorm, hnorm and final norm (5·s·b·h bf16)."""
    train = TrainSpec(seq_len=128, global_batch=16, mtp_layers=1)
    layout = Layout.parse("pp=2,tp=2,ep=2,dp=2,sp=1,recompute=full")
    first, last = training_memory_per_gpu(DS8, layout, train)
    sbh = 128 * 64
    layer = 2 * sbh / 2
    assert first.activations == 2 * 4 * layer
    assert last.activations == 4 * layer + 2 * sbh * 2 / 2 + (layer + 5 * sbh * 2 / 2)


def test_the_train_spec_defaults_when_left_out():
    tiny = get_model("tiny")
    (stage,) = training_memory_per_gpu(tiny, Layout(dp=2))
    assert stage.weights == stage.grads == 2 * tiny.count_params().total  # bf16 each


def test_plumbing_the_per_layer_settings_reach_the_activations():
    """Plumbing (the per-layer bytes are activations.py's, checked against closed forms in
    test_activations_closed_forms.py): stage 0 (1 dense and 3 MoE layers, 2 in flight, no
    dropout) holds 2 × (dense + 3 × MoE) layers' bytes worked out with the layout's etp and
    the run's recompute modules, which both change them here."""
    from shardwise.estimate.activations import activation_bytes_per_layer

    train = TrainSpec(seq_len=128, global_batch=16, recompute_modules=("mlp",))
    layout = Layout.parse("pp=2,tp=2,ep=2,etp=1,dp=2,sp=1,recompute=selective")

    def layer(moe, etp=1, modules=("mlp",)):
        return activation_bytes_per_layer(DS8, 128, 1, tp=2, sp=True, recompute="selective",
                                          flash=train.flash_attention, impl=train.profile,
                                          moe=moe, etp=etp, modules=modules)

    first = training_memory_per_gpu(DS8, layout, train)[0]
    assert first.activations == 2 * (layer(False) + 3 * layer(True))
    assert layer(True, etp=0) != layer(True) and layer(True, modules=None) != layer(True)


def test_an_expert_tensor_degree_apart_from_tp_in_mtp_and_the_zero3_workspace():
    """etp = 1 at tp = 2: a layer's routed experts are 8/ep · 3·64·32 whole, twice the etp =
    tp share. The MTP module's experts count so on the last stage, and ZeRO-3's workspace
    holds two gathered layers, the larger an MoE layer with its experts (bf16)."""
    experts = 8 / 2 * 3 * 64 * 32
    train = TrainSpec(seq_len=128, global_batch=16, mtp_layers=1)
    layout = Layout.parse("pp=2,tp=2,ep=2,etp=1,dp=2,sp=1")
    last = training_memory_per_gpu(DS8, layout, train)[1]
    mtp = MOE + 2 * 64 * 64 / 2 + 3 * 64
    assert last.weights == 2 * (LAST[0] + mtp + EMBED + 4 * experts + experts)
    zero3 = Layout.parse("pp=2,tp=2,ep=2,etp=1,dp=2,sp=1,zero=3")
    assert training_memory_per_gpu(DS8, zero3, TRAIN)[0].workspace == 2 * (MOE + experts) * 2
