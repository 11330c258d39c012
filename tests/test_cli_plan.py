"""`shardwise plan` through the real entry point: the default run, JSON, emit, bad input,
the order the rows are shown in, constraints; `shardwise memory`'s fit hints."""

import json
from itertools import pairwise

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.arch import get_model
from shardwise.cli import cli
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.plan.fit import fit_hints
from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json
from tests.web.cli_json import cli_json

try:  # /api/plan too where the ui extra is installed
    from fastapi.testclient import TestClient

    from shardwise.web.app import create_app

    client = TestClient(create_app())
except ImportError:
    client = None


def test_plan_with_no_arguments_runs_the_builtin_default():
    result = shardwise("plan")
    assert "llama3-8b" in result.stdout
    assert "Top 10 layouts" in result.stdout
    assert "Recommended layout's step time" in result.stdout
    assert "is recommended among" in result.stdout or "is the fastest of" in result.stdout
    assert "Rejected regions" in result.stdout


def test_plan_json_has_ranking_breakdown_and_cost():
    out = shardwise_json("plan", "llama3-70b", "--gpus", "64", "--seq", "8192",
                         "--global-batch", "256", "--top", "3", "--tokens", "15T",
                         "--price", "2.5", "--layout", "tp=8,pp=2,zero=1,sp=1")
    assert len(out["ranked"]) == 3
    best = out["ranked"][0]
    parts = ("compute", "tp_comm", "cp_comm_exposed", "ep_comm", "pp_comm", "bubble",
             "dp_comm_exposed", "optimizer")
    assert abs(sum(best["estimate"][k] for k in parts) - best["estimate"]["total"]) < 1e-9
    assert best["fits"] and 0 < best["estimate"]["mfu"] < 1
    assert out["training"]["cost"] > 0 and out["training"]["gpu_hours"] > 0
    assert out["given"]["layout"]["dp"] == 4 and out["given_note"]
    assert out["baseline"] is not None and out["explanation"]
    assert out["stats"]["evaluated"] > 0


def test_plan_reads_binary_token_batches():
    out = shardwise_json("plan", "llama3-8b", "--gpus", "8", "--seq", "8192",
                         "--global-batch", "4M-tokens", "--top", "1")
    # 4·10^6 / 8192 is not whole; 4·2^20 / 8192 = 512 is.
    assert out["train"]["global_batch"] == 512


def test_plan_emit_prints_only_the_config():
    # (the search's best here is ring attention over cp 2, which DeepSpeed cannot run)
    result = shardwise("plan", "llama3-8b", "--gpus", "16", "--global-batch", "64",
                       "--layout", "zero=2", "--emit", "deepspeed")
    config = json.loads(result.stdout)
    assert config["train_batch_size"] == 64


def test_plan_bad_inputs_exit_2_with_one_line():
    assert_one_line_error(shardwise("plan", "llama9", check=False), "unknown model")
    assert_one_line_error(shardwise("plan", "--gpus", "12", check=False), "whole nodes")
    assert_one_line_error(shardwise("plan", "--gpu", "z100", check=False), "accelerator")
    assert_one_line_error(shardwise("plan", "--gpus", "24", "--layout", "tp=3", check=False),
                          "tp=3 does not divide n_heads")
    assert_one_line_error(shardwise("plan", "llama3-405b", "--gpus", "8", check=False),
                          "GiB over")
    assert_one_line_error(shardwise("plan", "--price", "2", check=False), "--tokens")
    assert_one_line_error(shardwise("plan", "--fix", "tp=x", check=False),
                          "layout tp='x' must be an integer")
    assert_one_line_error(shardwise("plan", "--max", "schedule=zb-h1", check=False),
                          "--max takes counts")
    assert_one_line_error(shardwise("plan", "mixtral-8x7b", "--gpus", "64", "--expert-load",
                                    "0.5", check=False), "expert_load must be ≥ 1")


def test_a_pipeline_on_a_stack_without_pipelines_is_one_sentence():
    """The stack's missing axis is the whole reason: no empty list of schedules after it."""
    result = shardwise("plan", "--impl", "hf-sdpa", "--fix", "pp=2", check=False)
    assert_one_line_error(result)
    assert result.stderr.strip() == "error: hf-sdpa has no PP (pp=2); it runs data parallelism only"


