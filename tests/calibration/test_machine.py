"""The "this machine" preset: a cluster built from a calibration file's machine section."""

import json
from dataclasses import replace

import pytest

from shardwise.arch import get_model
from shardwise.calibration import load_calibration
from shardwise.calibration.machine import machine_cluster
from shardwise.errors import ShardwiseError
from shardwise.estimate.machine import predict_step
from shardwise.estimate.step import Links, estimate_step, group_collective_time
from shardwise.hardware import Accelerator, Cluster, Link
from shardwise.layout import Layout, TrainSpec
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

MACHINE = {"name": "this-machine", "backend": "gloo", "dtype": "fp32", "cores": 2,
           "memory_bytes": 16e9, "peak_flops": 5e10, "memory_bandwidth": 2e10,
           "link": {"name": "gloo", "bandwidth": 1e9, "latency": 3e-4}}
CONSTANTS = {"matmul_efficiency": 1.0, "matmul_half_dim": 30.0, "attention_efficiency": 0.1,
             "hbm_efficiency": 0.5, "kernel_overhead": 2e-4}


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": MACHINE,
                                "measurements": {"anything": [1, 2]}}))
    return str(path)


def test_constants_load_with_the_machine_and_measurement_sections(calibration):
    cal = load_calibration("this-machine", calibration)
    assert cal.matmul_half_dim == 30.0 and cal.kernel_overhead == 2e-4
    assert cal.dp_bucket_bytes == 80e6  # not in the file: the built-in value


@pytest.mark.parametrize("ranks, share", [(1, 1.0), (2, 1.0), (4, 0.5), (8, 0.25)])
def test_ranks_share_the_cores(calibration, ranks, share):
    cluster, cal = machine_cluster(ranks, calibration)
    assert (cluster.nodes, cluster.gpus_per_node) == (1, ranks)
    acc = cluster.accelerator
    assert acc.peak_flops("fp32") == 5e10 * share
    assert acc.hbm_bandwidth == 2e10 * share
    assert acc.memory_bytes == 16e9 / ranks
    assert cal.kernel_overhead == pytest.approx(2e-4 / share)
    assert cal.op_count == "runtime"
    assert cal.link(cluster.intra) == Link("gloo", 1e9 * share, 3e-4 / share)


def test_predicted_step_is_the_step_model_on_the_files_figures(calibration):
    model, layout = get_model("tiny"), Layout(tp=2, dp=2)
    train = TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    # by hand: 4 ranks on 2 cores, each at half a core
    acc = Accelerator("this-machine", 4e9, 1e10, 2.5e10, None, 2.5e10)
    link = Link("gloo", 5e8, 6e-4)
    cal = replace(load_calibration("this-machine", calibration), kernel_overhead=4e-4,
                  op_count="runtime")  # the preset runs shardwise's runtime: its aten ops
    expected = estimate_step(model, Cluster(1, 4, acc, link, link), layout, train, cal)
    assert predict_step(model, layout, train, calibration).total == pytest.approx(
        expected.total, rel=1e-12)


def test_constants_under_the_machines_own_accelerator_section_count(calibration, tmp_path):
    """`load_calibration`'s file shape with the constants under accelerators.this-machine
    (not "default") predicts the same step: the machine's section is read."""
    model, layout = get_model("tiny"), Layout(tp=2, dp=2)
    train = TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"accelerators": {"this-machine": CONSTANTS},
                               "machine": MACHINE}))
    assert predict_step(model, layout, train, str(own)).total == pytest.approx(
        predict_step(model, layout, train, calibration).total, rel=1e-12)


def test_a_run_in_another_dtype_is_refused(calibration):
    with pytest.raises(ShardwiseError, match="measured in fp32"):
        predict_step(get_model("tiny"), Layout(), TrainSpec(seq_len=64, global_batch=8,
                                                            dtype="fp64"), calibration)


