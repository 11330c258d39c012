"""Megatron-DeepSpeed's launch rules at a pinned commit, as test data (it is not on PyPI).

github.com/deepspeedai/Megatron-DeepSpeed at `COMMIT` (2025-07-16):

* `OPTIONS` (megatron_deepspeed_args.json): every option of `megatron/arguments.py`'s
  `parse_args` (with DeepSpeed's `add_config_arguments`) — dest, type, choices, default,
  action — written from the checkout's own parser by
  `python -m tests.integration.megatron_deepspeed CHECKOUT` (never typed by hand).
* `validate`: the checks of `validate_args` (megatron/arguments.py),
  `initialize_model_parallel` (megatron/core/parallel_state.py) and `_initialize_distributed`
  (megatron/initialize.py) that touch the degrees, SP, ZeRO, the pipeline and dtypes, each with
  its line, in the order the code runs them.

`parse(argv)` reads argv with an argparse parser rebuilt from `OPTIONS` (argparse is what the
real one is), then `validate`. test_deepspeed.py checks the DeepSpeed export's launch line
with it; with a checkout at `MEGATRON_DEEPSPEED` it also checks the model against the real
parser and checks (`test_model_matches_the_checkout`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

COMMIT = "4efb479d5317ce9b86096b9d8e3e8030b0b5263b"
DATA = Path(__file__).with_name("megatron_deepspeed_args.json")
_TYPES = {"int": int, "float": float, "str": str}


class Refused(Exception):
    """A check of Megatron-DeepSpeed failed: `where` is its file:line."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


def options() -> list[dict]:
    return json.loads(DATA.read_text())["options"]


def parser() -> argparse.ArgumentParser:
    """An argparse parser with the pinned options (allow_abbrev=False, as the real one)."""
    out = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    for opt in options():
        kwargs: dict = {"dest": opt["dest"], "default": opt["default"]}
        action = opt["action"]
        if action in ("store_true", "store_false"):
            kwargs["action"] = action
        else:
            kwargs["type"] = _TYPES.get(opt["type"])
            if opt["choices"] is not None:
                kwargs["choices"] = opt["choices"]
            if opt["nargs"] is not None:
                kwargs["nargs"] = opt["nargs"]
            if action == "append":
                kwargs["action"] = "append"
        out.add_argument(*opt["flags"], **kwargs)
    return out


def parse(argv: list[str], world_size: int, env: dict[str, str] | None = None
          ) -> SimpleNamespace:
    """`pretrain_gpt.py` arguments as Megatron-DeepSpeed reads and checks them on a CUDA
    machine of `world_size` ranks with environment `env`; `Refused` when a check fails,
    `SystemExit` on an unknown option, type or choice (argparse)."""
    args = SimpleNamespace(**vars(parser().parse_args(argv)))
    args.world_size, args.rank = world_size, 0
    validate(args, env or {})
    return args


