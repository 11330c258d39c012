"""What a stack refuses, each as the one sentence a run prints, with the framework code behind
the fact where it is one the framework states: torchtitan's compile config refusing async TP
without compile (config/configs.py:304 @0.3.0) and always overlapping FSDP traffic; the ZeRO
stages and shard groups each stack runs; recompute policies; the stack versions modelled;
offloads; and a stack definition's own field checks."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.stacks import OFFLOADS, Offload, get_stack, parse_impl, resolve, stack_names


def _refused(call) -> str:
    with pytest.raises(ShardwiseError) as info:
        call()
    return str(info.value)


def test_resolve_refuses_settings_the_stack_does_not_have():
    spec = importlib.util.find_spec("torchtitan")
    if spec is not None and spec.submodule_search_locations:
        configs = Path(next(iter(spec.submodule_search_locations))) / "config" / "configs.py"
        lines = configs.read_text().splitlines()
        assert "if self.enable_async_tensor_parallel and not (" in lines[303]
        assert "Async TP requires" in lines[307]
    assert _refused(lambda: resolve("torchtitan", tp_overlap="async")) == (
        "async TP needs torch.compile (--compile)")
    assert resolve("torchtitan", tp_overlap="async", compile=True).kernels == "compiled"
    assert _refused(lambda: resolve("torchtitan", dp_overlap=False)) == (
        "torchtitan always overlaps DP traffic; drop the DP-overlap setting")
    assert resolve("torchtitan", dp_overlap=True).dp_overlap is True
    assert _refused(lambda: resolve("hf-sdpa", flash=False)) == (
        "hf-sdpa always runs a fused attention kernel (fa2); drop --no-flash")
    assert _refused(lambda: resolve("megatron-te", attention="flex")) == (
        "megatron-te has no attention kernel flex; valid: cudnn, fa2, fa3")
    # --no-flash on a stack that has math: math, stated
    settings = resolve("megatron-te", flash=False)
    assert settings.attention == "math" and "attention" not in settings.assumed
    # several problems on one line
    assert _refused(lambda: resolve("hf-eager", compile=True, tp_overlap="bulk",
                                    attention="fa2")) == (
        "hf-eager has no TP overlap bulk; valid: none; hf-eager has no attention kernel fa2; "
        "valid: math")


@pytest.mark.parametrize(("stack", "layout", "problems"), [
    ("torchtitan", Layout(dp=4, zero=1),  # FSDP2: nothing shards only the optimizer state
     ["torchtitan has no ZeRO-1; valid: 0, 2, 3"]),
    ("torchtitan", Layout(dp=4, zero=0, zero_group=2),
     ["torchtitan cannot shard ZeRO-0 in groups (zero_group=2); it can at ZeRO 2, 3"]),
    ("megatron-deepspeed", Layout(dp=4, zero=3, zero_group=2),
     ["megatron-deepspeed cannot shard ZeRO-3 in groups (zero_group=2); use zero_group=0"]),
    ("gpt-neox", Layout(dp=4, recompute="selective"),
     ["gpt-neox has no selective recompute; valid: none, full"]),
    ("hf-sdpa", Layout(dp=2, tp=2, pp=2, zero=2),
     ["hf-sdpa has no TP (tp=2); it runs data parallelism only",
      "hf-sdpa has no PP (pp=2); it runs data parallelism only"]),
    ("torchtitan", Layout(dp=2, zero=2, zero_group=2), []),
])
def test_layout_problems_one_sentence_each(stack, layout, problems):
    assert get_stack(stack).layout_problems(layout) == problems


def test_a_stack_that_always_exposes_dp_traffic_says_so(monkeypatch):
    """A stack whose DP traffic is never overlapped and cannot be (none registered today:
    each stack without the setting overlaps at every ZeRO stage) refuses the overlap with
    the sentence torchtitan's refusal mirrors, and runs without it."""
    from shardwise.stacks.stack import STACKS

    monkeypatch.setitem(STACKS, "serial-ddp", replace(
        get_stack("torchtitan"), name="serial-ddp", dp_overlap_zero=()))
    assert _refused(lambda: resolve("serial-ddp", dp_overlap=True)) == (
        "serial-ddp always exposes DP traffic; drop the DP-overlap setting")
    assert resolve("serial-ddp", dp_overlap=False).dp_overlap is False


