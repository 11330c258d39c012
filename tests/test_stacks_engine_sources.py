"""DeepSpeed's pipeline engine and the stacks' gradient dtypes against the frameworks' code,
run or read from the installed sources without importing the packages (deepspeed's import
alone takes seconds): `TrainSchedule.num_pipe_buffers` itself, executed on each (stages,
stage, micro-batches), against `PipeEngine.buffers`; the engine's ZeRO assertion as the
`PIPE_ZERO` rule's mask over arrays of layouts (`Stack.refused`); the TP all-gathers per
micro-batch on the busiest stage by hand; torchtitan's reduce dtype literal."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shardwise.stacks import get_stack
from shardwise.stacks.definitions import PIPE_DP_OVERLAP, PIPE_ZERO
from shardwise.stacks.pipe_engine import DEEPSPEED_PIPE, NEOX_PIPE


def _source(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _method(package: str, relative: str, cls: str, name: str):
    """The function `cls.name` of the package's file, compiled on its own."""
    tree = ast.parse(_source(package, relative).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    namespace: dict = {}
                    exec(compile(ast.Module([item], []), relative, "exec"), namespace)
                    return namespace[name]
    raise AssertionError(f"{cls}.{name} not in {relative}")


def test_pipe_buffers_are_deepspeeds_train_schedule():
    """deepspeed/runtime/pipe/schedule.py @0.19.8 TrainSchedule.num_pipe_buffers:
    max(2, min(stages - stage_id, micro_batches))."""
    num_pipe_buffers = _method("deepspeed", "runtime/pipe/schedule.py", "TrainSchedule",
                               "num_pipe_buffers")
    for engine in (DEEPSPEED_PIPE, NEOX_PIPE):
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 3, 5, 16):
                for stage in range(p):
                    real = num_pipe_buffers(SimpleNamespace(stages=p, stage_id=stage,
                                                            micro_batches=m))
                    assert engine.buffers(p, m, stage) == real, (p, m, stage)
    # by hand: stage 0 of 4 with 3 micro-batches keeps 3; the last stage 2, not 1
    assert (DEEPSPEED_PIPE.buffers(4, 3, 0), DEEPSPEED_PIPE.buffers(4, 8, 3)) == (3, 2)


def test_the_pipeline_engine_refuses_zero_2_and_3_as_deepspeed_asserts():
    """deepspeed/runtime/pipe/engine.py:76 asserts `zero_optimization_stage() <
    ZeroStageEnum.gradients` (= 2, runtime/zero/config.py:85); without pp the engine is not
    used. The mask over arrays of layouts is the assertion's."""
    engine = _source("deepspeed", "runtime/pipe/engine.py").read_text().splitlines()
    assert "< ZeroStageEnum.gradients" in engine[76]
    zero_config = _source("deepspeed", "runtime/zero/config.py").read_text().splitlines()
    assert zero_config[84].strip() == "gradients = 2"
    pp = np.array([1, 1, 2, 2, 2, 4, 4, 4])
    zero = np.array([2, 3, 0, 1, 2, 1, 2, 3])
    v = {"pp": pp, "zero": zero}
    assert PIPE_ZERO.refuses(v, None).tolist() == ((pp > 1) & (zero >= 2)).tolist() == [
        False, False, False, False, True, False, True, True]
    stack = get_stack("megatron-deepspeed")
    one, none = np.ones(8, dtype=int), np.zeros(8, dtype=int)
    codes = {"dp": 4 * one, "tp": one, "cp": one, "ep": one, "sp": none, "zero_group": none,
             "schedule": none} | v  # 4-way data parallel, nothing else
    masks = dict((rule.source, mask) for rule, mask in stack.refused(codes))
    assert masks[PIPE_ZERO.source].tolist() == [False, False, False, False, True, False,
                                                True, True]
    # --dp-overlap under the pipeline engine: refused only with pp > 1 and only when asked
    asked = SimpleNamespace(dp_overlap=True)
    assert PIPE_DP_OVERLAP.refuses(v, asked).tolist() == (pp > 1).tolist()
    assert not PIPE_DP_OVERLAP.refuses(v, SimpleNamespace(dp_overlap=None)).any()


def test_tp_all_gathers_on_the_busiest_stage():
    """`gathers` (2, 3, 1): the first stage 2, a middle one 3, the last 1 per micro-batch
    (PartitionedTensor.full in the forward's input, the backward's output and gradient): two
    stages have no middle one, so their busiest is the first's 2."""
    assert DEEPSPEED_PIPE.gathers == (2, 3, 1)
    assert DEEPSPEED_PIPE.critical_gathers(np.array([2, 3, 4, 8])).tolist() == [2, 3, 3, 3]
    assert int(DEEPSPEED_PIPE.critical_gathers(2)) == 2


def test_gradient_dtypes_are_what_each_framework_accepts():
    """torchtitan reduces in float32 only (config/configs.py:93 `mixed_precision_reduce:
    Literal["float32"]`); Megatron in bf16 with --grad-reduce-in-bf16, else fp32; a stack
    with no modelled rule (Hugging Face) takes any (None)."""
    tree = ast.parse(_source("torchtitan", "config/configs.py").read_text())
    (reduce,) = [n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == "mixed_precision_reduce"]
    assert reduce.lineno == 93 and ast.literal_eval(reduce.annotation.slice) == "float32"
    titan = get_stack("torchtitan")
    assert titan.grad_choices("bf16") == titan.grad_choices("fp32") == ("fp32",)
    assert titan.grad_choices("fp16") is None  # not one of its dtypes
    megatron = get_stack("megatron-te")
    assert megatron.grad_choices("bf16") == ("bf16", "fp32")
    assert megatron.grad_choices("fp16") == ("fp16", "fp32")
    assert get_stack("hf-sdpa").grad_choices("bf16") is None
