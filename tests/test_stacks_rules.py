"""shardwise.stacks' own rules against references written here: the pipeline engines'
blocking transfers in their documented closed forms (serial DeepSpeed p2p, batched), and a
stack definition's refusals, one named problem each, joined on one line.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.stacks.pipe_engine import DEEPSPEED_PIPE, get_pipe_engine
from shardwise.stacks.stack import get_stack, stack_names


@pytest.mark.parametrize(("p", "m", "serial"), [
    (1, 8, 0), (4, 1, 2 * 3), (2, 5, 2 * 5), (4, 8, 4 * 8 + 2 * 4 - 8), (3, 7, 4 * 7 - 2)])
def test_serial_p2p_transfers_in_closed_form(p, m, serial):
    """DeepSpeed's serial p2p: none on one stage, 2(p-1) for one micro-batch, 2m over two
    stages, else 4m + 2p - 8; batched (Megatron's) 2(m + p - 1) — by hand."""
    assert int(DEEPSPEED_PIPE.transfers(p, m)) == serial
    batched = replace(DEEPSPEED_PIPE, serial_p2p=False)
    assert int(batched.transfers(p, m)) == 2 * (m + p - 1)
    got = DEEPSPEED_PIPE.transfers(np.array([p, p]), np.array([m, m]))
    assert list(got) == [serial, serial]


def test_unknown_pipeline_engine_names_the_valid_ones():
    assert get_pipe_engine("deepspeed") is DEEPSPEED_PIPE
    with pytest.raises(ShardwiseError, match="pipeline engine 'x' unknown; valid: deepspeed, "
                                             "deepspeed-neox"):
        get_pipe_engine("x")


def test_a_stack_definition_refuses_each_wrong_field():
    """Kernels neither fused nor eager, an unknown TP overlap, async TP without
    torch.compile, an unknown pipeline engine — each named, several on one line."""
    titan = get_stack("torchtitan")
    for kernels in ("fused", "eager"):
        assert replace(titan, kernels=kernels).validate().kernels == kernels
    assert replace(titan, pipe_costs=None).validate().pipe_costs is None
    assert replace(titan, tp_overlap=("none", "async"), compile=(True,)).validate()
    assert replace(titan, tp_overlap=("none",), compile=(False,)).validate()
    cases = [({"kernels": "xla"}, "kernels 'xla' must be fused or eager"),
             ({"tp_overlap": ("none", "ring")}, "tp_overlap ('none', 'ring') not in ('none', "
                                                "'bulk', 'async')"),
             ({"tp_overlap": ("async",), "compile": (False,)}, "async TP needs torch.compile"),
             ({"pipe_costs": "gpipe"}, "pipe_costs 'gpipe' not in ('deepspeed', "
                                       "'deepspeed-neox')")]
    for fields, message in cases:
        with pytest.raises(ShardwiseError) as info:
            replace(titan, **fields).validate()
        assert str(info.value) == f"stack torchtitan: {message}"
    with pytest.raises(ShardwiseError) as info:
        replace(titan, kernels="xla", pipe_costs="gpipe").validate()
    assert str(info.value) == ("stack torchtitan: kernels 'xla' must be fused or eager; "
                               "pipe_costs 'gpipe' not in ('deepspeed', 'deepspeed-neox')")


def test_offload_kinds_refused_by_name():
    titan = get_stack("torchtitan")
    assert titan.offload_support("none") is None
    assert titan.offload_support("params").kind == "params"
    with pytest.raises(ShardwiseError, match=r"offload 'disk' unknown; valid: none, "
                                             r"optimizer, params$"):
        titan.offload_support("disk")
    with pytest.raises(ShardwiseError, match=r"torchtitan has no optimizer offload \(it "
                                             r"offloads: params\); stacks that offload the "
                                             r"optimizer: megatron-te, megatron-deepspeed$"):
        titan.offload_support("optimizer")
    assert {"megatron-te", "torchtitan", "megatron-deepspeed"} <= set(stack_names())


def test_stack_splits_at_their_thresholds():
    """GPT-NeoX's L + 2 units need L + 2 ≥ 2·pp (else a stage is empty: None); DeepSpeed's
    blocks, the first L mod pp stages one more — by hand; any other split makes none."""
    from shardwise.stacks.splits import stack_split

    assert stack_split("neox", 6, 4) == (1, 2, 2, 1)  # 8 units, 2 each, ends one short
    assert stack_split("neox", 5, 4) is None
    assert stack_split("deepspeed", 10, 4) == (3, 3, 2, 2)
    assert stack_split("torchtitan", 6, 2, 2) == (1, 2, 2, 1)
    assert stack_split("torchtitan", 5, 2, 2) is None
    assert stack_split("any", 10, 4) is None


@pytest.mark.parametrize(("split", "n_layers", "pp", "sizes"), [
    ("deepspeed", 10, 4, (3, 3, 2, 2)), ("deepspeed", 8, 4, (2, 2, 2, 2)),
    ("neox", 6, 4, (1, 2, 2, 1)), ("neox", 6, 2, (3, 3)), ("torchtitan", 9, 4, (2, 3, 3, 1))])
def test_balanced_ends_reproduce_the_stacks_split(split, n_layers, pp, sizes):
    """The planner's Balanced counts for a stack's own split: counts in [-2, 2] whose
    documented rule (`L + a + z` units, q each, the r extras on stages 1…r, the first stage
    `a` short and the last `z`, written out here) gives the split worked by hand."""
    from shardwise.stacks.splits import balanced_ends

    (a, z), got = balanced_ends(split, n_layers, pp)
    assert got == sizes and -2 <= a <= 2 and -2 <= z <= 2
    q, r = divmod(n_layers + a + z, pp)
    assert [q + (1 <= i <= r) - a * (i == 0) - z * (i == pp - 1) for i in range(pp)] == list(
        sizes)
    assert balanced_ends("any", n_layers, pp) is None


def test_one_layer_per_stage_is_torchtitans_one_layer_per_stage():
    """sizes (1, 1, 1, 1): torchtitan's layers_per_stage 1 with no stage shortened; checked
    with torchtitan 0.3.0's own split."""
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    from shardwise.stacks.splits import titan_partition

    assert titan_partition(4, (1, 1, 1, 1)) == (1, 0, 0)
    parts = _generate_llm_fqn_per_model_part(4, 4, 0, 0)
    assert [sum(n.startswith("layers.") for n in part) for part in parts] == [1, 1, 1, 1]


def test_megatron_deepspeed_refuses_zb_h1_with_sequence_parallelism_only():
    """Megatron-DeepSpeed (megatron/arguments.py:81 @4efb479) asserts ZB-H1 runs without
    sequence parallelism; only a pipelined ZB-H1 run with SP is refused."""
    from shardwise.schedules.registry import SCHEDULE_CODES

    rule = next(r for r in get_stack("megatron-deepspeed").rules if "ZB-H1" in r.reason)
    zb, other = SCHEDULE_CODES["zb-h1"], SCHEDULE_CODES["1f1b"]
    v = {"pp": np.array([2, 2, 2, 1]), "schedule": np.array([zb, other, zb, zb]),
         "sp": np.array([1, 1, 0, 1])}
    assert list(rule.refuses(v, None)) == [True, False, False, False]


def test_resolved_settings_name_what_the_run_left_to_the_stack():
    """`resolve`: each choice not given takes the stack's default and is listed as assumed;
    a choice the stack lacks names the setting in words and the valid ones."""
    from shardwise.stacks.stack import resolve

    every = resolve("torchtitan")
    assert every.assumed == ("compile", "tp_overlap", "dp_overlap", "attention")
    assert (every.compile, every.tp_overlap) == (False, "none")
    some = resolve("torchtitan", compile=True, tp_overlap="async", dp_overlap=True)
    assert some.assumed == ("attention",) and some.kernels == "compiled"
    with pytest.raises(ShardwiseError, match=r"^megatron-te has no kernel mode torch\.compile; "
                                             r"valid: eager$"):
        resolve("megatron-te", compile=True)
    with pytest.raises(ShardwiseError, match=r"^megatron-te has no TP overlap async; valid: "
                                             r"none, bulk; async TP needs torch\.compile"):
        resolve("megatron-te", tp_overlap="async")
    with pytest.raises(ShardwiseError, match=r"^attention flash is a fused kernel; --no-flash "
                                             r"means math"):
        resolve("torchtitan", attention="flash", flash=False)
