"""`shardwise calibrate` through the real entry point, and `check`'s step-time row."""

import json
import os
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

from shardwise.arch import get_model
from shardwise.calibration import load_calibration
from shardwise.calibration.fit import matmul_seconds, relative_residuals
from shardwise.estimate.comm import ring_bytes_on_wire, ring_steps
from shardwise.estimate.compute import _OPS_LAYER
from shardwise.estimate.machine import predict_step
from shardwise.layout import Layout
from shardwise.runtime.calibrate import REFERENCE_STEP, Plan, _dispatch, _group_seconds
from shardwise.runtime.launch import spawn
from shardwise.runtime.measure import (
    CALL_ROW,
    EXPERT_LOAD_ROWS,
    IN_STEP_ROW,
    REFERENCE_ROW,
    REPORTED,
    WAITED_ROW,
    CheckRow,
)
from shardwise.runtime.mesh import AxisGroup
from shardwise.runtime.step_time import (
    COMPONENTS,
    HOST_RETIMED,
    OUTSIDE,
    RETIMED,
    with_prediction,
)
from shardwise.runtime.train import TrainConfig

MACHINE = {"name": "this-machine", "backend": "gloo", "dtype": "fp32", "cores": 2,
           "memory_bytes": 16e9, "peak_flops": 2e11, "memory_bandwidth": 2e10,
           "link": {"name": "gloo", "bandwidth": 1e9, "latency": 3e-4}}


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": {"kernel_overhead": 2e-4, "matmul_efficiency": 1.0,
                                            "attention_efficiency": 0.3},
                                "machine": MACHINE}))
    return str(path)


@pytest.mark.slow
def test_a_non_physical_fit_is_measured_once_more(monkeypatch):
    # on a loaded machine a small copy can time slower than a large one: the first
    # measurement's copy times are reversed, so its fit has bandwidth ≤ 0
    from shardwise.runtime.calibrate import run

    measured, said, real = [], [], run._measure

    def measure(plan, progress):
        raw = real(plan, progress)
        if not measured:
            times = [t for _, t in raw["copy"]][::-1]
            raw["copy"] = [[b, t] for (b, _), t in zip(raw["copy"], times, strict=True)]
        measured.append(raw)
        return raw

    monkeypatch.setattr(run, "_measure", measure)
    data = run.calibrate(Plan(quick=True), progress=said.append)
    assert len(measured) == 2
    assert any(m.startswith("copy α-β fit: time does not grow with size") and
               m.endswith("measuring once more") for m in said)
    copy = data["measurements"]["copy"]
    assert copy[next(k for k in copy if k.startswith("points"))] == measured[1]["copy"]


