"""`/api/learn/*`: every explainer's numbers against SPEC's figures, closed forms, PyTorch or the
project's own functions called directly — and bad input answered with one line."""

from __future__ import annotations

import math
import sys

import pytest

from shardwise.arch import PRESETS
from shardwise.estimate.context import sequence_unit
from shardwise.estimate.memory import largest_stage_memory
from shardwise.layout import Layout, TrainSpec
from tests.figures import matches_figure


def get(client, path: str, **params) -> dict:
    response = client.get(f"/api/learn/{path}", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def one_line_error(client, path: str, status: int, **params) -> str:
    response = client.get(f"/api/learn/{path}", params=params)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    if isinstance(detail, list):  # pydantic: one entry naming the field and the limit
        assert len(detail) == 1
        detail = detail[0]["msg"]
    assert "\n" not in detail and "Traceback" not in detail
    return detail


# -------------------------------------------------------------------- memory budget, ZeRO
def test_memory_budget_reproduces_spec_zero_figures(client):
    # SPEC §2: 7.5B params -> 15 / 15 / 90 / 120 GB; on 64 devices stages 0..3 give
    # 120.00, 31.41, 16.64, 1.88 GB per device.
    d = get(client, "memory-budget", params=7.5e9, devices=64, stage=1)
    assert [d["baseline"][k] / 1e9 for k in ("weights", "grads", "optimizer", "total")] == [
        15, 15, 90, 120]
    for row, figure in zip(d["stages"], (120.00, 31.41, 16.64, 1.88)):
        assert matches_figure(row["bytes_per_device"] / 1e9, figure)
    assert matches_figure(d["per_device"]["total"] / 1e9, 31.41)
    assert d["per_device"]["partitioned"] == {"weights": False, "grads": False, "optimizer": True}


def test_memory_budget_stage_two_small_model_and_partition_flags(client):
    # SPEC §2: 1,000,000 params on 8 devices at stage 2 = 3,750,000 bytes.
    d = get(client, "memory-budget", params=1e8, devices=8, stage=2)
    assert d["per_device"]["total"] == 100 * 3_750_000
    assert d["per_device"]["partitioned"] == {"weights": False, "grads": True, "optimizer": True}


def test_memory_budget_curve_shows_stage1_floor_and_stage3_falling(client):
    psi = 7e10
    d = get(client, "memory-budget", params=psi, devices=64, stage=3)
    last = d["curve"][-1]
    assert last["devices"] == 1024
    stage1, stage3 = last["bytes_per_device"][1], last["bytes_per_device"][3]
    assert 4 * psi < stage1 < 4 * psi * 1.01  # 4Ψ + 12Ψ/N flattens at 4Ψ
    assert stage3 == 16 * psi / 1024
    # 70B at stage 3 fits 80 GB once 16Ψ/N ≤ 80e9: N ≥ 14; stages 0-2 never fit.
    assert d["fewest_devices_that_fit"] == math.ceil(16 * psi / 80e9)
    assert get(client, "memory-budget", params=psi, devices=64, stage=2)[
        "fewest_devices_that_fit"] is None


@pytest.mark.parametrize("params", [{"params": 1e13}, {"params": 1e7}, {"stage": 4},
                                    {"devices": 0}, {"devices": 2048}])
def test_memory_budget_rejects_out_of_range(client, params):
    one_line_error(client, "memory-budget", 422, **params)


# ---------------------------------------------------------------------- ring all-reduce
def test_ring_matches_spec_example_and_byte_count(client):
    d = get(client, "ring", devices=4)
    assert d["initial"][1] == [10, 20, 30, 40]
    assert d["column_sums"] == [1111, 2222, 3333, 4444]  # SPEC §8
    assert len(d["steps"]) == 2 * (4 - 1)
    final = d["steps"][-1]
    assert all(row == [1111, 2222, 3333, 4444] for row in final["rows"])
    # SPEC §5: 2(N-1)/N · M bytes per rank (4000 B on 4 ranks sends 6000 B).
    m = d["message_bytes"]
    assert m == 4 * 8 and d["expected_bytes_per_device"] == 2 * 3 / 4 * m
    assert final["bytes_sent"] == [2 * 3 / 4 * m] * 4


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_reduce_scatter_finishes_one_chunk_per_device(client, n):
    d = get(client, "ring", devices=n)
    sums = [sum(row[c] for row in d["initial"]) for c in range(n)]
    assert d["column_sums"] == sums
    after_rs = d["steps"][n - 2]
    assert after_rs["phase"] == "reduce-scatter" and d["steps"][n - 1]["phase"] == "all-gather"
    assert [sum(row) for row in after_rs["complete"]] == [1] * n
    finished = sorted(row.index(True) for row in after_rs["complete"])
    assert finished == list(range(n))  # each chunk finished on exactly one device
    for step in d["steps"]:
        assert sorted(r for r, _ in step["sends"]) == list(range(n))
        assert step["complete"] == [[v == s for v, s in zip(row, sums)] for row in step["rows"]]
    assert all(row == sums for row in d["steps"][-1]["rows"])


@pytest.mark.parametrize("n", [1, 9, "four"])
def test_ring_rejects_bad_device_counts(client, n):
    one_line_error(client, "ring", 422, devices=n)


def test_emulations_answer_503_without_torch(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    for path in ("ring", "tp-mlp", "ring-attention"):
        assert "needs torch" in one_line_error(client, path, 503)
    assert get(client, "bubble")["p"] == 4  # the analytic widgets do not need it


# ---------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_tp_mlp_equals_pytorch_single_device(client, devices):
    torch = pytest.importorskip("torch")
    d = get(client, "tp-mlp", devices=devices, seed=3)
    weights = {w["name"]: torch.tensor(w["values"], dtype=torch.float64) for w in d["weights"]}
    A = torch.cat([weights[f"A{i + 1}"] for i in range(devices)], dim=1)  # column blocks
    B = torch.cat([weights[f"B{i + 1}"] for i in range(devices)], dim=0)  # row blocks
    X = torch.tensor(d["stages"][0]["tensors"][0]["values"], dtype=torch.float64)
    reference = torch.nn.functional.gelu(X @ A) @ B
    Z = torch.tensor(d["stages"][-1]["tensors"][0]["values"], dtype=torch.float64)
    assert torch.allclose(Z, reference, rtol=0, atol=1e-12)
    assert d["max_abs_diff"] < 1e-12
    # Shapes: X (3, 4); per device X·A_i and GeLU (3, 8/N); partials (3, 4); Z (3, 4).
    shapes = [[t["shape"] for t in stage["tensors"]] for stage in d["stages"]]
    assert shapes == [[[3, 4]], [[3, 8 // devices]] * devices, [[3, 8 // devices]] * devices,
                      [[3, 4]] * devices, [[3, 4]]]
    assert [s["communication"] for s in d["stages"]] == [None, None, None, None, "all-reduce"]
    assert d["operators"]["f"]["forward"] == "identity" and d["operators"]["g"]["backward"] == (
        "identity")


def test_tp_mlp_rejects_uneven_split(client):
    pytest.importorskip("torch")
    assert "cannot split 8 into 3" in one_line_error(client, "tp-mlp", 400, devices=3)
    one_line_error(client, "tp-mlp", 422, devices=5)


# ------------------------------------------------------------------------------- bubble
def test_bubble_curve_is_the_closed_form_and_the_simulator_agrees(client):
    for t_b in (1, 2):
        d = get(client, "bubble", p=8, m=16, v=2, t_b=t_b)
        assert [pt["m"] for pt in d["curve"]] == list(range(1, 257))
        for pt in d["curve"]:
            assert pt["bubble"] == pytest.approx(7 / (pt["m"] + 7), rel=1e-12)
        for pt in d["curve_interleaved"]:
            assert pt["bubble"] == pytest.approx(7 / (2 * pt["m"] + 7), rel=1e-12)
        assert len(d["simulated"]) >= 10
        for pt in d["simulated"]:  # SPEC §6: unchanged when t_b ≠ t_f
            assert pt["bubble"] == pytest.approx(7 / (pt["m"] + 7), rel=1e-9)
    assert d["bubble"] == pytest.approx(7 / 23)  # SPEC §6: p=8, m=16 -> 7/23
    assert d["m_4p"] == 32 and d["bubble_at_4p"] == pytest.approx(7 / 39)


@pytest.mark.parametrize("params", [{"p": 1}, {"p": 33}, {"m": 0}, {"m": 257}, {"t_b": 5}])
def test_bubble_rejects_out_of_range(client, params):
    one_line_error(client, "bubble", 422, **params)


# ----------------------------------------------------------------------- pipeline grid
@pytest.mark.parametrize("schedule, peak", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_pipeline_grid_spec_figures(client, schedule, peak):
    # SPEC §6: p=4, m=8, unit slots: 64 actions, makespan 22, bubble 3/11.
    d = get(client, "pipeline", schedule=schedule, p=4, m=8)
    assert len(d["events"]) == 64 and d["makespan"] == 22
    assert d["bubble_fraction"] == pytest.approx(3 / 11) == d["closed_form_bubble"]
    assert d["peak_in_flight"] == peak
    assert {e["kind"] for e in d["events"]} == {"F", "B"}


def test_pipeline_grid_zb_h1_and_interleaved(client):
    # ZB-H1 with a whole backward of 2 split into B = W = 1 = t_f: makespan (3m + p - 1)·t
    # (generators.py, Qi et al. 2023).
    d = get(client, "pipeline", schedule="zb-h1", p=4, m=8, backward=2)
    assert (d["t_b"], d["t_w"]) == (2, 1) and d["makespan"] == 3 * 8 + 3
    assert {e["kind"] for e in d["events"]} == {"F", "B", "W"}
    # interleaved: per-stage times, a chunk's box is half a stage's (issue 31): makespan
    # m(t_f + t_b) + (p-1)(t_f + t_b)/v = 16 + 3
    d = get(client, "pipeline", schedule="interleaved", p=4, m=8, v=2)
    assert d["makespan"] == 19 and d["bubble_fraction"] == pytest.approx(3 / (2 * 8 + 3))
    assert {e["chunk"] for e in d["events"]} == {0, 1}
    assert {e["end"] - e["start"] for e in d["events"]} == {0.5}
    assert d["peak_in_flight"][0] == 4 + 3 / 2  # micro-batches: p + (p-1)/v


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_pipeline_grid_v_schedules_equal_the_schedule_api(client, schedule):
    # the Learn grid and /api/schedule (= `shardwise schedule --json`) give the same numbers
    d = get(client, "pipeline", schedule=schedule, p=4, m=8)
    out = client.post("/api/schedule", json={"stages": 4, "microbatches": 8,
                                             "schedule": schedule}).json()
    assert d["v"] == out["chunks"] == 2 and d["placement"] == out["placement"] == "v"
    assert d["makespan"] == out["makespan"] < 22  # below 1F1B's at the same work
    assert d["peak_in_flight"] == out["peak_in_flight"]
    assert d["closed_form_bubble"] == pytest.approx(d["bubble_fraction"])
    assert [(e["stage"], e["kind"], e["start"]) for e in d["events"]] == [
        (e["stage"], e["kind"], e["start"]) for e in out["timeline"]]


def test_pipeline_grid_bad_input(client):
    assert "m divisible by p" in one_line_error(client, "pipeline", 400, schedule="interleaved",
                                                p=4, m=6)
    one_line_error(client, "pipeline", 422, schedule="pipedream")
    one_line_error(client, "pipeline", 422, p=17)
    one_line_error(client, "pipeline", 422, m=65)


# ---------------------------------------------------------------------- ring attention
def test_ring_attention_causal_work_spec_figures(client):
    pytest.importorskip("torch")
    # SPEC §8: 8 devices × 16 tokens.
    d = get(client, "ring-attention", devices=8, tokens=16, causal=True, layout="contiguous")
    assert d["work"] == [136, 392, 648, 904, 1160, 1416, 1672, 1928]
    assert d["work"] == d["causal_block_work"]
    assert f"{d['imbalance']:.2f}" == "14.18"
    assert d["max_abs_diff"] < 1e-12  # against torch's scaled_dot_product_attention
    # The per-step schedule adds up to the emulated run's counts.
    assert [sum(step["pairs"][p] for step in d["steps"]) for p in range(8)] == d["work"]
    assert [sum(1 for step in d["steps"] if step["pairs"][p] == 0) for p in range(8)] == (
        d["blocks_skipped"])
    assert d["steps"][0]["holds"] == list(range(8))  # every device starts with its own block
    striped = get(client, "ring-attention", devices=8, tokens=16, layout="striped")
    assert striped["work"] == list(range(976, 1089, 16))
    assert f"{striped['imbalance']:.2f}" == "1.11"
    zigzag = get(client, "ring-attention", devices=8, tokens=16, layout="zigzag")
    s = 8 * 16
    for run in (d, striped, zigzag):
        assert sum(run["work"]) == s * (s + 1) // 2
    assert zigzag["imbalance"] < 1.2


def test_ring_attention_full_attention_is_balanced(client):
    pytest.importorskip("torch")
    d = get(client, "ring-attention", devices=4, tokens=8, causal=False, layout="striped")
    assert d["work"] == [8 * 32] * 4 and d["imbalance"] == 1 and d["causal_block_work"] is None
    assert d["blocks_skipped"] == [0] * 4 and d["max_abs_diff"] < 1e-12


def test_ring_attention_bad_input(client):
    pytest.importorskip("torch")
    assert "must be even" in one_line_error(client, "ring-attention", 400, tokens=5,
                                            layout="zigzag")
    one_line_error(client, "ring-attention", 422, devices=17)
    one_line_error(client, "ring-attention", 422, layout="diagonal")


# ------------------------------------------------------------------------- context wall
def _fits(model: str, layout: Layout, seq_len: int, budget: float) -> bool:
    peak = largest_stage_memory(PRESETS[model], layout, TrainSpec(seq_len=seq_len))
    return peak.total <= budget


def test_context_wall_is_the_longest_fitting_sequence(client):
    d = get(client, "context-wall", model="llama3-8b", budget_gb=80, cp=8, tp=8)
    layout = Layout(tp=8, cp=8, sp=True, recompute="selective")
    unit = sequence_unit(layout)
    assert d["max_seq_len"] % unit == 0
    assert _fits("llama3-8b", layout, d["max_seq_len"], 80e9)
    assert not _fits("llama3-8b", layout, d["max_seq_len"] + unit, 80e9)
    assert d["state_bytes"] + d["activation_bytes"] <= 80e9
    assert d["per_device_tokens"] * 8 == d["max_seq_len"]


def test_context_wall_grows_linearly_with_cp(client):
    d = get(client, "context-wall", model="llama3-8b", budget_gb=80, cp=1, tp=8, zero=0)
    curve = {pt["cp"]: pt["max_seq_len"] for pt in d["curve"]}
    assert list(curve) == [1, 2, 4, 8, 16, 32, 64]
    for cp, length in curve.items():  # state fixed, activations ∝ s/cp: s_max ∝ cp
        assert abs(length - cp * curve[1]) <= cp * sequence_unit(Layout(tp=8, cp=cp, sp=True))
    zero3 = {pt["cp"]: pt["max_seq_len"] for pt in get(
        client, "context-wall", model="llama3-8b", cp=1, tp=8, zero=3)["curve"]}
    assert zero3[64] > 64 * zero3[1]  # ZeRO also shards the state over the cp ranks


def test_context_wall_state_over_budget_and_bad_input(client):
    d = get(client, "context-wall", model="llama3-70b", budget_gb=80, cp=4, tp=1)
    assert d["max_seq_len"] == 0 and d["state_bytes"] > 80e9
    assert "unknown model" in one_line_error(client, "context-wall", 400, model="/etc/passwd")
    assert "tp=3 does not divide" in one_line_error(client, "context-wall", 400, tp=3)
    one_line_error(client, "context-wall", 422, cp=65)
    one_line_error(client, "context-wall", 422, recompute="some")


# ------------------------------------------------------------------- checkpoint interval
def test_checkpoint_interval_in_closed_form(client):
    """Llama 3's failure rate: M = 54·24 h / 419 at 16,384 GPUs, 7.8 interruptions a day;
    Young's √(2δM), Daly's refinement and Daly's wall time at it, worked out here."""
    d = get(client, "checkpoint-interval", gpus=16384, mtbf_gpu_hours=16384 * 54 * 24 / 419,
            stall_s=30, restart_min=10)
    m, delta, r = 54 * 24 * 3600 / 419, 30.0, 600.0
    assert d["job_mtbf_s"] == pytest.approx(m) and round(d["interruptions_per_day"], 1) == 7.8
    assert d["young_interval_s"] == pytest.approx(math.sqrt(2 * delta * m))
    x = delta / (2 * m)
    tau = math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9) - delta
    assert d["daly_interval_s"] == pytest.approx(tau)
    wall = (m / tau) * math.exp(r / m) * math.expm1((tau + delta) / m)
    assert d["daly_total"] == pytest.approx(wall - 1) and d["goodput"] == pytest.approx(1 / wall)
    # the curve: its parts add up, the stalls are δ/τ, and Daly's point is its minimum
    for i, tau_i in enumerate(d["interval_s"]):
        assert d["checkpoint"][i] == pytest.approx(delta / tau_i)
        assert d["checkpoint"][i] + d["restart"][i] + d["lost"][i] == pytest.approx(d["total"][i])
        assert d["total"][i] >= d["daly_total"] * (1 - 1e-9)
    # the restart lifts the curve but does not move the interval
    later = get(client, "checkpoint-interval", gpus=16384, mtbf_gpu_hours=16384 * 54 * 24 / 419,
                stall_s=30, restart_min=60)
    assert later["daly_interval_s"] == d["daly_interval_s"] and later["daly_total"] > d["daly_total"]


@pytest.mark.parametrize("params", [{"gpus": 0}, {"stall_s": 0}, {"restart_min": -1},
                                    {"mtbf_gpu_hours": 1}])
def test_checkpoint_interval_rejects_out_of_range(client, params):
    one_line_error(client, "checkpoint-interval", 422, **params)


# ----------------------------------------------------------------------- a run's timeline
def test_run_timeline_is_the_simulation_called_directly(client):
    """The endpoint returns what `goodput_sim.timeline` and `policies` compute for the same
    fleet, policy and seed (hosts failing too, so a failure's blast radius matters), and the
    run's events add up to its totals."""
    from shardwise.estimate.goodput_sim import (
        FailureClass,
        Fleet,
        policies,
        policy_options,
        timeline,
    )
    from shardwise.web.learn_timeline import Checkpointing

    d = get(client, "run-timeline", gpus=4096, mtbf_gpu_hours=20000, host_mtbf_hours=20000,
            days=3, write_s=90, copy_s=6, restart_min=15, straggler=1.1, policy="in-memory",
            seed=4)
    fleet = Fleet(4096, (FailureClass("gpu", 20000), FailureClass("host", 20000, gpus_each=8)))
    saving = Checkpointing(6, 90, 900)
    run = timeline(3 * 86400, fleet, policy_options(saving, 512)["in-memory"], seed=4,
                   straggler=1.1)
    assert d["wall_s"] == pytest.approx(run["wall_s"])
    assert d["interruptions"] == run["interruptions"] == len(d["failures"]) > 3
    assert d["goodput"] == pytest.approx(3 * 86400 / d["wall_s"])
    assert d["straggler_share"] == pytest.approx(1 - 1 / 1.1)
    assert {f["cls"] for f in d["failures"]} == {"gpu", "host"}
    assert sum(f["lost_s"] for f in d["failures"]) == pytest.approx(d["lost_s"])
    assert d["job_mtbf_s"] == pytest.approx(3600 / (4096 / 20000 + 512 / 20000))
    table = policies(saving, fleet, replica_gpus=512, work_s=3 * 86400, runs=200, seed=4,
                     straggler=1.1)
    for row in d["policies"]:
        assert row["mean"] == pytest.approx(table["policies"][row["name"]]
                                            ["goodput_vs_ideal"]["mean"])
    assert d["best"] == table["best"]


@pytest.mark.parametrize("params", [{"policy": "lazy"}, {"gpus": 4}, {"straggler": 0.5}])
def test_run_timeline_rejects_out_of_range(client, params):
    one_line_error(client, "run-timeline", 422, **params)