def test_a_stated_expert_load_slows_the_experts_and_fills_the_busiest_rank():
    """`--expert-load λ` (what `check` measures): the busiest ep rank's GEMMs, all-to-alls and
    routed activations grow; the attention and the weights do not."""
    def run(*extra):
        return shardwise_json("memory", "mixtral-8x7b", "--gpus", "64", "--seq", "4096",
                              "--tp", "2", "--pp", "2", "--ep", "8", *extra)
    even, busy = run(), run("--expert-load", "1.5")
    for a, b in zip(even["stages"], busy["stages"], strict=True):
        assert b["activations"] > a["activations"] and b["weights"] == a["weights"]
    step = [shardwise_json("plan", "mixtral-8x7b", "--gpus", "64", "--seq", "4096", "--layout",
                           "tp=2,pp=2,ep=8", "--top", "1", *extra)["given"]["estimate"]
            for extra in ((), ("--expert-load", "1.5"))]
    assert step[1]["compute"] > step[0]["compute"] and step[1]["ep_comm"] > step[0]["ep_comm"]
    assert step[1]["tp_comm"] == step[0]["tp_comm"]


def test_plan_json_names_its_flop_convention_and_the_explanation_reads_right():
    out = shardwise_json("plan", "llama3-8b", "--gpus", "64", "--seq", "4096",
                         "--global-batch", "8", "--top", "1")
    assert "full s^2 attention" in out["flop_convention"]
    best = out["ranked"][0]["estimate"]
    assert best["mfu_causal"] < best["mfu"] and best["flop_convention"] == out["flop_convention"]
    text = out["explanation"]
    assert "1 micro-batches" not in text and "none recompute" not in text
    layout = out["ranked"][0]["layout"]
    if layout["sp"]:  # sequence parallel: reduce-scatter / all-gather, not all-reduce
        assert "reduce-scatters and all-gathers" in text


def test_a_torchtitan_plan_won_by_op_sac_explains_its_hfu():
    """torchtitan's per-op SAC wins Llama 3 70B on 256 H100s; the explanation says what its HFU
    adds, and the HFU/MFU ratio is the recomputed matmuls' closed form (`ModelSpec`)."""
    out = shardwise_json("plan", "llama3-70b", "--impl", "torchtitan", "--gpus", "256",
                         "--global-batch", "256", "--compile", "--tp-overlap", "async",
                         "--top", "1")
    assert out["ranked"][0]["layout"]["recompute"] == "op-sac"
    assert "matmuls per-op SAC does not save (wo, w3) recomputed" in out["explanation"]
    model, best = get_model("llama3-70b"), out["ranked"][0]["estimate"]
    forward = model.forward_flops_per_token(8192)
    # wo (a·d·h) and w3 (h·f) of every layer once more, 2 FLOPs per multiply-add
    recomputed = 2 * model.n_layers * (model.q_dim * model.d_model + model.d_model * model.d_ff)
    assert best["hfu"] / best["mfu"] == pytest.approx(1 + recomputed / (3 * forward))


def test_gpt3_13b_preset_plans():
    # Brown et al. 2020 print d_model 5140 (a typo: 40 heads × 128); 5120 plans
    out = shardwise_json("plan", "gpt3-13b", "--gpus", "64", "--seq", "2048",
                         "--global-batch", "512", "--top", "1")
    assert out["ranked"][0]["fits"]


def test_no_layout_error_says_each_reason_once():
    # 19 GPUs: pp=19 would leave a stage of the 32 layers empty, tp=19 ∤ 32 heads
    result = shardwise("plan", "llama3-8b", "--gpus", "19", "--gpus-per-node", "19",
                       "--global-batch", "1", "--seq", "4096", check=False)
    assert_one_line_error(result, "no valid layout")
    assert "1 sequence:" in result.stderr
    assert "tp does not divide the attention heads (tp=19" not in result.stderr
    assert "tp=19 does not divide n_heads=32" in result.stderr


# ------------------------------------------------------------- the order shown is sorted
UNITS = {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "days": 86400.0}


def _seconds(text: str) -> float:
    """`human_time`'s text back to seconds: "758.0 µs" → 7.58e-4 (its "±4%" band dropped)."""
    value, unit = text.split()[:2]
    return float(value) * UNITS[unit]


