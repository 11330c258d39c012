"""README.md stays a short guide whose examples are true: at most 300 lines, no run-by-run
history, the test set-up command is the one `.ci/run` runs, and every example's output is what
its command prints now.

Each example block (`<!-- --8<-- [start:example-…] -->`, written by
`scripts/generate_docs.py`) is run again as a user runs it (`python -m shardwise …`,
COLUMNS=150) and compared exactly, trailing spaces aside — except the lines its `vary=` option
names, whose numbers are masked and whose table padding may differ: the training run's tokens/s
and step time, and the demo's rounding-level differences from one device (they depend on the
CPU's kernels). The runtime's commands (demo, train, check) start processes: `slow`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from scripts import generate_docs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RUNTIME_COMMANDS = {"demo", "train", "check", "calibrate"}


def _examples() -> list:
    params = []
    for block in generate_docs.blocks(README):
        if block.name.startswith("example-"):
            command = shlex.split(generate_docs.command_of(block))[1]
            marks = [pytest.mark.slow] if command in RUNTIME_COMMANDS else []
            params.append(pytest.param(block, id=block.name, marks=marks))
    return params


def test_readme_is_short_and_has_no_run_history():
    lines = README.splitlines()
    assert len(lines) <= 300, len(lines)
    dated = [line for line in lines if re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b", line)]
    assert not dated, dated


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(python3 -m venv .*?)\n```", README)
    assert len(commands) == 2, commands  # the main job, then the tests
    assert commands[0].endswith("pip install . && shardwise plan")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == commands[1]


def test_every_tour_command_has_an_example():
    names = {block.name for block in generate_docs.blocks(README)}
    for command in ("plan", "memory", "schedule", "demo", "train", "check"):
        assert f"example-{command}" in names, command


@pytest.mark.parametrize("block", _examples())
def test_example_output_is_current(block):
    if shlex.split(generate_docs.command_of(block))[1] in RUNTIME_COMMANDS:
        pytest.importorskip("torch")
    vary = block.options.get("vary")
    now = generate_docs.run_example(block)
    assert generate_docs.normalised(now, vary) == generate_docs.normalised(block.body, vary), (
        f"README.md's {block.name} is stale (python scripts/generate_docs.py rewrites it); "
        f"now:\n{now}")


def test_stale_output_is_seen():
    """The comparison itself: a changed figure fails, a changed timing on a `vary` line and
    its table's padding do not."""
    body = "```text\n$ shardwise x\n│ loss │ 5.5486 │\n│ step time │ 264.8 ms │\n```\n"
    vary = "step time"
    assert generate_docs.normalised(body.replace("264.8", "1,264.8  "), vary) == \
        generate_docs.normalised(body, vary)
    assert generate_docs.normalised(body.replace("5.5486", "5.5487"), vary) != \
        generate_docs.normalised(body, vary)


def test_no_picture_is_older_than_what_it_shows():
    """Each screenshot's recorded API calls, answered now, and the front-end files it loaded
    hash to what docs/pictures.json stored when it was taken; each Gantt chart is what
    `shardwise schedule --svg` writes now (scripts/generate_docs.py retakes them)."""
    pytest.importorskip("fastapi")
    stale = generate_docs.stale_pictures()
    assert not stale, f"stale pictures (python scripts/generate_docs.py retakes them): {stale}"


def test_a_picture_goes_stale_with_its_data():
    """The hash itself: a changed figure or front-end file changes it, a search's timing
    does not."""
    calls = [{"method": "POST", "path": "/api/plan", "body": {"gpus": 64}}]
    statics = ["static/planner.js"]

    def answer(step: float, timing: float):
        return lambda call: {"ranked": [{"total": step}], "stats": {"seconds": timing}}

    now = generate_docs.picture_hash(calls, statics, answer(6.94, 1.0))
    assert generate_docs.picture_hash(calls, statics, answer(6.94, 2.5)) == now
    assert generate_docs.picture_hash(calls, statics, answer(7.23, 1.0)) != now
    assert generate_docs.picture_hash(calls, ["static/memory.js"], answer(6.94, 1.0)) != now
    assert generate_docs.picture_hash([{**calls[0], "body": {"gpus": 32}}], statics,
                                      answer(6.94, 1.0)) != now