@pytest.mark.slow
def test_calibrate_quick_writes_a_file_the_planner_takes(tmp_path):
    out = tmp_path / "me.json"
    data = shardwise_json("calibrate", "--quick", "--out", str(out))
    assert json.loads(out.read_text())["machine"] == data["machine"]
    cal = load_calibration("this-machine", out)  # the existing format, validated
    machine, meas = data["machine"], data["measurements"]
    assert machine["cores"] == len(os.sched_getaffinity(0))
    assert cal.matmul_half_dim == meas["matmul"]["fit"]["half_dim"]
    # the stored residuals are the fitted curve's against the raw points
    m, k, n, t = (np.array(c, dtype=float) for c in zip(*meas["matmul"]["points [M, K, N, s]"]))
    fit = meas["matmul"]["fit"]
    fitted = meas["matmul"]["launch_s"] + matmul_seconds(m, k, n, fit["peak_flops"],
                                                         fit["half_dim"])
    assert np.allclose(relative_residuals(t, fitted), fit["residuals"], atol=1e-9)
    assert machine["peak_flops"] == fit["peak_flops"]
    points = meas["collectives"]["points [op, ranks, bytes, s]"]
    assert {p[0] for p in points} == {"all-reduce", "reduce-scatter", "all-gather",
                                      "all-to-all", "p2p"}
    link, cores = machine["link"], machine["cores"]
    model = [max(1, g / cores) * (  # a group of more ranks than cores is time-sliced
        (1 if op == "p2p" else ring_steps(op, g)) * link["latency"]
        + (size if op == "p2p" else ring_bytes_on_wire(op, size, g)) / link["bandwidth"])
        for op, g, size, _ in points]
    assert np.allclose(relative_residuals([p[3] for p in points], model),
                       meas["collectives"]["fit"]["residuals"], atol=1e-9)
    # the per-op host cost is fitted on the one-rank steps (relative least squares, the
    # probe block's figure kept beside it); the stored prediction is the step model's on the
    # file's own preset
    host = meas["host_ops"]
    assert cal.kernel_overhead == host["fitted on the one-rank steps: seconds per aten op"] > 0
    assert host["probe: seconds per aten op"] > 0
    # the probe block dispatches a dense layer's ops (as counted for the model, recounted by
    # test_host_ops.py) plus its own input and `.sum()` loss: a handful more
    assert _OPS_LAYER <= host["aten ops of the probe block (forward + backward)"] <= _OPS_LAYER + 24
    steps = meas["steps"]
    for (seq, mbs, _), predicted in zip(steps["points [seq, micro_batch, s]"],
                                        steps["predicted_s"], strict=True):
        layout = Layout(micro_batch=int(mbs))
        train = TrainConfig(get_model("tiny"), layout, seq_len=int(seq)).train_spec()
        assert predicted == pytest.approx(
            predict_step(get_model("tiny"), layout, train, out).total, rel=1e-12)
    # …and the fitted cost is the least-squares one: the normal equation Σ n_i·r_i/t_i = 0
    # (r: relative residual, n_i: the ops the model charges, ∝ the step's k-dependent part)
    measured = [p[2] for p in steps["points [seq, micro_batch, s]"]]
    k = cal.kernel_overhead

    def predicted_at(scale: float) -> list[float]:
        other = out.with_name("k.json")
        data = json.loads(out.read_text())
        data["default"]["kernel_overhead"] = k * scale
        other.write_text(json.dumps(data))
        return [predict_step(get_model("tiny"), Layout(micro_batch=int(mbs)),
                             TrainConfig(get_model("tiny"), Layout(micro_batch=int(mbs)),
                                         seq_len=int(seq)).train_spec(), other).total
                for seq, mbs, _ in steps["points [seq, micro_batch, s]"]]

    at_k, at_0 = predicted_at(1.0), predicted_at(0.0)
    assert at_k == pytest.approx(steps["predicted_s"], rel=1e-12)
    ops = [(a - b) / k for a, b in zip(at_k, at_0, strict=True)]
    residuals = [(t - a) / t for t, a in zip(measured, at_k, strict=True)]
    assert abs(sum(n * r / t for n, r, t in zip(ops, residuals, measured, strict=True))) < (
        1e-6 * sum(n / t for n, t in zip(ops, measured, strict=True)))
    # the same step alone, then with a rank on every core kept in step (--quick: one round,
    # s = 64 and micro-batch 1 alone): one point each, so each refitted per-op cost makes
    # the model's one-rank step equal its point — k = (t − a)/n, the step linear in k
    synced = meas["synced_steps"]
    (((seq, mbs, alone),), ((_, _, kept),)), = synced[
        "rounds: points [seq, micro_batch, s] alone, then kept in step (s outside the "
        "all-reduces)"]
    one = Layout(micro_batch=int(mbs))
    one_train = TrainConfig(get_model("tiny"), one, seq_len=int(seq)).train_spec()
    a, b = (predict_step(get_model("tiny"), one, one_train, out, kernel_overhead=x).total
            for x in (0.0, 1e-5))
    fitted = [(t - a) / ((b - a) / 1e-5) for t in (alone, kept)]
    assert synced["factor per round (fitted per-op cost kept in step ÷ alone)"] == (
        [pytest.approx(fitted[1] / fitted[0], rel=1e-9)])
    assert machine["synced_host_factor"] == pytest.approx(fitted[1] / fitted[0], rel=1e-9)
    assert set(meas["collectives"]["per_group_size"]) == {"2"}  # --quick: groups of 2
    plan = shardwise_json("plan", "tiny", "--gpus", "2", "--gpu", "this-machine",
                          "--calibration", str(out), "--seq", "64", "--global-batch", "8",
                          "--dtype", "fp32", "--top", "1")
    assert plan["cluster"]["accelerator"] == "this-machine"


