"""Every bad input is one clear line: exit code 2 from the CLI, `ShardwiseError` from the API,
never a traceback, a hang or a silently wrong number.

Two parts: the fault cases found by hand (each names the value and what is valid), and a
property test (hypothesis) that drives the analytic CLI commands and the public functions with
arbitrary values of each parameter and accepts only "a valid result" or "one line, exit 2 /
ShardwiseError"; a hang fails through the test's timeout (benchmarks/bench_bad_input.py times
the slowest answer). The reference for "valid" is the closed form where there is one (ring
formulas), else that the command succeeded with exit code 0.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise import validate
from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import collective_time, ring_bytes_on_wire, ring_steps
from shardwise.estimate.memory import in_flight_per_stage
from shardwise.hardware import get_link
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules import make_schedule, simulate
from shardwise.schedules.metrics import microbatches_for_bubble, partition_layers
from shardwise.units import parse_batch
from tests.cli_helpers import run_in_process as run


def assert_one_line(capsys, args: tuple[str, ...], *fragments: str) -> None:
    code, out, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, code, err)
    assert "Traceback" not in err and out == ""
    for fragment in fragments:
        assert fragment in lines[0], (args, lines[0])


# ----------------------------------------------------------------------- the fault cases
CLI_CASES = [
    (("memory", "--tp", "0"), "--tp must be an integer in [1,"),
    (("memory", "--pp", "0"), "--pp must be"),
    (("memory", "--cp", "0"), "--cp must be"),
    (("memory", "--seq", "0"), "--seq must be"),
    (("plan", "--layout", "tp=0"), "tp must be an integer"),
    (("plan", "--layout", "pp=0"), "pp must be an integer"),
    (("plan", "--layout", "tp=8,sp=maybe"), "sp='maybe' must be one of"),
    (("plan", "--global-batch", "1e30-tokens"), "global batch '1e30-tokens'"),
    (("memory", "--global-batch", "1e30-tokens"), "global batch '1e30-tokens'"),
    (("comm", "--ranks", "1" + "0" * 400), "--ranks"),
    (("comm", "--size", "1e400"), "size '1e400' must be a finite number"),
    (("schedule", "--tb", "inf"), "--tb must be a finite number in [1e-09, 1e+09]"),
    (("schedule", "--tw", "inf", "--schedule", "zb-h1"), "--tw must be a finite number"),
    (("schedule", "--p2p", "inf"), "--p2p must be a finite number in [0, 1e+09]"),
    (("schedule", "-m", "1000000000"), "--microbatches"),
    (("schedule", "-p", "1000000"), "--stages"),
    (("schedule", "-p", "1000", "-m", "1000"), "at most 200,000"),
    (("schedule", "--svg", "/proc/x.svg"), "--svg /proc/x.svg: cannot write there"),
    (("demo", "ddp", "--schedule", "gpipe"), "pipeline demo only"),
    (("memory", "--headroom", "5"), "--headroom must be a finite number in (0, 1], got 5"),
    (("memory", "--headroom", "nan"), "--headroom"),
    (("memory", "--headroom", "-1"), "--headroom"),
    (("memory", "--headroom", "inf"), "--headroom"),
    (("memory", "--headroom", "0"), "--headroom"),
    (("plan", "--tokens", "15T", "--price", "nan"), "--price must be a finite number ≥ 0"),
    (("plan", "--tokens", "15T", "--price", "-2.5"), "--price"),
    (("plan", "--tokens", "15T", "--price", "inf"), "--price"),
    (("plan", "--top", "1000000"), "--top"),
    (("train", "--dp", "0"), "--dp must be an integer in [1,"),
    (("check", "--dp", "0"), "--dp must be"),
    (("train", "--lr", "inf"), "--lr must be a finite number > 0"),
    (("train", "--weight-decay", "inf"), "--weight-decay"),
    (("train", "--clip", "nan"), "--clip"),
    (("train", "--timeout", "0"), "--timeout"),
    (("train", "--timeout", "-1"), "--timeout"),
    (("train", "--timeout", "nan"), "--timeout"),
    (("train", "--timeout", "inf"), "--timeout"),
    (("train", "--seed", str(10**23)), "--seed must be an integer in [0,"),
    (("train", "--tp", "0"), "--tp"),
    (("train", "--pp", "0"), "--pp"),
    (("train", "--cp", "0"), "--cp"),
    (("memory", "llama3-70b", "--gpus", "16", "--tp", "8", "--cp", "2", "--cp-kind", "ulysses"),
     "2 must divide 1"),
    (("memory", "--cp", "2", "--cp-kind", "ring2"), "--cp-kind"),
    (("memory", "--cp", "4", "--cp-kind", "hybrid"), "cp_kind=hybrid needs ulysses=u"),
    (("plan", "--layout", "cp=4,ulysses=2"), "applies to cp_kind=hybrid only"),
    (("train", "--seq", "0"), "--seq"),
]


@pytest.mark.parametrize(("args", "fragment"), CLI_CASES,
                         ids=[" ".join(a)[:40] for a, _ in CLI_CASES])
def test_cli_fault_case_is_one_line(capsys, args, fragment):
    assert_one_line(capsys, args, fragment)


@pytest.mark.parametrize(("config", "fragment"), [
    ('"num_hidden_layers": "32"', "num_hidden_layers must be an integer"),
    ('"hidden_size": null', "hidden_size must be an integer"),
])
def test_config_json_values_of_the_wrong_type(capsys, tmp_path, config, fragment):
    base = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "intermediate_size": 14336, "vocab_size": 128256}
    key = config.split(":")[0].strip('"')
    text = ", ".join(f'"{k}": {v!r}'.replace("'", '"') for k, v in base.items() if k != key)
    path = tmp_path / "config.json"
    path.write_text("{" + text + ", " + config + "}")
    assert_one_line(capsys, ("memory", str(path)), fragment, str(path))


def test_gpt2_config_with_a_string_dropout(capsys, tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text('{"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, '
                    '"vocab_size": 50257, "n_positions": 1024, "resid_pdrop": "0.1"}')
    assert_one_line(capsys, ("memory", str(path)), "resid_pdrop must be a finite number")


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"default": {"matmul_efficiency": Infinity}}', "matmul_efficiency must be a finite"),
    ('{"default": {"kernel_overhead": Infinity}}', "kernel_overhead must be a finite"),
    ('{"default": {"kernel_overhead": NaN}}', "kernel_overhead must be a finite"),
    ('{"accelerators": [1]}', "accelerators must be a JSON object"),
    ('{"accelerators": {"h100": 3}}', "must be a JSON object"),
    ('{"links": {"nvlink4": "fast"}}', "link nvlink4 efficiency must be a finite number"),
    ('{"default": ', "calibration"),
])
def test_malformed_calibration_files(capsys, tmp_path, text, fragment):
    path = tmp_path / "calibration.json"
    path.write_text(text)
    assert_one_line(capsys, ("plan", "--calibration", str(path)), fragment)


LINK = get_link("nvlink4")


@pytest.mark.parametrize(("call", "fragment"), [
    (lambda: ring_bytes_on_wire("all-reduce", -1, 8), "size (bytes) must be a finite number"),
    (lambda: collective_time("all-reduce", math.nan, 8, LINK), "size (bytes)"),
    (lambda: collective_time("all-reduce", math.inf, 8, LINK), "size (bytes)"),
    (lambda: ring_steps("all-reduce", 2.5), "n (ranks in the collective) must be an integer"),
    (lambda: ring_steps("all-reduce", "8"), "got '8'"),
    (lambda: ring_steps("all-reduce", True), "got True"),
    (lambda: in_flight_per_stage("1f1b", 4, 8, 0), "v (chunks) must be an integer in [1,"),
    (lambda: in_flight_per_stage("gpipe", 10**30, 8), "p (stages) must be an integer in [1,"),
    (lambda: in_flight_per_stage("gpipe", 4, -1), "m (micro-batches)"),
    (lambda: parse_batch(-3, 8192), "global batch must be an integer in [1,"),
    (lambda: parse_batch("8", 0), "seq_len must be"),
    (lambda: TrainSpec(seq_len=4096.5).validate(), "seq_len must be an integer"),
    (lambda: TrainSpec(seq_len=4096, global_batch=0).validate(), "global_batch must be"),
    (lambda: Layout(tp=0).problems(get_model("tiny")), None),
    (lambda: get_model(None), "model must be a preset name"),
    (lambda: make_schedule("1f1b", 10**6, 10**6), "at most 2,000,000"),
    (lambda: simulate(make_schedule("1f1b", 2, 2), 1.0, math.inf), "t_b must be a finite"),
    (lambda: validate.seed(-1), "seed must be an integer in [0,"),
    (lambda: microbatches_for_bubble(8, math.nan), "target bubble fraction must be a finite"),
    (lambda: partition_layers(32, 2.5), "n_stages must be an integer"),
    (lambda: partition_layers("8", 4), "n_layers must be an integer"),
])
def test_api_fault_case_raises_shardwise_error_naming_the_argument(call, fragment):
    if fragment is None:  # problems() lists rather than raises
        assert call() == ["tp must be an integer in [1, 1,048,576], got 0"]
        return
    with pytest.raises(ShardwiseError) as info:
        call()
    assert fragment in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------- the property test
def _values() -> st.SearchStrategy[str]:
    """What a user may type for a number: ints (huge and negative), floats, specials, junk."""
    return st.one_of(
        st.integers(-10**6, 10**6).map(str), st.integers(-10**40, 10**40).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(["0", "-0", "1", "nan", "inf", "-inf", "1e400", "", " ", "x", "1e30",
                         "2.5", "0x10", "16M", "1e30-tokens", "-3-tokens", "8192-tokens"]),
        st.text(max_size=8))


# (command, option, the fixed arguments that keep the command cheap)
OPTIONS = [
    ("memory", "--gpus", ()), ("memory", "--tp", ()), ("memory", "--pp", ()),
    ("memory", "--dp", ()), ("memory", "--cp", ()), ("memory", "--ep", ()),
    ("memory", "--zero", ()), ("memory", "--zero-group", ()), ("memory", "--chunks", ()),
    ("memory", "--mbs", ()), ("memory", "--seq", ()), ("memory", "--global-batch", ()),
    ("memory", "--headroom", ()), ("memory", "--gpus-per-node", ()),
    ("comm", "--size", ()), ("comm", "--ranks", ()), ("comm", "--nodes",
                                                       ("--algorithm", "hierarchical")),
    ("schedule", "--stages", ("-m", "4")), ("schedule", "--microbatches", ("-p", "2")),
    ("schedule", "--chunks", ("--schedule", "interleaved", "-p", "2", "-m", "4")),
    ("schedule", "--tf", ()), ("schedule", "--tb", ()), ("schedule", "--p2p", ()),
    ("schedule", "--tw", ("--schedule", "zb-h1")), ("schedule", "--width", ()),
    ("plan", "--price", ("tiny", "--gpus", "8", "--tokens", "1B")),
    ("plan", "--top", ("tiny", "--gpus", "8")), ("plan", "--headroom", ("tiny", "--gpus", "8")),
    ("plan", "--seq", ("tiny", "--gpus", "8", "--global-batch", "8")),
    ("plan", "--global-batch", ("tiny", "--gpus", "8", "--seq", "64")),
    ("plan", "--tokens", ("tiny", "--gpus", "8")),
]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=st.sampled_from(OPTIONS), value=_values())
def test_every_option_gives_a_result_or_one_line(capsys, case, value):
    command, name, fixed = case
    code, out, err = run(capsys, command, *fixed, name, value, "--json")
    assert "Traceback" not in err, (command, name, value, err)
    if code == 0:
        assert out.strip(), (command, name, value)
    else:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
            command, name, value, code, err)


_ARGS = st.one_of(st.integers(-10, 10**7), st.integers(-10**30, 10**30),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                  st.booleans(), st.none())


@settings(max_examples=300, deadline=2000, derandomize=True)
@given(size=_ARGS, n=_ARGS, op=st.sampled_from(["all-reduce", "all-gather", "x"]))
def test_comm_functions_give_the_ring_formula_or_shardwise_error(size, n, op):
    try:
        sent = ring_bytes_on_wire(op, size, n)
    except ShardwiseError as exc:
        assert "\n" not in str(exc)
        return
    factor = 2 if op == "all-reduce" else 1  # SPEC §5: 2(N-1)/N·S, (N-1)/N·S
    assert sent == pytest.approx(factor * (n - 1) / n * size)
    assert math.isfinite(sent) and sent >= 0


@settings(max_examples=200, deadline=2000, derandomize=True)
@given(p=_ARGS, m=_ARGS, v=_ARGS, schedule=st.sampled_from(["gpipe", "1f1b", "interleaved"]))
def test_in_flight_is_within_its_bounds_or_shardwise_error(p, m, v, schedule):
    try:
        held = in_flight_per_stage(schedule, p, m, v if schedule == "interleaved" else 1)
    except ShardwiseError:
        return
    # A stage holds at least one micro-batch and at most all of them (× chunks).
    assert len(held) == p and all(1 <= h <= m * (v if schedule == "interleaved" else 1)
                                  for h in held)
