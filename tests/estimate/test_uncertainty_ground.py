"""`estimate.uncertainty.unvalidated` at each edge of a validated ground written here: a
context-parallel run at and just below the measured sequence length, a stack whose runs
never used context parallelism (no floor, no cp bound), each axis at its bound and one past
it, TP overlap on and off a tensor-parallel layout, torch.compile, a preset timed with
another part's constants, and a band widened by 5 % per phrase."""

import pytest

import shardwise.estimate.uncertainty as unc
from shardwise.layout import Layout, TrainSpec

STACK, NO_CP = "megatron-te", "pytorch-fsdp"
TRAIN = TrainSpec(seq_len=4096, global_batch=64)


def _run(fam, error, source):
    return {"generation": "hopper", "stack": STACK, "family": fam, "loso_error": error,
            "source": source}


@pytest.fixture
def data(monkeypatch):
    runs = [_run("tp+pp", e, f"s{i % 3}") for i, e in
            enumerate((0.01, -0.02, 0.03, 0.04, -0.05, 0.06, 0.08, -0.1))]
    common = {"schedules": ["1f1b"], "max_tp": 4, "max_pp": 4, "max_ep": 2, "zero": [0, 1],
              "recompute": ["none"], "tp_overlap": ["none"], "compile": False}
    ground = {"generations": ["hopper"], "stacks": {
        STACK: {**common, "cp_seq": 16384, "cp_kinds": ["ring"], "max_cp": 4},
        NO_CP: {**common, "cp_seq": 0, "cp_kinds": [], "max_cp": 1}}}
    value = {"runs": runs, "ground": ground, "band_factors": {"0.8": {}}}
    monkeypatch.setattr(unc, "validation_data", lambda: value)
    return value


def test_context_parallel_at_and_below_the_measured_length(data):
    at = TrainSpec(seq_len=16384, global_batch=64)
    below = TrainSpec(seq_len=16383, global_batch=64)
    layout = Layout(cp=2, dp=1)
    assert unc.unvalidated("h100", STACK, layout, at) == ()
    assert unc.unvalidated("h100", STACK, layout, below) == (
        "context parallelism below 16k tokens",)
    # a kind no run used, at a measured length: named as such
    assert unc.unvalidated("h100", STACK, Layout(cp=2, dp=1, cp_kind="allgather"), at) == (
        "allgather context parallelism",)


def test_a_stack_never_run_with_context_parallelism(data):
    """cp_seq 0: "context parallelism" with no floor, and no "cp=2 (validated up to 1)"
    beside it (one phrase per feature)."""
    long = TrainSpec(seq_len=65536, global_batch=64)
    assert unc.unvalidated("h100", NO_CP, Layout(cp=2, dp=1), long) == (
        "context parallelism",)
    assert unc.unvalidated("h100", NO_CP, Layout(dp=2), long) == ()


def test_each_axis_at_its_bound_and_past_it(data):
    at = Layout(tp=4, pp=4, ep=2, dp=2, cp=4, sp=True)
    long = TrainSpec(seq_len=16384, global_batch=64)
    assert unc.unvalidated("h100", STACK, at, long) == ()
    past = Layout(tp=8, pp=8, ep=4, dp=4, cp=8, sp=True)
    assert unc.unvalidated("h100", STACK, past, long) == (
        "tp=8 (validated up to 4)", "pp=8 (validated up to 4)", "cp=8 (validated up to 4)",
        "ep=4 (validated up to 2)")


def test_zero_and_schedule_off_the_ground(data):
    assert unc.unvalidated("h100", STACK, Layout(dp=4, zero=3), TRAIN) == ("ZeRO-3",)
    # a schedule no run used counts only with a pipeline
    assert unc.unvalidated("h100", STACK, Layout(pp=2, dp=2, schedule="gpipe"), TRAIN) == (
        "the gpipe schedule",)
    assert unc.unvalidated("h100", STACK, Layout(pp=2, dp=2, schedule="1f1b"), TRAIN) == ()


def test_tp_overlap_only_with_tensor_parallelism(data):
    bulk = TrainSpec(seq_len=4096, global_batch=64, tp_overlap="bulk")
    assert unc.unvalidated("h100", STACK, Layout(tp=2, dp=2, sp=True), bulk) == (
        "bulk TP overlap",)
    assert unc.unvalidated("h100", STACK, Layout(dp=4), bulk) == ()


def test_compile_off_the_ground(data):
    compiled = TrainSpec(seq_len=4096, global_batch=64, impl="torchtitan", compile=True)
    assert unc.unvalidated("h100", STACK, Layout(dp=4), compiled)[-1] == "torch.compile"
    eager = TrainSpec(seq_len=4096, global_batch=64, impl="torchtitan", compile=False)
    assert "torch.compile" not in unc.unvalidated("h100", STACK, Layout(dp=4), eager)


