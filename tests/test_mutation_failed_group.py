"""benchmarks/mutation.py goes on past a group whose mutmut pass fails: that group's record says
`failed` with one line (the error's first line and mutmut's last), its row in the page says so,
and the next group still runs and is recorded with its counts."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_a_failing_group_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    if importlib.util.find_spec("mutmut") is None:
        pytest.skip("mutmut is not installed (pip install -e '.[dev]')")
    mutation = load_script("benchmarks/mutation.py")
    scratch = tmp_path / "shardwise-mutation-comm-x"
    scratch.mkdir()
    ran = []

    def run_group(group, sample, seed):
        ran.append(group)
        if group == "comm":  # what `_mutmut` raises when `mutmut run` exits non-zero
            raise RuntimeError(f"mutmut run failed in {scratch}:\nTraceback (most recent "
                               "call last):\n  ...\nKeyError: 'x_ring__mutmut_3'")
        files, tests = mutation.GROUPS[group]
        counts = dict.fromkeys(mutation.STATUSES, 0) | {"killed": 3, "survived": 1}
        return {"group": group, "where": str(tmp_path / "kept"), "files": files,
                "tests": tests, "mutants": 9, "checked": 4, "counts": counts,
                "constants": {"killed": 0, "survived": 0, "no tests": 0, "timeout": 0},
                "seconds": 6.0, "survivors": ["shardwise.estimate.memory.x_f__mutmut_1"]}

    monkeypatch.setattr(mutation, "run_group", run_group)
    monkeypatch.setattr(mutation, "RECORDS", tmp_path / "mutation.json")
    monkeypatch.setattr(mutation, "OUT", tmp_path / "mutation.md")
    monkeypatch.setattr(mutation, "ROOT", tmp_path)  # where it prints the page is
    monkeypatch.setattr(sys, "argv", ["mutation.py", "--only", "comm", "memory"])
    assert mutation.main() == 0
    assert ran == ["comm", "memory"]
    assert not scratch.exists()  # the failed group's scratch copy is removed (no --keep)
    records = json.loads((tmp_path / "mutation.json").read_text())
    failed = records["comm"]["failed"]
    assert "\n" not in failed
    assert failed == (f"RuntimeError: mutmut run failed in {scratch}: … "
                      "KeyError: 'x_ring__mutmut_3'")
    assert "counts" not in records["comm"] and records["memory"]["counts"]["survived"] == 1
    page = (tmp_path / "mutation.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| comm |"))
    assert f"failed: {failed}" in row and row.count("|") == 15  # the table's 14 columns
    assert "- **comm**: the run failed" in page
    memory = next(line for line in page.splitlines() if line.startswith("| memory |"))
    assert "| 25.0% |" in memory  # 1 survivor of 4 checked
