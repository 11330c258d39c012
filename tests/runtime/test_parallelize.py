"""`parallelize`'s bookkeeping, in one process: every rank of a layout is built in turn on a
mesh view with no process groups (building the shards sends nothing), and the ranks together
must hold the single-device model exactly — each element once per replica — and count it once
in the global gradient norm. The numerics are in test_train.py (real ranks)."""

import pytest
import torch

from shardwise.arch import get_model
from shardwise.layout import Layout
from shardwise.runtime.mesh import AXES, AxisGroup, Mesh, MeshShape
from shardwise.runtime.model import Transformer
from shardwise.runtime.parallel_transformer import TransformerStages
from shardwise.runtime.parallelize import parallelize, runtime_problems


def offline_mesh(shape: MeshShape, rank: int) -> Mesh:
    """Rank `rank`'s view of every axis, without process groups (no communication)."""
    axes = {}
    for axis in AXES:
        group = shape.group_of(axis, rank)
        axes[axis] = AxisGroup(axis, None, len(group), group.index(rank), group)
    return Mesh(shape, rank, axes)


def spec(name: str):
    if name.endswith("-tied"):
        return get_model(name.removesuffix("-tied")).with_(name=name, tie_embeddings=True)
    return get_model(name)


def every_rank(layout: Layout, model: str):
    shape = MeshShape.from_layout(layout)
    for rank in range(shape.world_size):
        mesh = offline_mesh(shape, rank)
        yield mesh, parallelize(Transformer(spec(model)), mesh, layout, seq_len=32)


LAYOUTS = [("dp=2,tp=2,pp=2", "tiny"), ("tp=2,sp=1,pp=2,schedule=interleaved,chunks=2", "tiny"),
           ("dp=2,cp=2,tp=2,ep=4", "tiny-moe"), ("tp=2,sp=1,ep=2,dp=2", "tiny-moe"),
           ("pp=2", "tiny-tied"), ("tp=2,pp=2", "tiny-tied"), ("cp=2,recompute=full", "tiny"),
           ("tp=4,sp=1", "tiny")]  # tiny: 2 kv heads, each held by 2 of the 4 tp ranks


@pytest.mark.parametrize(("text", "model"), LAYOUTS)
def test_ranks_hold_the_single_device_model_and_count_each_element_once(text, model):
    layout = Layout.parse(text)
    reference = dict(Transformer(spec(model)).named_parameters())
    counted = 0.0
    held: dict[str, dict[tuple[int, int], tuple[int, torch.Tensor]]] = {}
    for mesh, par in every_rank(layout, model):
        counted += sum(float(w) * p.numel() for p, w in par.norm_terms)
        for name, p in par.model.named_parameters():
            shard = par.shards[name]
            if shard.tied_copy:  # the last stage's copy of the first stage's embedding
                name = "embedding.weight"
            tp_i = mesh.coord["tp"] // shard.tp_replicas if shard.tp_dim is not None else 0
            ep_i = mesh.rank("ep") if shard.expert else 0
            copies = held.setdefault(name, {})
            if (ep_i, tp_i) in copies:  # a replica: the same values everywhere
                assert torch.equal(copies[(ep_i, tp_i)][1], p), name
            copies[(ep_i, tp_i)] = (shard.tp_dim or 0, p.detach())
    assert counted == sum(p.numel() for p in reference.values())  # Σ ranks' parts of ‖g‖²
    assert sorted(held) == sorted(reference)
    for name, want in reference.items():
        assert torch.equal(_assemble(held[name]), want), name


def _assemble(parts: dict[tuple[int, int], tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Concatenate tp shards along their dim, then expert shards along dim 0."""
    out = []
    for e in sorted({e for e, _ in parts}):
        shards = [parts[(e, t)] for t in sorted(t for e2, t in parts if e2 == e)]
        out.append(torch.cat([tensor for _, tensor in shards], dim=shards[0][0]))
    return torch.cat(out)


def test_sequence_parallel_stages_exchange_sequence_shards():
    layout = Layout.parse("tp=2,sp=1,pp=2")
    _, par = next(every_rank(layout, "tiny"))
    stages = TransformerStages(par.model, par.positions, sequence_split=2)
    assert stages.message_shape(4, 32) == (4, 16, 64)
    assert set(stages.named_parameters(par.stages[0])) == set(
        n for n in par.shards if n.startswith(("embedding.", "blocks.0.", "blocks.1.")))


def test_context_parallel_ranks_hold_zigzag_positions():
    layout = Layout.parse("cp=2")
    positions = [par.positions.tolist() for _, par in every_rank(layout, "tiny")]
    assert positions == [[*range(0, 8), *range(24, 32)], [*range(8, 24)]]


@pytest.mark.parametrize(("text", "model", "fragment"), [
    ("dp=6,zero=1,zero_group=3,ep=2", "tiny-moe", "neither a multiple nor a divisor of ep=2"),
    ("pp=2,schedule=zbv,chunks=2", "tiny", "does not run the zbv schedule"),
    ("pp=2,schedule=dualpipev,chunks=2", "tiny", "demo pipeline --schedule dualpipev"),
])
def test_the_runtime_refuses_what_it_cannot_run(text, model, fragment):
    problems = runtime_problems(Layout.parse(text), spec(model))
    assert any(fragment in p for p in problems), problems


def test_supported_layouts_have_no_runtime_problems():
    for text, model in [*LAYOUTS, ("dp=2,pp=2,zero=3,schedule=zb-h1,recompute=full", "tiny")]:
        assert runtime_problems(Layout.parse(text), spec(model)) == []
    assert "Llama-style" in runtime_problems(Layout(), get_model("gpt3-125m"))[0]


@pytest.mark.parametrize("text", ["tp=2", "tp=4", "tp=4,pp=2"])
def test_ranks_hold_what_the_memory_model_counts_with_biases_and_head_dim(text):
    """Q/K/V biases and head_dim ≠ h/a (a Qwen2-like tiny) at tp ≤ and > the 2 kv heads: each
    rank's parameters equal `estimate.memory.stage_params` (what `check` predicts)."""
    from shardwise.estimate.memory import stage_params

    model = get_model("tiny").with_(name="tiny-qwen", d_head=32, qkv_bias=True)
    layout = Layout.parse(text)
    shape = MeshShape.from_layout(layout)
    for rank in range(shape.world_size):
        mesh = offline_mesh(shape, rank)
        par = parallelize(Transformer(model), mesh, layout, seq_len=32)
        held = sum(p.numel() for p in par.model.parameters())
        assert held == stage_params(model, layout, mesh.coord["pp"])[0], (text, rank)


def test_unsupported_rope_scaling_is_refused_by_the_runtime():
    dynamic = get_model("tiny").with_(rope_scaling=(("factor", 4.0), ("rope_type", "dynamic")))
    assert any("RoPE scaling 'dynamic'" in p for p in runtime_problems(Layout(), dynamic))
