"""The longest context that fits: bisection over the memory model, checked against it."""

from __future__ import annotations

import pytest

from shardwise.arch import PRESETS
from shardwise.errors import ShardwiseError
from shardwise.estimate.context import MAX_SEQ_LEN, longest_context, sequence_unit
from shardwise.estimate.memory import largest_stage_memory
from shardwise.layout import Layout, TrainSpec


def peak(model: str, layout: Layout, seq_len: int) -> float:
    return largest_stage_memory(PRESETS[model], layout, TrainSpec(seq_len=seq_len)).total


@pytest.mark.parametrize("layout", [Layout(tp=8, sp=True, cp=4, recompute="selective"),
                                    Layout(tp=2, sp=True, cp=3, zero=1, recompute="full"),
                                    Layout(cp=4, zero=3), Layout(tp=4)])
def test_longest_context_is_the_last_length_that_fits(layout):
    budget = 60e9
    best = longest_context(PRESETS["llama3-8b"], layout, budget)
    unit = sequence_unit(layout)
    assert best > 0 and best % unit == 0
    assert peak("llama3-8b", layout, best) <= budget < peak("llama3-8b", layout, best + unit)


def test_sequence_unit_follows_the_layout_rules():
    assert sequence_unit(Layout()) == 1
    assert sequence_unit(Layout(cp=4)) == 8  # zigzag: 2·cp chunks
    assert sequence_unit(Layout(tp=8, sp=True, cp=4)) == 32  # lcm(2·cp, tp·cp)
    model, train = PRESETS["llama3-8b"], TrainSpec(seq_len=32)
    assert not Layout(tp=8, sp=True, cp=4).problems(model, train=train)


def test_nothing_fits_and_everything_fits():
    assert longest_context(PRESETS["llama3-70b"], Layout(), 80e9) == 0  # state alone: 1.1 TB
    assert longest_context(PRESETS["tiny"], Layout(), 1e15) == MAX_SEQ_LEN
    with pytest.raises(ShardwiseError, match="budget must be > 0"):
        longest_context(PRESETS["tiny"], Layout(), 0)
