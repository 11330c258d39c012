"""torchtitan's version selector (`stacks.titan_versions`): the 0.1.0 stack against torchtitan
v0.1.0's own code — benchmarks/torchtitan_v0.1.0_facts.json, read from the tag with `ast` by
scripts/torchtitan_facts.py and regenerated here where a checkout is at hand — its rules
against the conditions under which that code raises, its FP8 default against torchao's
roofline, its attention against the SDPA-flash timing of another stack, and `--impl` /
`--emit` as users run them."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules.registry import SCHEDULE_CODES, SCHEDULE_REGISTRY
from shardwise.stacks import STACKS, parse_impl, resolve
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
FACTS = json.loads((ROOT / "benchmarks" / "torchtitan_v0.1.0_facts.json").read_text())
CONFIG = FACTS["config"]
OLD, NEW = STACKS["torchtitan@0.1.0"], STACKS["torchtitan"]
ARGS, PARALLELIZE = ("torchtitan/models/llama3/model/args.py",
                     "torchtitan/models/llama3/infra/parallelize.py")
REPO = Path(os.environ.get("TORCHTITAN_REPO", "/work/.mirror/pytorch+torchtitan/repo"))


def _script():
    return load_script("scripts/torchtitan_facts.py")


def test_the_vendored_facts_are_the_tags_code():
    """Regenerated from a torchtitan checkout (TORCHTITAN_REPO), the facts are the file's."""
    tags = subprocess.run(["git", "-C", str(REPO), "tag", "-l", "v0.1.0"], capture_output=True,
                          text=True).stdout if REPO.is_dir() else ""
    if "v0.1.0" not in tags:
        pytest.skip("no torchtitan checkout with tag v0.1.0 (set TORCHTITAN_REPO)")
    assert _script().facts(REPO, "v0.1.0") == FACTS


