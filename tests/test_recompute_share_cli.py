"""`--recompute-share P` (`TrainSpec.recompute_share`) through the entry points users run: the
`shardwise` CLI (memory, plan, --emit megatron) and the web API's same builders. The memory a
share keeps is the closed-form blend `P·full + (1-P)·none` of each stage's activations (each
of the stage's layers either checkpointed or keeping all, as PyTorch's `checkpoint` keeps them:
`tests/test_recompute_share.py`); Megatron's `--recompute-num-layers` is `P` of a stage's
layers."""

from __future__ import annotations

import pytest

from tests.cli_helpers import assert_one_line_error, shardwise, shardwise_json

# Llama-3-8B on 8 GPUs, tp·pp = 4 (32 layers, 16 a stage): every term distinguishable per stage
MEMORY = ("memory", "llama3-8b", "--gpus", "8", "--tp", "2", "--pp", "2", "--seq", "4096")


def _activations(*extra: str) -> list[float]:
    return [s["activations"] for s in shardwise_json(*MEMORY, *extra)["stages"]]


def test_cli_memory_blends_none_and_full_by_the_share():
    none = _activations("--recompute", "none")
    full = _activations("--recompute", "full")
    quarter = _activations("--recompute", "full", "--recompute-share", "0.25")
    assert all(f < n for f, n in zip(full, none, strict=True))
    assert quarter == pytest.approx([0.25 * f + 0.75 * n for f, n in zip(full, none,
                                                                        strict=True)])
    assert shardwise_json(*MEMORY, "--recompute", "full", "--recompute-share", "0.25")[
        "train"]["recompute_share"] == 0.25


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.5", "nan", "half"])
def test_cli_refuses_a_share_outside_0_1(bad):
    result = shardwise(*MEMORY, "--recompute", "full", "--recompute-share", bad, check=False)
    assert_one_line_error(result, "--recompute-share")


def test_cli_refuses_a_share_without_full_recompute():
    result = shardwise(*MEMORY, "--recompute", "selective", "--recompute-share", "0.5",
                       check=False)
    assert_one_line_error(result, "needs recompute=full")


def test_plan_searches_full_recompute_and_megatron_runs_the_share_per_stage():
    """A share asks for full recompute of that share: the search ranks full-recompute layouts
    (it crashed on the first `none` one before), and Megatron's block method recomputes
    0.25 × 16 = 4 layers of each pp = 2 stage."""
    ranked = shardwise_json("plan", "llama3-8b", "--gpus", "8", "--seq", "4096",
                            "--recompute-share", "0.5", "--top", "3")["ranked"]
    assert ranked and {row["layout"]["recompute"] for row in ranked} == {"full"}
    text = shardwise("plan", "llama3-8b", "--gpus", "8", "--seq", "4096", "--layout",
                     "tp=2,pp=2,dp=2,recompute=full", "--recompute-share", "0.25",
                     "--emit", "megatron").stdout
    assert "--recompute-method block" in text and "--recompute-num-layers 4" in text


def test_web_api_takes_the_share_as_the_cli_does():
    """The web API's `/api/memory` builds the same `TrainSpec` (`builders.memory_payload`):
    the same stages as the CLI; a share outside (0, 1] is a 4xx naming the field."""
    from fastapi.testclient import TestClient

    from shardwise.web.app import create_app

    body = {"model": "llama3-8b", "gpus": 8, "tp": 2, "pp": 2, "seq": 4096,
            "recompute": "full", "recompute_share": 0.25}
    with TestClient(create_app()) as client:
        answer = client.post("/api/memory", json=body)
        assert answer.status_code == 200, answer.text
        cli = _activations("--recompute", "full", "--recompute-share", "0.25")
        assert [s["activations"] for s in answer.json()["stages"]] == cli
        for bad in (0, 1.5):
            refused = client.post("/api/memory", json=body | {"recompute_share": bad})
            assert 400 <= refused.status_code < 500 and "recompute_share" in refused.text
