"""A run's resolved stack (`stacks.resolve`, `Settings`) against the frameworks' own code, read
from the installed packages' sources (no import: megatron-core takes ~15 s to import): the
defaults a run that states nothing gets (Megatron's `tp_comm_overlap`, torchtitan's
`compile.enable` and `enable_async_tensor_parallel`, each framework's default FP8 recipe and
the recipes it accepts), DeepSpeed's `overlap_comm` default (stage == 3) as
`Settings.dp_overlapped` at each ZeRO stage, scalar and array; then the one-line
`describe()` and the `--json` dict written out by hand, and the context-parallel kinds a
layout is refused for, one sentence each."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.stacks import get_stack, resolve


def _source(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _field(package: str, relative: str, cls: str, name: str) -> tuple[int, object, object]:
    """(line, annotation, default) of dataclass field `cls.name` in the package's file."""
    tree = ast.parse(_source(package, relative).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and item.target.id == name):
                    assert item.value is not None
                    return item.lineno, item.annotation, ast.literal_eval(item.value)
    raise AssertionError(f"{cls}.{name} not in {relative}")


def _literal(annotation: object) -> tuple[str, ...]:
    """The strings of the `Literal[...]` inside an annotation (Optional[Literal[…]] too)."""
    for node in ast.walk(annotation):  # type: ignore[arg-type]
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "Literal"):
            return tuple(ast.literal_eval(node.slice))
    raise AssertionError("no Literal")


# ------------------------------------------------------------- defaults from the frameworks
def test_megatron_runs_without_tp_overlap_and_delayed_fp8_unless_told():
    line, _, default = _field("megatron", "core/model_parallel_config.py",
                              "ModelParallelConfig", "tp_comm_overlap")
    assert (line, default) == (186, False)
    settings = resolve("megatron-te")
    assert settings.tp_overlap == "none" and "tp_overlap" in settings.assumed
    line, annotation, default = _field("megatron", "core/transformer/transformer_config.py",
                                       "TransformerConfig", "fp8_recipe")
    stack = get_stack("megatron-te")
    assert line == 436 and stack.fp8[0] == default == "delayed"
    assert set(stack.fp8) == set(_literal(annotation)) - {"custom"}
    for name in stack.fp8:
        assert stack.fp8_recipe(name).name == name


def test_torchtitan_runs_eager_without_async_tp_and_rowwise_fp8_unless_told():
    for field, line in (("enable", 292), ("enable_async_tensor_parallel", 295)):
        assert _field("torchtitan", "config/configs.py", "CompileConfig", field)[::2] == (
            line, False)
    settings = resolve("torchtitan")
    assert (settings.compile, settings.kernels, settings.tp_overlap) == (False, "eager", "none")
    assert set(settings.assumed) == {"compile", "tp_overlap", "dp_overlap", "attention"}
    _, annotation, default = _field("torchtitan", "components/quantization/float8.py",
                                    "Config", "recipe_name")
    stack = get_stack("torchtitan")
    assert stack.fp8 == (default, *[r for r in _literal(annotation) if r != default], "mxfp8")


def test_a_stack_without_fp8_names_every_stack_with_its_recipes():
    with pytest.raises(ShardwiseError) as info:
        get_stack("hf-sdpa").fp8_recipe("delayed")
    assert str(info.value) == (
        "hf-sdpa has no FP8 training; stacks with FP8: megatron-te (delayed, tensorwise, "
        "mxfp8, blockwise), torchtitan (rowwise, rowwise_with_gw_hp, mxfp8), pytorch-fsdp "
        "(delayed), torchtitan@0.1.0 (tensorwise, rowwise, rowwise_with_gw_hp, mxfp8)")
    with pytest.raises(ShardwiseError) as info:
        get_stack("torchtitan").fp8_recipe("delayed")
    assert str(info.value) == ("torchtitan has no FP8 recipe 'delayed'; valid: rowwise, "
                               "rowwise_with_gw_hp, mxfp8")


def test_deepspeed_overlaps_zero_traffic_at_stage_3_only_by_default():
    """deepspeed/runtime/zero/config.py @0.19.8: `overlap_comm` None → `self.stage ==
    ZeroStageEnum.weights` (:386), `weights = 3` (:86)."""
    lines = _source("deepspeed", "runtime/zero/config.py").read_text().splitlines()
    assert lines[85].strip() == "weights = 3"
    assert lines[385].strip() == "self.overlap_comm = self.stage == ZeroStageEnum.weights"
    default = resolve("megatron-deepspeed")
    assert default.dp_overlap is None and "dp_overlap" in default.assumed
    stages = np.array([0, 1, 2, 3])
    assert [bool(default.dp_overlapped(z)) for z in range(4)] == [False, False, False, True]
    assert default.dp_overlapped(stages).tolist() == [False, False, False, True]
    for told in (True, False):  # --dp-overlap / --no-dp-overlap: every stage alike
        settings = resolve("megatron-deepspeed", dp_overlap=told)
        assert settings.dp_overlapped(2) is told and "dp_overlap" not in settings.assumed
        got = settings.dp_overlapped(stages)
        assert isinstance(got, np.ndarray) and got.shape == (4,) and got.tolist() == [told] * 4
        assert settings.dp_overlapped(np.array([[1, 3]])).shape == (1, 2)


