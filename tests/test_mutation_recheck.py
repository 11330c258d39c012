"""benchmarks/mutation.py --recheck: a record's survivors are run again only while the group's
sources are the record's (else the names would name other mutants); the page's *after
recheck* column is (survivors − those killed since) / the same denominator; and a sampled
run's unchosen constants never stay written in the scratch copy."""

import filecmp
import json
import shutil
import subprocess
import sys

import pytest

from tests.scripts import ROOT, load_script


@pytest.fixture(scope="module")
def mutation():
    return load_script("benchmarks/mutation.py")


def _first_commit() -> str:
    out = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode or not out.stdout.strip():
        pytest.skip("not a git checkout with history")
    return out.stdout.split()[0]


def test_a_record_of_other_sources_or_uncommitted_ones_is_not_rechecked(mutation):
    # the planner's sources changed since the repository's first commit; uncommitted
    # sources are not a commit at all: neither runs mutmut (it would take minutes)
    for commit in (_first_commit(), "0123456789ab (with uncommitted changes)"):
        record = {"commit": commit, "survivors": ["shardwise.plan.x_a__mutmut_1"]}
        assert mutation.recheck("plan", record) is None


def test_the_page_counts_the_survivors_killed_since(mutation, tmp_path, monkeypatch):
    counts = dict.fromkeys(mutation.STATUSES, 0) | {"killed": 14, "survived": 5,
                                                    "no tests": 1}
    names = [f"shardwise.estimate.comm.x_f__mutmut_{i}" for i in range(6)]
    record = {"group": "comm", "files": ["estimate/comm.py"], "tests": ["tests/t.py"],
              "mutants": 200, "checked": 20, "counts": counts, "seconds": 60.0,
              "constants": {}, "survivors": names, "command": "python benchmarks/mutation.py",
              "commit": "abc", "date": "2026-12-06", "machine": "2 cores, load average 1.0",
              "recheck": {"command": "python benchmarks/mutation.py --recheck",
                          "commit": "def", "date": "2026-12-06",
                          "killed": [*names[:3], "shardwise.estimate.comm.x_g__mutmut_9"]}}
    monkeypatch.setattr(mutation, "OUT", tmp_path / "mutation.md")
    monkeypatch.setattr(mutation, "EQUIVALENT", {names[5]: "the same number"})
    mutation.write_report({"comm": record})
    page = (tmp_path / "mutation.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| comm |"))
    # 6 survivors, 1 equivalent: 5 of 19; 3 of them killed since (x_g was no survivor): 2 of 19
    assert "| 26.3% | 10.5% |" in row
    assert "- **comm** (2, 3 more killed since): `f` 2" in page
    assert "run again against the tests at commit def" in page


def test_unchosen_constants_leave_the_scratch_sources_as_they_were(mutation, tmp_path):
    source = ROOT / "src" / "shardwise" / "estimate" / "offload.py"
    copy = tmp_path / "src" / "shardwise" / "estimate" / "offload.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(source, copy)
    assert mutation.constant_names("offload")  # the module has constants to mutate
    assert mutation.run_constants(tmp_path, "offload", chosen=set()) == {}
    assert filecmp.cmp(source, copy, shallow=False)


def test_recheck_is_a_command_line_option(mutation, monkeypatch, tmp_path):
    (tmp_path / "mutation.json").write_text(json.dumps({}))
    monkeypatch.setattr(mutation, "RECORDS", tmp_path / "mutation.json")
    monkeypatch.setattr(mutation, "OUT", tmp_path / "mutation.md")
    monkeypatch.setattr(sys, "argv", ["mutation.py", "--recheck", "--only", "comm"])
    assert mutation.main() == 0  # nothing recorded: nothing to recheck, the page written
    assert (tmp_path / "mutation.md").exists()
