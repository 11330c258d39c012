"""The "v" placement of ZBV and DualPipeV (stage `i` holds virtual stages `i` and `2p-1-i`)
against torchtitan 0.3.0's and torch.distributed.pipelining's own stage-to-rank mappings
(`_get_pp_rank_to_stage_indices_mapping`, `generate_stage_to_rank_mapping(style="v")`) and
torchtitan's even split of layers into stages (`_generate_llm_fqn_per_model_part`), on
DeepSeek-V3-like layer kinds (3 dense layers first, MoE after, one MTP module) where the
placement changes how many MoE layers each rank holds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.estimate.geometry import (
    StageGeometry,
    distinct_geometries,
    layer_params,
    stage_layers,
    stage_params,
)
from shardwise.layout import Layout
from shardwise.partition import chunk_span
from shardwise.schedules.registry import get_schedule

pipelining = pytest.importorskip("torch.distributed.pipelining._utils")
titan = pytest.importorskip("torchtitan.distributed.pipeline_parallel")

TITAN_NAMES = {"zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV", "interleaved": "Interleaved1F1B"}
PP, LAYERS = 4, 32


def deepseek_like(first_dense: int = 3, moe_every: int = 1, n_layers: int = LAYERS):
    """DeepSeek-V3's layer kinds (first 3 dense, MLA, shared + routed experts, one MTP
    module) on 32 layers (or 24), so that pp·chunks = 8 divides them (the even split)."""
    return replace(get_model("deepseek-v3"), n_layers=n_layers, first_dense_layers=first_dense,
                   moe_every=moe_every)


def titan_layers_per_rank(schedule: str, n_layers: int = LAYERS) -> list[list[str]]:
    """torchtitan's modules on each pp rank: its even split into 2·pp stages (no weight for the
    embedding and the head, so every stage holds L/(2·pp) layers) and its schedule's stage
    indices per rank."""
    parts = titan._generate_llm_fqn_per_model_part(2 * PP, n_layers, input_weight=0,
                                                   output_weight=0)
    return [[name for s in titan._get_pp_rank_to_stage_indices_mapping(
        rank, PP, TITAN_NAMES[schedule], 2 * PP) for name in parts[s]] for rank in range(PP)]


def is_moe(k: int, first_dense: int, moe_every: int) -> bool:
    """Layer `k`'s kind, as the model defines it: dense before `first_dense`, then every
    `moe_every`-th layer MoE (the last of each group: Llama 4's interleave step)."""
    return k >= first_dense and k % moe_every == moe_every - 1


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved"])
@pytest.mark.parametrize(("first_dense", "moe_every", "n_layers"), [(3, 1, 32), (1, 2, 32),
                                                                   (0, 2, 24), (5, 2, 24)])
def test_each_rank_holds_the_layers_torchtitan_puts_on_it(schedule, first_dense, moe_every,
                                                          n_layers):
    """24 layers, 3 a chunk, MoE every 2nd: the V's rank 0 holds layers 0-2 and 21-23, 3 MoE
    layers (4 with none dense first), where looped it would hold 0-2 and 12-14, 2."""
    model = deepseek_like(first_dense, moe_every, n_layers)
    layout = Layout(pp=PP, dp=8, ep=8, chunks=2, schedule=schedule)
    reference = titan_layers_per_rank(schedule, n_layers)
    for rank in range(PP):
        ref_layers = sorted(int(n.split(".")[1]) for n in reference[rank]
                            if n.startswith("layers."))
        assert sorted(stage_layers(model, layout, rank)) == ref_layers
        geo = StageGeometry.of_layout(model, layout, 16, rank)
        assert geo.layers == len(ref_layers)
        assert geo.moe_layers == sum(is_moe(k, first_dense, moe_every) for k in ref_layers)
        # the embedding where torchtitan builds it; the head, the loss and the MTP module
        # (memory.stage_memory adds it where `last`) where it builds norm and lm_head
        assert bool(geo.first) == ("tok_embeddings" in reference[rank])
        assert bool(geo.last) == ("lm_head" in reference[rank])


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_mapping_is_torchs(schedule):
    """`virtual_stage`'s "v" is torch.distributed.pipelining's V-style stage-to-rank map."""
    ref = pipelining.generate_stage_to_rank_mapping(PP, 2 * PP, style="v")
    model = deepseek_like()
    per = LAYERS // (2 * PP)
    layout = Layout(pp=PP, dp=8, ep=8, chunks=2, schedule=schedule)
    for rank in range(PP):
        starts = {int(chunk_span(LAYERS, PP, 2, rank, c, (), layout.placement)[0])
                  for c in range(2)}
        assert starts == {vs * per for vs, r in ref.items() if r == rank}
    assert sorted(k for r in range(PP) for k in stage_layers(model, layout, r)) == list(
        range(LAYERS))


def test_expert_parameters_follow_the_moe_layers_each_rank_holds():
    """ZBV, 24 layers, the first dense, MoE every 2nd (odd layers): rank 0 holds layers 0-2
    and 21-23 (MoE 1, 21, 23), every rank 3 MoE layers' experts; looped (layers 0-2 and
    12-14 on rank 0) the ranks would hold 2, 4, 2, 4."""
    model = deepseek_like(1, 2, 24)
    layout = Layout(pp=PP, dp=8, ep=8, chunks=2, schedule="zbv")
    experts = layer_params(model, layout.tp, layout.ep)[2]
    reference = titan_layers_per_rank("zbv", 24)
    moe = [sum(is_moe(int(n.split(".")[1]), 1, 2) for n in reference[rank]
               if n.startswith("layers.")) for rank in range(PP)]
    assert moe == [3, 3, 3, 3]  # the worked count above, from torchtitan's split
    for rank in range(PP):
        assert stage_params(model, layout, rank)[1] == pytest.approx(moe[rank] * experts)


def test_arrays_of_layouts_place_each_schedule_its_own_way():
    """The planner's arrays: a V and a looped schedule side by side, each element placed by
    its own schedule (the same MoE counts as torchtitan's split)."""
    model = deepseek_like(1, 2)
    codes = np.array([get_schedule(s).code for s in ("zbv", "interleaved", "dualpipev")])
    pp, chunks = np.full(3, PP), np.full(3, 2)
    for rank in range(PP):
        geo = StageGeometry.of(model, pp=pp, chunks=chunks, stage=rank * np.ones(3, int),
                               schedule=codes, m=np.full(3, 16))
        want = [sum(is_moe(int(n.split(".")[1]), 1, 2) for n in titan_layers_per_rank(s)[rank]
                    if n.startswith("layers.")) for s in ("zbv", "interleaved", "dualpipev")]
        assert list(geo.moe_layers) == want
    geos = distinct_geometries(model, pp, [np.full(3, r) for r in range(PP)], chunks=chunks,
                               schedule=codes, m=np.full(3, 16))
    assert all(np.shape(g.placement) == (3,) for g in geos)


def test_explicit_stage_counts_mirror_in_a_v():
    """`pp` counts under ZBV: each chunk of stage `i` holds half its layers, chunk 1 on
    virtual stage 2p-1-i, so the model-order virtual stages read 3,5,5,3 | 3,5,5,3 mirrored
    (torch's map gives rank i stages i and 7-i); the runtime's sizes and the estimate's spans
    agree, and each rank holds its count."""
    split = (6, 10, 10, 6)
    layout = Layout(pp=PP, dp=8, ep=8, chunks=2, schedule="zbv", partition=(8, 10, 8, 6))
    sizes = layout.stage_sizes(LAYERS)
    ref = pipelining.generate_stage_to_rank_mapping(PP, 2 * PP, style="v")
    assert [sum(n for vs, n in enumerate(sizes) if ref[vs] == r) for r in range(PP)] == [
        8, 10, 8, 6]
    assert sizes == (4, 5, 4, 3, 3, 4, 5, 4)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for rank in range(PP):
        held = sorted(k for vs, r in ref.items() if r == rank
                      for k in range(starts[vs], starts[vs] + sizes[vs]))
        assert sorted(stage_layers(deepseek_like(), layout, rank)) == held
    assert Layout(pp=PP, dp=8, chunks=2, schedule="zbv", partition=split).stage_layers(
        LAYERS) == split
