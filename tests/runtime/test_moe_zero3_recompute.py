"""MoE under ZeRO-3 with activation recompute equals one device.

Stage 3 gathers a layer's weights again before its backward, inside a backward hook; full
recompute's replay then runs the layer's forward on those weights and must save what the
forward saved (torch.utils.checkpoint counts them). The router's `x @ W_r` (gpt-oss's
`addmm(b_r, x, W_r)`) uses its weight directly, unlike a linear's `weight.t()`, so it is where
a replay on weights without an autograd edge saved one tensor fewer (CheckpointError).

References: `test_moe_train.reference` (a single-device `Transformer` trained with torch's
AdamW, capacity factor, aux loss and shared experts written out there) for the runtime, and
`shardwise train` on one device for the CLI: per-step loss and pre-clip gradient norm equal
(fp64, relative 1e-10), and the final parameters (runtime path).
"""

import pytest
from test_moe_train import _check, config
from test_train import _train_layouts  # the rank worker (tests/runtime is on sys.path)
from tests.cli_helpers import shardwise, shardwise_json

from shardwise.runtime.launch import spawn

# one shared expert, top-2 of 4 routed experts, capacity 1.0 and the aux loss (α = 0.1)
LAYOUTS = [config("dp=2,zero=3,recompute=full", shared=1),
           config("dp=2,ep=2,zero=3,recompute=full", shared=1),
           config("dp=2,zero=3,recompute=selective", shared=1),
           config("dp=2,zero=2,recompute=full", shared=1)]


@pytest.mark.slow
def test_moe_zero3_with_full_and_selective_recompute_equals_single_device():
    """ZeRO-3 + full recompute (with and without ep), its neighbours ZeRO-3 + selective and
    ZeRO-2 + full: losses, gradient norms and final parameters equal one device's."""
    _check(spawn(_train_layouts, 2, LAYOUTS, timeout_s=300), LAYOUTS)


STEPS = ("--steps", "3", "--seq", "16", "--global-batch", "4", "--mbs", "2", "--dtype",
         "fp64", "--lr", "3e-3", "--warmup", "1", "--quiet")


def _curve(model: str, *layout: str) -> list[tuple[float, float]]:
    out = shardwise_json("train", "--model", model, *layout, *STEPS)
    return [(r["loss"], r["grad_norm"]) for r in out["records"]]


def _assert_same(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> None:
    assert len(got) == len(want) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-10)
        assert norm == pytest.approx(ref_norm, rel=1e-10)


@pytest.mark.slow
def test_cli_trains_deepseek_moe_on_zero3_with_full_recompute_like_one_device():
    """`shardwise train` as a user runs it: tiny-deepseek (a shared expert, top-2 of 8
    sigmoid-routed experts in groups, MLA) on dp=2 with ZeRO-3 and full recompute."""
    zero3 = ("--dp", "2", "--zero", "3", "--recompute", "full", "--capacity-factor", "1.0",
             "--aux-loss-coef", "0.1")
    one = ("--capacity-factor", "1.0", "--aux-loss-coef", "0.1")
    _assert_same(_curve("tiny-deepseek", *zero3), _curve("tiny-deepseek", *one))


@pytest.mark.slow
def test_cli_trains_gpt_oss_on_zero3_with_full_recompute_like_one_device(tmp_path):
    """gpt-oss's router adds its bias with `addmm(b_r, x, W_r)` (weights from a
    transformers checkpoint): dp=2, ZeRO-3, full recompute against one device."""
    pytest.importorskip("transformers")
    from tests.runtime.hf_variant_models import hf_model

    hf_model("gpt_oss").save_pretrained(tmp_path, safe_serialization=True)
    zero3 = ("--dp", "2", "--zero", "3", "--recompute", "full")
    _assert_same(_curve(str(tmp_path), *zero3), _curve(str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-moe", "tiny"])
def test_check_on_zero3_with_full_recompute_meets_every_target(model):
    """The reported command, `shardwise check --model tiny-moe --dp 2 --zero 3 --recompute
    full` (before the fix: CheckpointError), and the dense model beside it."""
    run = shardwise("check", "--model", model, "--dp", "2", "--zero", "3", "--recompute",
                    "full", check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "meet their targets" in run.stdout
