"""Goodput in the planner: `--rank-by goodput` ranks by the effective step time it shows,
exactly (against every fitting layout evaluated one by one), and `plan` prints and returns the
goodput block; its inputs are checked like every other (one line, exit code 2)."""

import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import Reliability, estimate_goodput
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import plan
from tests.cli_helpers import assert_one_line_error, shardwise
from tests.test_plan import SMALL_MODELS, _brute_force, _family

# slow storage and frequent failures, so that layouts differ in goodput
SLOW = Reliability(mtbf_gpu_hours=0.2, checkpoint_bandwidth=2e5, restart_s=5.0)


@settings(max_examples=6, deadline=None)
@given(model=st.sampled_from(SMALL_MODELS[:2]), gpus=st.sampled_from([2, 4, 8]),
       batch=st.sampled_from([4, 8, 16]), top=st.sampled_from([1, 3, 10]))
def test_rows_are_the_exact_top_by_effective_step_time(model, gpus, batch, top):
    """The rows are the first `top` families by step ÷ goodput: the reference takes every
    fitting layout's exact step time (uneven pipelines simulated) in increasing order and
    evaluates its goodput one layout at a time, until the step time alone (goodput ≤ 1)
    exceeds the `top`-th best figure."""
    cluster = Cluster.of(gpus, "h100", min(gpus, 4))
    train = TrainSpec(seq_len=64, global_batch=batch)
    try:
        result = plan(model, cluster, train, top=top, baseline=False, rank_by="goodput",
                      reliability=SLOW)
    except ShardwiseError:  # no valid layout of this shape
        return
    best: dict = {}  # family -> its best figure
    for total, _, layout in sorted(_brute_force(model, cluster, train), key=lambda r: r[0]):
        if len(best) >= top and total > sorted(best.values())[top - 1] * (1 + 1e-9):
            break
        figure = total / estimate_goodput(model, cluster, layout, train, total, SLOW).goodput
        best[_family(layout)] = min(best.get(_family(layout), figure), figure)
    shown = [e.goodput.effective_step_s for e in result.ranked]
    assert shown == pytest.approx(sorted(best.values())[:top], rel=1e-8)
    assert all(a <= b * (1 + 1e-9) for a, b in pairwise(shown))
    assert result.rank_by == "goodput" and result.reliability == SLOW


def test_plan_prints_and_returns_the_goodput_block():
    out = json.loads(shardwise("plan", "llama3-8b", "--gpus", "64", "--tokens", "1T",
                               "--price", "2", "--restart-minutes", "5", "--rank-by",
                               "goodput", "--top", "3", "--json").stdout)
    g = out["goodput"]
    for key in ("job_mtbf_hours", "checkpoint_bytes", "checkpoint_write_s",
                "checkpoint_interval_s", "expected_interruptions", "goodput", "days"):
        assert isinstance(g[key], float), key
    assert g["restart_s"] == 300 and out["rank_by"] == "goodput"
    assert g["checkpoint_bytes"] == 14 * 8_030_261_248  # Megatron: 2 + 4 + 8 B/param
    # the budget: failure-free seconds ÷ goodput, and one interruption per job MTBF
    assert g["days"] * 86400 == pytest.approx(out["training"]["seconds"] / g["goodput"])
    assert g["expected_interruptions"] == pytest.approx(g["days"] * 24 / g["job_mtbf_hours"])
    assert g["cost"] == pytest.approx(g["gpu_hours"] * 2)
    effective = [row["goodput"]["effective_step_s"] for row in out["ranked"]]
    assert effective == sorted(effective)
    assert "dominate" in out["explanation"]
    text = shardwise("plan", "llama3-8b", "--gpus", "64", "--tokens", "1T", "--top",
                     "2").stdout
    # 50,677 GPU-hours ÷ 64 GPUs = 792 h: one interruption every 33 days (not "0.0 a day")
    assert "Failures, checkpoints and restarts" in text
    assert "one interruption every 33 days" in text
    assert "with failures" in text


@pytest.mark.parametrize("args, message", [
    (("--mtbf-gpu-hours", "-1"), "--mtbf-gpu-hours must be a finite number in (0"),
    (("--restart-minutes", "nan"), "--restart-minutes must be a finite number"),
    (("--checkpoint-bandwidth", "fast"), "--checkpoint-bandwidth 'fast'"),
    (("--checkpoint-bandwidth", "0GB/s"), "--checkpoint-bandwidth 0GB/s"),
    (("--async-checkpoint", "--impl", "hf-sdpa"), "saves checkpoints synchronously only"),
    (("--mtbf-gpu-hours", "1e-9", "--rank-by", "goodput"), "makes no progress"),
])
def test_bad_goodput_inputs_are_one_line(args, message):
    assert_one_line_error(shardwise("plan", *args, check=False), message)


