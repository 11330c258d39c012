"""`estimate.machine.predict_step`'s per-call costs measured later replace the file's (the
"this machine" preset, `shardwise check`): a call's fixed cost `α_call` replaces its ring
rounds' latencies (SPEC §5's α-β with a measured α), in-process."""

import json

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.machine import predict_step
from shardwise.layout import Layout, TrainSpec

MACHINE = {"name": "this-machine", "backend": "gloo", "dtype": "fp32", "cores": 2,
           "memory_bytes": 16e9, "peak_flops": 5e10, "memory_bandwidth": 2e10,
           "link": {"name": "gloo", "bandwidth": 1e9, "latency": 3e-4,
                    "per_call": {"all-reduce/2": 2e-3}}}
CONSTANTS = {"matmul_efficiency": 1.0, "matmul_half_dim": 30.0, "attention_efficiency": 0.1,
             "hbm_efficiency": 0.5, "kernel_overhead": 2e-4}


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "me.json"
    path.write_text(json.dumps({"default": CONSTANTS, "machine": MACHINE}))
    return str(path)


def test_measured_per_call_costs_replace_the_files(calibration):
    """dp 2 on 2 cores: the one gradient bucket's all-reduce and the step's two scalar
    all-reduces (loss, gradient norm) each pay the measured 5 ms instead of the file's 2 ms;
    a cost for another op joins the file's."""
    model, train = get_model("tiny"), TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    before = predict_step(model, Layout(dp=2), train, calibration)
    after = predict_step(model, Layout(dp=2), train, calibration,
                         per_call={"all-reduce/2": 5e-3, "all-gather/2": 1e-3})
    assert after.dp_comm_total - before.dp_comm_total == pytest.approx(3e-3, rel=1e-9)
    assert after.optimizer - before.optimizer == pytest.approx(2 * 3e-3, rel=1e-9)


def test_a_run_in_another_dtype_names_the_file(calibration):
    with pytest.raises(ShardwiseError, match="me.json.*measured in fp32; this run is bf16"):
        predict_step(get_model("tiny"), Layout(), TrainSpec(seq_len=64, global_batch=8),
                     calibration)
