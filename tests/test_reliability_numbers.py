"""Finite by construction (issue 32, classes 3, 4, 6, 7): every number a user gives is
finite and in range or refused in one line; every figure printed or served is finite; sizes
that drive loops are capped; the public API refuses wrong types with `ShardwiseError`.

References: `math.isfinite` on every number of the JSON the CLI prints; the closed form of
the divisors (trial division over all of 1..n); Python's own JSON (what a body holds); the
HTTP statuses the web app promises (4xx with a JSON body, never 500).
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise import validate
from shardwise.arch import ModelSpec, count_params, from_hf_dict, get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import collective_time
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.estimate.step import estimate_step
from shardwise.files import read_json
from shardwise.hardware import Cluster, get_link
from shardwise.layout import Layout, TrainSpec, parse_partition
from shardwise.plan import plan
from shardwise.plan.space import _divisors
from shardwise.schedules import make_schedule
from shardwise.units import parse_batch, parse_count, parse_size
from tests.cli_helpers import run_in_process as run

FIXTURE = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def numbers_in(text: str) -> list[float]:
    return [v for _, v, _ in validate.walk(json.loads(text))
            if isinstance(v, int | float) and not isinstance(v, bool)]


# ----------------------------------------------------------------- numbers in, numbers out
EXTREMES = st.sampled_from(["0", "-0.0", "1e-320", "5e-324", "1e-12", "1e308", "1.8e308",
                            "1e400", "-1e400", "inf", "-inf", "nan", "Infinity", "NaN", "1e30",
                            "1e18", "9" * 30, "-5", "2.5", "1", "15T", "1e400-tokens"])
VALUES = st.one_of(EXTREMES, st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.integers(-10**25, 10**25).map(str))
# (command, option, fixed arguments that keep it cheap): options whose value feeds a figure
NUMERIC = [
    ("plan", "--tokens", ("tiny", "--gpus", "8", "--global-batch", "8", "--seq", "64")),
    ("plan", "--price", ("tiny", "--gpus", "8", "--global-batch", "8", "--seq", "64",
                         "--tokens", "1e9")),
    ("schedule", "--tf", ()), ("schedule", "--tb", ()), ("schedule", "--p2p", ()),
    ("schedule", "--tw", ("--schedule", "zb-h1")),
    ("comm", "--size", ()), ("memory", "--headroom", ("tiny",)),
    ("memory", "--global-batch", ("tiny", "--seq", "64")),
]


@settings(FIXTURE, max_examples=45)
@given(case=st.sampled_from(NUMERIC), value=VALUES)
def test_a_number_given_is_a_finite_answer_or_one_line(capsys, case, value):
    command, option, fixed = case
    code, out, err = run(capsys, command, *fixed, f"{option}={value}", "--json")
    assert "Traceback" not in err
    if code == 0:
        assert all(math.isfinite(x) for x in numbers_in(out)), (command, option, value)
    else:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err


@settings(FIXTURE, max_examples=12)
@given(tf=st.sampled_from(["1e-9", "1e9", "3.7", "1e-3"]),
       tb=st.sampled_from(["1e-9", "1e9", "0.5"]))
def test_schedule_text_and_svg_at_extreme_times(capsys, tmp_path, tf, tb):
    """The ASCII chart and the SVG draw at the extreme times the bounds allow."""
    svg = tmp_path / "s.svg"
    code, _, err = run(capsys, "schedule", "--tf", tf, "--tb", tb, "--svg", str(svg))
    assert code == 0 and svg.read_text().startswith("<svg"), err


@pytest.mark.parametrize(("args", "fragment"), [
    (("schedule", "--schedule", "interleaved", "-v", "1"), "needs chunks ≥ 2"),
    (("schedule", "-v", "2"), "runs one chunk per stage, got chunks=2"),
    (("memory", "--dtype", "fp32", "--grad-dtype", "bf16"), "narrower than dtype fp32"),
    (("plan", "tiny", "--gpus", "8", "--layout", "tp=8,tp=4"), "sets tp twice"),
    (("memory", "tiny", "--pp", "2", "--partition", ",,,"), "partition ',,,' must be"),
    (("plan", "tiny", "--gpus", "8", "--tokens", "0"), "--tokens 0 must be a finite number"),
    (("schedule", "--svg", "/dev/full"), "not a regular file"),
])
def test_refused_alike_everywhere(capsys, args, fragment):
    code, _, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err


@settings(max_examples=80, deadline=None)
@given(items=st.lists(st.tuples(st.sampled_from(["tp", "pp", "dp", "cp", "zero", "mbs",
                                                 "micro_batch", "v", "chunks"]),
                                st.integers(1, 4)), min_size=1, max_size=4))
def test_layout_text_never_takes_the_last_of_two(items):
    """`k=v,…`: each key (or alias) given once is read as given; given twice, refused."""
    alias = {"mbs": "micro_batch", "v": "chunks"}
    text = ",".join(f"{k}={v}" for k, v in items)
    keys = [alias.get(k, k) for k, _ in items]
    if len(set(keys)) < len(keys):
        with pytest.raises(ShardwiseError, match="twice"):
            Layout.parse(text)
        return
    layout = Layout.parse(text)
    assert all(getattr(layout, alias.get(k, k)) == v for k, v in items)


@settings(max_examples=80, deadline=None)
@given(text=st.text(",0123456789 x-", max_size=12))
def test_a_partition_is_every_item_or_refused(text):
    try:
        counts = parse_partition(text)
    except ShardwiseError:
        return
    assert len(counts) == text.count(",") + 1  # no item dropped, none invented


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(1, 5000), st.integers(1, 10**12)))
def test_divisors_by_factorisation(n):
    start = time.monotonic()
    found = _divisors(n)
    assert time.monotonic() - start < 5  # a hang guard: counting to n would take hours
    if n <= 5000:
        assert found == [d for d in range(1, n + 1) if n % d == 0]
    else:
        assert all(n % d == 0 for d in found) and found == sorted(set(found))
        assert found[0] == 1 and found[-1] == n


def test_a_model_with_a_trillion_layers_is_refused_at_once(capsys, tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 10**12, "num_attention_heads": 4, "vocab_size": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for command in ("plan", "memory"):
        start = time.monotonic()
        code, _, err = run(capsys, command, str(path))
        assert time.monotonic() - start < 5 and code == 2, err
        assert "n_layers must be an integer in [1, 100,000]" in err


# ------------------------------------------------------------------------------ files
@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "loop", "deep", "nan",
                                  "huge"])
def test_a_json_file_that_is_no_json_file_is_one_line(tmp_path, kind):
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = "/dev/zero"
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        os.symlink(path, path)
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "nan":
        path.write_text('{"default": {"a": [1, NaN]}}')
    elif kind == "huge":
        path.write_text('{"a": 1e400}')
    start = time.monotonic()
    with pytest.raises(ShardwiseError) as info:
        read_json(path, "config file")
    assert time.monotonic() - start < 10 and "\n" not in str(info.value)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3)
                    | st.floats(allow_nan=True, allow_infinity=True),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(data=JSON, depth=st.integers(0, 60))
def test_read_json_returns_finite_shallow_json_or_one_line(tmp_path_factory, data, depth):
    path = tmp_path_factory.mktemp("j") / "f.json"
    path.write_text("[" * depth + json.dumps(data) + "]" * depth)
    try:
        parsed = read_json(path, "file")
    except ShardwiseError as exc:
        assert "\n" not in str(exc)
        return
    assert all(d <= 32 for _, _, d in validate.walk(parsed))
    assert validate.nonfinite(parsed) is None


# ---------------------------------------------------------------------------- the API
MODEL, CLUSTER, LAYOUT = get_model("tiny"), Cluster.of(8, "h100"), Layout(dp=8)
TRAIN = TrainSpec(seq_len=64, global_batch=64)
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256}
API = {  # name → (function, valid keyword arguments)
    "get_model": (get_model, {"name_or_path": "tiny"}),
    "count_params": (count_params, {"model": MODEL}),
    "forward_flops": (MODEL.forward_flops_per_token, {"seq_len": 64, "causal": True}),
    "training_flops": (MODEL.training_flops_per_token,
                       {"seq_len": 64, "causal": True, "recompute": "none"}),
    "ModelSpec": (ModelSpec, {"name": "x", "n_layers": 2, "d_model": 64, "n_heads": 4,
                              "n_kv_heads": 2, "d_ff": 128, "vocab": 256}),
    "Layout.problems": (lambda model, cluster, train: LAYOUT.problems(model, cluster, train),
                        {"model": MODEL, "cluster": CLUSTER, "train": TRAIN}),
    "Layout": (lambda **kw: Layout(**kw).problems(MODEL),
               {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "schedule": "1f1b",
                "chunks": 1, "recompute": "none", "micro_batch": 1, "sp": False,
                "zero_group": 0, "partition": ()}),
    "Layout.parse": (Layout.parse, {"text": "tp=2"}),
    "TrainSpec": (lambda **kw: TrainSpec(**kw).validate(),
                  {"seq_len": 64, "global_batch": 8, "dtype": "bf16", "grad_dtype": None,
                   "optimizer": "adam", "flash_attention": True}),
    "Cluster.of": (Cluster.of, {"gpus": 8, "gpu": "h100", "gpus_per_node": 8, "intra": None,
                                "inter": None}),
    "training_memory_per_gpu": (training_memory_per_gpu,
                                {"model": MODEL, "layout": LAYOUT, "train": TRAIN}),
    "estimate_step": (estimate_step, {"model": MODEL, "cluster": CLUSTER, "layout": LAYOUT,
                                      "train": TRAIN}),
    "plan": (plan, {"model": MODEL, "cluster": CLUSTER, "train": TRAIN, "top": 2}),
    "make_schedule": (make_schedule, {"name": "1f1b", "p": 2, "m": 4}),
    "parse_batch": (parse_batch, {"text": "8", "seq_len": 64}),
    "parse_size": (parse_size, {"text": "1GB"}),
    "parse_count": (parse_count, {"text": "15T"}),
    "collective_time": (collective_time, {"op": "all-reduce", "size": 1e9, "n": 8,
                                          "link": get_link("nvlink4")}),
    "from_hf_dict": (from_hf_dict, {"cfg": LLAMA, "name": "x"}),
}
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                      st.integers(), max_size=1),
                 st.sampled_from([MODEL, LAYOUT, CLUSTER, TRAIN, object()]))


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(API)), data=st.data(), junk=JUNK)
def test_a_public_function_answers_or_raises_shardwise_error(name, data, junk):
    """Any argument of any type: a result (numbers finite and ≥ 0) or one `ShardwiseError`
    line; never a TypeError or AttributeError from deep inside, a negative count or nan."""
    function, kwargs = API[name]
    key = data.draw(st.sampled_from(sorted(kwargs)), label="argument")
    try:
        result = function(**(kwargs | {key: junk}))
    except ShardwiseError as exc:
        assert "\n" not in str(exc)
        return
    if isinstance(result, int | float) and not isinstance(result, bool):
        assert math.isfinite(result) and result >= 0, (name, key, junk, result)
    if name == "count_params":
        assert all(v >= 0 for v in (result.total, result.active))


# ------------------------------------------------------------------------------ the web
@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from shardwise.web.app import create_app

    return TestClient(create_app(), raise_server_exceptions=False)


SPECIALS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400",
                            "0", "-1", '"x"', "null", "[]", "{}", "true", "1e308"])
BODIES = {"/api/memory": {"model": "tiny", "gpus": 8, "seq": 64},
          "/api/schedule": {"stages": 2, "microbatches": 4},
          "/api/comm": {"size": "1GB"},
          "/api/plan": {"model": "tiny", "gpus": 8, "seq": 64, "global_batch": "8"}}
FIELDS = {"/api/memory": ["gpus", "seq", "headroom", "tp", "micro_batch", "global_batch"],
          "/api/schedule": ["t_f", "t_b", "t_w", "p2p_latency", "stages", "chunks"],
          "/api/comm": ["ranks", "size", "nodes"],
          "/api/plan": ["price", "tokens", "headroom", "top"]}


@settings(FIXTURE, max_examples=40)
@given(path=st.sampled_from(sorted(BODIES)), data=st.data(), special=SPECIALS)
def test_a_body_with_any_number_is_an_answer_or_a_json_4xx(client, path, data, special):
    field = data.draw(st.sampled_from(FIELDS[path]), label="field")
    body = json.dumps(BODIES[path])[:-1] + f', "{field}": {special}}}'
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code in (200, 400, 422), (path, field, special, response.text)
    payload = json.loads(response.text)  # always JSON, strict: no NaN/Infinity in it
    if response.status_code == 200:
        assert validate.nonfinite(payload) is None


@settings(FIXTURE, max_examples=15)
@given(length=st.integers(65, 6000), prefix=st.sampled_from(["/", "/learn/", "/static/"]))
def test_a_long_path_is_404_or_414(client, length, prefix):
    assert client.get(prefix + "a" * length).status_code in (404, 414)


@pytest.mark.parametrize("host", ["a" * 5000, "a..b", "256.1.1.1", "x\x00y"])
def test_a_host_that_is_no_host_is_one_line(host):
    from shardwise.web.serve import bind

    with pytest.raises(ShardwiseError, match="cannot resolve --host") as info:
        bind(host, 0)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200
