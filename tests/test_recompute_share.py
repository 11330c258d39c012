"""Full recompute of a share of the layers (`TrainSpec.recompute_share`): block-level selective
checkpointing (torchtitan's every-n-th block, fms-fsdp's share p, Megatron's
`--recompute-method block`) in memory and time."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.activations import activation_bytes_per_layer
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec


def _saved_bytes(every: int | None) -> int:
    """Bytes PyTorch keeps for backward over 4 blocks when every `every`-th block (counted from
    1, as torchtitan's and fms-fsdp's wrappers count) runs under non-reentrant
    `torch.utils.checkpoint`; None: no block."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(),
                                  torch.nn.Linear(48, 16)) for _ in range(4)]
    x = torch.randn(8, 16, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for i, block in enumerate(blocks, 1):
            x = (checkpoint(block, x, use_reentrant=False) if every and i % every == 0
                 else block(x))
    return sum(seen.values())


def test_the_share_blends_memory_as_pytorch_checkpoint_does():
    """Checkpointing every 2nd of 4 blocks keeps half of what checkpointing none keeps plus
    half of what checkpointing all keeps (PyTorch's own saved tensors); shardwise's per-layer
    activations at share ½ are that same mean of its `none` and `full` figures."""
    none, half, every = _saved_bytes(None), _saved_bytes(2), _saved_bytes(1)
    assert every < half < none
    assert half == pytest.approx((none + every) / 2)
    model = get_model("llama3-8b")
    args = dict(tp=2, sp=True, flash=True, impl="megatron-te")
    full = activation_bytes_per_layer(model, 4096, 2, recompute="full", **args)
    kept = activation_bytes_per_layer(model, 4096, 2, recompute="none", **args)
    share = activation_bytes_per_layer(model, 4096, 2, recompute="full", full_share=0.25,
                                       **args)
    assert full < share < kept
    assert share == pytest.approx(0.25 * full + 0.75 * kept)


def test_memory_and_step_time_between_none_and_full():
    """What `plan --layout` runs: the stage's activations and the step's recompute term move by
    the share from `none` to `full` (Llama-2-13B-shaped, 40 layers, FSDP on 64 A100 as the
    torchtitan rows; tp·pp > 1 kept out so only the replay differs)."""
    model = get_model("llama2-13b")
    cluster = Cluster.of(64, "a100-80gb")

    def run(recompute: str, share: float = 1.0):
        train = TrainSpec(seq_len=4096, global_batch=128, impl="torchtitan",
                          attention="flex", recompute_share=share)
        layout = Layout(dp=64, zero=3, micro_batch=2, recompute=recompute)
        stage = training_memory_per_gpu(model, layout, train)[0]
        return stage.activations, estimate_step(model, cluster, layout, train)

    (a0, s0), (a1, s1), (ah, sh) = run("none"), run("full"), run("full", 0.5)
    assert ah == pytest.approx((a0 + a1) / 2)
    assert s0.compute < sh.compute < s1.compute
    assert sh.compute == pytest.approx((s0.compute + s1.compute) / 2, rel=1e-9)


@pytest.mark.parametrize("layout", ["tp=4,cp=2,pp=2", "tp=2,ep=8,pp=2"])
def test_communication_replayed_by_the_share(layout):
    """Full recompute replays the forward's tensor-, context- and expert-parallel collectives of
    the layers it recomputes, so a share of 0.5 exposes the midpoint of none and full: each
    backward term is linear in the replayed layers (no overlap on megatron-te's defaults).
    DeepSeek-V2-Lite: MLA (d_k ≠ d_v) and shared experts."""
    model = get_model("deepseek-v2-lite")
    cluster = Cluster.of(64, "h100")

    def run(recompute: str, share: float = 1.0):
        train = TrainSpec(seq_len=8192, global_batch=256, impl="megatron-te",
                          recompute_share=share)
        lay = Layout.parse(f"{layout},recompute={recompute}")
        lay = Layout.parse(f"{layout},recompute={recompute},"
                           f"dp={64 // (lay.tp * lay.cp * lay.pp)}")
        return estimate_step(model, cluster, lay, train)

    none, full, half = run("none"), run("full"), run("full", 0.5)
    terms = ("tp_comm", "cp_comm_exposed", "ep_comm")
    assert any(getattr(full, k) > getattr(none, k) for k in terms)
    for k in terms:
        assert getattr(half, k) == pytest.approx((getattr(none, k) + getattr(full, k)) / 2,
                                                 rel=1e-9), k


def test_a_share_needs_full_recompute_and_a_share():
    model, train = get_model("llama3-8b"), TrainSpec(recompute_share=0.5)
    with pytest.raises(LayoutError, match="needs recompute=full"):
        Layout(dp=8, recompute="selective").validate(model, None, train)
    Layout(dp=8, recompute="full").validate(model, None, train)
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ShardwiseError, match="share of the layers"):
            TrainSpec(recompute_share=bad).validate()
