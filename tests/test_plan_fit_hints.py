"""Fit hints (`plan.fit.fit_hints`): the smallest change of each knob that fits, found here by
trying each value."""


import pytest

from shardwise.arch import get_model
from shardwise.estimate.memory import (
    training_memory_per_gpu,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.plan.fit import FIT_KNOBS, fit_hints


def test_fit_hints_are_the_smallest_change_of_each_knob():
    """llama3-70b on 64 H100s, tp8 ZeRO-1, no recompute: 102 GiB, over the 68 GiB budget.
    Each hint fits by the memory model (the reference) and the knob's smaller values do not."""
    model, cluster = get_model("llama3-70b"), Cluster.of(64, "h100")
    train = TrainSpec(seq_len=8192)
    layout = Layout(dp=8, tp=8, zero=1)
    budget = 0.85 * cluster.accelerator.memory_bytes

    def largest(option):
        return max(s.total for s in training_memory_per_gpu(model, option, train))

    assert largest(layout) > budget
    hints = fit_hints(model, cluster, train, layout, budget)
    assert [h.knob for h in hints] == sorted((h.knob for h in hints), key=FIT_KNOBS.index)
    assert {h.knob for h in hints} >= {"recompute", "tp"}
    for hint in hints:
        assert largest(hint.layout) == pytest.approx(hint.total) and hint.total <= budget
        assert hint.layout.with_(**{hint.knob: getattr(layout, hint.knob)}) == layout \
            or hint.knob in ("tp", "pp")  # tp and pp hand their GPUs to dp
        smaller = {"recompute": ["selective"], "zero": [2, 3], "tp": [16],
                   "pp": [2, 4, 8]}[hint.knob]
        for value in smaller:
            if value == hint.value:
                break
            option = layout.with_(**{hint.knob: value})
            if hint.knob in ("tp", "pp"):
                option = option.with_(dp=64 // (option.tp * option.pp))
            assert option.problems(model, cluster, train) or largest(option) > budget
    assert fit_hints(model, cluster, train, hints[0].layout, budget) == []


def test_fit_hints_reach_every_larger_divisor_up_to_the_gpus():
    """Qwen3-30B-A3B on 8 H100 at dp = 8 does not fit; of tp (and pp) only 8, all the GPUs,
    fits: the hint names it — the smallest larger divisor of the GPUs that fits, found here
    by trying each divisor."""
    model, cluster = get_model("qwen3-30b-a3b"), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=4096, global_batch=8)
    layout = Layout(dp=8, zero=1, recompute="full")
    budget = cluster.accelerator.memory_bytes * 0.85
    hints = {h.knob: h for h in fit_hints(model, cluster, train, layout, budget)}

    def peak(option):
        return max(s.total for s in training_memory_per_gpu(model, option, train))

    for knob in ("tp", "pp"):
        options = [layout.with_(**{knob: d, "dp": 8 // d}) for d in (2, 4, 8)]
        fitting = [o for o in options if peak(o) <= budget]
        assert getattr(fitting[0], knob) == 8  # not degenerate: 2 and 4 do not fit
        assert hints[knob].value == 8 and hints[knob].total == peak(fitting[0])


def test_fit_hints_count_blackwells_fp8_weight_copies():
    """On B200 with Transformer Engine's per-tensor FP8, a cached FP8 weight is one copy
    (Blackwell transposes on the fly), two on Hopper: the hints' bytes are Blackwell's, and
    ZeRO-2 fits only by them."""
    model, cluster = get_model("qwen3-30b-a3b"), Cluster.of(8, "b200")
    train = TrainSpec(seq_len=4096, global_batch=8, fp8="tensorwise", impl="megatron-te")
    layout = Layout(dp=8, zero=1, recompute="full")
    budget = cluster.accelerator.memory_bytes * 0.85
    hints = fit_hints(model, cluster, train, layout, budget)
    assert hints
    for hint in hints:
        peak = {gen: max(s.total for s in training_memory_per_gpu(
            model, hint.layout, train, generation=gen)) for gen in ("blackwell", "hopper")}
        assert hint.total == peak["blackwell"] < peak["hopper"]
    zero = [h for h in hints if h.knob == "zero"]
    assert zero and zero[0].value == 2


def test_fit_hints_size_the_layout_at_the_users_sequence():
    """llama3-8b at dp = 8 on 8 H100: 60 GiB at the default 4,096 tokens (fits the 68 GiB
    budget), 117 GiB at 16,384 — the hints are for the user's sequence, not the default."""
    model, cluster = get_model("llama3-8b"), Cluster.of(8, "h100")
    layout, budget = Layout(dp=8, zero=1), 0.85 * cluster.accelerator.memory_bytes

    def largest(train):
        return max(s.total for s in training_memory_per_gpu(model, layout, train))

    long = TrainSpec(seq_len=16384)
    assert largest(TrainSpec()) <= budget < largest(long)
    assert fit_hints(model, cluster, TrainSpec(), layout, budget) == []
    hints = fit_hints(model, cluster, long, layout, budget)
    assert {h.knob for h in hints} >= {"recompute", "tp"}
    for hint in hints:
        peak = max(s.total for s in training_memory_per_gpu(model, hint.layout, long))
        assert peak == pytest.approx(hint.total) and peak <= budget