@pytest.mark.slow
def test_check_json_has_the_step_time_row_from_the_file_it_names(calibration):
    result = shardwise_json("check", "--tp", "2", "--calibration", calibration)
    assert result["calibration"] == calibration
    rows = {r["what"]: r for r in result["rows"] if r["item"] == "step time"}
    step = rows["step (s)"]
    train = TrainConfig(get_model("tiny"), Layout(tp=2)).train_spec()
    expected = predict_step(get_model("tiny"), Layout(tp=2), train, calibration)
    assert step["predicted"] == pytest.approx(expected.total, rel=1e-12)
    assert step["measured"] > 0 and calibration in step["note"]
    assert rows["tp comm (s)"]["predicted"] == pytest.approx(expected.tp_comm, rel=1e-12)
    assert rows["fastest step (s)"]["predicted"] == step["predicted"]
    assert 0 < rows["fastest step (s)"]["measured"] <= step["measured"]
    parts = sum(r["predicted"] for what, r in rows.items()
                if what.removesuffix(" (s)") in COMPONENTS.values())
    assert parts == pytest.approx(expected.total, rel=1e-9)  # the components sum to it
    # the median step's time blocked in tp's and the world's collectives, and the rest
    waited = {what: r["measured"] for what, r in rows.items() if what.startswith(WAITED_ROW)}
    assert set(waited) == {f"{WAITED_ROW}tp (s)", f"{WAITED_ROW}world (s)"}
    assert 0 < waited[f"{WAITED_ROW}tp (s)"] < step["measured"]
    assert rows[f"{WAITED_ROW}tp (s)"]["predicted"] == pytest.approx(expected.tp_comm)
    assert rows[OUTSIDE]["measured"] == pytest.approx(step["measured"] - sum(waited.values()))
    # tp's collectives and the world's (the loss and grad-norm all-reduces), timed on the
    # layout's own groups after its steps…
    calls = {what.removeprefix(CALL_ROW).removesuffix(" (s)"): r["measured"]
             for what, r in rows.items() if what.startswith(CALL_ROW)}
    assert set(calls) == {"all-reduce/2", "reduce-scatter/2", "all-gather/2"}
    assert all(v > 0 for v in calls.values())
    # …and `calibrate`'s one-rank step (tiny, s = 64, micro-batch 1), timed between its steps
    reference = rows[REFERENCE_ROW]["measured"]
    assert reference > 0
    # one point: the refitted per-op cost makes the model's one-rank step equal it exactly;
    # the step is linear in the cost, t = a + k·n, so k = (t − a) / n from two predictions
    one = Layout(micro_batch=1)
    one_train = TrainConfig(get_model("tiny"), one, seq_len=64).train_spec()
    assert rows[REFERENCE_ROW]["predicted"] == pytest.approx(  # the file's figure for it
        predict_step(get_model("tiny"), one, one_train, calibration).total, rel=1e-12)
    at = [predict_step(get_model("tiny"), one, one_train, calibration, kernel_overhead=k).total
          for k in (0.0, 1e-4)]
    def per_op(seconds: float) -> float:
        return (seconds - at[0]) / ((at[1] - at[0]) / 1e-4)

    k = per_op(reference)
    # the same step on both ranks at once: synced_host_factor now, its per-op cost ÷ alone
    # (a rank per core: the test machine has 2, as the calibration file says)
    factor = per_op(rows[IN_STEP_ROW]["measured"]) / k
    assert rows[IN_STEP_ROW]["measured"] > 0 and f"synced_host_factor {factor:.2f}" in rows[
        HOST_RETIMED]["note"]
    host = predict_step(get_model("tiny"), Layout(tp=2), train, calibration, kernel_overhead=k,
                        synced_host_factor=factor)
    assert rows[HOST_RETIMED]["predicted"] == pytest.approx(host.total, rel=1e-9)
    assert host.compute != expected.compute and host.tp_comm == expected.tp_comm
    retimed = predict_step(get_model("tiny"), Layout(tp=2), train, calibration, per_call=calls,
                           kernel_overhead=k, synced_host_factor=factor)
    assert rows[RETIMED]["predicted"] == pytest.approx(retimed.total, rel=1e-9)
    assert rows[RETIMED]["measured"] == rows[HOST_RETIMED]["measured"] == step["measured"]
    assert retimed.tp_comm != expected.tp_comm  # it moves with the calls' costs too