def test_a_preset_timed_with_another_parts_constants(data):
    """h20 (Hopper, timed with H100's constants): named with the constants it borrows."""
    out = unc.unvalidated("h20", STACK, Layout(dp=4), TRAIN)
    assert out[-1].startswith("h20 GPUs (timed with ") and out[-1].endswith("'s constants)")
    assert "h100" in out[-1].lower()
    assert not any("GPUs" in phrase for phrase in unc.unvalidated("h100", STACK,
                                                                   Layout(dp=4), TRAIN))


def test_each_phrase_widens_the_band_by_five_percent(data):
    """8 runs: the ⌈9·0.8⌉ = 8th smallest |error| is 0.1; ZeRO-3 and gpipe off the ground
    add 2 × 0.05 (the family tp+pp+fsdp has no runs: its parent × 1.5)."""
    plain = unc.uncertainty("h100", STACK, Layout(tp=2, pp=2, dp=2, sp=True), TRAIN)
    assert (plain.band, plain.runs) == (0.1, 8)
    off = unc.uncertainty("h100", STACK, Layout(tp=2, pp=2, dp=2, sp=True, zero=3,
                                                schedule="gpipe"), TRAIN)
    assert off.unvalidated == ("the gpipe schedule", "ZeRO-3")
    assert off.band == pytest.approx(0.1 * 1.5 + 2 * 0.05)
    assert "+ 5% × 2 unvalidated" in off.basis and "× 1.5^1" in off.basis
    assert "sources' spread" not in off.basis  # no factor for the group: none named
    assert off.basis.endswith("× 1.5^1 (the nearest group with enough runs whose sources "
                              "cover each other), + 5% × 2 unvalidated")


def test_a_preset_at_a_set_clock_is_still_borrowed(data):
    calibration = unc.default_calibration("h100-sxm")  # what h20 is timed with
    assert unc.unvalidated("h20@1500MHz", STACK, Layout(dp=4), TRAIN, calibration) == (
        "h20@1500MHz GPUs (timed with h100-sxm's constants)",)


def test_a_band_at_the_cap_is_given(data):
    """The cap is ±50 %: a group whose 8th |error| of 8 is exactly 0.5 still gets its band."""
    data["runs"] = [_run("tp+pp", e, f"s{i % 3}") for i, e in
                    enumerate((0.01, -0.02, 0.03, 0.04, -0.05, 0.06, 0.08, -0.5))]
    sure = unc.uncertainty("h100", STACK, Layout(tp=2, pp=2, dp=2, sp=True), TRAIN)
    assert (sure.band, sure.validated) == (0.5, True)


def test_no_group_says_why(data):
    data["runs"] = data["runs"][:4]  # 4 runs: fewer than the 5 the 80 % band needs
    sure = unc.uncertainty("h100", STACK, Layout(tp=2, pp=2, dp=2, sp=True), TRAIN)
    assert sure.basis == ("no group of published runs on megatron-te has 5 runs whose "
                          "sources cover each other: not validated")


def test_a_95_band_equal_to_the_80_one_keeps_its_own_group(data):
    """80 %: tp+pp's 8 runs, 8th |error| 0.1, × its factor 1.5; 95 %: the parent's 19 runs
    (19th |error| 0.1) one step up, × 1.5 — the same width, from its own group."""
    tp_pp = [_run("tp+pp", e, "a") for e in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.1)]
    dp = [_run("dp", e, "b") for e in (0.01,) * 10 + (-0.1,)]
    factors = {"0.8": {"hopper · megatron-te · tp+pp": 1.5}}
    names = unc.group_names("hopper", STACK, "tp+pp")
    out = unc.bands(tp_pp + dp, names, factors)
    assert out[0.8] == (0.1 * 1.5, "hopper · megatron-te · tp+pp", 8, 0)
    assert out[0.95] == (0.1 * 1.5, "hopper · megatron-te", 19, 1)
    # the factor named in the basis; the 95 % band rounded to 4 places
    data["runs"], data["band_factors"] = tp_pp + dp, factors
    data["runs"][-1] = _run("dp", -0.123456, "b")  # the parent's 19th: 0.123456 · 1.5
    sure = unc.uncertainty("h100", STACK, Layout(tp=2, pp=2, dp=2, sp=True), TRAIN)
    assert "× 1.5 for its sources' spread" in sure.basis
    assert sure.band_95 == 0.1852  # round(0.185184, 4)