def test_simulated_goodput_agrees_with_the_closed_form_where_it_holds(tmp_path):
    """`plan --failure-model` with Daly's assumptions (one class: independent GPU failures at
    the plan's own per-GPU MTBF, no spares limit, a restart the plan also charges): the
    synchronous policy's simulated mean goodput equals the winner's closed-form goodput
    (`estimate.goodput`) within Monte Carlo error; the other policies beat or match it."""
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"classes": [{"name": "gpu", "mtbf_hours": 2000}]}))
    out = json.loads(shardwise("plan", "llama3-70b", "--gpus", "1024", "--top", "2",
                               "--mtbf-gpu-hours", "2000", "--checkpoint-bandwidth", "0.5GB/s",
                               "--failure-model", str(fleet), "--simulate", "400",
                               "--json").stdout)
    sim, closed = out["goodput_simulated"], out["goodput"]
    assert sim["job_mtbf_hours"] == pytest.approx(closed["job_mtbf_hours"])
    sync = sim["policies"]["synchronous"]
    assert sync["interval_s"] == pytest.approx(closed["checkpoint_interval_s"])
    assert sync["goodput"]["mean"] == pytest.approx(closed["goodput"], abs=0.005)
    assert closed["goodput"] < 0.95  # failures matter here: the agreement is not trivial
    assert all(row["goodput"]["mean"] >= sync["goodput"]["mean"] - 0.005
               for row in sim["policies"].values())
    assert sim["best"] != "synchronous" and sim["sentence"].startswith("Simulated over 400")
    text = shardwise("plan", "llama3-70b", "--gpus", "1024", "--top", "2", "--failure-model",
                     str(fleet)).stdout
    assert "Goodput simulated (200 runs per policy" in text and "(planned)" in text


@pytest.mark.parametrize(("args", "message"), [
    (["--simulate", "50"], "need --failure-model"),
    (["--failure-model", "/no/such/fleet.json"], "/no/such/fleet.json"),
])
def test_bad_simulation_inputs_are_one_line(args, message):
    assert_one_line_error(shardwise("plan", "--gpus", "8", *args, check=False), message)


def test_rank_by_goodput_with_a_failure_model_ranks_by_the_simulated_mean(tmp_path):
    """`--rank-by goodput --failure-model`: the shown rows re-ranked by step ÷ mean simulated
    goodput. With Daly's assumptions (one GPU class at the plan's own MTBF, synchronous
    checkpoints) each row's simulated effective step equals the closed form's within Monte
    Carlo error, and its p10–p90 brackets the mean."""
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"classes": [{"name": "gpu", "mtbf_hours": 2000}]}))
    args = ("plan", "llama3-70b", "--gpus", "1024", "--top", "3", "--mtbf-gpu-hours", "2000",
            "--checkpoint-bandwidth", "0.5GB/s", "--rank-by", "goodput",
            "--failure-model", str(fleet), "--simulate", "300")
    out = json.loads(shardwise(*args, "--json").stdout)
    ranking = out["goodput_simulated"]["ranking"]
    assert [row["layout"] for row in ranking] != [] and len(ranking) == len(out["ranked"])
    effective = [row["effective_step_s"] for row in ranking]
    assert effective == sorted(effective) and [r["rank"] for r in ranking] == [1, 2, 3]
    closed = {row["short"]: row["goodput"]["effective_step_s"] for row in out["ranked"]}
    for row in ranking:
        assert row["effective_step_s"] == pytest.approx(closed[row["layout"]], rel=0.005)
        assert row["effective_step_s"] == pytest.approx(row["step_s"] / row["goodput_mean"])
        assert row["p10"] < row["effective_step_s"] < row["p90"]
        assert row["effective_step_s"] > 1.05 * row["step_s"]  # failures cost real time
    text = shardwise(*args).stdout
    assert "re-ranked by the simulated mean effective step time" in text
    # without --rank-by goodput the closed-form ranking stands alone
    plain = json.loads(shardwise(*args[:-6], "--failure-model", str(fleet), "--json").stdout)
    assert "ranking" not in plain["goodput_simulated"]