def _reference_beside_a_layout(steps: int) -> tuple[list[float], list[float], float, bool]:
    from shardwise.runtime.measure import _Reference
    from shardwise.runtime.mesh import Mesh, current_mesh

    layout_mesh = Mesh.from_layout(Layout(dp=2))
    reference = _Reference("fp32")
    for _ in range(steps):
        reference.step()
    losses = [r.loss for r in reference.state.records]
    alone, in_step = reference.seconds()
    return losses, alone, in_step, current_mesh() is layout_mesh


def _one_rank_losses(steps: int) -> list[float]:
    from shardwise.runtime.calibrate import REFERENCE_STEP, one_rank_state
    from shardwise.runtime.train import train_step

    state = one_rank_state("fp32", *REFERENCE_STEP)
    return [train_step(state).loss for _ in range(steps)]


@pytest.mark.slow
def test_the_reference_step_beside_a_layout_is_calibrates_one_rank_step():
    # `check` times `calibrate`'s one-rank step between a layout's steps, the ranks taking
    # turns while the others wait at a barrier: each must train as one rank alone does (a
    # process of its own), reach no other rank (its world is itself: an all-reduce of the
    # loss or norm would go unanswered) and leave the layout's mesh current; the first step
    # is not timed; every rank gets every turn's time
    ranks = spawn(_reference_beside_a_layout, 2, 3, timeout_s=120)
    alone, = spawn(_one_rank_losses, 1, 3, timeout_s=120)
    (first, times, in_step, restored), (second, same, in_step_too, _) = ranks
    assert first == alone and second == alone[:2]  # untimed + turns 0, 2 / untimed + turn 1
    assert restored and times == same and len(times) == 3 and all(t > 0 for t in times)
    assert in_step == in_step_too > 0  # then both at once: the ranks' mean


def test_without_a_file_the_row_says_the_built_in_constants_cannot_predict_a_cpu():
    measured = CheckRow("step time", "step (s)", None, 0.25, REPORTED, "median of 3 steps")
    config = TrainConfig(get_model("tiny"), Layout(dp=2))
    rows = with_prediction([measured], config, None)
    assert len(rows) == 1 and rows[0].predicted is None and rows[0].measured == 0.25
    assert "built-in" in rows[0].note and "shardwise calibrate" in rows[0].note


def test_components_follow_the_total(calibration):
    """Plumbing: `check`'s predicted step row is `predict_step`'s total and its component
    rows are named from `COMPONENTS` (no formula is at stake here: `predict_step`'s terms
    are checked by tests/estimate's closed forms and, against a run, by `calibrate`'s fit)."""
    measured = CheckRow("step time", "step (s)", None, 0.25, REPORTED, "median of 3 steps")
    config = TrainConfig(get_model("tiny"), Layout(pp=2))
    rows = with_prediction([measured], config, calibration)
    expected = predict_step(config.model, config.layout, config.train_spec(), calibration)
    assert rows[0].predicted == expected.total
    labels = [r.what for r in rows[1:]]
    assert "bubble (s)" in labels and "pp p2p (s)" in labels
    assert set(labels) <= {f"{label} (s)" for label in COMPONENTS.values()}


