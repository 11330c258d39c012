"""The planner's memory evaluates one stage per distinct stage composition
(`estimate.geometry.distinct_stages`); its peak must equal, bit for bit, the largest total over
every pipeline stage of every layout of the grid."""

from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.estimate.geometry import candidate_stages, distinct_stages
from shardwise.estimate.memory import peak_stage_total, stage_memory
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _flatten
from shardwise.plan.evaluate import _partition
from shardwise.plan.grid import _Rejections

LITE = get_model("deepseek-v2-lite")  # 27 layers, the first dense, 2 shared experts, MLA
SPACE = SearchSpace(recompute=("none", "full"), zero=(1, 3))
CASES = [
    # dense first layers, DeepSeek-V3's MTP module on the head's stage (27 layers: 1F1B)
    (LITE, TrainSpec(seq_len=2048, global_batch=64, mtp_layers=1), 32, 1),
    # every second layer MoE after a dense one, interleaved and V schedules in the grid
    (replace(LITE, name="alt", moe_every=2, n_layers=24),
     TrainSpec(seq_len=1024, global_batch=128, impl="shardwise"), 32, 3),
]


@pytest.mark.parametrize(("model", "train", "gpus", "schedules"), CASES)
def test_distinct_stages_give_the_peak_of_every_stage(model, train, gpus, schedules):
    grid, _ = _enumerate(model, Cluster.of(gpus, "h100"), train, SPACE, _Rejections())
    flat, _ = _flatten(grid)
    keys = ("tp", "pp", "cp", "ep", "dp", "zero", "zero_group", "sp", "schedule", "chunks",
            "recompute", "micro_batch", "m", "etp", "cp_kind", "ulysses")
    cand = {k: flat[k] for k in keys if k in flat}
    partition = _partition(flat)
    got = peak_stage_total(model, train, **cand, partition=partition)
    pp = cand["pp"]
    every = [stage_memory(model, train, **cand, stage=np.minimum(i, pp - 1),
                          partition=partition)["total"] for i in range(int(pp.max()))]
    assert np.array_equal(got, np.max(every, axis=0))
    # not degenerate: deep pipelines and several schedules, and fewer stages evaluated
    assert pp.max() >= 8 and len(np.unique(cand["schedule"])) >= schedules
    reps = distinct_stages(model, pp, candidate_stages(model, pp), chunks=cand["chunks"],
                           schedule=cand["schedule"], m=cand["m"], partition=partition)
    assert 2 <= len(reps) < int(pp.max())
