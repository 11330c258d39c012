"""Multi-token prediction in the step time: megatron-core's `GPTModel.forward` runs, per MTP
module and on the stage holding the LM head, `eh_proj` (a column-parallel (2h → h) linear,
`MultiTokenPredictionLayer.__init__`), one more layer of the decoder's last kind (DeepSeek-V3:
MoE, so its dispatcher's all-to-alls too) and the output layer with its loss again. Checked
against those modules' own costs (`compute_costs`, `linear`) by hand."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.calibration import default_calibration
from shardwise.estimate.compute import RC_CODES, ComputeContext
from shardwise.estimate.kernels import linear
from shardwise.estimate.step import compute_costs, estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec

MODEL = get_model("deepseek-v3").with_(n_layers=5, first_dense_layers=1)  # 1 dense + 4 MoE
CLUSTER = Cluster.of(16, "h100", 8)


def _train(mtp: int) -> TrainSpec:
    return TrainSpec(seq_len=4096, global_batch=32, mtp_layers=mtp)


def test_one_stage_pays_the_mtp_layer_its_projection_head_and_all_to_alls():
    layout = Layout.parse("tp=2,pp=1,cp=1,ep=8,dp=8,sp=1,zero=1,mb=1")
    without, with_ = (estimate_step(MODEL, CLUSTER, layout, _train(n)) for n in (0, 1))
    train = _train(1)
    cal = default_calibration(CLUSTER.accelerator.calibration_name)
    ctx = ComputeContext.of(MODEL, CLUSTER.accelerator, train, cal)
    costs = compute_costs(ctx, 2, 1, 1, 1, RC_CODES["none"], 8)
    moe, (head_f, head_b, _) = costs["moe"], costs["head"]
    h = MODEL.d_model
    proj = linear(ctx, 4096, 2 * h, h / 2)  # eh_proj: all T rows (SP gathers), h/t outputs
    m = with_.microbatches
    extra = m * (moe.fwd + moe.bwd + moe.recompute + proj.fwd + proj.dgrad + proj.wgrad
                 + head_f + head_b)
    assert with_.compute - without.compute == pytest.approx(extra, rel=1e-9)
    # the MTP layer's dispatch and combine: one more MoE layer's worth, 5 instead of 4
    assert with_.ep_comm == pytest.approx(without.ep_comm * 5 / 4, rel=1e-9)
    assert without.ep_comm > 0 and extra > 0.05 * without.compute


def test_the_module_sits_on_the_heads_stage_only():
    """pp = 2: with a light last stage (4:1) the first stays critical and the MTP module adds
    nothing to the critical path; with 1:4 the last stage is critical and pays it."""
    heavy_first = Layout.parse("partition=4:1,tp=2,pp=2,cp=1,ep=4,dp=4,sp=1,zero=1,mb=1")
    heavy_last = Layout.parse("partition=1:4,tp=2,pp=2,cp=1,ep=4,dp=4,sp=1,zero=1,mb=1")
    a0, a1 = (estimate_step(MODEL, CLUSTER, heavy_first, _train(n)) for n in (0, 1))
    assert a1.compute == pytest.approx(a0.compute, rel=1e-12)
    assert a1.ep_comm == pytest.approx(a0.ep_comm, rel=1e-12)
    b0, b1 = (estimate_step(MODEL, CLUSTER, heavy_last, _train(n)) for n in (0, 1))
    assert b1.compute > b0.compute * 1.1
    # a stage's MoE layers at the model's MoE share (4 of 5 layers): 4 · 4/5 = 3.2, + 1 MTP
    assert b1.ep_comm == pytest.approx(b0.ep_comm * 4.2 / 3.2, rel=1e-9)
