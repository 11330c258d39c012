"""The planner's grid (`plan.grid._enumerate`) where a stack refuses whole rows: Megatron-Core
shards the experts' ZeRO state over the expert data-parallel ranks, so a hybrid ZeRO group
that does not tile them is refused for every (sp, recompute) column. Such rows are left out;
what is left is every layout the stack runs, and the counts still partition the grid."""

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _flatten, _Rejections

RULE = "megatron/core/parallel_state.py"


@pytest.mark.parametrize(("name", "gpus", "seq", "batch"),
                         [("tiny-deepseek", 32, 64, 256), ("deepseek-v2-lite", 32, 4096, 128)])
def test_rows_the_stack_refuses_whole_are_left_out_and_counted(name, gpus, seq, batch):
    spec, cluster = get_model(name), Cluster.of(gpus, "h100")
    train = TrainSpec(seq_len=seq, global_batch=batch).validate()
    rejections = _Rejections()
    cand, grid = _enumerate(spec, cluster, train, SearchSpace(), rejections)
    valid = cand["_valid"]
    assert valid.any(axis=1).all()  # no row without a layout
    refused = [r for r in rejections.result() if RULE in r.reason]
    assert len(refused) == 1 and refused[0].count > 0
    # every layout of the grid counted once: evaluated or in one rejected region
    assert int(valid.sum()) + sum(r.count for r in rejections.result()) == grid
    flat, _ = _flatten(cand)
    # the rule by hand on every layout kept (Megatron-Core: the expert data-parallel group of
    # dp·cp/ep ranks holds whole ZeRO shard groups of zero_group ranks)
    dp_cp = flat["dp"] * flat["cp"]
    hybrid = (flat["zero_group"] > 0) & (flat["ep"] > 1)
    expert_dp = dp_cp // flat["ep"]
    per_group = dp_cp // np.maximum(flat["zero_group"], 1)
    assert not (hybrid & (expert_dp % np.maximum(per_group, 1) != 0)).any()
    # not degenerate: MoE with shared experts, hybrid ZeRO groups beside ep > 1 kept
    assert spec.n_moe_layers and spec.n_shared_experts
    assert (hybrid & (flat["tp"] * flat["ep"] > 1)).any()
    # the refused region's example names a layout that breaks the rule
    ep = int(refused[0].example.split("ep=")[1].split()[0])
    group = int(refused[0].example.split("zero_group=")[1].split()[0])
    assert ep > 1 and group > 0
    assert any((d // ep) % max(d // group, 1) for d in set(dp_cp.tolist()) if d % ep == 0)
