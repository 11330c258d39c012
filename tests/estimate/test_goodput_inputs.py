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
