"""`TrainSpec`'s documented normalisation and its one-line refusals (layout.py), and the rest of
`Layout`'s grammar: list fields given as "a,b" or "a b" text; `impl` as name@version;
`--dtype fp8` read as FP8 training (bf16 weights, the stack's default recipe: Megatron-LM's
`--fp8-recipe` default "delayed", arguments.py of megatron-core 0.16.1); gradients reduced
in the stack's own dtype (torchtitan: fp32, `mixed_precision_reduce`); the expert-parallel
dispatchers and overlaps each stack runs (Megatron-Core transformer_config.py:
moe_shared_expert_overlap only with alltoall; DeepEP's FP8 dispatch with flex); the
"partition=" Megatron layout string whose commas are cosmetic; the spec type checks.
Every bad input: `ShardwiseError`, one line naming the value and what is valid."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec, check_specs


def _refused(message: str, **fields: object) -> str:
    with pytest.raises(ShardwiseError) as err:
        TrainSpec(**fields).validate()  # type: ignore[arg-type]
    text = str(err.value)
    assert message in text and "\n" not in text, text
    return text


def test_list_fields_read_from_text():
    spec = TrainSpec(recompute_modules="core_attn,mlp moe_act", cuda_graph="attn, mlp",
                     offload_modules=["attn_norm"])
    assert spec.recompute_modules == ("core_attn", "mlp", "moe_act")
    assert spec.cuda_graph == ("attn", "mlp")
    assert spec.offload_modules == ("attn_norm",)
    assert TrainSpec(recompute_modules=["mlp", "core_attn"]).recompute_modules == (
        "mlp", "core_attn")


def test_impl_version_fp8_dtype_and_gradient_defaults():
    assert TrainSpec(impl="torchtitan@0.1.0").impl == "torchtitan@0.1.0"
    assert TrainSpec(impl="torchtitan@0.3.0").impl == "torchtitan"  # the current version
    assert TrainSpec(impl="megatron-te").fp8 is None  # bf16 GEMMs unless asked
    fp8 = TrainSpec(dtype="fp8", impl="megatron-te")
    assert (fp8.dtype, fp8.fp8) == ("bf16", "delayed")
    # a stack without FP8 keeps dtype fp8, refused by validate
    _refused("dtype fp8: FP8 training keeps bf16 weights", dtype="fp8", impl="gpt-neox")
    _refused("dtype fp8 with --fp8 delayed: use --dtype bf16 --fp8 delayed", dtype="fp8",
             fp8="delayed", impl="megatron-te")
    assert TrainSpec(impl="torchtitan").grad_dtype == "fp32"
    assert TrainSpec(impl="torchtitan", grad_dtype="fp32").validate().grad_dtype == "fp32"
    assert TrainSpec(impl="megatron-te").grad_dtype is None  # bf16: its first choice
    assert TrainSpec(impl="megatron-te", dtype="fp32").grad_dtype is None  # hf: no choice
    _refused("torchtitan reduces bf16 gradients in fp32, not bf16; valid --grad-dtype: fp32",
             impl="torchtitan", grad_dtype="bf16")


def test_dtype_and_optimizer_refusals_name_the_valid_values():
    _refused("grad_dtype bf16 is narrower than dtype fp32", dtype="fp32", grad_dtype="bf16",
             impl="megatron-te")
    _refused("optimizer 'lion' unknown; valid: adam, sgd-momentum, sgd, adam-8bit, adafactor",
             optimizer="lion")
    _refused("stack 'nope' unknown; valid: megatron-te, ", impl="nope")
    _refused("megatron-te reduces bf16 gradients in bf16 or fp32, not fp16; valid "
             "--grad-dtype: bf16, fp32", impl="megatron-te", grad_dtype="fp16")
    _refused("megatron-te has no TP overlap bogus; valid: none, bulk", tp_overlap="bogus")
    _refused("megatron-te has no FP8 recipe 'bogus'; valid: delayed", fp8="bogus")
    _refused("offload 'bogus' unknown; valid: none, optimizer, params", offload="bogus")
    _refused("dtype 'fp7' unknown; valid: ", dtype="fp7")
    assert _refused("torchtitan does not train in fp16", impl="torchtitan", dtype="fp16"
                    ).endswith("torchtitan does not train in fp16; valid: bf16, fp32")
    text = _refused("expert_load must be ≥ 1", expert_load=0.5)
    assert "0.5" in text
    TrainSpec(expert_load=1.0).validate()
    assert _refused("expert_load must be a finite number > 0", expert_load=0).startswith(
        "expert_load must be a finite number > 0")
    assert _refused("experts_active", experts_active=1.5).startswith(
        "experts_active must be a finite number in (0, 1]")
    _refused("seq_len must be an integer in [1, ", seq_len=None)
    _refused("seq_len", seq_len=0)
    _refused("global_batch", global_batch=0)
    TrainSpec(global_batch=None).validate()


def test_moe_communication_per_stack():
    _refused("moe_dispatcher 'allgather': torchtitan runs alltoall, flex", impl="torchtitan",
             moe_dispatcher="allgather")
    _refused("moe_overlap 'shared': torchtitan runs none", impl="torchtitan",
             moe_overlap="shared")
    # a stack with no entry runs alltoall without overlap
    _refused("moe_overlap 'shared': gpt-neox runs none", impl="gpt-neox", moe_overlap="shared")
    TrainSpec(impl="gpt-neox", moe_overlap="none").validate()
    # megatron-te's default dispatcher (alltoall) allows the shared-expert overlap
    TrainSpec(impl="megatron-te", moe_overlap="shared").validate()
    _refused("moe_overlap shared needs the alltoall dispatcher", impl="megatron-te",
             moe_overlap="shared", moe_dispatcher="flex")
    _refused("moe_dispatch_fp8 needs the flex (DeepEP) dispatcher", impl="megatron-te",
             moe_dispatch_fp8=True)
    TrainSpec(impl="megatron-te", moe_dispatch_fp8=True, moe_dispatcher="flex").validate()
    for sms in (1, 64):
        TrainSpec(comm_sms=sms).validate()
    for sms in (0, 65, 2.5):
        _refused(f"comm_sms must be an integer in 1..64 or None, got {sms!r}", comm_sms=sms)
    # a capacity factor pads to at least the balanced share: below 1 it would drop tokens
    _refused("moe_capacity must be a factor ≥ 1 or None (dropless), got 0.5", moe_capacity=0.5)
    TrainSpec(moe_capacity=1.0).validate()


def test_offload_fraction_refusals():
    assert _refused("offload_fraction", offload_fraction=1.5).startswith(
        "offload_fraction must be a finite number in (0, 1]")
    _refused("offload_fraction 0.5 needs an optimizer offload that can keep a share on the GPU",
             offload_fraction=0.5, impl="torchtitan")


def test_settings_carry_the_dp_overlap():
    assert TrainSpec(impl="megatron-te", dp_overlap=False).settings().dp_overlap is False
    assert TrainSpec(impl="megatron-te", dp_overlap=True).settings().dp_overlap is True


def test_megatron_layout_with_cosmetic_commas_and_virtual_stages():
    """`partition=Et*3,t|t*4|t*4|t*3,L,pp=2` (commas inside the layout string are cosmetic, as
    megatron-core reads it) with pp=2: four virtual stages → chunks 2, interleaved."""
    fields = Layout.parse_fields("partition=Et*3,t|t*4|t*4|t*3,L,pp=2")
    assert fields["pp"] == 2 and fields["chunks"] == 2
    assert fields["schedule"] == "interleaved"
    given = Layout.parse_fields("pp=2,chunks=1,partition=Et*3,t|t*4|t*4|t*3,L")
    assert given["chunks"] == 1 and "schedule" not in given


def test_short_names_the_cp_kind_only_when_cp_splits():
    assert "ulysses" not in Layout(cp=1, cp_kind="ulysses", dp=2).short()
    assert Layout(cp=2, cp_kind="ulysses", dp=2).short().startswith("dp2 cp2 ulysses")


def test_spec_type_checks_name_the_argument():
    model = get_model("tiny")
    with pytest.raises(ShardwiseError, match=r"^model must be a ModelSpec "
                                             r"\(shardwise.get_model\), got 'llama3-8b'$"):
        Layout().problems("llama3-8b")
    with pytest.raises(ShardwiseError, match=r"cluster .*\(Cluster.of\(gpus, gpu\)\)"):
        Layout().problems(model, cluster="8xh100")
    with pytest.raises(ShardwiseError, match=r"layout .*Layout.parse\('tp=8'\)"):
        check_specs(layout="tp=8")
    assert Layout().problems(model, Cluster.of(1, "h100-sxm"), TrainSpec(seq_len=64)) == []


def test_a_huge_bad_partition_gives_a_short_line():
    """The refusal quotes the value cut to 200 characters, however long the input."""
    with pytest.raises(ShardwiseError) as err:
        Layout(partition=("x" * 50,) * 100)
    text = str(err.value)
    assert text.startswith("partition must be whole layer counts per stage, got ")
    assert len(text) <= 200 and "\n" not in text


@pytest.mark.parametrize(("settings", "message"), [
    ({"moe_overlap": "shared", "moe_dispatcher": "flex"},
     "moe_overlap shared needs the alltoall dispatcher (Megatron-Core transformer_config.py: "
     "moe_shared_expert_overlap only works with alltoall)"),
    ({"moe_overlap": "1f1b", "moe_dispatcher": "allgather"},
     "moe_overlap 1f1b needs the alltoall or flex dispatcher"),
    ({"fp8": "blockwise", "dtype": "fp16"},
     "FP8 recipes run beside bf16 weights and activations; use --dtype bf16 with --fp8 "
     "blockwise, not fp16"),
])
def test_megatron_moe_and_fp8_settings_refused_with_their_reason(settings, message):
    with pytest.raises(ShardwiseError) as info:
        TrainSpec(impl="megatron-te", **settings).validate()
    assert message in str(info.value)


def test_the_allowed_neighbours_of_those_settings_are_accepted():
    """The allgather dispatcher without an overlap, and FP8 in bf16: no problem."""
    TrainSpec(impl="megatron-te", moe_overlap="none", moe_dispatcher="allgather").validate()
    TrainSpec(impl="megatron-te", fp8="blockwise").validate()


def test_a_layout_checked_against_a_train_that_is_not_a_trainspec_is_told_so():
    with pytest.raises(ShardwiseError) as info:
        Layout().problems(get_model("tiny"), None, "x")
    assert str(info.value) == "train must be a TrainSpec (TrainSpec(seq_len=…)), got 'x'"
