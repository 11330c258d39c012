"""The mutation figure cannot go stale (issue 45): CI mutates one analytic group whole,
estimate/offload.py (`benchmarks/mutation.py`'s `run_group`, the same mutmut run, constant
operator and test selection as `python benchmarks/mutation.py --only offload`), against the
group's real test files, and fails on any survivor not in the script's `EQUIVALENT`. 120
mutants: 58 s at load average 2.7 and 152 s at 11 on the shared 2-core machine. `slow`:
deselected locally with -m "not slow", run in CI."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
GROUP = "offload"


@pytest.mark.slow
def test_every_offload_mutant_is_killed_or_listed_as_equivalent():
    if importlib.util.find_spec("mutmut") is None:
        if os.environ.get("CI"):
            pytest.fail("mutmut is not installed (the dev extra pins it)")
        pytest.skip("mutmut is not installed (pip install -e '.[dev]')")
    mutation = load_script("benchmarks/mutation.py")
    files, tests = mutation.GROUPS[GROUP]
    # the group runs its real test files (those importing estimate.offload): the closed forms
    assert "tests/estimate/test_offload_steps.py" in tests
    record = mutation.run_group(GROUP, None, 0)
    shutil.rmtree(str(record["where"]), ignore_errors=True)
    equivalent = mutation.EQUIVALENT
    alive = [name for name in record["survivors"] if name not in equivalent]
    # every mutant generated was run (mutmut's and the constants'), none left unchecked
    assert record["checked"] == record["mutants"] > 100
    assert record["constants"]["killed"] + record["constants"]["survived"] > 0
    assert not alive, f"{len(alive)} mutants of {files} survive the tests: {alive}"