def test_plan_for_this_machine(calibration):
    result = shardwise_json("plan", "tiny", "--gpus", "4", "--gpu", "this-machine",
                            "--calibration", calibration, "--seq", "64", "--global-batch",
                            "8", "--dtype", "fp32", "--top", "2")
    assert result["cluster"] == {"gpus": 4, "gpus_per_node": 4, "accelerator": "this-machine",
                                 "intra": "gloo", "inter": "gloo"}
    best = result["ranked"][0]
    train = TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    expected = predict_step(get_model("tiny"), Layout(**best["layout"]), train, calibration)
    assert best["estimate"]["total"] == pytest.approx(expected.total, rel=1e-9)


def test_memory_and_comm_take_the_file(calibration):
    memory = shardwise_json("memory", "tiny", "--gpus", "2", "--gpu", "this-machine",
                            "--calibration", calibration, "--seq", "64", "--dtype", "fp32")
    assert memory["budget_bytes"] == pytest.approx(16e9 / 2 * 0.85)
    comm = shardwise_json("comm", "--op", "all-reduce", "--size", "1MB", "--ranks", "2",
                          "--link", "this-machine", "--calibration", calibration)
    # ring all-reduce on 2 ranks: 2 rounds of α, 2·(1/2)·1e6 bytes at β
    assert comm["seconds"] == pytest.approx(2 * 3e-4 + 1e6 / 1e9, rel=1e-12)


def test_this_machine_without_a_file_is_one_line(tmp_path):
    result = shardwise("plan", "tiny", "--gpus", "2", "--gpu", "this-machine", check=False)
    assert_one_line_error(result, "--calibration")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"default": CONSTANTS}))
    result = shardwise("plan", "tiny", "--gpus", "2", "--gpu", "this-machine",
                       "--calibration", str(bare), check=False)
    assert_one_line_error(result, "no machine section", "shardwise calibrate")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"machine": MACHINE | {"peak_flops": -1}}))
    result = shardwise("plan", "tiny", "--gpus", "2", "--gpu", "this-machine",
                       "--calibration", str(broken), check=False)
    assert_one_line_error(result, "peak_flops must be a finite number > 0")


def test_per_call_costs_replace_the_ring_latencies(tmp_path):
    # the file's per-call cost of an all-reduce on 2 ranks; 2 ranks on 2 cores: share 1
    machine = MACHINE | {"link": MACHINE["link"] | {"per_call": {"all-reduce/2": 2e-3}}}
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": machine}))
    cluster, cal = machine_cluster(2, str(path))
    assert cal.collective_call == {"all-reduce/2": 2e-3}
    links = Links.of(cluster, cal)
    size = 4e6
    # closed form: α_call + ring all-reduce bytes on the wire 2·(n-1)/n·S over β
    assert group_collective_time("all-reduce", size, 2, 2, links) == pytest.approx(
        2e-3 + size / 1e9, rel=1e-12)
    # a collective the file has no cost for keeps rounds·α + bytes/β (1 round, (n-1)/n·S)
    assert group_collective_time("all-gather", size, 2, 2, links) == pytest.approx(
        3e-4 + size / 2 / 1e9, rel=1e-12)
    # the step model: dp2's one gradient bucket pays α_call instead of its 2 rounds' α
    model, train = get_model("tiny"), TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    with_call = estimate_step(model, cluster, Layout(dp=2), train, cal)
    without = estimate_step(model, cluster, Layout(dp=2), train, replace(cal, collective_call={}))
    assert with_call.dp_comm_total - without.dp_comm_total == pytest.approx(2e-3 - 2 * 3e-4,
                                                                            rel=1e-9)


def test_per_call_costs_scale_with_the_core_share(tmp_path):
    machine = MACHINE | {"link": MACHINE["link"] | {"per_call": {"all-reduce/4": 1e-3}}}
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": machine}))
    _, cal = machine_cluster(4, str(path))  # 4 ranks on 2 cores: half a core each
    assert cal.collective_call == {"all-reduce/4": pytest.approx(2e-3)}


