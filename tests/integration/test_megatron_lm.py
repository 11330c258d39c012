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

from shardwise.cli import main
from tests.integration.conftest import Emit, require
from tests.integration.plans import EXPECTED, MEGATRON_EXTRA, PLANS
from tests.integration.test_winners import GRID

pytestmark = pytest.mark.integration

TABLE = json.loads((Path(__file__).parent / "data" / "megatron_lm_arguments.json").read_text())
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # Megatron-LM main of 2026-08-22
# what a user adds to the emitted command: data and tokenizer, which the plan does not choose
USER = ["--tokenizer-type", "NullTokenizer", "--mock-data"]
# the accepted plans, the other runs and the planner's winners (test_winners.GRID)
RUNS = {**{p: PLANS[p] for p in PLANS if EXPECTED[p]["megatron"] is None}, **MEGATRON_EXTRA,
        **{f"winner-{m}-{g}-{s}": [m, "--gpus", str(g), "--seq", str(s), "--top", "1"]
           for m, g, s in GRID["megatron"]}}
BACKENDS = {"cudnn": "fused", "fa2": "flash", "fa3": "flash", "math": "unfused"}


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
    if args.bf16:  # L1204-1216: bf16 accumulates and reduces in fp32 unless told otherwise
        assert not args.fp16
        if args.accumulate_allreduce_grads_in_fp32:
            assert args.main_grads_dtype == "fp32"
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
        elif args.main_grads_dtype == "fp32":
            args.accumulate_allreduce_grads_in_fp32 = True
    if args.kv_channels is None:  # L1331-1333: else the heads' width is --kv-channels
        assert args.hidden_size % args.num_attention_heads == 0
    if cp > 1:  # L1335-1338
        assert args.seq_length % (2 * cp) == 0
    assert args.max_position_embeddings >= args.seq_length  # L1354
    if args.recompute_granularity == "selective":  # L1425
        assert args.recompute_method is None
    if tp == 1:  # L1432-1439: sequence parallelism off without tp
        args.sequence_parallel = False
    if args.tp_comm_overlap:  # L1441
        assert args.sequence_parallel
    if args.optimizer_cpu_offload:  # L1884
        assert args.use_precision_aware_optimizer
    if args.fine_grained_activation_offloading:  # L1935-1940 (with TE >= 2.10)
        assert env.get("NVTE_CPU_OFFLOAD_V1") == "1"


def megatron_lm_args(out: Emit) -> argparse.Namespace:
    """The emitted command (plus the user's data and tokenizer) through the rebuilt parser,
    `validate_args`' rules and megatron-core's micro-batch calculator."""
    require("megatron")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    assert out.code == 0, out.err
    env, words = out.command()
    args = _parse([*words[words.index("pretrain_gpt.py") + 1:], *USER])
    _validate(args, out.layout.world_size, env)
    ConstantNumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size,
                                      args.data_parallel_size, False, 0)  # divisibility
    return args


