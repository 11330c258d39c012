"""`estimate.context`: the sequence unit against the layout's own seq_len rules (the lengths
`Layout.problems` accepts, found by trying each), and the bisection's answer at the edges of
its search (budget just at and just under a length's peak)."""

from __future__ import annotations

import pytest

from shardwise.arch import PRESETS
from shardwise.errors import ShardwiseError
from shardwise.estimate.context import MAX_SEQ_LEN, longest_context, sequence_unit
from shardwise.estimate.memory import largest_stage_memory
from shardwise.layout import Layout, TrainSpec

MODEL = PRESETS["llama3-8b"]  # 32 heads, 8 kv heads: tp 1, 2, 4, 8 are valid


def _accepted(layout: Layout, seq_len: int) -> bool:
    problems = layout.problems(MODEL, train=TrainSpec(seq_len=seq_len))
    return not [p for p in problems if "seq_len" in p]


@pytest.mark.parametrize("layout", [
    Layout(), Layout(tp=4), Layout(tp=4, sp=True), Layout(cp=2), Layout(cp=3),
    Layout(tp=2, sp=True, cp=3), Layout(tp=8, sp=True, cp=2), Layout(tp=4, sp=True, cp=6),
    Layout(tp=2, cp=5), Layout(tp=3, sp=True, cp=2),  # lcm(4, 6) = 12, not tp·cp
], ids=lambda l: f"tp{l.tp}{'-sp' if l.sp else ''}-cp{l.cp}")
def test_the_unit_is_the_step_of_the_lengths_the_layout_accepts(layout):
    unit = sequence_unit(layout)
    accepted = [k for k in range(1, 3 * unit + 1) if _accepted(layout, k)]
    assert accepted == [unit, 2 * unit, 3 * unit]


def test_the_answer_is_exact_at_a_lengths_peak():
    """A budget equal to a length's peak admits that length; a byte less, the one before."""
    layout = Layout(tp=2, sp=True, cp=3, recompute="selective")
    unit = sequence_unit(layout)  # 6
    peak = largest_stage_memory(MODEL, layout, TrainSpec(seq_len=1000 * unit)).total
    assert longest_context(MODEL, layout, peak) == 1000 * unit
    assert longest_context(MODEL, layout, peak - 1) == 999 * unit
    below = largest_stage_memory(MODEL, layout, TrainSpec(seq_len=unit)).total
    assert longest_context(MODEL, layout, below) == unit
    assert longest_context(MODEL, layout, below - 1) == 0


def test_the_ceiling_and_bad_budgets():
    assert MAX_SEQ_LEN == 2**30
    tiny = PRESETS["tiny"]
    layout = Layout(cp=3)  # unit 6: the largest multiple of 6 under 2^30
    assert longest_context(tiny, layout, 1e18) == (MAX_SEQ_LEN // 6) * 6
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ShardwiseError, match=r"budget must be > 0 bytes"):
            longest_context(tiny, layout, bad)
    assert longest_context(tiny, Layout(), 1.0) == 0  # a byte: nothing fits
