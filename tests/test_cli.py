"""The `shardwise` command through its real entry point, good input and bad."""

from pathlib import Path

import pytest

from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

HF = Path(__file__).parent / "fixtures" / "hf"


def test_models_lists_presets_with_counts():
    rows = {r["name"]: r for r in shardwise_json("models")}
    assert round(rows["llama2-7b"]["total_params"] / 1e9, 2) == 6.74
    assert round(rows["mixtral-8x7b"]["active_params"] / 1e9, 1) == 12.9
    text = shardwise("models").stdout
    assert "llama3-405b" in text and "406B" in text


def test_memory_json_matches_spec_example():
    # SPEC §4: Llama-3-70B, TP 8 × DP 8, ZeRO-1, s=8192, mb 1, selective recompute + SP.
    out = shardwise_json("memory", "llama3-70b", "--gpus", "64", "--tp", "8", "--zero", "1",
                         "--sp", "--recompute", "selective", "--seq", "8192", "--no-flash",
                         "--formula", "korthikanti")
    stage = out["stages"][0]
    assert round((stage["weights"] + stage["grads"]) / 1e9, 1) == 35.3
    assert round(stage["optimizer"] / 1e9, 1) == 13.2
    assert out["fits"] is True


def test_memory_table_says_whether_it_fits():
    # SPEC §4's figure is for the generalised count: the shardwise profile
    text = shardwise("memory", "llama3-8b", "--zero", "2", "--mbs", "2",
                     "--impl", "shardwise").stdout
    assert "does not fit" in text
    text = shardwise("memory", "llama3-8b", "--zero", "2", "--mbs", "1",
                     "--impl", "shardwise").stdout
    assert "fits" in text and "does not fit" not in text
    assert "--impl shardwise" in text


def test_memory_reads_config_json():
    out = shardwise_json("memory", str(HF / "mixtral-8x7b" / "config.json"), "--ep", "8",
                         "--zero", "3")
    assert out["model"] == "mixtral-8x7b"


def test_comm_spec_figure():
    out = shardwise_json("comm", "--op", "all-reduce", "--size", "4000B", "--ranks", "4")
    assert out["bytes_sent_per_rank"] == 6000
    out = shardwise_json("comm", "--size", "13.5GB", "--ranks", "8", "--link", "ndr")
    assert out["seconds"] == pytest.approx(0.47, abs=0.005)


@pytest.mark.parametrize(("args", "fragments"), [
    (["memory", "lama3-8b"], ["unknown model 'lama3-8b'", "did you mean llama3-8b"]),
    (["memory", "--tp", "3"], ["tp·pp·cp = 3 does not divide --gpus 8"]),
    (["memory", "--gpus", "64", "--tp", "64"], ["tp=64 does not divide n_heads=32"]),
    (["memory", "--seq", "abc"], ["'abc' is not a valid integer"]),
    (["memory", "--gpu", "h1000"], ["unknown accelerator 'h1000'"]),
    (["memory", "/nonexistent/config.json"], ["not found"]),
    (["comm", "--size", "13.5GX"], ["cannot read size '13.5GX'"]),
    (["comm", "--link", "nvlink9"], ["unknown link 'nvlink9'"]),
    (["memory", "--bogus"], ["No such option '--bogus'"]),
])
def test_bad_input_is_one_line_and_exit_2(args, fragments):
    assert_one_line_error(shardwise(*args, check=False), *fragments)


def test_malformed_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{oops")
    assert_one_line_error(shardwise("memory", str(path), check=False), "not valid JSON")


def test_schedule_spec_figures(tmp_path):
    out = shardwise_json("schedule", "--stages", "4", "--microbatches", "8", "--schedule",
                         "gpipe")
    assert out["actions"] == 64 and out["makespan"] == 22
    assert out["bubble_fraction"] == pytest.approx(3 / 11)
    assert out["peak_in_flight"] == [8, 8, 8, 8]
    svg = tmp_path / "zb.svg"
    out = shardwise_json("schedule", "-p", "4", "-m", "8", "--schedule", "zb-h1", "--svg",
                         str(svg))
    assert out["peak_in_flight"] == [4, 3, 2, 1]
    assert svg.read_text().startswith("<svg")
    text = shardwise("schedule", "-p", "2", "-m", "2", "--schedule", "gpipe").stdout
    assert "0 | F0 F1 .  .  B0 B1" in text


def test_schedule_times_are_per_stage_for_every_schedule():
    # issue 31's acceptance, t_f = t_b = 1 per stage: 1F1B (m+p-1)(t_f+t_b) = 22; interleaved
    # m(t_f+t_b) + (p-1)(t_f+t_b)/v = 16 + 3 = 19; ZB-H1 (B = W = 1/2), ZBV and DualPipeV
    # below 1F1B at the same work; in-flight in micro-batches (interleaved stage 0:
    # p + (p-1)/v)
    def run(*args):
        return shardwise_json("schedule", "-p", "4", "-m", "8", *args)

    one_f_one_b = run("--schedule", "1f1b")["makespan"]
    interleaved = run("--schedule", "interleaved", "--chunks", "2")
    assert one_f_one_b == 22 and interleaved["makespan"] == 19
    assert interleaved["peak_in_flight"][0] == 5.5
    for name in ("zb-h1", "zbv", "dualpipev"):
        out = run("--schedule", name)
        assert out["makespan"] < one_f_one_b and out["t_w"] == 0.5, name
    assert run("--schedule", "zbv")["chunks"] == run("--schedule", "dualpipev")["chunks"] == 2


def test_schedule_bad_input():
    result = shardwise("schedule", "-p", "4", "-m", "6", "--schedule", "interleaved",
                       check=False)
    assert_one_line_error(result, "m=6, p=4")
    assert_one_line_error(shardwise("schedule", "--schedule", "pipedream", check=False),
                          "'pipedream' is not one of")
    assert_one_line_error(shardwise("schedule", "--schedule", "dualpipev", "-p", "4", "-m", "6",
                                    check=False), "at least 2p = 8 micro-batches")
    assert_one_line_error(shardwise("schedule", "--schedule", "zb-h1", "--tb", "1", "--tw", "1",
                                    check=False), "t_w (1) must be less than t_b (1)")


def test_the_analytic_side_never_imports_torch():
    # `pip install shardwise` must plan without torch: nothing outside runtime/ and emulate/
    # may pull it in, not even indirectly.
    import subprocess
    import sys

    code = ("import sys; import shardwise, shardwise.cli, shardwise.plan, shardwise.emit, "
            "shardwise.estimate.step, shardwise.schedules, shardwise.report.plan_report, "
            "shardwise.report.builders, shardwise.report.text; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
