"""The step-time band (estimate/uncertainty.py) on validation data written here, so each
quantile is worked out by hand: split-conformal's ⌈(n+1)·c⌉-th smallest |error| (Vovk et al.;
Lei et al. 2018), groups at each threshold (4 and 5 runs at 80 %, 18 and 19 at 95 %), a parent
group widened by 1.5 per step, a group whose factor is None passed over, the ±50 % cap, the
95 % band never narrower than the 80 % one, and the ratio resolution from same-source pairs."""

import math

import pytest

import shardwise.estimate.uncertainty as unc
from shardwise.layout import Layout, TrainSpec

GEN, STACK = "hopper", "megatron-te"


def _run(fam, error, source="a", gen=GEN, stack=STACK):
    return {"generation": gen, "stack": stack, "family": fam, "loso_error": error,
            "source": source}


def test_family_and_group_names():
    assert unc.family(1, 1, 1, 1, 0) == "dp"
    assert unc.family(2, 4, 2, 8, 3) == "tp+pp+cp+ep+fsdp"
    assert unc.family(1, 2, 1, 1, 1) == "pp" and unc.family(1, 1, 1, 1, 2) == "dp"
    # each axis at its threshold, 2, alone: it is non-trivial
    assert [unc.family(*(2 if i == j else 1 for i in range(4)), 0) for j in range(4)] == [
        "tp", "pp", "cp", "ep"]
    assert unc.group_names(GEN, STACK, "tp+pp") == ("hopper · megatron-te · tp+pp",
                                                    "hopper · megatron-te", "megatron-te")


def test_needed_runs_and_the_conformal_quantile_at_each_threshold():
    assert (unc.needed(0.8), unc.needed(0.95), unc.needed(0.5)) == (5, 19, 5)
    errors = [-0.05, 0.01, 0.04, -0.02, 0.03]  # |e| sorted: .01 .02 .03 .04 .05
    assert unc.conformal(errors, 0.8) == 0.05  # ⌈6·0.8⌉ = 5th of 5
    # n = 4: k = ⌈5·0.8⌉ = 4 ≤ 4 exists (0.05); only needed() refuses a group of 4
    assert unc.conformal(errors[:4], 0.8) == 0.05
    assert unc.conformal([0.1, 0.2, 0.3, 0.4], 0.75) == 0.4  # ⌈5·0.75⌉ = 4
    assert unc.conformal([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9], 0.8) == 0.8  # 8th
    assert unc.conformal([0.3] * 18, 0.95) is None and unc.conformal([0.3] * 19, 0.95) == 0.3
    assert unc.conformal([], 0.8) is None


def test_band_of_takes_the_nearest_group_with_enough_runs():
    names = unc.group_names(GEN, STACK, "tp+pp")
    four = [_run("tp+pp", e) for e in (0.01, 0.02, 0.03, 0.04)]  # one short of 5
    others = [_run("dp", e) for e in (0.06, -0.07, 0.08, 0.09)]
    # the group has 4: its parent (all 8 on hopper · megatron-te) gives 1.5 × its quantile
    width, group, n, step = unc.band_of(four + others, names, 0.8)
    assert (group, n, step) == ("hopper · megatron-te", 8, 1)
    assert width == pytest.approx(0.09 * 1.5)  # ⌈9·0.8⌉ = 8th of 8 |errors|: 0.09
    five = [*four, _run("tp+pp", -0.05)]
    assert unc.band_of(five + others, names, 0.8) == (pytest.approx(0.05), names[0], 5, 0)
    # a factor widens it; a group whose factor is None is passed over
    assert unc.band_of(five, names, 0.8, {names[0]: 1.2})[0] == pytest.approx(0.06)
    width, group, _, step = unc.band_of(five + others, names, 0.8, {names[0]: None})
    # the parent's 9 runs: ⌈10·0.8⌉ = 8th |error|, 0.08
    assert (group, step, width) == (names[1], 1, pytest.approx(0.08 * 1.5))
    # from level 1 on, the parent is not widened
    assert unc.band_of(five + others, names, 0.8, start=1)[0] == pytest.approx(0.08)
    # over the cap: not validated; no group at all: none either
    assert unc.band_of(five, names, 0.8, cap=0.04) == (None, names[0], 5, -1)
    assert unc.band_of([], names, 0.8, start=1) == (None, names[1], 0, -1)


def test_bands_keep_the_95_band_at_least_the_80_one():
    names = unc.group_names(GEN, STACK, "tp")
    # 19 runs: the 95 % band is the 19th |error|, the 80 % the ⌈20·0.8⌉ = 16th
    runs = [_run("tp", (i + 1) / 100) for i in range(19)]
    out = unc.bands(runs, names)
    assert out[0.8][0] == pytest.approx(0.16) and out[0.95][0] == pytest.approx(0.19)
    # a factor under 1 at 95 % would make it narrower: the 80 % band instead
    out = unc.bands(runs, names, {"0.95": {names[0]: 0.5}})
    assert out[0.95] == out[0.8]
    # no 80 % band (over ±50 %): no 95 % one
    wide = [_run("tp", 0.6 + i / 100) for i in range(19)]
    out = unc.bands(wide, names)
    assert out[0.8][0] is None and out[0.95] == (None, names[0], 19, -1)
    assert unc.cap_for(0.8) == 0.5 and unc.cap_for(0.95) == 1.0