def test_the_stack_is_v010s_config():
    """Each choice of the 0.1.0 stack is what v0.1.0's config and model code offer, and
    differs from 0.3.0 where the code does."""
    training, par = CONFIG["Training"], CONFIG["Parallelism"]
    assert OLD.compile == (training["compile"]["default"], True)
    assert "enable_async_tensor_parallel" in par and "async" in OLD.tp_overlap
    # SDPA's flash backend first (FlashAttention-2); cuDNN first only from sm100
    sdpa = FACTS["sdpa_backends"]
    assert sdpa["order"][0] == "FLASH_ATTENTION" and OLD.attention[0] == "fa2"
    assert sdpa["first"] == "CUDNN_ATTENTION" and sdpa["first_at_capability"] == [10, 0]
    assert FACTS["llama3_args"]["use_flex_attn"] is False and "flex" in OLD.attention[1:]
    assert "fa2" not in NEW.attention  # 0.3.0 refuses SDPA for language models
    # activation_checkpoint.mode none | full | selective ("op" or every n-th layer)
    assert set(CONFIG["ActivationCheckpoint"]["mode"]["choices"]) == {"none", "full",
                                                                      "selective"}
    assert set(OLD.recompute) == {"none", "full", "op-sac"}
    # float8.recipe_name None (the default) is tensorwise; MX adds mxfp8
    float8 = CONFIG["Float8"]["recipe_name"]
    assert float8["default"] is None and OLD.fp8[0] == "tensorwise"
    assert set(OLD.fp8) == set(float8["choices"]) | set(CONFIG["MX"]["recipe_name"]["choices"])
    assert "tensorwise" not in NEW.fp8
    assert TrainSpec(impl="torchtitan@0.1.0", dtype="fp8").fp8 == "tensorwise"
    rotate = par["context_parallel_rotate_method"]
    kinds = {"allgather": "allgather", "alltoall": "ring"}
    assert OLD.cp_kinds == tuple(kinds[k] for k in [rotate["default"], *(
        c for c in rotate["choices"] if c != rotate["default"])])
    assert {"always", "never"} <= set(par["fsdp_reshard_after_forward"]["choices"])
    assert {2, 3} <= set(OLD.zero_hybrid)
    names = {"bfloat16": "bf16", "float32": "fp32"}
    assert set(OLD.dtypes) == {names[c] for c in training["mixed_precision_param"]["choices"]}
    assert {g for _, gs in OLD.grad_dtypes or () for g in gs} == {
        names[c] for c in training["mixed_precision_reduce"]["choices"]}
    assert "enable_cpu_offload" in training and OLD.offload_kinds() == ("none", "params")
    # no expert parallelism in v0.1.0's config (MoE only under experiments/); 0.3.0 has it
    assert "expert_parallel_degree" not in par and FACTS["core_models"] == ["llama3"]
    assert "ep" not in OLD.axes and "ep" in NEW.axes
    installed = importlib.util.find_spec("torchtitan")
    if installed is not None and installed.origin:
        configs = Path(installed.origin).parent / "config" / "configs.py"
        fields = {n.target.id for n in ast.walk(ast.parse(configs.read_text()))
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        assert "expert_parallel_degree" in fields


def test_async_tp_needs_compile_as_v010_raises():
    guard = next(g for g in FACTS["guards"][PARALLELIZE] if "Async TP" in g["raises"])
    assert "not job_config.training.compile" in guard["path"][-1][0]
    with pytest.raises(ShardwiseError, match="async TP needs torch.compile"):
        resolve("torchtitan@0.1.0", tp_overlap="async", compile=False)
    assert resolve("torchtitan@0.1.0", tp_overlap="async", compile=True).tp_overlap == "async"


def _raises(guard, namespace) -> bool:
    return all(bool(eval(test, {}, namespace)) == taken for test, taken in guard["path"])


def _namespace(dp, tp, pp, cp, zero, attention, recompute, share):
    """torchtitan v0.1.0's objects for a shardwise layout: zero 0 is DDP (dp_replicate),
    2/3 FSDP (dp_shard); layer SAC every second block is full recompute of half the layers."""
    mode, option = {("none", 1): ("none", "op"), ("full", 1): ("full", "op"),
                    ("full", 0.5): ("selective", "2"), ("op-sac", 1): ("selective", "op")}[
        (recompute, share)]
    replicate, shard = (dp, 1) if zero == 0 else (1, dp)
    dims = SimpleNamespace(dp_replicate_enabled=replicate > 1, dp_shard_enabled=shard > 1,
                           cp_enabled=cp > 1, tp_enabled=tp > 1, pp_enabled=pp > 1)
    config = SimpleNamespace(
        activation_checkpoint=SimpleNamespace(mode=mode, selective_ac_option=option),
        parallelism=SimpleNamespace(context_parallel_degree=cp,
                                    enable_async_tensor_parallel=False),
        training=SimpleNamespace(compile=False))
    ndim = sum(d > 1 for d in (pp, replicate, shard, cp, tp))
    return {"job_config": config, "self": SimpleNamespace(use_flex_attn=attention == "flex"),
            "parallel_dims": dims, "world_mesh": SimpleNamespace(ndim=ndim)}


def rules_match_v010_raises():
    """Over a grid of layouts and settings, the stack refuses exactly where v0.1.0's llama3
    args and parallelize_llama raise; zero=0 under CP, where v0.1.0 shards over the cp ranks
    instead (FSDP's branch), is refused too; each rule cites the line of its check."""
    guards = FACTS["guards"][ARGS] + [g for g in FACTS["guards"][PARALLELIZE]
                                      if "Async TP" not in g["raises"]]
    fsdp = next(g for g in FACTS["guards"][PARALLELIZE] if "DDP" in g["raises"])["path"][0][0]
    lines = {f"{path}:{line}" for path in (ARGS, PARALLELIZE) for g in FACTS["guards"][path]
             for line in (g["line"], g["if_line"])}
    cited = [r for r in OLD.rules if "pipeline.py" not in r.source]
    assert {r.source.split()[0] for r in cited} <= lines | {f"{PARALLELIZE}:82"}
    shards = next(r for r in cited if r.source.startswith(f"{PARALLELIZE}:82"))
    seen = set()
    for dp, tp, pp, cp, zero, attention, (recompute, share) in itertools.product(
            (1, 2), (1, 2), (1, 2), (1, 2), (0, 3), ("fa2", "flex"),
            (("none", 1), ("full", 1), ("full", 0.5), ("op-sac", 1))):
        ns = _namespace(dp, tp, pp, cp, zero, attention, recompute, share)
        train = TrainSpec(impl="torchtitan@0.1.0", attention=attention, recompute_share=share)
        codes = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, recompute=recompute).codes()
        refused = {r for r in cited if r is not shards and bool(r.refuses(codes, train))}
        raises = any(_raises(g, ns) for g in guards)
        assert bool(refused) == raises, (dp, tp, pp, cp, zero, attention, recompute, share)
        assert bool(shards.refuses(codes, train)) == (
            zero == 0 and bool(eval(fsdp, {}, ns)) and cp > 1)
        seen.add(raises)
    assert seen == {True, False}


def only_zbv_is_placed_in_a_v():
    """v0.1.0's stage placement is "v" for ScheduleZBVZeroBubble only: a V schedule that gets
    the looped placement (DualPipeV) is refused, every other schedule it runs is not."""
    style = FACTS["pipeline_stage_style"]
    rule = next(r for r in OLD.rules if "pipeline.py" in r.source)
    assert rule.source.split()[0].endswith(f"pipeline.py:{style['line']}")
    checked = 0
    for name in OLD.schedules():
        info = SCHEDULE_REGISTRY[name]
        placed = eval(style["value"], {}, {"schedule_class": info.torchtitan,
                                           "ScheduleZBVZeroBubble": "ZBVZeroBubble"})
        wrong = info.placement == "v" and placed != "v"
        assert bool(rule.refuses({"pp": 4, "schedule": SCHEDULE_CODES[name]}, None)) == wrong
        checked += wrong
    assert checked == 1


# each rule of the 0.1.0 stack and its check (tests/integration/test_stacks.py runs them all)
TITAN_010_CHECKS = {rule.source: (only_zbv_is_placed_in_a_v if "pipeline.py" in rule.source
                                  else rules_match_v010_raises) for rule in OLD.rules}


