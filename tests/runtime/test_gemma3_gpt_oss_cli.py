"""`shardwise train` and `shardwise check` on Gemma 3 and gpt-oss checkpoints written by
transformers' `save_pretrained`, as a user runs them: `train --steps 0 --save-hf OUT` writes a
checkpoint `AutoModelForCausalLM` loads back as the same model (logits equal in float64), and
`check` over three pipeline stages (one sliding or full layer each) meets every target, the
bytes each sliding and full layer saves equal to the count (`estimate.profiles`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.runtime.hf_variant_models import _fp64_islands, hf_model, tokens  # noqa: E402

KINDS = ("gemma3_text", "gpt_oss")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True,
                          text=True, timeout=600)


def _logits(directory, kind: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="eager" if kind == "gpt_oss"
        else "sdpa", experts_implementation="eager").eval()
    _fp64_islands(model, kind)
    with torch.no_grad():
        return model(tokens()).logits


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_train_save_hf_round_trip(tmp_path, kind):
    src, out = tmp_path / "src", tmp_path / "out"
    model = hf_model(kind)
    model.save_pretrained(src, safe_serialization=True)
    run = _cli("train", "--model", str(src), "--dtype", "fp64", "--seq", "12",
               "--global-batch", "2", "--steps", "0", "--save-hf", str(out), "--quiet")
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == kind
    with torch.no_grad():
        theirs = model(tokens()).logits
    assert (_logits(out, kind) - theirs).abs().max().item() <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_check_meets_every_target_over_three_stages(tmp_path, kind):
    hf_model(kind).save_pretrained(tmp_path / "src", safe_serialization=True)
    run = _cli("check", "--model", str(tmp_path / "src"), "--dtype", "fp64", "--seq", "12",
               "--global-batch", "4", "--steps", "2", "--pp", "3", "--json")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(run.stdout)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    saved = [r for r in rows if r["item"] == "activations"]
    assert {r["what"].split()[1] for r in saved} == {"0", "1", "2"}  # sliding, full, sliding
    assert all(r["measured"] == r["predicted"] for r in saved), saved
