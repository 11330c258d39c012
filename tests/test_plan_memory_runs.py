"""The planner's bulk memory path (`plan.evaluate.memory_grid` through
`estimate.memory.peak_stage_total_runs`: activations once per run of ZeRO variants, the
state once per row) against `peak_stage_total` evaluated on every cell of the grid, bit for
bit, on MoE grids with tp·ep > 1, etp, every ZeRO stage and group, searched uneven
partitions, MTP, an FP8 recipe, an optimizer offload and a parameter offload."""

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.calibration import default_calibration
from shardwise.estimate.compute import RC_CODES
from shardwise.estimate.memory import peak_stage_total
from shardwise.hardware import Cluster
from shardwise.layout import Balanced, TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _Rejections
from shardwise.plan.evaluate import (
    _STEP_KEYS,
    RunGeometries,
    _partition,
    _take,
    memory_grid,
    shared_costs,
)
from shardwise.plan.prune import _by_stages


@pytest.mark.parametrize(("name", "gpus", "train"), [
    ("tiny-deepseek", 32, TrainSpec(seq_len=64, global_batch=256, mtp_layers=1)),
    ("tiny-deepseek", 16, TrainSpec(seq_len=64, global_batch=64, fp8="tensorwise",
                                    offload="optimizer", offload_fraction=0.5)),
    ("mixtral-8x7b", 16, TrainSpec(seq_len=4096, global_batch=64)),
    # torchtitan offloads the parameters too: every state class leaves the GPU
    ("tiny-deepseek", 16, TrainSpec(seq_len=64, global_batch=64, impl="torchtitan",
                                    offload="params")),
])
def test_bulk_memory_equals_every_cell(name, gpus, train):
    spec, cluster = get_model(name), Cluster.of(gpus, "h100")
    train = train.validate()
    cand, _ = _enumerate(spec, cluster, train, SearchSpace(), _Rejections())
    shared = shared_costs(spec, cluster, train, cand,
                          default_calibration(cluster.accelerator.calibration_name))
    n_rc = len(RC_CODES)
    geometries = RunGeometries(spec, cand)  # one per search, shared by its blocks (`prune`)
    for rows in _by_stages(cand, np.arange(cand["_valid"].shape[0])):
        bulk = memory_grid(spec, train, cand, shared, rows)
        # in three blocks that split runs, the geometry worked out once for the whole group
        blocks = np.array_split(rows, 3) if len(rows) >= 3 else [rows]
        np.testing.assert_array_equal(np.concatenate(
            [memory_grid(spec, train, cand, shared, block, geometries) for block in blocks]),
            bulk)
        sub = _take(cand, rows, None)
        index = shared.inverse[rows] * 2 * n_rc + sub["sp"] * n_rc + sub["recompute"]
        act = {k: np.broadcast_to(v, (shared.size,))[index] for k, v in shared.act.items()}
        every = peak_stage_total(spec, train, **{k: sub[k] for k in _STEP_KEYS}, act=act,
                                 partition=_partition(sub), generation=shared.ctx.generation)
        np.testing.assert_array_equal(bulk, every)
    # not degenerate: ZeRO 0-3 (the offload: its stages) and groups, etp = 1 with ep > 1, uneven partitions, pp > 1
    zero, group = np.asarray(cand["zero"]), np.asarray(cand["zero_group"])
    assert (set(np.unique(zero)) == {0, 1, 2, 3} or train.offload != "none") \
        and (group > 0).any()
    assert ((np.asarray(cand["etp"]) == 1) & (np.asarray(cand["ep"]) > 1)).any()
    pp = np.asarray(cand["pp"])
    assert (Balanced(cand["first_less"], cand["last_less"]).searched(spec.n_layers, pp)
            | (spec.n_layers % pp != 0)).any()
    assert (np.asarray(cand["pp"]) > 1).any()