def test_bounds_of_a_band():
    assert unc.bounds(10.0, {"band": 0.1, "band_95": 1.2}) == {
        "low": pytest.approx(9.0), "high": pytest.approx(11.0), "low_95": 0.0,
        "high_95": pytest.approx(22.0)}
    assert unc.bounds(10.0, None) == {"low": None, "high": None, "low_95": None,
                                      "high_95": None}


@pytest.fixture
def data(monkeypatch):
    runs = ([_run("tp+pp", e, "s1") for e in (0.01, -0.02, 0.03, 0.04, -0.05, 0.06)]
            + [_run("tp+pp", e, "s2") for e in (0.1, 0.1)]
            + [_run("dp", e, "s3", gen="ampere") for e in (0.2, -0.2)])
    ground = {"generations": ["hopper", "ampere"], "stacks": {STACK: {
        "schedules": ["1f1b"], "cp_seq": 32768, "cp_kinds": ["ring"], "max_tp": 8,
        "max_pp": 8, "max_cp": 2, "max_ep": 1, "zero": [0, 1], "recompute": ["selective"],
        "tp_overlap": ["none"], "compile": False}}}
    value = {"runs": runs, "ground": ground, "band_factors": {"0.8": {}}}
    monkeypatch.setattr(unc, "validation_data", lambda: value)
    unc._pair_errors.cache_clear()
    yield value
    unc._pair_errors.cache_clear()


def test_uncertainty_of_a_layout_on_written_data(data):
    layout = Layout(tp=2, pp=2, dp=2, recompute="selective")
    train = TrainSpec(seq_len=4096, global_batch=64)
    sure = unc.uncertainty("h100", STACK, layout, train)
    # 8 runs of hopper · megatron-te · tp+pp: ⌈9·0.8⌉ = 8th |error| = 0.1; no 95 % group
    assert (sure.band, sure.group, sure.runs, sure.validated) == (
        0.1, "hopper · megatron-te · tp+pp", 8, True)
    assert (sure.band_95, sure.group_95, sure.unvalidated) == (None, "", ())
    # a feature off the ground: + 5 % each (ZeRO-3 and full recompute)
    off = unc.uncertainty("h100", STACK, Layout(tp=2, pp=2, dp=2, zero=3, recompute="full"),
                          train)
    assert off.unvalidated == ("ZeRO-3", "full recompute")
    # the tp+pp+fsdp group has no runs: the parent's 8, 0.1 × 1.5, + 2 × 5 %
    assert off.band == pytest.approx(0.1 * 1.5 + 0.1)
    # a stack without runs: not validated, said why
    none = unc.uncertainty("h100", "torchtitan", layout, train)
    assert (none.band, none.validated) == (None, False)
    assert none.basis.startswith("no group of published runs on torchtitan has 5 runs")
    assert none.unvalidated == ("the torchtitan stack",)


def test_unvalidated_features_one_phrase_each(data):
    train = TrainSpec(seq_len=4096, global_batch=64)
    layout = Layout(tp=16, pp=2, cp=4, ep=2, dp=1, schedule="interleaved", chunks=2,
                    recompute="full", zero=1)
    assert unc.unvalidated("h100", STACK, layout, train) == (
        "the interleaved schedule", "context parallelism below 32k tokens",
        "tp=16 (validated up to 8)", "cp=4 (validated up to 2)", "ep=2 (validated up to 1)",
        "full recompute")
    long = TrainSpec(seq_len=65536, global_batch=64)
    assert unc.unvalidated("h100", STACK, Layout(cp=2, dp=1, cp_kind="ulysses",
                                                                recompute="selective"), long) == (
        "ulysses context parallelism",)
    # a generation off the ground (beside any attention kernel it borrows a curve for)
    blackwell = unc.unvalidated("b200", STACK, Layout(dp=8, recompute="selective"), train)
    assert blackwell[-1] == "blackwell GPUs"


def test_resolution_from_same_source_pairs(data):
    # s1's 6 runs give 15 pairs, s2's 2 one: |(1+a)/(1+b) − 1| over 16 pairs ≥ 10
    errors = [0.01, -0.02, 0.03, 0.04, -0.05, 0.06]
    pairs = [abs((1 + a) / (1 + b) - 1) for i, a in enumerate(errors) for b in errors[i + 1:]]
    pairs.append(0.0)
    value, basis = unc.resolution("h100", STACK)
    pairs.sort()
    at = 0.8 * (len(pairs) - 1)  # numpy's linear interpolation
    lo = math.floor(at)
    assert value == pytest.approx(round(pairs[lo] + (at - lo) * (pairs[lo + 1] - pairs[lo]), 4))
    assert basis.startswith("80% of 16 same-source pairs of published runs "
                            "(hopper · megatron-te)")
    # too few pairs on ampere (1): every run of all
    assert unc.resolution("a100", "megatron-deepspeed")[1].startswith("80% of 17 same-source")


