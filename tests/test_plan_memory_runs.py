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


@pytest.mark.parametrize(("name", "gpus", "train", "gpu"), [
    ("tiny-deepseek", 32, TrainSpec(seq_len=64, global_batch=256, mtp_layers=1), "h100"),
    ("tiny-deepseek", 16, TrainSpec(seq_len=64, global_batch=64, fp8="tensorwise",
                                    offload="optimizer", offload_fraction=0.5), "h100"),
    ("mixtral-8x7b", 16, TrainSpec(seq_len=4096, global_batch=64), "h100"),
    # torchtitan offloads the parameters too: every state class leaves the GPU
    ("tiny-deepseek", 16, TrainSpec(seq_len=64, global_batch=64, impl="torchtitan",
                                    offload="params"), "h100"),
    # Blackwell keeps one FP8 copy per weight where Hopper keeps two (the generation matters)
    ("tiny-deepseek", 16, TrainSpec(seq_len=64, global_batch=64, fp8="tensorwise"), "b200"),
])
def test_bulk_memory_equals_every_cell(name, gpus, train, gpu):
    spec, cluster = get_model(name), Cluster.of(gpus, gpu)
    train = train.validate()
    cand, _ = _enumerate(spec, cluster, train, SearchSpace(), _Rejections())
    shared = shared_costs(spec, cluster, train, cand,
                          default_calibration(cluster.accelerator.calibration_name))
    n_rc = len(RC_CODES)
    geometries = RunGeometries(spec, cand)  # one per search, shared by its blocks (`prune`)
    for rows in geometries.by_stages():
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


def test_rows_shared_only_where_every_input_is_equal():
    """`_same_state_rows` against the rows worked out by hand: three runs of three rows (ZeRO
    variants), the third equal to the first in its run values but not in one row's ZeRO
    group; a fourth of two rows; and a fifth whose values' bits hash like the first's (a
    constructed collision) but differ."""
    from shardwise.estimate.memory import _same_state_rows

    k1 = 0x9E3779B97F4A7C15 + 2  # the hash's multiplier of the second column
    a = np.array([1.5, 2.5, 1.5, 1.5, 0.0])
    bits = a.view(np.uint64).copy()
    b = np.array([4.0, 4.0, 4.0, 4.0, 0.0])
    b_bits = b.view(np.uint64).copy()
    # run 4 hashes like run 0: a's bits one more, b's bits k1 less (mod 2**64)
    bits[4] = bits[0] + np.uint64(1)
    b_bits[4] = np.uint64((int(b_bits[0]) - k1) % 2**64)
    per_run = [bits.view(np.float64)[:, None], b_bits.view(np.float64)[:, None]]
    first = np.array([0, 3, 6, 9, 11])
    run = np.repeat(np.arange(5), [3, 3, 3, 2, 3])
    zero = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 2])[:, None]
    group = np.array([0, 0, 8, 0, 0, 8, 0, 0, 4, 0, 0, 0, 0, 8])[:, None]
    need, of_row = _same_state_rows(per_run, [zero, group], first, run)
    # run 2 reads run 0's first two rows, its third (group 4 ≠ 8) is its own; runs 1, 3 and 4
    # are their own
    expected = [0, 1, 2, 3, 4, 5, 0, 1, 8, 9, 10, 11, 12, 13]
    np.testing.assert_array_equal(need[of_row], expected)
    assert list(need) == sorted(set(expected))
