"""The launcher tests' tools: each job run with stand-in `torchrun`, `srun` and `scontrol` that
record what they are handed, `sbatch --help`'s options, the launchers' own environment's
validators (`.venv/launchers`, scripts/install-frameworks.sh)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHERS_VENV = Path(sys.prefix) / "launchers" / "bin"
VALIDATORS = Path(__file__).with_name("launch_validators.py")
# stand-ins: torchrun records its argv; srun drops its own options and runs the rest
FAKES = {"torchrun": 'python3 -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" '
                     '>> "$RECORD"',
         "srun": 'while [ "${1#-}" != "$1" ]; do shift; done; exec "$@"',
         "scontrol": 'echo node-001; echo node-002'}


def tool(name: str) -> str:
    """A validator of the launchers' environment (a skip locally, a failure under CI)."""
    path = LAUNCHERS_VENV / name
    if not path.exists():
        if os.environ.get("CI"):
            raise AssertionError(f"{path} is missing: run scripts/install-frameworks.sh")
        pytest.skip(f"{path} is missing (scripts/install-frameworks.sh installs it)")
    return str(path)


def run_job(script: str | list[str], tmp: Path, env: dict[str, str]
            ) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run `script` (a bash script, or a container's command) with the stand-ins on PATH, in
    `tmp`; (the run, torchrun's argv lists)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    record = tmp / "torchrun.jsonl"
    record.unlink(missing_ok=True)
    if isinstance(script, str):
        (tmp / "job.sh").write_text(script)
    done = subprocess.run(["bash", "job.sh"] if isinstance(script, str) else script, cwd=tmp,
                          text=True,
                          capture_output=True, timeout=60,
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "RECORD": str(record), **env})
    calls = [json.loads(line) for line in record.read_text().splitlines()] \
        if record.exists() else []
    return done, calls


def sbatch_options() -> set[str]:
    """The long options `sbatch --help` documents (Debian's slurm-client; it needs a
    configuration file to start, not a controller)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        if os.environ.get("CI"):
            raise AssertionError("sbatch is missing: apt-get install slurm-client (.ci/run)")
        pytest.skip("sbatch is missing (apt-get install slurm-client)")
    conf = Path(__file__).with_name("data") / "slurm.conf"
    text = subprocess.run([sbatch, "--help"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "SLURM_CONF": str(conf)}).stdout
    return set(re.findall(r"--([a-z][a-z-]*)", text))