def test_stack_versions_are_named_when_another_is_asked():
    assert parse_impl("torchtitan") == "torchtitan"
    assert parse_impl("torchtitan@0.3.0") == "torchtitan"
    assert parse_impl("torchtitan@0.1.0") == "torchtitan@0.1.0"
    assert get_stack("torchtitan").label == "torchtitan@0.3.0"
    assert get_stack("torchtitan@0.1.0").label == "torchtitan@0.1.0"
    assert _refused(lambda: parse_impl("torchtitan@0.2.0")) == (
        "stack torchtitan is modelled at torchtitan 0.3.0 and torchtitan 0.1.0 only; use "
        "torchtitan@0.3.0, torchtitan@0.1.0 or torchtitan")
    assert _refused(lambda: parse_impl(3)) == "stack must be a name, got int"
    assert _refused(lambda: parse_impl("nemo")) == (
        f"stack 'nemo' unknown; valid: {', '.join(stack_names())}")
    assert stack_names()[0] == "megatron-te"


def test_offloads_each_stack_runs_and_the_ones_it_does_not():
    assert get_stack("hf-sdpa").offload_support("none") is None
    assert get_stack("hf-sdpa").offload_kinds() == ("none",)
    assert get_stack("megatron-deepspeed").offload_kinds() == ("none", "optimizer", "params")
    titan = get_stack("torchtitan").offload_support("params")
    assert (titan.zero, titan.flag) == ((3,), "--training.enable_cpu_offload")
    assert _refused(lambda: get_stack("hf-sdpa").offload_support("optimizer")) == (
        "hf-sdpa has no optimizer offload (it offloads: nothing); stacks that offload the "
        "optimizer: megatron-te, megatron-deepspeed")
    assert _refused(lambda: get_stack("torchtitan").offload_support("optimizer")) == (
        "torchtitan has no optimizer offload (it offloads: params); stacks that offload the "
        "optimizer: megatron-te, megatron-deepspeed")
    assert _refused(lambda: get_stack("torchtitan").offload_support("disk")) == (
        f"offload 'disk' unknown; valid: {', '.join(OFFLOADS)}")


def test_a_stack_definition_names_each_wrong_field():
    titan = get_stack("torchtitan")
    cases = [
        ({"fp8": ("rowwise", "delayed")},
         "fp8 recipe 'delayed' is not one of torchao framework's"),
        ({"fp8": ("delayed",), "fp8_framework": ""}, "fp8 recipe 'delayed' is not one of no "
                                                     "framework's"),
        ({"offloads": (Offload("disk", (3,), "torch-adamw-fused", "none", "--x"),)},
         "offload 'disk' not in ('optimizer', 'params')"),
        ({"split": "even"}, "split 'even' not in ('any', 'torchtitan', 'deepspeed', 'neox')"),
        ({"grad_dtypes": (("bf16", ("fp32",)),)},
         "grad_dtypes (('bf16', ('fp32',)),) do not cover ('bf16', 'fp32')"),
        ({"attention": ("flex", "sdpa")},
         "attention ('flex', 'sdpa') not in ('cudnn', 'fa2', 'fa3', 'flex', 'triton', 'math')"),
        ({"p2p_overlap": "sometimes"}, "p2p_overlap 'sometimes' unknown"),
    ]
    for fields, message in cases:
        assert _refused(lambda f=fields: replace(titan, **f).validate()) == (
            f"stack torchtitan: {message}")
    assert replace(titan, grad_dtypes=None).validate().grad_dtypes is None


def test_a_pipeline_the_stacks_engine_cannot_run_is_named():
    """Megatron-DeepSpeed over 2 stages: DeepSpeed's 'type:transformer' partition gives the
    first stage the odd block of 7 (4, 3), so the balanced default 3,4 is refused and 4,3 is
    not; its engine runs 1F1B and ZB-H1, not the interleaved schedule."""
    from shardwise.stacks import SPLIT_RULES

    ds = get_stack("megatron-deepspeed")
    assert ds.layout_problems(Layout(dp=2, pp=2), n_layers=7) == [
        f"megatron-deepspeed cannot split 7 layers as 3,4 ({SPLIT_RULES['deepspeed']})"]
    assert ds.layout_problems(Layout(dp=2, pp=2, partition=(4, 3)), n_layers=7) == []
    assert ds.layout_problems(Layout(dp=2, pp=2), n_layers=None) == []  # not checked
    assert ds.layout_problems(Layout(dp=2, pp=2, chunks=2, schedule="interleaved")) == [
        "megatron-deepspeed has no interleaved pipeline schedule; valid: 1f1b, zb-h1"]