@pytest.mark.parametrize("run", list(RUNS))
def test_megatron_lm_parser_reads_back_the_plan(capsys, run):
    out = Emit(capsys, RUNS[run], "megatron")
    args = megatron_lm_args(out)
    layout, plan = out.layout, out.plan
    stack = plan["stack"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.expert_model_parallel_size,
            args.data_parallel_size) == (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp)
    chunked = layout.pp > 1 and layout.schedule == "interleaved"
    assert args.virtual_pipeline_model_parallel_size == (layout.chunks if chunked else None)
    assert args.sequence_parallel == layout.sp
    if layout.cp > 1:  # the context-parallel kind
        assert args.cp_comm_type == [{"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p",
                                   "allgather": "all_gather"}[
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
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    assert dtype == plan["dtype"]
    if layout.zero >= 2:
        assert args.megatron_fsdp_main_grads_dtype == plan["grad_dtype"]
    else:
        assert args.accumulate_allreduce_grads_in_fp32 == (
            plan["grad_dtype"] == "fp32" and plan["dtype"] != "fp32")
    # the stack's overlap settings and attention kernel
    overlapped = (stack["dp_overlap"] if stack["dp_overlap"] is not None
                  else layout.zero in stack["dp_overlap_by_default_at_zero"])
    assert args.overlap_grad_reduce == overlapped
    assert args.overlap_param_gather == (overlapped and layout.zero >= 1)
    assert args.tp_comm_overlap == (stack["tp_overlap"] == "bulk" and layout.sp)
    assert args.attention_backend == BACKENDS[stack["attention"]]


def sequential_neox(tmp_path) -> str:
    """Pythia-1.4B's config with a sequential block: RoPE on a quarter of each head."""
    from tests.integration.plans import PYTHIA

    cfg = json.loads(Path(PYTHIA).read_text()) | {"use_parallel_residual": False}
    path = tmp_path / "neox" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return str(path)


def test_a_partial_rotary_share_reaches_megatron_lm(capsys, tmp_path):
    out = Emit(capsys, [sequential_neox(tmp_path), "--gpus", "16", "--seq", "2048",
                        "--global-batch", "256", "--layout", "tp=2,zero=1"], "megatron")
    args = megatron_lm_args(out)
    assert args.position_embedding_type == "rope" and args.rotary_percent == 0.25


def test_an_option_megatron_lm_does_not_know_is_refused():
    """The rebuilt parser fails where Megatron-LM's would: an unknown option, a value its
    type cannot read, a value outside its choices."""
    for argv in (["--tensor-parallel-size", "2"], ["--tensor-model-parallel-size", "two"],
                 ["--attention-backend", "flash2"]):
        with pytest.raises(argparse.ArgumentError):
            _parse(argv)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (1, False)])
def test_bulk_tp_overlap_is_refused_where_megatron_lm_refuses_it(capsys, tp, sp):
    """`--tp-comm-overlap` without sequence parallelism fails Megatron-LM's validate_args
    (arguments.py L1441): shardwise refuses `--tp-overlap bulk` on such a layout in one line
    (exit 2) instead of planning a no-op; with SP it is exported and Megatron takes it; at
    tp=1 there is no TP traffic and the export leaves the flag out."""
    base = ["llama3-8b", "--gpus", "16", "--global-batch", "128"]
    layout = f"tp={tp},sp={int(sp)},zero=1"
    plain = Emit(capsys, [*base, "--layout", layout], "megatron")
    env, words = plain.command()
    argv = [*words[words.index("pretrain_gpt.py") + 1:], *USER]
    megatron_refuses = False
    try:
        _validate(_parse([*argv, "--tp-comm-overlap"]), plain.layout.world_size, env)
    except AssertionError:
        megatron_refuses = True
    assert megatron_refuses == (not sp)  # tp=1: SP off, then the assertion
    bulk = Emit(capsys, [*base, "--layout", layout, "--tp-overlap", "bulk"], "megatron")
    if tp > 1 and not sp:
        assert bulk.code == 2 and len(bulk.err.splitlines()) == 1
        assert "--tp-comm-overlap" in bulk.err and "sequence parallelism" in bulk.err
    else:
        assert bulk.code == 0, bulk.err
        args = megatron_lm_args(bulk)  # Megatron-LM's checks take what is exported
        assert args.tp_comm_overlap == (tp > 1)


def test_the_planner_never_searches_bulk_tp_overlap_without_sp(capsys):
    """With `--tp-overlap bulk` every ranked layout with TP has SP (the rule above), and the
    rejection names Megatron-LM's check."""
    main(["plan", "llama3-8b", "--gpus", "16", "--global-batch", "128", "--tp-overlap", "bulk",
          "--json"])
    payload = json.loads(capsys.readouterr().out)
    rows = [row["layout"] for row in payload["ranked"]]
    assert any(r["tp"] > 1 for r in rows) and all(r["sp"] for r in rows if r["tp"] > 1)
    assert any("arguments.py:1441" in r["reason"] for r in payload["rejected"])
