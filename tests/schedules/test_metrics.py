"""Closed forms of SPEC §6 against its acceptance figures."""

from fractions import Fraction

import pytest

from shardwise.schedules import (
    bubble_fraction,
    bubble_over_ideal,
    microbatches_for_bubble,
    partition_layers,
)


def test_bubble_p4_m8_is_3_over_11():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert round(bubble_fraction(4, 8), 4) == 0.2727


@pytest.mark.parametrize(("m", "expected"), [(8, 7 / 15), (16, 7 / 23), (32, 7 / 39), (64, 7 / 71)])
def test_bubble_p8_not_the_misquoted_7_over_m(m, expected):
    assert bubble_fraction(8, m) == pytest.approx(expected)
    assert bubble_fraction(8, m) != pytest.approx(7 / (m + 6))


def test_interleaving_divides_the_bubble_time_by_v():
    assert bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    assert bubble_over_ideal(4, 8) == pytest.approx(3 / 8)
    assert bubble_over_ideal(4, 8, v=4) == pytest.approx(3 / 32)


@pytest.mark.parametrize(("p", "target", "expected"),
                         [(4, 0.1, 27), (8, 0.1, 63), (16, 0.05, 285), (1, 0.1, 1)])
def test_microbatches_for_bubble(p, target, expected):
    assert microbatches_for_bubble(p, target) == expected


def test_microbatches_for_bubble_is_the_smallest_reaching_the_target():
    for p, target in [(4, 0.1), (8, 0.1), (16, 0.05), (8, 0.2), (32, 0.01)]:
        m = microbatches_for_bubble(p, target)
        beta = Fraction(str(target))
        assert Fraction(p - 1, m + p - 1) <= beta < Fraction(p - 1, m - 1 + p - 1)


def test_microbatches_for_bubble_with_chunks_rounds_up_to_a_multiple_of_p():
    # (8-1)(1-0.1)/(2·0.1) = 31.5 -> 32, already a multiple of 8; p=4: 27/2 = 13.5 -> 14 -> 16.
    assert microbatches_for_bubble(8, 0.1, v=2) == 32
    assert microbatches_for_bubble(4, 0.1, v=2) == 16
    assert microbatches_for_bubble(4, Fraction(1, 10), v=3) == 12  # 9 -> 12


@pytest.mark.parametrize("target", [0, 1, 1.5, -0.1])
def test_microbatches_for_bubble_rejects_targets_outside_0_1(target):
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        microbatches_for_bubble(4, target)


def test_partition_12_layers_over_4_stages():
    assert partition_layers(12, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_partition_uneven_gives_first_stages_the_extra_layers():
    assert partition_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert partition_layers(4, 4) == [[0], [1], [2], [3]]
    assert partition_layers(5, 1) == [[0, 1, 2, 3, 4]]


def test_partition_balances_embedding_and_head_costs():
    # Head worth 2 layers: costs [4, 4, 3, 1+2] -> max 4 = ceil((12 + 2) / 4).
    assert [len(s) for s in partition_layers(12, 4, last_stage_extra=2)] == [4, 4, 3, 1]
    # Embedding and head worth 1 layer each: costs [4, 4, 3, 3], ties going to the first stages.
    assert [len(s) for s in partition_layers(12, 4, first_stage_extra=1, last_stage_extra=1)] \
        == [3, 4, 3, 2]
    assert [len(s) for s in partition_layers(8, 4, first_stage_extra=1.5)] == [1, 3, 2, 2]


@pytest.mark.parametrize(("n_layers", "n_stages", "kwargs"),
                         [(3, 4, {}), (4, 0, {}), (8, 4, {"last_stage_extra": -1})])
def test_partition_rejects_bad_arguments(n_layers, n_stages, kwargs):
    with pytest.raises(ValueError):
        partition_layers(n_layers, n_stages, **kwargs)


@pytest.mark.parametrize(("p", "m", "v"), [(0, 8, 1), (4, 0, 1), (4, 8, 0), (4.0, 8, 1)])
def test_closed_forms_reject_bad_dimensions(p, m, v):
    with pytest.raises(ValueError, match="integer ≥ 1"):
        bubble_fraction(p, m, v)
