"""Ties said as ties (issue 44 item 2): rows the model cannot order share a tier, one stated
rule recommends inside the first tier, and the headline, the explanation and the exports name
the same recommended layout — through the CLI's `--json` and the Python API it calls."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.plan.tiers import tiers
from shardwise.report.builders import plan_payload, run_plan
from tests.cli_helpers import shardwise, shardwise_json

AXES = ("dp", "tp", "pp", "cp", "ep")
EXPOSED = ("tp_comm", "cp_comm_exposed", "ep_comm", "pp_comm", "dp_comm_exposed")


def _axes(row: dict) -> int:
    return sum(row["layout"][axis] > 1 for axis in AXES)


def _exposed(row: dict) -> float:
    return sum(row["estimate"][key] for key in EXPOSED)


def _check_tiers(figures: list[float], tier: list[int], resolution: float) -> None:
    """The chain rule: two figures closer than the resolution (relative to the smaller) share
    a tier; two figures in one tier are joined by sorted neighbours each closer than it; two
    in different tiers are separated by a gap of at least it; tiers count up from 1."""
    for i, a in enumerate(figures):
        for j, b in enumerate(figures):
            low, high = min(a, b), max(a, b)
            between = sorted(f for f in figures if low <= f <= high)
            gaps = [y >= x * (1 + resolution) for x, y in pairwise(between)]
            if high < low * (1 + resolution):
                assert tier[i] == tier[j], (a, b, resolution)
            if tier[i] == tier[j]:
                assert not any(gaps), (a, b, resolution)
            else:
                assert any(gaps), (a, b, resolution)
    assert sorted(set(tier)) == list(range(1, max(tier) + 1))


@settings(max_examples=300, deadline=None)
@given(figures=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=25),
       resolution=st.floats(0.001, 0.5))
def test_tiers_never_split_rows_closer_than_the_resolution(figures, resolution):
    _check_tiers(figures, tiers(figures, resolution), resolution)


def test_tiers_at_the_resolution_exactly():
    """A gap equal to the resolution separates; one just under it does not."""
    assert tiers([1.0, 1.25, 1.5625], 0.25) == [1, 2, 3]  # exact in binary
    assert tiers([1.0, 1.2499, 1.5623], 0.25) == [1, 1, 1]  # a chain 56 % wide
    assert tiers([1.5625, 1.0, 1.25], 0.25) == [3, 1, 2]  # in the order given


MODELS = ("tiny", "tiny-moe")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), gpus_per_node=st.sampled_from([2, 4, 8]),
       nodes=st.sampled_from([1, 2, 4]), gpu=st.sampled_from(["h100", "a100", "b200"]),
       batch=st.sampled_from([8, 16, 32]), choose=st.sampled_from(["simplest", "fastest"]),
       rank_by=st.sampled_from(["step", "goodput"]))
def test_random_plans_tier_and_recommend_by_the_stated_rule(model, gpus_per_node, nodes, gpu,
                                                             batch, choose, rank_by):
    """Random small plans, through the API the CLI calls: the JSON's tiers follow the chain
    rule at the stated resolution over the figures ranked, and the recommended row is in the
    first tier — the fastest, or the fewest parallel axes, then the least exposed
    communication, then the least memory."""
    gpus = gpus_per_node * nodes
    try:
        result = run_plan(get_model(model), gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node,
                          seq=256, global_batch=str(batch), top=10, rank_by=rank_by,
                          choose=choose)
    except ShardwiseError:  # no layout of this shape fits or exists
        return
    out = plan_payload(result)
    rows, resolution = out["ranked"], out["tiers"]["resolution"]
    figure = ((lambda r: r["goodput"]["effective_step_s"]) if rank_by == "goodput" else
              (lambda r: r["estimate"]["total"]))
    _check_tiers([figure(r) for r in rows], [r["tier"] for r in rows], resolution)
    assert out["tiers"]["count"] == sum(r["tier"] == 1 for r in rows)
    assert resolution > 0 and out["tiers"]["rule"] and out["choose"] == choose
    rec = out["recommended"]
    assert rec["tier"] == 1
    first = [r for r in rows if r["tier"] == 1]
    if choose == "fastest":
        assert rec["rank"] == 1
    else:
        fewest = min(_axes(r) for r in first)
        assert _axes(rec) == fewest
        assert _exposed(rec) == min(_exposed(r) for r in first if _axes(r) == fewest)
    assert rec["short"] in out["explanation"].split(":")[0]


def test_the_default_plan_names_one_layout_in_headline_explanation_and_export():
    """`shardwise plan` with no arguments: the recommended layout (the simplest of the first
    tier, not the fastest row here) is the one the explanation starts with, the figures of
    the training summary and goodput come from, and the export configures; the text output
    names it in its headline and breakdown."""
    out = shardwise_json("plan", "--tokens", "1T")
    rec = out["recommended"]
    fastest = out["ranked"][0]
    assert rec["short"] != fastest["short"]  # the tie makes a difference here
    assert out["explanation"].startswith(f"{rec['short']} is recommended")
    assert out["emits"]["megatron"]["layout"] == rec["layout"]
    assert out["goodput"]["effective_step_s"] == pytest.approx(
        rec["goodput"]["effective_step_s"])
    assert out["training"]["seconds"] == pytest.approx(
        1e12 / rec["estimate"]["tokens_per_s"], rel=1e-3)
    assert "simplest" not in out
    sure = rec["estimate"]["uncertainty"]
    total = rec["estimate"]["total"]
    assert sure["coverage"] == 0.8 and sure["group"] and sure["basis"]
    assert sure["low"] == pytest.approx(total * (1 - sure["band"]))
    assert sure["high"] == pytest.approx(total * (1 + sure["band"]))
    text = shardwise("plan").stdout
    assert f"Recommended: {rec['short']} (#{rec['rank']}" in text
    assert f"Recommended layout's step time: {rec['short']}" in text
    assert shardwise_json("plan", "--emit", "megatron")["layout"] == rec["layout"]


def test_choose_fastest_recommends_the_first_row():
    model = get_model("llama3-8b")
    result = run_plan(model, gpus=64, choose="fastest", top=5)
    assert result.recommended is result.ranked[0]
    assert plan_payload(result)["explanation"].startswith(
        f"{result.ranked[0].layout.short()} is the fastest of")
    with pytest.raises(ShardwiseError, match="--choose 'quickest': use one of simplest, "
                                              "fastest"):
        run_plan(model, gpus=64, choose="quickest")