def test_time_in_collectives_is_set_against_the_components_that_charge_it(calibration):
    # the runtime's per-axis clock (the median step's) against the model's terms for that axis:
    # pp's waits are its p2p and its bubble alike; the rest of the step against compute +
    # optimizer; the world's scalar all-reduces are reported only
    config = TrainConfig(get_model("tiny"), Layout(pp=2))
    waited = {"pp": 0.04, "world": 0.002}
    rows = [CheckRow("step time", "step (s)", None, 0.25, REPORTED, "median of 3 steps"),
            *(CheckRow("step time", f"{WAITED_ROW}{axis} (s)", None, s, REPORTED, "clock")
              for axis, s in waited.items())]
    by = {r.what: r for r in with_prediction(rows, config, calibration)}
    step = predict_step(config.model, config.layout, config.train_spec(), calibration)
    pp = by[f"{WAITED_ROW}pp (s)"]
    assert (pp.predicted, pp.measured) == (step.pp_comm + step.bubble, 0.04)
    world = by[f"{WAITED_ROW}world (s)"]
    assert (world.predicted, world.measured) == (None, 0.002)
    rest = by[OUTSIDE]
    assert rest.predicted == step.compute + step.optimizer
    assert rest.measured == pytest.approx(0.25 - 0.04 - 0.002)
    # without a calibration file the clock's rows are kept, measured only
    kept = with_prediction(rows, config, None)
    assert [r.what for r in kept if r.what.startswith(WAITED_ROW)] == [r.what for r in rows[1:]]


def test_the_reference_row_says_how_far_the_machine_drifted_from_the_file(calibration):
    # the reference step against the file's own prediction for it; off by more than the
    # target, the row says the file is stale
    config = TrainConfig(get_model("tiny"), Layout(dp=2))
    one = Layout(micro_batch=REFERENCE_STEP[1])
    file_s = predict_step(get_model("tiny"), one, TrainConfig(
        get_model("tiny"), one, seq_len=REFERENCE_STEP[0]).train_spec(), calibration).total
    step = CheckRow("step time", "step (s)", None, 0.25, REPORTED, "median of 3 steps")
    for ratio, stale in ((1.1, False), (0.7, True), (1.3, True)):
        ref = CheckRow("step time", REFERENCE_ROW, None, ratio * file_s, REPORTED, "turns")
        row, = (r for r in with_prediction([step, ref], config, calibration)
                if r.what == REFERENCE_ROW)
        assert row.predicted == file_s and row.error == pytest.approx(ratio - 1)
        assert f"{ratio:.2f}×" in row.note and ("calibrate` again" in row.note) == stale


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(dp=2, tp=2, pp=2)])
def test_the_host_retimed_row_charges_the_per_op_cost_of_every_rank_busy(calibration, layout):
    # the one-rank step alone and on every rank at once, timed beside the run: the re-timed
    # row charges each op what it cost with every rank busy — the refitted alone cost × the
    # factor now ÷ the share of a core the model gives each rank (2 cores in the file: 1 for
    # 2 ranks, 1/4 for 8, whose every rank was busy in that step) is that cost itself
    config = TrainConfig(get_model("tiny"), layout)
    one = Layout(micro_batch=REFERENCE_STEP[1])
    one_train = TrainConfig(get_model("tiny"), one, seq_len=REFERENCE_STEP[0]).train_spec()
    at = [predict_step(get_model("tiny"), one, one_train, calibration, kernel_overhead=k).total
          for k in (0.0, 1e-4)]

    def per_op(seconds: float) -> float:  # the step is linear in the per-op cost
        return (seconds - at[0]) / ((at[1] - at[0]) / 1e-4)

    alone, busy = 0.06, 0.09 * layout.world_size / 2
    rows = with_prediction([CheckRow("step time", "step (s)", None, 0.25, REPORTED, "median"),
                            CheckRow("step time", REFERENCE_ROW, None, alone, REPORTED, ""),
                            CheckRow("step time", IN_STEP_ROW, None, busy, REPORTED, "")],
                           config, calibration)
    row, = (r for r in rows if r.what == HOST_RETIMED)
    share = min(1.0, MACHINE["cores"] / layout.world_size)
    charged = predict_step(config.model, layout, config.train_spec(), calibration,
                           kernel_overhead=per_op(busy) * share, synced_host_factor=1.0)
    assert row.predicted == pytest.approx(charged.total, rel=1e-9)
    assert f"synced_host_factor {per_op(busy) / per_op(alone) * share:.2f}" in row.note


