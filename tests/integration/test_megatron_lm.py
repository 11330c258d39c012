"""`--emit megatron` through Megatron-LM's full `parse_args` + `validate_args`.

Megatron-LM's training package is not on PyPI: this runs when a Megatron-LM checkout is on
PYTHONPATH (e.g. `PYTHONPATH=src:../Megatron-LM`) and skips otherwise, in CI too. Megatron-LM
main imports Python 3.12's `typing.override` and probes the GPU generation; both stand-ins are
below. All 21 plans passed with Megatron-LM main of 2026-08-22 (d98e8a6, megatron-core 0.20).
"""

import sys
import typing

import pytest

from tests.integration.conftest import emit
from tests.integration.plans import PLANS

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("plan", list(PLANS))
def test_megatron_lm_parser_accepts_the_plan(capsys, monkeypatch, plan):
    import typing_extensions

    monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # H100 (sm_90)
    out = emit(capsys, plan, "megatron")
    assert out.code == 0, out.err
    env, words = out.command()
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # the user's data and tokenizer choices, which the plan does not make
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py",
                                      *words[words.index("pretrain_gpt.py") + 1:],
                                      "--tokenizer-type", "NullTokenizer", "--mock-data"])
    args = arguments.parse_args()
    layout = out.layout
    args.world_size, args.rank = layout.world_size, 0
    arguments.validate_args(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.expert_model_parallel_size,
            args.data_parallel_size) == (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp)
    assert args.virtual_pipeline_model_parallel_size == (
        layout.chunks if layout.schedule == "interleaved" else None)
    assert args.sequence_parallel == layout.sp
    # the context-parallel kind (validate_args requires the a2a+p2p group sizes)
    if layout.cp > 1:
        assert args.cp_comm_type == [{"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p"}[
            layout.cp_kind]]
    assert args.hierarchical_context_parallel_sizes == (
        [layout.ulysses, layout.cp // layout.ulysses] if layout.cp_kind == "hybrid" else None)
    assert args.recompute_granularity == (None if layout.recompute == "none"
                                          else layout.recompute)
    assert args.micro_batch_size == layout.micro_batch
    assert args.use_distributed_optimizer == (layout.zero >= 1)
    assert args.use_megatron_fsdp == (layout.zero >= 2)
    assert not args.accumulate_allreduce_grads_in_fp32  # the plans reduce in bf16/fp16
