"""A tensor-parallel Transformer block (GQA + SwiGLU) and a vocab-parallel LM equal the
unsharded computation; bytes per layer equal `tp_comm_bytes_per_layer`."""

from __future__ import annotations

import pytest

from shardwise.runtime.demos import _tp_both, run_tp_demo
from shardwise.runtime.launch import spawn

TOL = 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 2, 4])
def test_block_and_lm_equal_unsharded(t: int) -> None:
    for rank_results in spawn(_tp_both, t, "float64"):
        for sp, o in zip((False, True), rank_results):
            label = f"t={t} sp={sp}"
            for key in ("out", "grad_x", "grads", "loss", "emb_grad", "head_grad"):
                assert o[key] <= TOL, f"{label}: {key} differs by {o[key]:g}"
            # 4 · 2(t-1)/t · s·b·h·8 bytes: 2 all-reduces forward, 2 backward (or RS + AG)
            assert o["layer_bytes"] == o["predicted_bytes"], label
            if t > 1:
                assert o["ops"] == ({"all-gather", "reduce-scatter"} if sp else {"all-reduce"})


@pytest.mark.slow
def test_tp_demo_rows() -> None:
    rows = run_tp_demo(ranks=2)
    assert len(rows) == 12 and all(r["ok"] for r in rows), rows