def _shown_steps(output: str) -> list[float]:
    """The step column of the ranked table the CLI prints."""
    header = next(line for line in output.splitlines() if "┃ layout" in line or "layout ┃" in line)
    column = [c.strip() for c in header.split("┃")].index("step")
    rows = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > column and cells[1].isdigit():
            rows.append(_seconds(cells[column]))
        elif rows and "Recommended" in line:
            break
    return rows


@settings(max_examples=6)
@given(model=st.sampled_from(["tiny", "tiny-moe"]), gpus=st.sampled_from([3, 4, 6, 8]),
       batch=st.sampled_from([6, 8, 12]), variants=st.booleans())
def test_cli_text_json_and_api_show_the_rows_sorted(model, gpus, batch, variants):
    """The rows' step times read in the order shown — the CLI's table, its --json and
    /api/plan — never decrease (ties to 1e-9, broken by the simpler layout)."""
    args = ["plan", model, "--gpus", str(gpus), "--gpus-per-node", str(gpus),
            "--global-batch", str(batch), "--seq", "64", "--top", "8"]
    if variants:
        args.append("--all-variants")
    text = CliRunner().invoke(cli, args)
    if text.exit_code == 2:  # no valid layout of this shape
        return
    assert text.exit_code == 0, text.output
    shown = _shown_steps(text.output)
    assert len(shown) >= 1 and shown == sorted(shown)
    out = cli_json(*args)
    totals = [e["estimate"]["total"] for e in out["ranked"]]
    assert all(a <= b * (1 + 1e-9) for a, b in pairwise(totals))
    assert [e["rank"] for e in out["ranked"]] == list(range(1, len(totals) + 1))
    if client is not None:
        body = {"model": model, "gpus": gpus, "gpus_per_node": gpus, "global_batch": str(batch),
                "seq": 64, "top": 8, "all_variants": variants}
        api = client.post("/api/plan", json=body).json()
        assert [e["estimate"]["total"] for e in api["ranked"]] == totals


def test_fix_ranks_only_what_it_fixes():
    # the acceptance: plan llama3-70b --gpus 512 --fix tp=8,pp=4
    out = shardwise_json("plan", "llama3-70b", "--gpus", "512", "--fix", "tp=8,pp=4")
    assert len(out["ranked"]) == 10
    assert all(e["layout"]["tp"] == 8 and e["layout"]["pp"] == 4 for e in out["ranked"])
    assert out["constraint"] == "fix tp=8,pp=4"
    assert out["rejected"][0]["reason"] == "outside the constraints (fix tp=8,pp=4)"
    # rows folded: no two differ only in the ZeRO group size
    firsts = {json.dumps({k: v for k, v in e["layout"].items() if k != "zero_group"})
              for e in out["ranked"]}
    assert len(firsts) == len(out["ranked"])


def test_memory_prints_and_returns_the_fit_hints():
    args = ["memory", "llama3-70b", "--gpus", "64", "--tp", "8", "--zero", "1"]
    out = cli_json(*args)
    hints = fit_hints(get_model("llama3-70b"), Cluster.of(64, "h100"), TrainSpec(seq_len=8192),
                      Layout(dp=8, tp=8, zero=1), out["budget_bytes"])
    assert out["fit_hints"] == json.loads(json.dumps([h.to_dict() for h in hints])) and hints
    assert not out["fits"] and out["margin_bytes"] < 0
    text = CliRunner().invoke(cli, args).output
    assert "To make it fit" in text
    for hint in hints:
        assert f"{hint.knob}={hint.value} → {hint.layout.short()}" in " ".join(text.split())


def test_an_attention_kernel_without_a_benchmark_on_the_gpu_is_marked_unvalidated():
    """flash-attn's Triton kernel has fitted curves on A100 and H100 only (data/
    calibration.json); on a B200 the plan times it with B200's default kernel and says so."""
    args = ("plan", "llama3-8b", "--gpus", "8", "--impl", "pytorch-fsdp", "--attention",
            "triton", "--top", "2")
    b200 = shardwise_json(*args, "--gpu", "b200")
    h100 = shardwise_json(*args, "--gpu", "h100")
    phrase = "triton attention (no kernel benchmark on b200"
    assert all(any(f.startswith(phrase) for f in row["estimate"]["uncertainty"]["unvalidated"])
               for row in b200["ranked"])
    assert phrase.split(" (")[0] + " (no kernel benchmark" in b200["explanation"]
    assert not any("kernel benchmark" in f for row in h100["ranked"]
                   for f in row["estimate"]["uncertainty"]["unvalidated"])
