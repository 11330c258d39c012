"""`shardwise plan` reads at any width (issue 46): at 80 and 100 columns no line is wider than
the terminal and no number or layout is cut ("6.…", "dp…"); `--wide` shows every column at
its full width. Through the real entry point, as a user's terminal runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwise.units import human_count, human_time


def _run(*args: str, columns: int) -> str:
    env = os.environ | {"COLUMNS": str(columns)}
    done = subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True,
                          text=True, timeout=120, env=env, check=True)
    return done.stdout


def _rows(text: str) -> list[list[str]]:
    """The ranked table's rows, their wrapped lines joined cell by cell."""
    lines = text.split("Recommended:")[0].splitlines()
    rows: list[list[str]] = []
    for line in lines:
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            rows.append(cells)
        else:  # a wrapped continuation of the row above
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows


PLANS = [("plan",), ("plan", "llama3-70b", "--gpus", "512", "--impl", "torchtitan")]


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("args", PLANS, ids=["default", "torchtitan-not-validated"])
def test_the_plan_fits_the_terminal_with_nothing_cut(args, columns):
    text = _run(*args, columns=columns)
    out = json.loads(_run(*args, "--json", columns=200))
    assert max(len(line) for line in text.splitlines()) <= columns
    assert "…" not in text
    rows = _rows(text)
    assert len(rows) == len(out["ranked"])
    for cells, entry in zip(rows, out["ranked"]):
        rank, tier, layout, step, rate, mfu, memory = cells
        sure = entry["estimate"]["uncertainty"]
        assert rank == str(entry["rank"])
        assert tier == str(entry["tier"]) + (" ★" if entry["rank"] == out["recommended"]["rank"]
                                             else "")
        assert layout == (entry["short"] + (f" +{entry['variants']}" if entry["variants"] else "")
                          + (" †" if sure["unvalidated"] else ""))
        band = ("not validated" if sure["band"] is None else f"±{round(sure['band'] * 100)}%")
        assert step == f"{human_time(entry['estimate']['total'])} {band}"
        assert rate == human_count(entry["estimate"]["tokens_per_s"])
        assert mfu == f"{entry['estimate']['mfu']:.1%}"
        assert memory == f"{entry['memory']['total'] / 2**30:,.1f}"
    if "torchtitan" in args:
        assert all(r["estimate"]["uncertainty"]["validated"] is False for r in out["ranked"])


def test_wide_shows_every_column_uncut_in_a_narrow_terminal():
    text = _run("plan", "--wide", columns=80)
    header = next(line for line in text.splitlines() if line.startswith("┃"))
    for column in ("goodput", "tokens/s", "HFU", "mem GiB", "compute", "TP", "DP",
                   "PP+bubble", "other"):
        assert f" {column} " in header
    assert "…" not in text
    assert "+3 variants" in text  # the full fold text, not the compact "+3"
