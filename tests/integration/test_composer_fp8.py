"""pytorch-fsdp's FP8 (issue 44): llm-foundry's FP8 benchmark runs — Composer `amp_fp8` over
Transformer Engine 0.10's `te.Linear` (`fc_type: te`) — checked against the code they ran
(data/composer_te_fp8.json, parsed with `ast` by scripts/composer_fp8_facts.py: TE needs CUDA
to import), the cast bytes and scaling state in closed form, the published FP8 / BF16 ratio,
and the refusals."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.emit import emit
from shardwise.errors import ShardwiseError
from shardwise.estimate.compute import ComputeContext, layer_cost
from shardwise.estimate.geometry import fp8_linear_params
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.fp8 import AMAX_HISTORY, COMPOSER_AMAX_HISTORY, get_recipe
from shardwise.hardware import get_accelerator
from shardwise.layout import Layout, TrainSpec
from shardwise.stacks import STACKS
from tests.test_bad_input import assert_one_line

ROOT = Path(__file__).resolve().parents[2]
FACTS = json.loads((Path(__file__).parent / "data" / "composer_te_fp8.json").read_text())
TE, FOUNDRY = FACTS["transformer_engine"], FACTS["llm_foundry"]
RECIPE = get_recipe("composer", "delayed")
H100 = get_accelerator("h100")
# llm-foundry's mpt-1b (validation_runs.json): h=2048, f=4h, learned positions, tied head
MPT1B = ModelSpec(name="mpt-1b", n_layers=24, d_model=2048, n_heads=16, n_kv_heads=16,
                  d_ff=8192, vocab=50368, gated_mlp=False, tie_embeddings=True,
                  norm="layernorm", learned_positions=8192, max_seq=8192).validate()
TRAIN = TrainSpec(seq_len=8192, global_batch=64, fp8="delayed", impl="pytorch-fsdp",
                  attention="triton")


# ------------------------------------------------------------ the recipe against the code
def test_recipe_is_composers_default_delayed_scaling_over_te():
    for tag, config in FACTS["composer"].items():  # the table's pin and the cited commit's
        assert ast.literal_eval(config["amax_history_len"]) == RECIPE.history, tag
        assert ast.literal_eval(config["amax_compute_algo"]) == "max", tag
        assert config["fp8_format"] == TE["DelayedScaling"]["fp8_format"] == "Format.HYBRID"
    # Composer overrides TE's own default history, which the "te" recipes keep
    te_default = ast.literal_eval(TE["DelayedScaling"]["amax_history_len"])
    assert te_default == AMAX_HISTORY == get_recipe("te", "delayed").history
    assert RECIPE.history == COMPOSER_AMAX_HISTORY != te_default
    # the weight-gradient GEMM in FP8 unless the recipe overrides it (default: no override)
    assert RECIPE.wgrad_fp8 == (TE["_OverrideLinearPrecision"]["wgrad"] == "False")
    # backward keeps the FP8 transpose of the input (1 byte, no block scales)
    assert "inputmat_t if weight.requires_grad and fp8_wgrad else None" in TE["save_for_backward"]
    assert RECIPE.saved_input_bytes() == 1.0


def test_weights_are_cast_every_micro_batch_because_mpt_passes_no_is_first_microbatch():
    assert TE["update_fp8_weights"] == "is_first_microbatch is None or is_first_microbatch"
    calls = FOUNDRY["call_keywords"]
    assert set(calls) == {m for ms in FOUNDRY["built_with_fc_type"].values() for m in ms}
    assert all("is_first_microbatch" not in kw and "**" not in kw
               for call in calls.values() for kw in call)
    assert not RECIPE.weight_cached
    # TE delayed scaling otherwise: what Megatron-LM runs is the same recipe with its cache
    te = get_recipe("te", "delayed")
    assert replace(RECIPE, framework=te.framework, title=te.title, source=te.source,
                   history=te.history, weight_cached=True) == te


def test_fp8_layers_are_the_four_fc_type_linears_and_not_the_tied_head():
    assert FOUNDRY["fp8_sets"] == {"parameters['model']['fc_type']": "te"}
    assert FOUNDRY["fc_registered"]["te"] == "te.Linear"
    built = FOUNDRY["built_with_fc_type"]
    assert built == {"GroupedQueryAttention": ["self.Wqkv", "self.out_proj"],
                     "MPTMLP": ["self.up_proj", "self.down_proj"]}
    # the LM head is its own (torch) layer only when untied; llm-foundry's MPTs are tied
    assert FOUNDRY["lm_head_if"] == "not config.tie_word_embeddings"
    assert FOUNDRY["tie_word_embeddings_default"] == "True" and MPT1B.tie_embeddings
    assert not RECIPE.head_fp8
    # the MLP is MPTMLP (torch GeLU between two te.Linear), not TE's fused LayerNorm-MLP: the
    # block's memory-bound traffic stays the bf16 table's, plus the casts
    assert FOUNDRY["ffn_type_default"] == "'mptmlp'"
    assert FOUNDRY["yaml_sets_ffn_config"] == {"1b": False, "3b": False}
    h, f = MPT1B.d_model, MPT1B.d_ff
    weights, _, gemms, _ = fp8_linear_params(MPT1B, RECIPE, 1, 1)
    assert gemms == sum(len(v) for v in built.values()) == 4
    assert weights == 3 * h * h + h * h + h * f + f * h  # Wqkv, out_proj, up, down


def test_the_stack_runs_it_and_the_rows_ask_for_it():
    stack = STACKS["pytorch-fsdp"]
    assert stack.fp8 == ("delayed",) and stack.fp8_recipe("delayed") is RECIPE
    data = json.loads((ROOT / "benchmarks" / "validation_runs.json").read_text())
    source = next(s for s in data["sources"] if s["id"] == "llm-foundry-h100-fp8")
    assert source["defaults"]["fp8"] == "delayed"
    assert source["defaults"]["stack"]["impl"] == "pytorch-fsdp"


# --------------------------------------------------------------------------- closed forms
def test_cast_bytes_per_element_on_hopper_weight_every_micro_batch():
    # cast + transpose: read bf16 (2), write the FP8 copy (1) and its transpose (1)
    per_element = 2 + 1 + 1
    expected = (per_element, 0.0, per_element, per_element, 0.0, 0.0)
    assert RECIPE.cast_bytes("hopper") == RECIPE.cast_bytes("hopper", fsdp=True) == expected
    # no FP8 weight held across the step, sharded or not (TE delayed keeps 2 bytes unsharded)
    assert RECIPE.weight_copy_bytes("hopper") == RECIPE.weight_copy_bytes("hopper", True) == 0
    assert get_recipe("te", "delayed").weight_copy_bytes("hopper") == 2.0


def test_a_layers_fp8_casts_in_closed_form():
    """MPT-1B layer, 2 × 8192 tokens: forward casts each linear's input (T·h for Wqkv,
    out_proj and up_proj, T·f for down_proj) and its weight (3h², h², h·f, f·h), backward each
    output gradient (T·3h, T·h, T·f, T·h), 4 bytes per element; the same layer with a recipe
    that moves no cast bytes gives the reference time."""
    ctx = ComputeContext.of(MPT1B, H100, TRAIN)
    free = replace(ctx, fp8=replace(RECIPE, torchao_bytes=(0.0,) * 5))
    t_rows, h, f = 2 * 8192, MPT1B.d_model, MPT1B.d_ff
    fwd = 4 * (t_rows * (3 * h + f) + 4 * h * h + 2 * h * f)
    bwd = 4 * t_rows * (3 * h + h + f + h)
    with_casts, without = layer_cost(ctx, 1, 1, 2, 0, 0), layer_cost(free, 1, 1, 2, 0, 0)
    assert (with_casts.fwd - without.fwd) * ctx.hbm == pytest.approx(fwd, rel=1e-9)
    assert (with_casts.bwd - without.bwd) * ctx.hbm == pytest.approx(bwd, rel=1e-9)


@pytest.mark.parametrize("zero", [2, 3])
def test_fp8_memory_is_the_scaling_state_only(zero):
    """Per FP8 GEMM five scaled tensors, each a 16-entry amax history plus scale and inverse
    scale in fp32; no weight copies under ZeRO-2 or ZeRO-3."""
    layout = Layout.parse(f"dp=8,zero={zero},mb=2")
    stage = training_memory_per_gpu(MPT1B, layout, TRAIN)[0]
    assert stage.fp8 == MPT1B.n_layers * 4 * 5 * (COMPOSER_AMAX_HISTORY + 2) * 4


# ------------------------------------------------------------ the published FP8 speed-up
@pytest.fixture(scope="module")
def vr():
    path = ROOT / "benchmarks" / "validation_rows.py"
    spec = importlib.util.spec_from_file_location("validation_rows", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_fp8_over_bf16_speedup_tracks_the_published_tables(vr):
    """The five rows both llm-foundry H100 tables ran with the same model, GPUs, sequence,
    micro-batch and batch: the predicted FP8 / BF16 throughput ratio within 10 % of the
    published one (1.00 … 1.35: FP8 gains nothing at s=32768, where attention dominates)."""
    _, _, rows = vr.load()
    by_key = {(r["model"]["spec"]["name"], r["gpus"], r["seq"], r["layout"], r["global_batch"]):
              r for r in rows if r["source"] == "llm-foundry-h100-bf16"}
    pairs = [(r, by_key[k]) for r in rows if r["source"] == "llm-foundry-h100-fp8"
             and (k := (r["model"]["spec"]["name"], r["gpus"], r["seq"], r["layout"], r["global_batch"]))
             in by_key]
    assert len(pairs) == 5
    for fp8, bf16 in pairs:
        published = fp8["published"]["value"] / bf16["published"]["value"]
        predicted = vr.evaluate(fp8).predicted / vr.evaluate(bf16).predicted
        assert predicted == pytest.approx(published, rel=0.10), fp8["id"]


# ---------------------------------------------------------------------------- refusals
def test_other_recipes_and_exports_are_refused(capsys):
    args = ("plan", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--impl",
            "pytorch-fsdp", "--layout", "zero=3,mb=2")
    assert_one_line(capsys, (*args, "--fp8", "tensorwise"),
                    "pytorch-fsdp has no FP8 recipe 'tensorwise'; valid: delayed")
    assert_one_line(capsys, (*args, "--fp8", "delayed", "--emit", "torchtitan"),
                    "--impl pytorch-fsdp another")
    train = TrainSpec(seq_len=8192, global_batch=64, fp8="delayed", impl="pytorch-fsdp")
    for framework in ("torchtitan", "megatron", "deepspeed"):
        with pytest.raises(ShardwiseError, match="pytorch-fsdp has no export"):
            emit(framework, get_model("llama3-8b"), Layout.parse("dp=8,zero=3,mb=2"), train)
