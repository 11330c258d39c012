"""The step model's per-op host cost counts the operations the runtime really dispatches.

Reference: the aten operations of `ParallelTransformer.forward_backward` counted with a
`TorchDispatchMode` on the runtime itself (what `shardwise train` runs), per layer and
micro-batch: the count at 4 layers minus the count at 2, ÷ (2 · micro-batches).
"""

import collections
import dataclasses

import pytest
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


def _ops_per_layer(model_name: str, layout: Layout) -> float:
    """On every rank: aten ops (collectives excluded) per layer and micro-batch, fwd + bwd."""
    counts = []
    for layers in (4, 2):
        spec = dataclasses.replace(get_model(model_name), n_layers=layers)
        state = build(TrainConfig(spec, layout, steps=2))
        inputs, targets = state.batches.shard(0, state.model.axis("dp").rank,
                                              state.model.axis("dp").size)
        state.model.forward_backward(inputs, targets)  # warm-up (lazy buffers)
        state.model.zero_grad()
        with _Count() as count:
            state.model.forward_backward(inputs, targets)
        counts.append(sum(n for op, n in count.ops.items() if not op.startswith("c10d")))
    micro_batches = 8 // layout.dp // layout.micro_batch
    return (counts[0] - counts[1]) / (2 * micro_batches)


def _modelled(model_name: str, layout: Layout) -> float:
    model = get_model(model_name)
    cal = dataclasses.replace(default_calibration(), op_count="runtime")
    ctx = ComputeContext(model, get_accelerator("h100-sxm"), cal, 64, 4.0, True, 1.0)
    fwd, bwd = host_ops(ctx, layout.tp, layout.cp, layout.sp, model.is_moe, layout.ep)
    return float(fwd + bwd)


def _check(model_name: str, layout: Layout, ranks: int) -> None:
    counted = launch.spawn(_ops_per_layer, ranks, model_name, layout, timeout_s=300)
    mean = sum(counted) / len(counted)  # ring attention's ranks differ by a few %
    # an MoE layer's count follows the routing (which experts get tokens): ±7 % batch to batch
    tolerance = 0.08 if get_model(model_name).is_moe else 0.03
    assert _modelled(model_name, layout) == pytest.approx(mean, rel=tolerance)


@pytest.mark.parametrize("model_name", ["tiny", "tiny-moe"])
def test_one_rank_op_count_is_the_runtimes(model_name):
    _check(model_name, Layout(), 1)


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