def test_p2p_overlap_is_megatrons_interleaved_only_rule():
    """Megatron overlaps pipeline p2p only with virtual stages (chunks > 1); torchtitan's
    schedules always, DeepSpeed's engine never."""
    megatron = resolve("megatron-te")
    assert [bool(megatron.p2p_overlapped(c)) for c in (1, 2, 4)] == [False, True, True]
    assert megatron.p2p_overlapped(np.array([1, 2])).tolist() == [False, True]
    assert resolve("torchtitan").p2p_overlapped(1) is True
    assert resolve("megatron-deepspeed").p2p_overlapped(4) is False


@pytest.mark.parametrize("rule", ["never", "interleaved", "always", "sometimes"])
def test_a_stacks_p2p_rule_is_one_of_three(rule):
    from dataclasses import replace

    stack = replace(get_stack("megatron-deepspeed"), p2p_overlap=rule)
    if rule == "sometimes":
        with pytest.raises(ShardwiseError, match="p2p_overlap 'sometimes' unknown"):
            stack.validate()
    else:
        assert stack.validate() is stack


# -------------------------------------------------------------------- what a run prints
def test_describe_marks_exactly_the_assumed_settings():
    assert resolve("megatron-te").describe() == (
        "Megatron-LM + Transformer Engine (megatron-core 0.16.1; Megatron-LM main d98e8a6): "
        "fused kernels (assumed), TP overlap none (assumed), DP overlap default (assumed), "
        "attention cudnn (assumed)")
    told = resolve("torchtitan", compile=True, tp_overlap="async", attention="fa3")
    assert told.describe() == ("torchtitan (torchtitan 0.3.0): torch.compile, TP overlap "
                               "async, DP overlap default (assumed), attention fa3")
    eager = resolve("torchtitan", compile=False, tp_overlap="none", attention="flex")
    assert eager.describe() == ("torchtitan (torchtitan 0.3.0): eager kernels, TP overlap "
                                "none, DP overlap default (assumed), attention flex")
    ds = "Megatron-DeepSpeed (DeepSpeed's pipeline engine and ZeRO) (DeepSpeed 0.19.8; " \
         "Megatron-DeepSpeed 4efb479)"
    for flag, word in ((True, "on"), (False, "off")):
        assert resolve("megatron-deepspeed", dp_overlap=flag).describe() == (
            f"{ds}: fused kernels (assumed), TP overlap none (assumed), DP overlap {word}, "
            "attention fa2 (assumed)")
    assert resolve("megatron-deepspeed", flash=False).describe().endswith(
        "DP overlap default (assumed), attention math")


def test_to_dict_is_the_stack_and_its_resolved_settings():
    stack = get_stack("torchtitan")
    told = resolve("torchtitan", compile=True, tp_overlap="async", attention="fa3")
    assert told.to_dict() == {
        "name": "torchtitan", "title": "torchtitan", "version": "torchtitan 0.3.0",
        "source": stack.source, "compile": True, "kernels": "compiled",
        "tp_overlap": "async", "dp_overlap": None, "dp_overlap_by_default_at_zero": [0, 1, 2, 3],
        "attention": "fa3", "assumed": ["dp_overlap"], "export": "torchtitan"}
    ds = resolve("megatron-deepspeed", dp_overlap=False).to_dict()
    assert (ds["dp_overlap"], ds["dp_overlap_by_default_at_zero"], ds["export"]) == (
        False, [3], "deepspeed")
    assert ds["assumed"] == ["compile", "tp_overlap", "attention"]


# ------------------------------------------------------------ context-parallel kinds refused
def test_a_context_parallel_kind_the_stack_lacks_is_named_with_the_ones_it_has():
    """Megatron-DeepSpeed's CP is DeepSpeed-Ulysses (deepspeed/sequence/layer.py
    `DistributedAttention`: all-to-alls over heads); torchtitan 0.1.0 rotates K/V by
    all-gather or all-to-all round the ring; GPT-NeoX has no CP axis at all, so only that is
    said."""
    layer = _source("deepspeed", "sequence/layer.py").read_text()
    assert "class DistributedAttention" in layer and "all_to_all_single" in layer
    ring = Layout(dp=2, cp=2, cp_kind="ring")
    assert get_stack("megatron-deepspeed").layout_problems(ring) == [
        "megatron-deepspeed's context parallelism is Ulysses (an all-to-all over heads), not "
        "ring attention (cp_kind=ring, planned for cp=2)"]
    ulysses = Layout(dp=2, cp=4, cp_kind="ulysses", zero=2)
    assert get_stack("torchtitan@0.1.0").layout_problems(ulysses) == [
        "torchtitan@0.1.0's context parallelism is an all-gather of K/V or ring attention, "
        "not Ulysses (an all-to-all over heads) (cp_kind=ulysses, planned for cp=4)"]
    assert get_stack("gpt-neox").layout_problems(ring) == [
        "gpt-neox has no CP (cp=2); it runs tp, pp"]
    assert get_stack("megatron-deepspeed").layout_problems(Layout(dp=2, cp=2,
                                                                  cp_kind="ulysses")) == []


def test_resolve_names_each_refused_choice():
    with pytest.raises(ShardwiseError) as info:
        resolve("megatron-te", compile=True, tp_overlap="async")
    assert str(info.value) == ("megatron-te has no kernel mode torch.compile; valid: eager; "
                               "megatron-te has no TP overlap async; valid: none, bulk")