def test_band_rounding_factor_and_its_json(data):
    # 8 runs with six-decimal errors: the 8th |error| 0.123456 × the group's factor 1.2
    group = "hopper · megatron-te · tp+pp"
    data["runs"] = [_run("tp+pp", e, "s1") for e in
                    (0.01, -0.02, 0.03, 0.04, -0.05, 0.06, 0.07, -0.123456)]
    data["band_factors"] = {"0.8": {group: 1.2}}
    layout = Layout(tp=2, pp=2, dp=2, recompute="selective")
    sure = unc.uncertainty("h100", STACK, layout, TrainSpec(seq_len=4096, global_batch=64))
    assert sure.band == round(0.123456 * 1.2, 4) == 0.1481
    assert sure.basis == (f"80% conformal quantile of the 8 leave-one-source-out errors of "
                          f"{group}, × 1.2 for its sources' spread")
    assert sure.to_dict() == {
        "band": 0.1481, "group": group, "runs": 8, "unvalidated": [], "band_95": None,
        "group_95": "", "coverage": 0.8, "validated": True, "basis": sure.basis,
        "docs": "docs/accuracy/bands.md"}
    # without any factors recorded the band is the bare quantile
    del data["band_factors"]
    assert unc.uncertainty("h100", STACK, layout, TrainSpec(seq_len=4096, global_batch=64)
                           ).band == 0.1235


def test_a_group_too_wide_is_not_validated_and_says_so(data):
    data["runs"] = [_run("tp+pp", 0.6 + i / 100, "s1") for i in range(5)]
    layout = Layout(tp=2, pp=2, dp=2, recompute="selective")
    sure = unc.uncertainty("h100", STACK, layout, TrainSpec(seq_len=4096, global_batch=64))
    assert (sure.band, sure.group, sure.runs, sure.band_95, sure.group_95, sure.coverage,
            sure.validated) == (None, "hopper · megatron-te · tp+pp", 0, None, "", 0.8, False)
    assert sure.basis == ("the out-of-sample errors of hopper · megatron-te · tp+pp (5 runs) "
                          "exceed ±50%: not validated")


def test_resolution_falls_back_level_by_level(data):
    # hopper · megatron-te: s1's 5 runs, exactly 10 pairs (the threshold)
    data["runs"] = [_run("tp+pp", e, "s1") for e in (0.01, 0.02, 0.03, 0.04, 0.05)] + [
        _run("dp", e, "s2", gen="ampere") for e in (0.1, 0.2, 0.3, 0.4)]
    unc._pair_errors.cache_clear()
    assert unc.resolution("h100", STACK)[1].startswith("80% of 10 same-source pairs of "
                                                        "published runs (hopper · megatron-te)")
    # ampere · megatron-te has 6 pairs: the stack's 16
    assert unc.resolution("a100", STACK)[1].startswith("80% of 16 same-source pairs of "
                                                        "published runs (megatron-te)")
    # another stack, fewer than 10 pairs anywhere: every run's
    data["runs"] = data["runs"][:4]
    unc._pair_errors.cache_clear()
    value, basis = unc.resolution("h100", "torchtitan")
    assert basis == ("80% of 6 same-source pairs of published runs (all runs) have their "
                     "step-time ratio predicted within it")
    assert value > 0


def test_the_band_uses_the_calibration_it_was_timed_with(data):
    """b200's built-in constants time cuDNN attention with FA4's curve (a borrowed kernel: one
    feature more); constants that measured cuDNN attention (H100's) borrow nothing."""
    from shardwise.calibration import default_calibration

    layout = Layout(tp=2, pp=2, dp=2, recompute="selective")
    train = TrainSpec(seq_len=4096, global_batch=64)
    borrowed = unc.uncertainty("b200", STACK, layout, train)
    own = unc.uncertainty("b200", STACK, layout, train, default_calibration("h100-sxm"))
    assert borrowed.unvalidated == ("cudnn attention (no kernel benchmark on b200: timed with "
                                    "fa4's curve)", "blackwell GPUs")
    assert own.unvalidated == ("blackwell GPUs",)


def test_a_kernel_without_any_curve_says_it_is_timed_with_the_generic_efficiency():
    """TPU v5p's constants hold no attention-kernel curve: FlashAttention-2 there is timed with
    the generic attention efficiency, and the phrase says so."""
    assert unc._borrowed_kernel("tpu-v5p", "fa2", None) == (
        "fa2 attention (no kernel benchmark on tpu-v5p: timed with the generic attention "
        "efficiency)",)