@pytest.mark.parametrize("ranks, share", [(1, 1.0), (2, 1.0), (8, 0.25)])
def test_layouts_of_several_ranks_pay_the_per_op_cost_of_ranks_kept_in_step(tmp_path, ranks,
                                                                            share):
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS,
                                "machine": MACHINE | {"synced_host_factor": 1.25}}))
    _, cal = machine_cluster(ranks, str(path))
    factor = 1.25 if ranks > 1 else 1.0  # one rank runs alone: the file's own figure
    assert cal.kernel_overhead == pytest.approx(2e-4 * factor / share)
    # a measured figure in place of the file's (what `check` re-times) keeps the factor
    model, layout = get_model("tiny"), Layout(dp=ranks)
    train = TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    at = [predict_step(model, layout, train, str(path), kernel_overhead=k).compute
          for k in (0.0, 1e-4, 2e-4)]
    assert at[2] - at[1] == pytest.approx(at[1] - at[0], rel=1e-9)  # linear in the figure
    assert predict_step(model, layout, train, str(path)).compute == pytest.approx(at[2])


@pytest.mark.parametrize("factor", [0, -1, "x"])
def test_a_bad_synced_host_factor_is_one_line(tmp_path, factor):
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS,
                                "machine": MACHINE | {"synced_host_factor": factor}}))
    with pytest.raises(ShardwiseError, match="synced_host_factor"):
        machine_cluster(2, str(path))


def test_a_bad_per_call_section_is_one_line(tmp_path):
    machine = MACHINE | {"link": MACHINE["link"] | {"per_call": [1, 2]}}
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": machine}))
    with pytest.raises(ShardwiseError, match="per_call"):
        machine_cluster(2, str(path))


@pytest.mark.parametrize("pp, tensors", [(1, 39), (2, 2 * 9 + 2)])
def test_the_optimizer_pays_the_host_cost_of_each_parameter_tensor(calibration, pp, tensors):
    # reference count: the runtime's own tiny model has 39 parameter tensors (4 layers × 9,
    # embedding, final norm, head); a pp2 last stage holds 2 layers, the norm and the head
    from shardwise.runtime.model import Transformer

    model = get_model("tiny")
    assert len(list(Transformer(model).parameters())) == 39
    train = TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    cluster, cal = machine_cluster(pp, calibration)
    layout = Layout(pp=pp)
    with_ops = estimate_step(model, cluster, layout, train, cal)
    fused = estimate_step(model, cluster, layout, train, replace(cal, op_count="fused"))
    # 14 aten ops per tensor (AdamW(foreach=False) 10, the global norm 3, clipping 1)
    assert with_ops.optimizer - fused.optimizer == pytest.approx(
        14 * tensors * cal.kernel_overhead, rel=1e-12)


# per-call costs of every call the runtime makes (bytes made free: β = 1e18 B/s)
CALLS = {"all-reduce/2": 1e-3, "reduce-scatter/2": 3e-3, "all-gather/2": 5e-3,
         "all-to-all/2": 7e-3, "p2p/2": 11e-3}


@pytest.fixture
def calls(tmp_path):
    machine = MACHINE | {"link": {"name": "gloo", "bandwidth": 1e18, "latency": 0.0,
                                  "per_call": CALLS}}
    path = tmp_path / "calls.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": machine}))
    return str(path)


def _runtime_spec():
    """What `check` predicts with: the runtime's own TrainSpec (its overlap, none of
    Megatron's TP/p2p/ring pipelining)."""
    from shardwise.runtime.train import TrainConfig

    return TrainConfig(get_model("tiny"), Layout(), seq_len=64, global_batch=8,
                       dtype="fp32").train_spec()


def test_the_runtime_spec_says_what_the_runtime_overlaps():
    spec = _runtime_spec()
    settings = spec.settings()
    assert spec.impl == "shardwise" and settings.tp_overlap == "none"
    assert not settings.p2p_overlapped(2) and not settings.stack.cp_overlap
    assert all(settings.dp_overlapped(z) for z in range(4))


