"""`--emit megatron` against Megatron-LM's own parser and `validate_args` rules.

Megatron-LM's training package is not on PyPI, so its parser is kept as data:
data/megatron_lm_arguments.json lists every option `pretrain_gpt.py` accepts as
`megatron.training.arguments.add_megatron_arguments` builds it (its hand-written options and
those generated from megatron-core's config dataclasses) at the Megatron-LM commit the file
names; scripts/megatron_lm_arguments.py writes it from a checkout. The emitted command is
parsed by an `argparse` parser rebuilt from that table — an option Megatron-LM does not know,
a value its type cannot read or outside its choices fails — and the `validate_args` rules
that the emitted options touch are applied as written there (line numbers of that commit's
megatron/training/arguments.py). The global batch goes through megatron-core's own
micro-batch calculator (the `frameworks` extra's megatron-core).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import pytest

from tests.integration.conftest import emit, require
from tests.integration.plans import PLANS

pytestmark = pytest.mark.integration

TABLE = json.loads((Path(__file__).parent / "data" / "megatron_lm_arguments.json").read_text())
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # Megatron-LM main of 2026-08-22
# what a user adds to the emitted command: data and tokenizer, which the plan does not choose
USER = ["--tokenizer-type", "NullTokenizer", "--mock-data"]


def _parse(argv: list[str]) -> argparse.Namespace:
    """`argv` read by the rebuilt parser; an option it does not know is an error, as in
    Megatron-LM's `parse_args` (which does not ignore unknown arguments)."""
    args, unknown = _parser().parse_known_args(argv)
    if unknown:
        raise argparse.ArgumentError(None, f"unrecognized arguments: {' '.join(unknown)}")
    return args


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser rebuilt from the table: its types are int, float, str and bool;
    an enum option takes its members' names; a custom parsing function is read as text."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    types = {"int": int, "float": float, "str": str, "enum": str, "custom": str,
             "bool": lambda text: {"true": True, "false": False}[text.lower()]}
    for option in TABLE["options"]:
        kind, flags = option["kind"], option["flags"]
        common = {"dest": option["dest"], "default": option["default"]}
        if kind in ("store_true", "store_false"):
            parser.add_argument(*flags, action=kind, **common)
        elif kind == "boolean_optional":
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        else:
            parser.add_argument(*flags, type=types[option["type"]], nargs=option["nargs"],
                                choices=option["choices"], **common)
    return parser


def test_the_table_is_the_pinned_commits():
    assert TABLE["commit"] == COMMIT
    flags = {flag for option in TABLE["options"] for flag in option["flags"]}
    assert len(flags) > 800 and "--num-distributed-optimizer-instances" in flags


def _validate(args: argparse.Namespace, world: int, env: dict[str, str]) -> None:
    """The rules of Megatron-LM's `validate_args` (arguments.py at COMMIT, line numbers) that
    the emitted options reach; each raises as Megatron-LM's does (an AssertionError)."""
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    assert world % (tp * pp * cp) == 0  # L432
    args.data_parallel_size = world // (tp * pp * cp)  # L448
    if args.recompute_activations:  # L607
        args.recompute_granularity = "selective"
    vp_options = (args.num_layers_per_virtual_pipeline_stage,
                  args.num_virtual_stages_per_pipeline_rank,
                  args.pipeline_model_parallel_layout)
    assert sum(option is not None for option in vp_options) <= 1  # L927
    vp = args.num_virtual_stages_per_pipeline_rank  # L988
    if vp is None and args.num_layers_per_virtual_pipeline_stage is None:
        uneven = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
        if uneven == (None, None):  # L996-1000
            assert args.num_layers % pp == 0
    args.virtual_pipeline_model_parallel_size = None if vp == 1 else vp  # L990
    if args.virtual_pipeline_model_parallel_size is not None:  # L1001-1008
        assert pp > (1 if args.overlap_p2p_comm else 2)
    if args.overlap_param_gather:  # L1024-1029
        assert args.use_distributed_optimizer or args.use_megatron_fsdp
        assert args.overlap_grad_reduce
    if args.use_megatron_fsdp:  # L1118-1135: FSDP v1 runs on the distributed optimizer
        if args.megatron_fsdp_version == 2:
            assert not args.use_distributed_optimizer
        else:
            args.use_distributed_optimizer = True
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1"  # L1166
        assert args.ckpt_format == "fsdp_dtensor"  # L1169
    assert args.hidden_size % args.num_attention_heads == 0  # L1332
    if cp > 1:  # L1335-1338
        assert args.seq_length % (2 * cp) == 0
    assert args.max_position_embeddings >= args.seq_length  # L1354
    if args.recompute_granularity == "selective":  # L1425
        assert args.recompute_method is None
    if tp == 1:  # L1432-1439: sequence parallelism off without tp
        args.sequence_parallel = False
    if args.tp_comm_overlap:  # L1441
        assert args.sequence_parallel


@pytest.mark.parametrize("plan", list(PLANS))
def test_megatron_lm_parser_accepts_the_plan(capsys, plan):
    require("megatron")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    out = emit(capsys, plan, "megatron")
    assert out.code == 0, out.err
    env, words = out.command()
    args = _parse([*words[words.index("pretrain_gpt.py") + 1:], *USER])
    layout = out.layout
    _validate(args, layout.world_size, env)
    ConstantNumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size,
                                      args.data_parallel_size, False, 0)  # divisibility
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.expert_model_parallel_size,
            args.data_parallel_size) == (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp)
    assert args.virtual_pipeline_model_parallel_size == (
        layout.chunks if layout.schedule == "interleaved" else None)
    assert args.sequence_parallel == layout.sp
    assert args.recompute_granularity == (None if layout.recompute == "none"
                                          else layout.recompute)
    assert args.micro_batch_size == layout.micro_batch
    assert args.use_distributed_optimizer == (layout.zero >= 1)
    assert args.use_megatron_fsdp == (layout.zero >= 2)
    assert not args.accumulate_allreduce_grads_in_fp32  # the plans reduce in bf16/fp16


def test_an_option_megatron_lm_does_not_know_is_refused():
    """The rebuilt parser fails where Megatron-LM's would: an unknown option, a value its
    type cannot read, a value outside its choices."""
    for argv in (["--tensor-parallel-size", "2"], ["--tensor-model-parallel-size", "two"],
                 ["--attention-backend", "flash2"]):
        with pytest.raises(argparse.ArgumentError):
            _parse(argv)
