"""megatron-te's CUDA-graph choice (`TrainSpec.cuda_graph`, `--cuda-graph-scope`): accepted
exactly where megatron-core 0.16.1's own `TransformerConfig` accepts the scopes, refused in
one line (exit 2) by the CLI, and a graphed scope's kernels cost the host one launch."""

from __future__ import annotations

import itertools
import warnings

import pytest

from shardwise.arch import ModelSpec
from shardwise.cli import main as cli_main
from shardwise.cuda_graph import CUDA_GRAPH_SCOPES
from shardwise.errors import ShardwiseError
from shardwise.estimate.compute import ComputeContext, layer_cost
from shardwise.estimate.host import dispatch_sync, expert_host, host_ops
from shardwise.hardware import get_accelerator
from shardwise.layout import Layout, TrainSpec


def _model(kind: str, dropout: bool) -> ModelSpec:
    """Two layers: dense, all-MoE (8 experts, 1 shared), or a dense first layer then MoE."""
    moe = {} if kind == "dense" else dict(n_experts=8, top_k=2, d_ff_expert=48,
                                            n_shared_experts=1,
                                            first_dense_layers=1 if kind == "mixed" else 0)
    return ModelSpec(name=f"g-{kind}", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                     d_ff=160, vocab=128, max_seq=128, dropout=dropout, **moe).validate()


def _megatron_accepts(model: ModelSpec, scopes, capacity, recompute, modules) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    drop = 0.1 if model.dropout else 0.0
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_dropout=drop,
              hidden_dropout=drop, cuda_graph_impl="transformer_engine",
              cuda_graph_scope=list(scopes))
    if model.is_moe:
        kw.update(num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                  moe_layer_freq=[0, 1] if model.first_dense_layers else 1)
        if capacity is not None:
            kw.update(moe_expert_capacity_factor=capacity, moe_pad_expert_input_to_capacity=True)
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=list(modules))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TransformerConfig(**kw)
    except (AssertionError, ValueError):
        return False
    return True


def _shardwise_accepts(model, scopes, capacity, recompute, modules) -> bool:
    train = TrainSpec(seq_len=128, global_batch=8, impl="megatron-te", cuda_graph=scopes,
                      moe_capacity=capacity,
                      recompute_modules=modules if recompute == "selective" else None)
    try:
        train.validate()
        Layout(dp=2, ep=2 if model.is_moe else 1, recompute=recompute).validate(model, None,
                                                                        train)
    except ShardwiseError:
        return False
    return True


SCOPE_SETS = [s for n in (1, 2, 3) for s in itertools.combinations(CUDA_GRAPH_SCOPES, n)]


@pytest.mark.parametrize("kind, dropout", [("moe", False), ("mixed", True), ("dense", True)])
def test_scopes_accepted_exactly_where_megatron_accepts_them(kind, dropout):
    pytest.importorskip("megatron.core")
    model = _model(kind, dropout)
    cases = itertools.product(SCOPE_SETS, (None, 1.0),
                              (("none", ()), ("full", ()), ("selective", ("core_attn",)),
                               ("selective", ("mlp", "moe"))))
    disagree = []
    for scopes, capacity, (recompute, modules) in cases:
        if capacity is not None and not model.is_moe:
            continue
        ours = _shardwise_accepts(model, scopes, capacity, recompute, modules)
        theirs = _megatron_accepts(model, scopes, capacity, recompute, modules)
        if ours != theirs:
            disagree.append((scopes, capacity, recompute, modules, ours, theirs))
    assert not disagree


def test_other_stacks_refuse_cuda_graphs():
    with pytest.raises(ShardwiseError, match="captures no CUDA graphs"):
        TrainSpec(seq_len=128, impl="torchtitan", cuda_graph="attn").validate()


def test_cli_refuses_a_bad_scope_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", "qwen3-30b-a3b", "--gpu", "b200", "--gpus", "8", "--seq", "4096",
                  "--global-batch", "512", "--layout", "ep=8,mb=1", "--cuda-graph-scope",
                  "moe"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop-and-pad" in err[0] and "Traceback" not in err[0]


def test_graphed_scopes_cost_the_host_one_launch_each():
    """attn: the attention block's kernels (all but the MLP's 4) become one launch; a `moe`
    graph (drop-and-pad) removes the experts' host loop; drop-and-pad never syncs on the
    routing counts, graphed or not (`test_dispatcher_blocks_the_host_once_per_forward`)."""
    model = _model("moe", False)
    acc = get_accelerator("b200")

    def ctx(scopes):
        train = TrainSpec(seq_len=128, global_batch=8, impl="megatron-te", fp8="mxfp8",
                          moe_capacity=1.0, cuda_graph=scopes)
        return ComputeContext.of(model, acc, train)

    plain, attn, moe = ctx(()), ctx(("attn",)), ctx(("attn", "moe"))
    fwd0, bwd0 = host_ops(plain, 1, 1, False, True, 2)
    assert host_ops(attn, 1, 1, False, True, 2) == (4 + 1, 2 * (4 + 1))
    assert fwd0 == 10 + 1 and bwd0 == 22  # flash attention core: 10 + 1 kernels
    assert host_ops(moe, 1, 1, False, True, 2) == (2, 4)
    assert host_ops(attn, 1, 1, False, False, 1) == (5, 10)  # dense layer: attn only
    assert expert_host(attn, 4.0)[0] > 0 and expert_host(moe, 4.0) == (0.0, 0.0)
    assert dispatch_sync(attn) == 0.0 and dispatch_sync(moe) == 0.0
    slow = layer_cost(attn, 1, 1, 1, False, 0, moe=True, ep=2)
    fast = layer_cost(moe, 1, 1, 1, False, 0, moe=True, ep=2)
    assert fast.fwd < slow.fwd
