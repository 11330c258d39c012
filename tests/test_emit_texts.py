"""What the exports write that no framework's parser reads back: the layout named in the
header, the note on `.deepspeed_env`, Megatron's token dispatcher left at its default where
the plan keeps it, and the refusal of the precision-aware optimizer without the distributed
optimizer — each against the rule its docstring or source states."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.emit.common import layout_text
from shardwise.emit.deepspeed import deepspeed_config
from shardwise.emit.megatron_run import megatron_run_settings
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec


def test_a_layout_of_data_parallelism_alone_is_named_so():
    """`--layout` text lists every field but dp that differs from the default; none: "dp
    only"."""
    assert layout_text(Layout(dp=8)) == "dp only"
    assert layout_text(Layout(dp=2, tp=2, sp=True)) == "tp=2,sp=1"


def test_deepspeed_names_the_env_file_that_carries_the_variable_to_other_nodes():
    """With sequence parallelism over several nodes, CUDA_DEVICE_MAX_CONNECTIONS=1 must
    reach every node: DeepSpeed's launcher forwards only `.deepspeed_env`'s variables
    (deepspeed/launcher/runner.py)."""
    out = deepspeed_config(get_model("llama3-8b"), Layout(dp=4, tp=4, sp=True),
                           TrainSpec(seq_len=4096, global_batch=16, impl="megatron-deepspeed"),
                           gpus_per_node=8)
    assert any(note.startswith("on the other nodes CUDA_DEVICE_MAX_CONNECTIONS=1 comes from "
                               ".deepspeed_env (the launcher forwards only its listed")
               for note in out.notes), out.notes


@pytest.mark.parametrize(("ep", "dispatcher", "flag"), [
    (1, None, None),  # Megatron's default (allgather), which the plan times without ep
    (2, None, "--moe-token-dispatcher-type alltoall"),
    (1, "alltoall", "--moe-token-dispatcher-type alltoall"),
])
def test_megatron_names_the_token_dispatcher_only_where_the_plan_changes_it(ep, dispatcher,
                                                                            flag):
    model = get_model("mixtral-8x7b")
    train = TrainSpec(seq_len=4096, global_batch=64, moe_dispatcher=dispatcher)
    args = megatron_run_settings(model, Layout(dp=8, ep=ep), train, [], False)
    said = [arg for arg in args if arg.startswith("--moe-token-dispatcher-type")]
    assert said == ([flag] if flag else [])


def test_megatron_refuses_low_precision_moments_without_the_distributed_optimizer():
    """megatron-core 0.16.1's --use-precision-aware-optimizer runs adam with the distributed
    optimizer only (optimizer_config.py): BF16 moments at ZeRO 0 are refused in one line."""
    train = TrainSpec(seq_len=4096, global_batch=64, exp_avg_dtype="bf16",
                      exp_avg_sq_dtype="bf16")
    with pytest.raises(ShardwiseError, match=r"^--emit megatron cannot run exp_avg_dtype, "
                                             r"exp_avg_sq_dtype as planned: .*distributed "
                                             r"optimizer only .*not adam at zero=0$"):
        megatron_run_settings(get_model("llama3-8b"), Layout(dp=8), train, [], False)