def test_an_moe_step_is_predicted_at_the_routing_the_run_drew(calibration):
    # the routing rows `check` measured (the busiest ep rank: twice the balanced rows, half
    # its experts running) go into every prediction; balanced routing is what the planner
    # assumes
    config = TrainConfig(get_model("tiny-moe"), Layout(dp=2, ep=2))
    drawn = {"expert_load": 2.0, "experts_active": 0.5}
    rows = with_prediction([CheckRow("step time", "step (s)", None, 0.25, REPORTED, "median"),
                            *(CheckRow("step time", EXPERT_LOAD_ROWS[name], 1.0, value,
                                       REPORTED, "") for name, value in drawn.items())],
                           config, calibration)
    expected = predict_step(config.model, config.layout,
                            replace(config.train_spec(), **drawn), calibration)
    balanced = predict_step(config.model, config.layout, config.train_spec(), calibration)
    assert rows[0].predicted == expected.total != balanced.total
    assert "routing the checked steps drew" in rows[0].note
    assert {r.what: r.measured for r in rows if r.what in EXPERT_LOAD_ROWS.values()} == {
        EXPERT_LOAD_ROWS[name]: value for name, value in drawn.items()}


def _dispatched(rows: int) -> tuple[list[float], list[float]]:
    """Through the MoE dispatch `check` times, each rank's rows numbered by global position
    (rank r's row i is r·rows + i, h = 3): (what this rank received, what it should: from
    each rank in turn, that rank's rows of this rank's share)."""
    g = AxisGroup.world()
    x = (torch.arange(rows, dtype=torch.float32) + g.rank * rows)[:, None].repeat(1, 3)
    call, out = _dispatch(x, g)
    call()
    share = rows // g.size
    lo, hi = g.rank * share, rows if g.rank == g.size - 1 else (g.rank + 1) * share
    expected = [float(s * rows + i) for s in range(g.size) for i in range(lo, hi)]
    return out[:, 0].tolist(), expected


@pytest.mark.slow
@pytest.mark.parametrize("ranks, rows", [(2, 128), (3, 10)])
def test_the_timed_dispatch_moves_each_ranks_share_of_the_rows(ranks, rows):
    for received, expected in spawn(_dispatched, ranks, rows, timeout_s=60):
        assert received == expected


def test_check_with_a_bad_calibration_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = shardwise("check", "--calibration", str(bad), check=False)
    assert result.returncode == 2 and "no machine section" in result.stderr
    assert "Traceback" not in result.stderr


def test_calibrate_bad_input_is_one_line(tmp_path):
    assert_one_line_error(shardwise("calibrate", "--ranks", "1", check=False), "--ranks")
    if torch.cuda.device_count() < 2:
        assert_one_line_error(shardwise("calibrate", "--backend", "nccl", "--out",
                                        str(tmp_path / "x.json"), check=False),
                              "--backend nccl needs 2 GPUs")


def _burn(cpu_s: float) -> None:
    """Spin until this process has used `cpu_s` more CPU seconds."""
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass


def _charged(kind: str, active_per_core: int) -> tuple[float, int]:
    """`_group_seconds` of a call that sleeps or burns 20 ms, with `active_per_core` ranks per
    core said to run at once (one rank here: the branch is chosen by the count, not measured)."""
    cores = len(os.sched_getaffinity(0))
    call = (lambda: time.sleep(0.02)) if kind == "sleep" else (lambda: _burn(0.02))
    group = torch.distributed.group.WORLD
    return _group_seconds(call, group, torch.device("cpu"), 5, active_per_core * cores), cores


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.parametrize("kind, active_per_core, low, high", [
    ("sleep", 1, 0.02, 1.0),    # a core per rank: the wall time, waits included
    ("sleep", 4, 0.0, 0.01),    # time-sliced: a rank asleep burns no CPU, its core runs others
    ("burn", 4, 0.06, 0.1),     # time-sliced: its CPU time × ranks/cores = 20 ms × 4
])
def test_a_call_is_charged_wall_time_with_a_core_per_rank_else_cpu_time_times_ranks_per_core(
        kind, active_per_core, low, high):
    (seconds, cores), = spawn(_charged, 1, kind, active_per_core, timeout_s=60)
    assert low <= seconds <= high, (seconds, cores)
