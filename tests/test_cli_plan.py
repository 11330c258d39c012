"""`shardwise plan` through the real entry point: the default run, JSON, emit, bad input."""

import json

from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json


def test_plan_with_no_arguments_runs_the_builtin_default():
    result = shardwise("plan")
    assert "llama3-8b" in result.stdout
    assert "Top 10 layouts" in result.stdout
    assert "Winner's step time" in result.stdout
    assert "is the fastest of" in result.stdout  # the explanation paragraph
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
