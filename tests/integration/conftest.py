"""Integration tests: each `shardwise plan … --emit <framework>` output is loaded by the real
framework's own parser (installed by the `frameworks` extra, see .ci/run); `--emit F` plans
on F's stack (issue 33), so every planned value must come back.

A framework that is not importable skips its tests locally; with the CI environment variable
set (as .ci/run sets it) the import error fails them instead.
"""

import importlib
import os
import shlex

import pytest

from shardwise.cli import main
from shardwise.layout import Layout
from tests.integration.plans import PLANS

FRAMEWORKS = {"megatron": "megatron.core", "torchtitan": "torchtitan",
              "deepspeed": "deepspeed"}


IMAGE = "registry.example.com/training:latest"  # the k8s launcher's container (--image)


def require(framework: str):
    """The framework's top package, or a skip (locally) / failure (CI) when missing."""
    name = FRAMEWORKS[framework]
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


class Emit:
    """One `shardwise plan ARGS --emit FRAMEWORK` run through the console entry point."""

    def __init__(self, capsys, args: list[str], framework: str):
        import json

        code = 0
        capsys.readouterr()  # drop what importing a framework printed
        try:  # the JSON form carries the layout the config was made for
            main(["plan", *args, "--emit", framework, "--image", IMAGE, "--json"])
        except SystemExit as exc:
            code = exc.code
        captured = capsys.readouterr()
        self.code, self.err = code, captured.err.strip()
        if code == 0:
            payload = json.loads(captured.out)
            self.layout = Layout(**payload["layout"])
            self.text: str = payload["config"]
            self.notes: list[str] = payload["notes"]
            self.plan: dict = payload["plan"]  # the planned run: dtypes, batch, stack settings
            self.launchers: dict = payload["launchers"]  # each launcher's job (emit.launchers)
            # the plain form prints the same text on stdout, notes on stderr
            main(["plan", *args, "--emit", framework])
            plain = capsys.readouterr()
            assert plain.out == self.text
            assert plain.err.splitlines() == [f"note: {n}" for n in self.notes]

    def command(self) -> tuple[dict[str, str], list[str]]:
        """(exported environment, argv of the launch line) of a shell-script emit."""
        env, words = {}, []
        for line in self.text.splitlines():
            if line.startswith("#"):
                continue
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                env[key] = value
                continue
            words += shlex.split(line.rstrip("\\"))
        return env, words


_EMITTED: dict[tuple[str, str], Emit] = {}  # the CLI's output for a plan: the same each time


def emit(capsys, plan: str, framework: str) -> Emit:
    """`shardwise plan PLAN --emit FRAMEWORK`, run once per session (test_megatron and
    test_megatron_lm read the same plans)."""
    if (plan, framework) not in _EMITTED:
        _EMITTED[(plan, framework)] = Emit(capsys, PLANS[plan], framework)
    return _EMITTED[(plan, framework)]


def _option(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def planned_seq(plan: str) -> int:
    """The plan's sequence length (`plan`'s default 8192)."""
    return int(_option(PLANS[plan], "--seq", "8192"))


def planned_batch(plan: str) -> int:
    """The plan's global batch in sequences: a count, or `<n>M-tokens` (M = 2^20 tokens, the
    CLI's default 4M-tokens) divided by the sequence length."""
    text = _option(PLANS[plan], "--global-batch", "4M-tokens")
    if text.endswith("M-tokens"):
        return int(text[:-len("M-tokens")]) * 2**20 // planned_seq(plan)
    return int(text)


def flags(argv: list[str]) -> dict[str, str | None]:
    """`--name value` / `--switch` pairs of an argument list (the last value wins)."""
    out: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[word] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def arg_value(raw: str | None) -> bool | int | float | str:
    """An argument's text (a `flags` value) as argparse's `type=` reads it: a switch, int,
    float or text."""
    if raw is None:
        return True
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