@pytest.mark.parametrize("kwargs, component, per_microbatch", [
    # tp2: per layer 2 all-reduces forward, 2 backward; the head's and embedding's; the
    # vocabulary-parallel cross-entropy's 3 (max, target logit, sum of exponentials)
    ({"tp": 2}, "tp_comm", 4 * 4 * CALLS["all-reduce/2"] + 2 * CALLS["all-reduce/2"]
     + 3 * CALLS["all-reduce/2"]),
    # tp2+sp: each all-reduce a reduce-scatter + all-gather, and backward all-gathers the
    # QKV and gate/up inputs again (2 per layer)
    ({"tp": 2, "sp": True}, "tp_comm",
     4 * (4 * (CALLS["reduce-scatter/2"] + CALLS["all-gather/2"]) + 2 * CALLS["all-gather/2"])
     + 2 * (CALLS["reduce-scatter/2"] + CALLS["all-gather/2"]) + 3 * CALLS["all-reduce/2"]),
    # cp2: a hop forward and two backward per layer, each a blocking send then receive
    ({"cp": 2}, "cp_comm_exposed", 4 * 3 * 2 * CALLS["p2p/2"]),
])
def test_each_call_of_a_step_pays_its_measured_cost(calls, kwargs, component, per_microbatch):
    layout = Layout(**kwargs)
    step = predict_step(get_model("tiny"), layout, _runtime_spec(), calls)
    assert getattr(step, component) == pytest.approx(8 * per_microbatch, rel=1e-6)


@pytest.mark.parametrize("chunks, transfers", [(1, 2 * (8 + 1)), (2, 2 * (2 * 8 + 1))])
def test_pipeline_transfers_are_blocking_at_the_measured_p2p_cost(calls, chunks, transfers):
    # and once per step the stages' agreement all-gather (`runtime.pipeline._check_agreement`)
    layout = Layout(pp=2, chunks=chunks, schedule="interleaved" if chunks > 1 else "1f1b")
    step = predict_step(get_model("tiny"), layout, _runtime_spec(), calls)
    assert step.pp_comm == pytest.approx(transfers * CALLS["p2p/2"] + CALLS["all-gather/2"],
                                         rel=1e-6)


def test_expert_parallel_swaps_token_counts_before_each_dispatch(calls):
    # per MoE layer: the count all-to-all, dispatch and combine forward, both backward
    layout = Layout(dp=2, ep=2)
    step = predict_step(get_model("tiny-moe"), layout, _runtime_spec(), calls)
    layers = get_model("tiny-moe").n_moe_layers
    assert step.ep_comm == pytest.approx(4 * layers * 5 * CALLS["all-to-all/2"], rel=1e-6)


def test_the_loss_and_grad_norm_all_reduces_are_charged_once_per_step(calls):
    spec = _runtime_spec()
    with_calls = predict_step(get_model("tiny"), Layout(dp=2), spec, calls)
    alone = predict_step(get_model("tiny"), Layout(), spec, calls)
    # the same optimizer work on one rank and on each of dp2's; dp2 adds 2 scalar all-reduces
    assert with_calls.optimizer - alone.optimizer == pytest.approx(
        2 * CALLS["all-reduce/2"], rel=1e-6)


def test_per_call_costs_measured_with_all_ranks_busy_stand_for_that_many_ranks(tmp_path):
    per_call = {"all-reduce/2": 1e-3, "all-reduce/2@8": 5e-3}
    machine = MACHINE | {"link": MACHINE["link"] | {"per_call": per_call}}
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": machine}))
    # 8 ranks: the figure measured with 8 busy, as it is (not the lone one ÷ the 1/4 share)
    assert machine_cluster(8, str(path))[1].collective_call == {"all-reduce/2": 5e-3}
    # 4 ranks: no figure for 4 busy ranks; the lone one time-sliced to half a core
    assert machine_cluster(4, str(path))[1].collective_call == {
        "all-reduce/2": pytest.approx(2e-3)}
