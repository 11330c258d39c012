"""What the exact-flag tests of the exports share: the run they export, the argv and one
flag's value, a refusal's one line, and the frameworks' own parsers (Megatron-LM's table,
Megatron-DeepSpeed 4efb479's)."""

from __future__ import annotations

import shlex

import pytest

from shardwise.emit import emit
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec

IMPL = {"megatron": "megatron-te", "torchtitan": "torchtitan", "deepspeed": "megatron-deepspeed"}


def _train(framework: str, **changes) -> TrainSpec:
    return TrainSpec(**{"impl": IMPL[framework], "global_batch": 256, "seq_len": 4096}
                     | changes)


def _argv(out) -> list[str]:
    return shlex.split(" ".join(out.launch.args))


def _flag(out, name: str) -> str:
    words = _argv(out)
    return words[words.index(name) + 1]


def _refusal(framework: str, model, layout: Layout, **train) -> str:
    with pytest.raises(ShardwiseError) as info:
        emit(framework, model, layout, _train(framework, **train))
    message = str(info.value)
    assert "\n" not in message
    return message



def _megatron_lm(out, world: int):
    """Megatron-LM's parser rebuilt from its table (scripts/megatron_lm_arguments.py) and the
    `validate_args` rules the options reach (tests/integration/test_megatron_lm.py)."""
    pytest.importorskip("megatron.core")
    from tests.integration.test_megatron_lm import USER, _parse, _validate

    args = _parse([*_argv(out), *USER])
    _validate(args, world, dict(e.split("=", 1) for e in out.launch.env))
    return args



def _megatron_deepspeed(out, world: int):
    """Megatron-DeepSpeed 4efb479's `pretrain_gpt.py` parser and checks (its pinned table,
    tests/integration/megatron_deepspeed.py)."""
    from tests.integration import megatron_deepspeed

    return megatron_deepspeed.parse(_argv(out), world,
                                    dict(e.split("=", 1) for e in out.launch.env))


# a MoE with shared experts over tp·ep = 8 and sequence parallelism, most refusals start from it
V2, V2_LAYOUT = "deepseek-v2-lite", dict(dp=4, tp=2, ep=4, zero=1, sp=True)
