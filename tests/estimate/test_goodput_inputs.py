"""`estimate.goodput`'s inputs: each bad field of `Reliability` named in one line at both
ends of its range, the edges accepted, asynchronous checkpoints refused on a stack without
them, and Young's and Daly's intervals written out here (Young 1974: √(2δM); Daly 2006 eq. 37
and its δ ≥ 2M branch, the MTBF itself)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import Reliability, daly_interval, young_interval
from shardwise.layout import TrainSpec


@pytest.mark.parametrize(("inputs", "message"), [
    ({"mtbf_gpu_hours": 0.0}, r"^mtbf_gpu_hours \(GPU-hours\) must be"),
    ({"mtbf_gpu_hours": 2e12}, r"^mtbf_gpu_hours \(GPU-hours\) must be"),
    ({"checkpoint_bandwidth": 0.0}, r"^checkpoint_bandwidth \(bytes/s per node\) must be"),
    ({"checkpoint_bandwidth": 2e15}, r"^checkpoint_bandwidth \(bytes/s per node\) must be"),
    ({"restart_s": -1.0}, r"^restart_s \(seconds\) must be"),
    ({"restart_s": 2e8}, r"^restart_s \(seconds\) must be"),
    ({"async_checkpoint": 1}, r"^async_checkpoint must be true or false, got 1$"),
])
def test_each_bad_reliability_field_is_named(inputs, message):
    with pytest.raises(ShardwiseError, match=message):
        Reliability(**inputs).validate()


def test_the_edges_are_valid_and_round_trip():
    for r in (Reliability(1e12, 1e15, 1e8, True), Reliability(1e-9, 1e-9, 0.0, False)):
        assert r.validate() is r
        assert Reliability(**r.to_dict()) == r


def test_asynchronous_checkpoints_need_a_stack_that_has_them():
    from shardwise.estimate.goodput import CHECKPOINTS

    able = [f"{name} ({fmt.async_option})" for name, fmt in CHECKPOINTS.items()
            if fmt.async_option]
    assert able and len(able) < len(CHECKPOINTS)  # both kinds exist
    for name, fmt in CHECKPOINTS.items():
        train = TrainSpec(impl=name)
        Reliability(async_checkpoint=False).check_stack(train)
        if fmt.async_option:
            Reliability(async_checkpoint=True).check_stack(train)
        else:
            with pytest.raises(ShardwiseError) as info:
                Reliability(async_checkpoint=True).check_stack(train)
            assert str(info.value) == (f"stack {name} saves checkpoints synchronously only; "
                                       f"asynchronous checkpoints: {', '.join(able)}")


def test_young_and_daly_written_out():
    for stall, mtbf in ((60.0, 3 * 3600.0), (300.0, 86400.0), (5.0, 600.0)):
        young = math.sqrt(2 * stall * mtbf)
        x = stall / (2 * mtbf)
        assert young_interval(stall, mtbf) == pytest.approx(young, rel=1e-12)
        assert daly_interval(stall, mtbf) == pytest.approx(
            young * (1 + math.sqrt(x) / 3 + x / 9) - stall, rel=1e-12)
    # δ ≥ 2M: Daly's interval is M
    assert daly_interval(500.0, 200.0) == 200.0 and daly_interval(400.0, 200.0) == 200.0
    got = daly_interval(np.array([60.0, 500.0]), np.array([3600.0, 200.0]))
    np.testing.assert_allclose(got, [math.sqrt(2 * 60 * 3600) * (1 + math.sqrt(60 / 7200) / 3
                                                                 + 60 / 7200 / 9) - 60, 200.0])


def test_interval_curve_grid_and_bad_restart():
    """121 log-spaced intervals from δ/10 (at least the lag) to M; a negative restart is one
    line."""
    from shardwise.estimate.goodput import interval_curve

    curve = interval_curve(0.002, 500.0, 30.0)
    taus = np.array(curve["interval_s"])
    assert len(taus) == 121
    assert taus[0] == pytest.approx(0.0002) and taus[-1] == pytest.approx(500.0)
    np.testing.assert_allclose(np.diff(np.log(taus)), math.log(500.0 / 0.0002) / 120)
    lagged = interval_curve(60.0, 3600.0, 30.0, lag=100.0, points=11)
    assert lagged["interval_s"][0] == pytest.approx(100.0) and len(lagged["interval_s"]) == 11
    with pytest.raises(ShardwiseError, match=r"^restart must be"):
        interval_curve(60.0, 3600.0, -1.0)
    with pytest.raises(ShardwiseError, match=r"^lag must be"):
        interval_curve(60.0, 3600.0, 1.0, lag=-1.0)


def test_goodput_as_json_by_hand():
    """`Goodput.to_dict` (what `plan --json` prints): each derived figure from its formula —
    interruptions a day 86,400/M, the interval in whole steps, step ÷ goodput, the dominant
    share, the loss per interruption M·(restart + lost work shares)."""
    from shardwise.estimate.goodput import Goodput

    g = Goodput("megatron-te", 512, 50_000.0, 7200.0, 1e12, 14.0, 2e9, 1.6e10, 1e9, "pcie5",
                3.0, 19.0, 19.0, 0.0, 600.0, 500.0, 480.0, 510.0, 4.0, 0.9,
                {"checkpoint": 0.03, "restart": 0.05, "lost work": 0.02}, False)
    d = g.to_dict()
    assert d["job_mtbf_hours"] == 2.0 and d["interruptions_per_day"] == 12.0
    assert d["checkpoint_every_steps"] == 128 and d["effective_step_s"] == pytest.approx(4 / 0.9)
    assert d["dominant"] == "restart"
    assert d["lost_per_interruption_s"] == pytest.approx(7200.0 * 0.07)
    assert (d["checkpoint_rank_bytes"], d["checkpoint_node_bytes"], d["checkpoint_bandwidth"],
            d["checkpoint_copy_s"], d["checkpoint_write_s"], d["checkpoint_stall_s"],
            d["durability_lag_s"], d["checkpoint_interval_s"]) == (
        2e9, 1.6e10, 1e9, 3.0, 19.0, 19.0, 0.0, 510.0)
    assert (d["stack"], d["gpus"], d["mtbf_gpu_hours"], d["checkpoint_bytes"],
            d["bytes_per_param"], d["host_link"], d["restart_s"], d["young_interval_s"],
            d["daly_interval_s"], d["step_s"], d["goodput"], d["async_checkpoint"]) == (
        "megatron-te", 512, 50_000.0, 1e12, 14.0, "pcie5", 600.0, 500.0, 480.0, 4.0, 0.9,
        False)
    assert d["shares"] == g.shares and d["shares"] is not g.shares
    assert g.budget(0.9 * 86400) == {"seconds": 86400.0, "days": 1.0,
                                     "expected_interruptions": 12.0}
    assert Goodput(**{**vars(g), "interval_s": 1.0}).every_steps == 1  # at least one step


def test_the_curves_minimum_and_the_upper_edges():
    from shardwise.estimate.goodput import interval_curve

    curve = interval_curve(60.0, 4 * 3600.0, 600.0, lag=30.0)
    totals = np.array(curve["total"])
    assert curve["best_total"] == pytest.approx(totals.min(), rel=1e-12)
    assert curve["best_interval_s"] == curve["interval_s"][int(totals.argmin())]
    assert 0 < curve["best_total"] == pytest.approx(curve["daly_total"], rel=0.01)  # ~ optimum
    with pytest.raises(ShardwiseError, match=r"^mtbf_gpu_hours \(GPU-hours\) must be"):
        Reliability(mtbf_gpu_hours=1e12 + 0.5).validate()


def test_a_zero_step_is_named():
    from shardwise.arch import PRESETS
    from shardwise.estimate.goodput import estimate_goodput
    from shardwise.hardware import Cluster
    from shardwise.layout import Layout

    with pytest.raises(ShardwiseError, match=r"^step_s must be"):
        estimate_goodput(PRESETS["llama3-8b"], Cluster.of(8, "h100", 8), Layout(dp=8), TrainSpec(),
                         0.0)
