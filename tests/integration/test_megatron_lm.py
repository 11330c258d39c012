"""`--emit megatron` through Megatron-LM's full `parse_args` + `validate_args`.

Megatron-LM's training package is not on PyPI: this runs when a Megatron-LM checkout is on
PYTHONPATH (e.g. `PYTHONPATH=src:../Megatron-LM`) and skips otherwise, in CI too. Megatron-LM
main imports Python 3.12's `typing.override` and probes the GPU generation; both stand-ins are
below. Checked with Megatron-LM main d98e8a6 (2026-08-22), the version the export targets.
"""

import sys
import typing

import pytest

from tests.integration.conftest import Emit
from tests.integration.plans import EXPECTED, MEGATRON_EXTRA, PLANS
from tests.integration.test_winners import GRID

pytestmark = pytest.mark.integration

# the accepted plans, the other runs and the planner's winners (test_winners.GRID)
RUNS = {**{p: PLANS[p] for p in PLANS if EXPECTED[p]["megatron"] is None}, **MEGATRON_EXTRA,
        **{f"winner-{m}-{g}-{s}": [m, "--gpus", str(g), "--seq", str(s), "--top", "1"]
           for m, g, s in GRID["megatron"]}}
BACKENDS = {"cudnn": "fused", "fa2": "flash", "fa3": "flash", "math": "unfused"}


def parsed(capsys, monkeypatch, args: list[str]):
    """(the emit, Megatron-LM's validated arguments) of `shardwise plan ARGS --emit megatron`."""
    import typing_extensions

    monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # H100 (sm_90)
    out = Emit(capsys, args, "megatron")
    assert out.code == 0, out.err
    env, words = out.command()
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # the user's data and tokenizer choices, which the plan does not make
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py",
                                      *words[words.index("pretrain_gpt.py") + 1:],
                                      "--tokenizer-type", "NullTokenizer", "--mock-data"])
    args_ = arguments.parse_args()
    args_.world_size, args_.rank = out.layout.world_size, 0
    arguments.validate_args(args_)
    return out, args_


@pytest.mark.parametrize("run", list(RUNS))
def test_megatron_lm_parser_reads_back_the_plan(capsys, monkeypatch, run):
    import torch

    out, args = parsed(capsys, monkeypatch, RUNS[run])
    layout, plan = out.layout, out.plan
    stack = plan["stack"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.expert_model_parallel_size,
            args.data_parallel_size) == (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp)
    chunked = layout.pp > 1 and layout.schedule == "interleaved"
    assert args.virtual_pipeline_model_parallel_size == (layout.chunks if chunked else None)
    assert args.sequence_parallel == layout.sp
    # the context-parallel kind (validate_args requires the a2a+p2p group sizes)
    if layout.cp > 1:
        assert args.cp_comm_type == [{"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p"}[
            layout.cp_kind]]
    assert args.hierarchical_context_parallel_sizes == (
        [layout.ulysses, layout.cp // layout.ulysses] if layout.cp_kind == "hybrid" else None)
    assert args.recompute_granularity == (None if layout.recompute == "none"
                                          else layout.recompute)
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == (
        layout.micro_batch, plan["global_batch"], plan["seq_len"])
    # ZeRO: the distributed optimizer, Megatron-FSDP and the shard groups
    assert args.use_distributed_optimizer == (layout.zero >= 1)
    assert args.use_megatron_fsdp == (layout.zero >= 2)
    if layout.zero >= 2:
        assert args.data_parallel_sharding_strategy == (
            "optim_grads" if layout.zero == 2 else "optim_grads_params")
    assert args.num_distributed_optimizer_instances == (
        layout.dp * layout.cp // layout.zero_group if layout.zero_group else 1)
    # precision and gradient dtype
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert args.params_dtype == dtypes[plan["dtype"]]
    if layout.zero >= 2:
        assert args.megatron_fsdp_main_grads_dtype == dtypes[plan["grad_dtype"]]
    else:
        assert args.accumulate_allreduce_grads_in_fp32 == (
            plan["grad_dtype"] == "fp32" and plan["dtype"] != "fp32")
    # the stack's overlap settings and attention kernel
    overlapped = (stack["dp_overlap"] if stack["dp_overlap"] is not None
                  else layout.zero in stack["dp_overlap_by_default_at_zero"])
    assert args.overlap_grad_reduce == overlapped
    assert args.overlap_param_gather == (overlapped and layout.zero >= 1)
    assert args.tp_comm_overlap == (stack["tp_overlap"] == "bulk" and layout.sp)
    assert args.attention_backend.name == BACKENDS[stack["attention"]]
