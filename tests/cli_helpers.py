"""Run the real `shardwise` entry point: in a subprocess, or (`run_in_process`) its function
in this process."""

import json
import os
import subprocess
import sys


def shardwise(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = os.environ | {"COLUMNS": "200"}  # wide tables, whatever the caller's terminal
    result = subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True,
                            text=True, timeout=120, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"shardwise {' '.join(args)} failed:\n{result.stderr}")
    return result


def shardwise_json(*args: str):
    return json.loads(shardwise(*args, "--json").stdout)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`shardwise ARGS` through the console entry point's function, in this process: its exit
    code, stdout and stderr."""
    from shardwise.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err
