"""The ranking runs the schedule simulator only where the closed form is not the figure
(`plan.rank`: uneven pipelines small enough to simulate; equal stages have the closed form's
bubble exactly): none for a grid of even pipelines, at most the uneven fitting layouts
otherwise, and every shown row's figure is the scalar `evaluate_layout`'s (simulated
bubble included)."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, plan
from shardwise.plan.evaluate import evaluate_layout

CLUSTER = Cluster.of(16, "h100")
TRAIN = TrainSpec(seq_len=64, global_batch=32, impl="shardwise")
SPACE = SearchSpace(tp=(1, 2), pp=(1, 2, 4), cp=(1,), ep=(1, 4), etp=(0,), micro_batch=(1, 2),
                    zero=(0, 1), recompute=("none", "full"), schedules=("1f1b", "zb-h1"))


@pytest.mark.parametrize("layers", [4, 6])  # pp 2 and 4 even; pp 4 of 6 uneven
def test_only_uneven_pipelines_are_simulated(layers):
    model = get_model("tiny-deepseek").with_(n_layers=layers)
    result = plan(model, CLUSTER, TRAIN, top=6, space=SPACE, baseline=False,
                  all_variants=True)
    uneven = [e for e in result.ranked
              if max(e.layout.stage_partition(layers)) * e.layout.pp != layers]
    if layers == 4:
        assert result.stats.simulated == 0 and not uneven
    else:
        assert 0 < result.stats.simulated <= result.stats.fits
    for entry in result.ranked:
        scalar = evaluate_layout(model, CLUSTER, TRAIN, entry.layout, result.calibration,
                                 result.headroom)
        assert entry.estimate.total == pytest.approx(scalar.estimate.total, rel=1e-9)
