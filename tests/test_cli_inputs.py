"""The `shardwise` entry point on the inputs issues 46 and 47 found wanting: command summaries
cut mid-sentence, values accepted silently or answered with a traceback, errors that came
after minutes of work or after torch had imported, a rate printed as "0.0 a day".

Each runs the real entry point in a subprocess (`python -m shardwise`, or `main()` with a probe
that reports whether torch was imported) and asserts one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from shardwise.stacks import get_stack
from tests.cli_helpers import assert_one_line_error, shardwise

# `main(argv)`, then whether torch was imported, on stdout (stderr stays the command's own)
PROBE = ("import sys\nfrom shardwise.cli import main\ncode = 0\ntry:\n    main(sys.argv[1:])\n"
         "except SystemExit as exc:\n    code = exc.code\n"
         "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")


def probe(*args: str) -> subprocess.CompletedProcess:
    """`shardwise ARGS` through `main`, reporting on stdout whether torch was imported."""
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          timeout=120, env=os.environ | {"COLUMNS": "200"})


# --------------------------------------------------------------------- command summaries
def test_every_command_summary_is_a_whole_sentence_at_80_columns():
    """`shardwise --help` at COLUMNS=80 cuts no summary (click ends a cut one with "..."),
    and the first line the CLI reference (mkdocs-click) lists for a command is that same
    sentence."""
    from shardwise.cli import cli

    result = subprocess.run([sys.executable, "-m", "shardwise", "--help"], capture_output=True,
                            text=True, timeout=60, env=os.environ | {"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("Commands:\n", 1)[1]
    rows = dict(re.findall(r"^  (\S+) +(.+)$", section, flags=re.MULTILINE))
    assert set(rows) == set(cli.commands)  # one row per command: none wrapped to a 2nd line
    for name, summary in rows.items():
        assert not summary.endswith(("...", "…")), (name, summary)
        assert summary.endswith("."), (name, summary)
        listed = (cli.commands[name].short_help or cli.commands[name].help).splitlines()[0]
        assert listed == summary, name  # what docs/cli.md's subcommand list shows
    assert max(map(len, result.stdout.splitlines())) <= 80


# ------------------------------------------------------------------- plan --fix / --impl
@pytest.mark.parametrize(("stack", "value"), [("megatron-te", "op-sac"),
                                              ("torchtitan", "selective")])
def test_fix_a_recompute_the_stack_does_not_search(stack, value):
    valid = ", ".join(get_stack(stack).recompute)
    result = shardwise("plan", "tiny", "--gpus", "8", "--impl", stack, "--fix",
                       f"recompute={value}", check=False)
    assert_one_line_error(result, f"recompute={value}", f"valid: {valid}")


def test_the_api_refuses_the_same_fix_with_a_400():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from shardwise.web.app import create_app

    with TestClient(create_app()) as client:
        response = client.post("/api/plan", json={"model": "tiny", "gpus": 8,
                                                  "fix": "recompute=op-sac"})
    assert response.status_code == 400, response.text
    valid = ", ".join(get_stack("megatron-te").recompute)
    assert f"valid: {valid}" in response.json()["detail"]


@pytest.mark.parametrize(("args", "fragment"), [
    (("--impl", "megatron-te@"), "the version after @ is empty"),
    (("--impl", "torchtitan@ "), "the version after @ is empty"),
    (("--fix", "tp=8,,pp=2"), "--fix 'tp=8,,pp=2': an item is empty"),
    (("--max", "pp=2,"), "--max 'pp=2,': an item is empty"),
    (("--layout", ",tp=2"), "--layout ',tp=2': an item is empty"),
])
def test_empty_parts_of_plan_options_are_refused(args, fragment):
    assert_one_line_error(shardwise("plan", "tiny", "--gpus", "8", *args, check=False),
                          fragment)


def test_the_same_options_without_the_empty_part_still_plan():
    """The refusals above are of the empty part only: the same values without it plan."""
    for args in (("--impl", get_stack("megatron-te").label),
                 ("--fix", "tp=2,pp=2"), ("--max", "pp=2"), ("--layout", "tp=2")):
        out = json.loads(shardwise("plan", "tiny", "--gpus", "8", "--top", "1", *args,
                                   "--json").stdout)
        assert out["ranked"], args


# ----------------------------------------------------- train / check / calibrate / ui
@pytest.mark.parametrize(("args", "fragment"), [
    (("train", "--override", "lr"), "add --resume"),
    (("train", "--tp", "3"), "tp=3 does not divide n_heads=4"),
    (("train", "--global-batch", "abc"), "cannot read global batch 'abc'"),
    (("train", "--model", "nope"), "unknown model 'nope'"),
    (("train", "--log", "/nonexistent/dir/log.jsonl"), "does not exist"),
    (("check", "--seq", "100000"), "exceeds tiny's maximum sequence length"),
    (("check", "--pp", "2", "--schedule", "zbv"), "shardwise has no zbv pipeline schedule"),
])
def test_run_argument_errors_come_before_torch_is_imported(args, fragment):
    result = probe(*args)
    assert_one_line_error(result, fragment)
    assert result.stdout.strip() == "no torch"


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_measuring(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = ", ".join(sorted(FigureCanvasBase.get_supported_filetypes()))
    for command in ("calibrate", "train"):
        result = probe(command, "--plot", str(tmp_path / "x.xyz"))
        assert_one_line_error(result, "cannot write .xyz files", f"valid: {formats}")
        assert result.stdout.strip() == "no torch"  # the runtime never started
    result = probe("calibrate", "--plot", str(tmp_path / "missing" / "x.png"))
    assert_one_line_error(result, "does not exist")
    assert result.stdout.strip() == "no torch"
    assert not list(tmp_path.iterdir())


def test_ui_refuses_an_invalid_host_without_the_network_warning():
    pytest.importorskip("uvicorn")
    result = shardwise("ui", "--no-browser", "--host", "999.999.999.999", check=False)
    assert_one_line_error(result, "cannot resolve --host '999.999.999.999'")
    assert "warning" not in result.stderr


def test_too_little_data_says_how_many_tokens_it_holds_and_needs(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "five.txt").write_bytes(b"hello")
    for name, tokens in (("empty.txt", 0), ("five.txt", 5)):
        result = shardwise("train", "--data", str(tmp_path / name), "--seq", "16",
                           "--global-batch", "4", check=False)
        # 4 windows of 17 tokens, each starting 16 after the last: 4·16 + 1 = 65 tokens
        assert_one_line_error(result, f"holds {tokens} tokens", "16 after the last, take 65")
        assert "-1" not in result.stderr


# ------------------------------------------------------------------- the goodput rate
@pytest.mark.parametrize(("mtbf_gpu_hours", "text"), [
    (6336, "one interruption every 33 days"),  # 6,336 h / 8 GPUs = 792 h = 33 days
    (384, "3.5 interruptions a week"),  # 384 / 8 = 48 h: 0.5 a day
    (96, "2.0 interruptions a day"),  # 96 / 8 = 12 h
])
def test_the_interruption_rate_reads_in_its_unit(mtbf_gpu_hours, text):
    out = shardwise("plan", "tiny", "--gpus", "8", "--top", "1", "--mtbf-gpu-hours",
                    str(mtbf_gpu_hours)).stdout
    job_mtbf = [line for line in out.splitlines() if "job MTBF" in line]
    assert len(job_mtbf) == 1 and text in job_mtbf[0], job_mtbf
    assert "0.0 interruptions" not in out