def _check(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise Refused(where, message)


def validate(args: SimpleNamespace, env: dict[str, str]) -> None:
    """The checks and settings of validate_args, initialize_model_parallel and
    _initialize_distributed that an export reaches (file:line at `COMMIT`)."""
    a = "megatron/arguments.py"
    args.tensor_model_parallel_size = min(args.tensor_model_parallel_size, args.world_size)
    _check(args.world_size % args.tensor_model_parallel_size == 0, f"{a}:75",
           "world size is not divisible by tensor model parallel size")
    if args.enable_zbh1_pipeline:
        _check(args.deepspeed, f"{a}:80", "Use DeepSpeed to use zero-bubble H1 pipeline")
        _check(not args.sequence_parallel, f"{a}:81", "Sequence Parallel not tested")
    args.pipeline_model_parallel_size = min(
        args.pipeline_model_parallel_size, args.world_size // args.tensor_model_parallel_size)
    if args.no_pipeline_parallel:
        _check(args.pipeline_model_parallel_size == 1, f"{a}:95",
               "pipeline_model_parallel_size must be 1 if pipeline parallel is disabled")
    model_parallel = (args.pipeline_model_parallel_size * args.tensor_model_parallel_size
                      * args.ds_sequence_parallel_size)
    _check(args.world_size % model_parallel == 0, f"{a}:104",
           "world size is not divisible by tp × pp × sequence parallel size")
    args.data_parallel_size = args.world_size // model_parallel
    if args.recompute_activations:  # a:145
        args.recompute_granularity = "selective"
    _check(args.micro_batch_size is not None and args.micro_batch_size > 0, f"{a}:164",
           "micro batch size")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _check(args.global_batch_size > 0, f"{a}:171", "global batch size")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _check(args.pipeline_model_parallel_size > 2, f"{a}:173",
               "pipeline-model-parallel size should be greater than 2 with interleaved "
               "schedule")
    _check(not (args.fp16 and args.bf16), f"{a}:188", "fp16 and bf16 both set")
    for name in ("num_layers", "hidden_size", "num_attention_heads",
                 "max_position_embeddings"):  # a:282, _check_arg_is_not_none
        _check(getattr(args, name) is not None, f"{a}:282", f"{name} argument is None")
    if args.kv_channels is None:
        _check(args.hidden_size % args.num_attention_heads == 0, f"{a}:299",
               "hidden size is not divisible by the attention heads")
    args.seq_length = args.seq_length if args.seq_length is not None else \
        args.encoder_seq_length
    _check(args.seq_length is not None, f"{a}:306", "no sequence length")
    _check(args.max_position_embeddings >= args.seq_length, f"{a}:311",
           "max_position_embeddings < seq_length")
    if args.recompute_granularity == "selective":
        _check(args.recompute_method is None, f"{a}:380",
               "recompute method is not yet supported for selective recomputing granularity")
    if args.tensor_model_parallel_size == 1:  # a:386
        args.sequence_parallel = False
    if args.sequence_parallel or args.deepspeed:  # a:392-397
        args.async_tensor_model_parallel_allreduce = False
    if env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        _check(not args.sequence_parallel, f"{a}:403",
               "Using sequence parallelism requires setting the environment variable "
               "CUDA_DEVICE_MAX_CONNECTIONS to 1")
        _check(not args.async_tensor_model_parallel_allreduce, f"{a}:407",
               "Using async gradient all reduce requires CUDA_DEVICE_MAX_CONNECTIONS=1")
    if args.num_key_value_heads is None:
        args.num_key_value_heads = args.num_attention_heads
    _check(args.num_attention_heads % args.num_key_value_heads == 0, f"{a}:446",
           "num_attention_heads must be divisible by num_key_value_heads")
    # _initialize_distributed, then initialize_model_parallel
    if args.ds_sequence_parallel_size > 1:
        _check(not args.sequence_parallel, "megatron/initialize.py:247",
               "sequence_parallel_size > 1 enables DeepSpeed's sequence parallel, which is not "
               "compatible with Megatron-LM's sequence parallel")
        _check(args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1,
               "megatron/core/parallel_state.py:146",
               "DeepSpeed's sequence parallel does not work with tensor parallel or pipeline "
               "parallel")


def moe_layers(args: SimpleNamespace) -> list[bool]:
    """Which layers are MoE: megatron/model/transformer.py:1650 `get_num_experts_per_layer`
    (layer number `i + 1` divisible by --expert-interval, with the single --num-experts)."""
    assert len(args.num_experts) == 1 or len(args.num_experts) == (
        args.num_layers // args.expert_interval)  # transformer.py:1651
    return [max(args.num_experts) > 1 and (i + 1) % args.expert_interval == 0
            for i in range(args.num_layers)]


def _dump(checkout: Path) -> dict:
    """The options of the checkout's own parser (run in this process: the checkout goes first
    on sys.path, and `six`, which only its BERT tokenizer imports, is stubbed)."""
    import types

    import deepspeed  # noqa: F401  (imported first, as the real entry point does)

    sys.path.insert(0, str(checkout))
    sys.modules.setdefault("six", types.ModuleType("six"))
    import megatron.arguments as arguments

    captured: dict = {}
    original = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        captured["parser"] = self
        return original(self, [])

    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        arguments.parse_args()
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    out = []
    kinds = {"_StoreAction": "store", "_StoreTrueAction": "store_true",
             "_StoreFalseAction": "store_false", "_AppendAction": "append"}
    for act in captured["parser"]._actions:
        if not act.option_strings or type(act).__name__ == "_HelpAction":
            continue
        kind = kinds.get(type(act).__name__)
        if kind is None:
            raise SystemExit(f"unmodelled action {type(act).__name__} of {act.option_strings}")
        default = act.default
        out.append({"flags": act.option_strings, "dest": act.dest, "action": kind,
                    "type": getattr(act.type, "__name__", None),
                    "choices": list(act.choices) if act.choices is not None else None,
                    "nargs": act.nargs,
                    "default": default if isinstance(default, (int, float, str, bool, list,
                                                               type(None))) else str(default)})
    return {"repository": "github.com/deepspeedai/Megatron-DeepSpeed", "commit": COMMIT,
            "source": "megatron/arguments.py parse_args + deepspeed.add_config_arguments "
                      "(DeepSpeed 0.19.8)", "options": out}


if __name__ == "__main__":  # python -m tests.integration.megatron_deepspeed CHECKOUT
    DATA.write_text(json.dumps(_dump(Path(sys.argv[1])), indent=1) + "\n")
