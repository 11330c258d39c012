"""shardwise.cuda_graph's refusals, each one line saying what is wrong and what would be
valid, as `TrainSpec.validate` / `Layout.validate` raise them; which combinations refuse is
checked against megatron-core's own TransformerConfig in tests/test_cuda_graph.py, the
wording (the scope named, the valid scopes or the fix) here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.arch import ModelSpec
from shardwise.cuda_graph import (
    CUDA_GRAPH_SCOPES,
    cuda_graph_layout_problems,
    cuda_graph_problems,
)
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec

MOE = ModelSpec(name="g-moe", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160,
                vocab=128, max_seq=128, n_experts=8, top_k=2, d_ff_expert=48,
                n_shared_experts=1, dropout=True).validate()
DENSE = ModelSpec(name="g-dense", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160,
                  vocab=128, max_seq=128, dropout=True).validate()


def _train(scopes, **kw) -> TrainSpec:
    return TrainSpec(seq_len=128, global_batch=8, impl=kw.pop("impl", "megatron-te"),
                     cuda_graph=scopes, **kw)


def test_scope_list_is_megatrons():
    """megatron-core 0.16.1 `CudaGraphScope` less full_iteration (local impl only) and
    mamba (hybrid models' SSM layers, which shardwise does not model)."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    names = {s.name for s in enums.CudaGraphScope}
    assert set(CUDA_GRAPH_SCOPES) == names - {"full_iteration", "full_iteration_inference",
                                               "mamba"}


def test_train_refusals_name_the_scope_and_the_fix():
    assert cuda_graph_problems(_train(())) == []
    assert cuda_graph_problems(_train(("attn", "mlp"))) == []
    assert cuda_graph_problems(_train(("bogus",))) == [
        "cuda_graph scope 'bogus' unknown; valid: attn, mlp, moe, moe_router, "
        "moe_preprocess"]
    assert cuda_graph_problems(_train(("moe", "moe_router"), moe_capacity=1.0)) == [
        "cuda_graph: moe and moe_router exclude each other (moe captures the router)"]
    assert cuda_graph_problems(_train(("moe_preprocess",))) == [
        "cuda_graph: moe_preprocess needs moe_router"]
    assert cuda_graph_problems(_train(("moe_router", "moe_preprocess"))) == []
    assert cuda_graph_problems(_train(("moe",))) == [
        "cuda_graph: moe captures drop-and-pad MoE layers only; set moe_capacity"]
    assert cuda_graph_problems(_train(("moe",), moe_capacity=1.0)) == []
    titan = SimpleNamespace(cuda_graph=("attn",), impl="torchtitan", moe_capacity=None)
    assert cuda_graph_problems(titan) == [
        "cuda_graph: torchtitan captures no CUDA graphs (megatron-te's --cuda-graph-impl "
        "transformer_engine does)"]
    odd = SimpleNamespace(cuda_graph=["attn"], impl="megatron-te", moe_capacity=None)
    assert cuda_graph_problems(odd) == ["cuda_graph must be scope names, got ['attn']"]
    assert cuda_graph_problems(replace_scopes(odd, ("attn", 3))) == [
        "cuda_graph must be scope names, got ('attn', 3)"]
    with pytest.raises(ShardwiseError, match="moe_preprocess needs moe_router"):
        _train(("moe_preprocess",)).validate()


def replace_scopes(ns: SimpleNamespace, scopes) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(ns), "cuda_graph": scopes})


def _layout(recompute="none"):
    return SimpleNamespace(recompute=recompute)


def test_layout_refusals_name_the_scope_and_the_fix():
    graphs = _train(("attn", "mlp"))
    assert cuda_graph_layout_problems(_layout("full"), DENSE, graphs) == [
        "cuda_graph: full recompute is graphed only as a whole-iteration graph "
        "(megatron-core's local impl); use recompute=selective or none"]
    assert cuda_graph_layout_problems(_layout(), MOE, _train(("mlp",))) == [
        "cuda_graph: mlp captures dense layers' MLPs; g-moe has none"]
    assert cuda_graph_layout_problems(_layout(), DENSE, _train(("moe_router",))) == [
        "cuda_graph: moe scopes need an MoE model; g-dense is dense"]
    assert cuda_graph_layout_problems(_layout(), DENSE, _train(("moe",),
                                                               moe_capacity=1.0)) == [
        "cuda_graph: moe scopes need an MoE model; g-dense is dense"]
    # selective recompute: core_attn by default
    assert cuda_graph_layout_problems(_layout("selective"), DENSE, _train(("attn",))) == [
        "cuda_graph: with dropout the graphed attn scope cannot recompute core_attn"]
    nodrop = DENSE.with_(dropout=False, name="g-nodrop")
    assert cuda_graph_layout_problems(_layout("selective"), nodrop, _train(("attn",))) == []
    modules = _train(("moe_router", "mlp"), recompute_modules=("moe", "mlp"))
    mixed = MOE.with_(first_dense_layers=1, name="g-mixed")
    assert cuda_graph_layout_problems(_layout("selective"), mixed, modules) == [
        "cuda_graph: recomputing the moe module does not go with the moe_router graph",
        "cuda_graph: with dropout the graphed mlp scope cannot recompute mlp"]
    moe_graph = _train(("moe",), moe_capacity=1.0, recompute_modules=("moe",))
    assert cuda_graph_layout_problems(_layout("selective"), MOE, moe_graph) == [
        "cuda_graph: with dropout the graphed moe scope cannot recompute moe"]
    assert cuda_graph_layout_problems(_layout("none"), MOE, moe_graph) == []
    # a train refusal is reported once, by TrainSpec, not again per layout
    assert cuda_graph_layout_problems(_layout("full"), DENSE, _train(("bogus",))) == []
    assert cuda_graph_layout_problems(_layout("full"), DENSE, _train(())) == []
    with pytest.raises(ShardwiseError, match="g-moe has none"):
        Layout(dp=2, ep=2).validate(MOE, None, _train(("mlp",)))
