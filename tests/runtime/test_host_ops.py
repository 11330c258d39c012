"""The step model's per-op host cost counts the operations the runtime really dispatches.

Reference: the aten operations of `ParallelTransformer.forward_backward` counted with a
`TorchDispatchMode` on the runtime itself (what `shardwise train` runs), per layer and
micro-batch: the count at 4 layers minus the count at 2, ÷ (2 · micro-batches). An MoE
layer's count follows which experts receive rows, so the model is asked at the share of
experts that did in the counted calls (`TrainSpec.experts_active`).
"""

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.arch import get_model
from shardwise.calibration import default_calibration
from shardwise.estimate.compute import ComputeContext, host_ops
from shardwise.hardware import get_accelerator
from shardwise.layout import Layout
from shardwise.runtime import launch
from shardwise.runtime.train import TrainConfig, build


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_layer(model_name: str, layout: Layout, zero_router: bool
                   ) -> tuple[float, float]:
    """On every rank: aten ops (collectives excluded) per layer and micro-batch, fwd + bwd,
    and of an MoE layer's experts here, how many ran rows per layer and micro-batch.
    `zero_router`: every token's router logits tie (top-k then picks the same experts)."""
    counts, running = [], []
    for layers in (4, 2):
        spec = dataclasses.replace(get_model(model_name), n_layers=layers)
        state = build(TrainConfig(spec, layout, steps=2))
        moes = [b.mlp for b in state.model.model.blocks if hasattr(b.mlp, "router")]
        for moe in moes if zero_router else ():
            moe.router.data.zero_()
        seen: list[torch.Tensor] = []  # (experts here,) rows, per MoE call: no aten op
        for moe in moes:
            moe.register_forward_hook(lambda m, args, out, seen=seen: seen.append(m.expert_rows))
        inputs, targets = state.batches.shard(0, state.model.axis("dp").rank,
                                              state.model.axis("dp").size)
        state.model.forward_backward(inputs, targets)  # warm-up (lazy buffers)
        state.model.zero_grad()
        seen.clear()
        with _Count() as count:
            state.model.forward_backward(inputs, targets)
        counts.append(sum(n for op, n in count.ops.items() if not op.startswith("c10d")))
        running.append(sum(int((rows > 0).sum()) for rows in seen))
    per = 2 * (8 // layout.dp // layout.micro_batch)  # the 2 layers more, each micro-batch
    return (counts[0] - counts[1]) / per, (running[0] - running[1]) / per


def _modelled(model_name: str, layout: Layout, experts_running: float) -> float:
    model = get_model(model_name)
    cal = dataclasses.replace(default_calibration(), op_count="runtime")
    active = experts_running / (model.n_experts / layout.ep) if model.is_moe else 1.0
    ctx = ComputeContext(model, get_accelerator("h100-sxm"), cal, 64, 4.0, True, 1.0,
                         experts_active=active)
    fwd, bwd = host_ops(ctx, layout.tp, layout.cp, layout.sp, model.is_moe, layout.ep)
    return float(fwd + bwd)


def _check(model_name: str, layout: Layout, ranks: int, zero_router: bool = False) -> None:
    counted = launch.spawn(_ops_per_layer, ranks, model_name, layout, zero_router,
                           timeout_s=300)
    ops, running = (sum(c[i] for c in counted) / len(counted) for i in (0, 1))  # ranks' mean
    # (ring attention's ranks differ by a few %)
    assert _modelled(model_name, layout, running) == pytest.approx(ops, rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny", "tiny-moe"])
def test_one_rank_op_count_is_the_runtimes(model_name):
    _check(model_name, Layout(), 1)


@pytest.mark.slow
def test_an_moe_layer_counts_only_the_experts_that_receive_rows():
    """Tied router logits send every token to the same top-k experts: the others launch
    nothing, and the count is the model's at that share of running experts (half)."""
    _check("tiny-moe", Layout(), 1, zero_router=True)


@pytest.mark.slow
@pytest.mark.parametrize("model_name, layout", [
    ("tiny", Layout(tp=2, sp=True)),
    ("tiny", Layout(cp=2)),
    ("tiny-moe", Layout(dp=2, ep=2)),
])
def test_parallel_op_counts_are_the_runtimes(model_name, layout):
    _check(model_name, layout, layout.world_size)


def test_gpu_presets_keep_the_fused_kernel_count():
    ctx = ComputeContext(get_model("tiny"), get_accelerator("h100-sxm"),
                         default_calibration("h100-sxm"), 64, 2.0, True, 1.0)
    assert default_calibration("h100-sxm").op_count == "fused"
    assert host_ops(ctx, 2, 1, True) == (11, 22)  # 10 + flash attention; backward 2×