def test_rules_refuse_where_v010_raises():
    rules_match_v010_raises()


def test_only_zbv_is_placed_in_a_v():
    only_zbv_is_placed_in_a_v()


def test_tensorwise_cast_bytes_are_torchaos_roofline():
    """torchao 0.18.0's roofline of its tensorwise casts (`get_tensor_memory_traffic_ovhd_s`
    at 1 byte/s): the input's amax and one cast writing both layouts, all in the forward; the
    output gradient's in the backward; the weight's second-layout cast in the backward."""
    pytest.importorskip("sympy")
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    from shardwise.fp8 import get_recipe

    specs = {"peak_mem_bw_bytes_sec": 1.0, "pct_achievable_mem_bw": 1.0}
    numel = 10**9

    def kernels(role):
        return [float(k) / numel for k in roofline.get_tensor_memory_traffic_ovhd_s(
            specs, numel, 1, role, "tensorwise", None)]

    cast = get_recipe("torchao", "tensorwise").cast_bytes("hopper")
    assert (cast.input_fwd, cast.input_bwd) == (pytest.approx(sum(kernels("input"))), 0.0)
    assert cast.grad_bwd == pytest.approx(sum(kernels("grad_output")))
    weight = kernels("weight")
    assert cast.weight_bwd == pytest.approx(weight[-1])
    assert cast.weight_fwd == pytest.approx(sum(weight[:-1]))


def test_sdpa_is_timed_as_flash_attention_2():
    """Only the attention kernel differs: 0.1.0's SDPA (fa2) times as pytorch-fsdp's
    FlashAttention-2 over the same eager block (GPT-3: no RoPE, so both stacks count
    torchtitan's block), its FlexAttention as 0.3.0's (Llama 3 with GQA), and fa2 ≠ flex."""
    cluster, layout = Cluster.of(8, "h100-sxm"), Layout(dp=8, zero=3)

    def compute(model, impl, attention):
        train = TrainSpec(impl=impl, attention=attention, seq_len=8192, global_batch=8,
                          compile=False)
        return estimate_step(get_model(model), cluster, layout, train).compute

    gpt = compute("gpt3-6.7b", "torchtitan@0.1.0", "fa2")
    assert gpt == pytest.approx(compute("gpt3-6.7b", "pytorch-fsdp", "fa2"), rel=1e-9)
    flex = compute("llama3-8b", "torchtitan@0.1.0", "flex")
    assert flex == pytest.approx(compute("llama3-8b", "torchtitan", "flex"), rel=1e-9)
    assert compute("llama3-8b", "torchtitan@0.1.0", "fa2") < flex * 0.99


def test_impl_picks_the_version():
    assert parse_impl("torchtitan") == parse_impl("torchtitan@0.3.0") == "torchtitan"
    assert parse_impl("torchtitan@0.1.0") == "torchtitan@0.1.0"
    assert OLD.label == "torchtitan@0.1.0" and NEW.label == "torchtitan@0.3.0"
    with pytest.raises(ShardwiseError, match="torchtitan 0.3.0 and torchtitan 0.1.0 only"):
        parse_impl("torchtitan@0.2.0")
    base = ("plan", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "8192")
    old = shardwise_json(*base, "--impl", "torchtitan@0.1.0")["stack"]
    new = shardwise_json(*base, "--impl", "torchtitan")["stack"]
    assert (old["version"], old["attention"]) == ("torchtitan 0.1.0", "fa2")
    assert (new["version"], new["attention"]) == ("torchtitan 0.3.0", "flex")
    assert_one_line_error(shardwise(*base, "--impl", "torchtitan@0.2.0", check=False),
                          "torchtitan 0.3.0 and torchtitan 0.1.0 only")
    assert_one_line_error(shardwise(*base, "--impl", "torchtitan@0.1.0", "--emit",
                                    "torchtitan", check=False), "--impl torchtitan")
    assert_one_line_error(shardwise(*base, "--impl", "torchtitan@0.1.0", "--layout",
                                    "cp=2,zero=3", "--attention", "flex", check=False),
                          "args.py:51")


@pytest.fixture(scope="module")
def rows():
    module = load_script("benchmarks/validation_rows.py", register=True)
    return module, module.load()[2]


def test_the_rows_that_ran_010_build_on_it(rows):
    """The published runs of torchtitan's SDPA era (its 2024 docs, AWS's 2024 blog, torchao's
    float8 tables) name torchtitan@0.1.0 and build on it, FA2 and tensorwise FP8 included."""
    module, merged = rows
    mine = [r for r in merged if r["stack"].get("impl") == "torchtitan@0.1.0"]
    assert {r["source"] for r in mine} == {"torchtitan-docs-a100", "aws-torchtitan-2024",
                                           "torchao-float8"}
    built = [module.build(r) for r in mine]
    assert all(case.train.impl == "torchtitan@0.1.0" for case in built)
    assert sum(case.train.fp8 == "tensorwise" for case in built) == 4
    assert all(case.train.settings().attention == "fa2" for case in built)
