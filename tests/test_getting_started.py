"""docs/getting-started.md can be followed literally: its shell commands, run in order in a
fresh temporary folder, clone the repository, make a fresh virtual environment (no system
site-packages, so a missing dependency fails), install shardwise there and plan.

`<this repository>` is this checkout (its committed HEAD: `git clone` of the working tree).
Every command is checked to parse (`bash -n`); the extras' lines (`pip install ".[torch]"`,
ui, plot, docs) are not run, only checked to name extras pyproject.toml defines: torch alone
took over 5 minutes to install into a fresh environment here (the base install, ~30 s, runs).
Needs the package index that `pip install` uses; `slow`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting-started.md"
EXTRA = re.compile(r'^pip install (?:-e )?"\.\[(\w+)\]"')


def page_commands() -> list[str]:
    """The lines of the page's ```bash blocks, in order, comments kept (bash drops them)."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_page_starts_from_a_clone_and_names_real_extras():
    commands = page_commands()
    assert commands[0].startswith("git clone <this repository> shardwise && cd shardwise")
    assert commands[1].startswith("python3 -m venv .venv && . .venv/bin/activate")
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[",
                        (ROOT / "pyproject.toml").read_text(encoding="utf-8"), flags=re.S | re.M)
    assert section, "pyproject.toml has no [project.optional-dependencies]"
    extras = re.findall(r"^([\w-]+) = ", section.group(1), flags=re.M)
    named = [m.group(1) for line in commands if (m := EXTRA.match(line))]
    assert named and set(named) <= set(extras), (named, sorted(extras))
    for line in commands:  # each parses as bash
        done = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stderr)


@pytest.mark.slow
def test_the_page_runs_literally_in_a_fresh_folder(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    script = ["set -e"]
    for line in page_commands():
        if EXTRA.match(line):
            continue  # parsed and its extra checked above; too slow to install here
        script.append(line.replace("<this repository>", shlex.quote(str(ROOT))))
    script.append('test "$(command -v shardwise)" = "$PWD/.venv/bin/shardwise"')
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # the interpreter running the tests makes the venv, as `python3` would
    env["PATH"] = os.pathsep.join([str(Path(sys._base_executable).parent), env["PATH"]])
    env["COLUMNS"] = "200"
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "shardwise" / ".venv").is_dir()
    # `shardwise plan`'s default: Llama-3-8B on 64 H100s
    assert "llama3-8b" in done.stdout and "Top " in done.stdout, done.stdout[-2000:]
