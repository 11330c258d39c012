"""Mutation testing of the analytic core (mutmut 3): how many small changes to the formulas
(an operator swapped, a constant moved by one, a condition negated…) the unit tests notice.

Each module group is mutated on its own, in a scratch copy of the repository, against every
test file that imports it (in-process tests only; arch and layout, which nearly every test
imports, against the tests whose subject they are: SUBJECT_TESTS). Module- and class-level
numeric constants are mutated too by our own operator (int n → n + 1, float x → 1.1·x). Unreached
mutants count as survivors; equivalent ones are listed by hand in mutation_equivalent.py (mutant →
reason). Results per group, with commit, date, machine and command,
live in docs/accuracy/mutation.json; docs/accuracy/mutation.md is written from it. A group
whose mutmut pass fails is recorded as failed, with the reason in one line, and the next runs.

CI runs the offload group whole (tests/test_mutation_subset.py). Run on demand (the
`mutation` extra): `.venv/bin/python benchmarks/mutation.py` (every group),
`--sample 200`, `--only comm memory`, `--list` (groups and their tests), `--report` (the page
from the JSON), `--recheck` (each record's survivors again, against today's tests, while the
group's sources are the record's); `mutmut show NAME` in the scratch copy prints a survivor's
diff.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "accuracy" / "mutation.md"
RECORDS = OUT.with_suffix(".json")
# group: files to mutate under src/shardwise/ (every module that computes an answer); the
# tests are every test file that imports one of them (`tests_of`)
MODULES = {
    "comm": ["estimate/comm.py"], "memory": ["estimate/memory.py"],
    "compute": ["estimate/compute.py"], "step": ["estimate/step.py", "estimate/stages.py"],
    "context": ["estimate/context.py"], "profiles": ["estimate/profiles.py"],
    "check": ["estimate/check/*"], "state": ["estimate/state.py"],
    "activations": ["estimate/activations.py"], "axes": ["estimate/axes.py"],
    "geometry": ["estimate/geometry.py"], "links": ["estimate/links.py"],
    "host": ["estimate/host.py"], "kernels": ["estimate/kernels.py"],
    "machine": ["estimate/machine.py"], "components": ["estimate/components.py"],
    "goodput": ["estimate/goodput.py"], "goodput_sim": ["estimate/goodput_sim.py"],
    "offload": ["estimate/offload.py"], "uncertainty": ["estimate/uncertainty.py"],
    "fp8": ["fp8.py"], "plan": ["plan/*"], "stacks": ["stacks/*"], "arch": ["arch/*"],
    "layout": ["layout.py"], "schedules": ["schedules/*"], "emit": ["emit/*"],
    "checkpoint": ["runtime/checkpoint/*"], "reducers": ["runtime/collectives/*"],
    "pipe_engine": ["estimate/pipe_engine.py"],
    "expert": ["estimate/expert.py"], "cuda_graph": ["cuda_graph.py"],
    "partition": ["partition.py"], "rows": ["estimate/rows.py"],
}
SRC = ROOT / "src" / "shardwise"
sys.path.insert(0, str(ROOT / "benchmarks"))  # beside this script, however it is loaded
from mutation_equivalent import EQUIVALENT  # noqa: E402  (mutant -> why it is equivalent)


def _dotted(pattern: str) -> str:
    """"estimate/goodput.py" → "shardwise.estimate.goodput", "plan/*" → "shardwise.plan"."""
    return "shardwise." + pattern.removesuffix("/*").removesuffix(".py").replace("/", ".")


def _importing(files: list[str], where: Path, glob: str) -> list[Path]:
    """The files under `where` matching `glob` that import one of `files` (`import
    shardwise.a.b`, `from shardwise.a.b import …`, `from shardwise.a import b`)."""
    patterns = []
    for f in files:
        dotted = _dotted(f)
        parent, _, leaf = dotted.rpartition(".")
        patterns += [re.escape(dotted) + r"\b",
                     rf"from {re.escape(parent)} import [^\n]*\b{leaf}\b"]
    found = re.compile("|".join(patterns))
    return [p for p in where.rglob(glob) if found.search(p.read_text())]


def tests_of(files: list[str]) -> list[str]:
    """The test files that import one of `files`; for a module no test imports (an internal
    one, e.g. estimate/state.py), those importing the modules that import it."""
    direct = _importing(files, ROOT / "tests", "test_*.py")
    if not direct:
        users = [str(p.relative_to(SRC)) for p in _importing(files, SRC, "*.py")]
        direct = _importing(users, ROOT / "tests", "test_*.py") if users else []
    # tests/test_layers.py checks the sources' shape (lines, imports), which mutmut's
    # trampolines change: it is no test of a formula
    return sorted(str(p.relative_to(ROOT)) for p in direct if p.name != "test_layers.py")


# groups whose modules nearly every test imports (~100 files each, too slow for mutmut's
# stats pass and per-mutant runs): the tests whose subject they are, chosen by what checks
# those modules' behaviour — arch: parameter counts against transformers' own models,
# config.json readers, presets; layout: parsing, derived degrees, validation messages
SUBJECT_TESTS = {
    "arch": ["tests/test_arch.py", "tests/test_arch_components.py",
             "tests/test_arch_hub_defaults.py", "tests/test_deepseek.py",
             "tests/test_model_types.py", "tests/test_presets.py",
             "tests/estimate/test_compute_op_sac_moe.py"],  # ModelSpec.op_sac_recomputed_flops
    "layout": ["tests/test_bad_input.py", "tests/test_hardware_layout.py",
               "tests/test_layout_fields.py", "tests/test_layout_references.py",
               "tests/test_layout_train_spec.py"],
}
GROUPS = {name: (files, SUBJECT_TESTS.get(name) or tests_of(files))
          for name, files in MODULES.items()}
PYTEST_ARGS = ["-p", "no:cacheprovider", "-q", "-m", "not slow and not integration",
               "-k", "not cli"]  # the CLI tests run a subprocess, which mutmut cannot trace
STATUSES = ("killed", "survived", "timeout", "no tests", "suspicious", "segfault",
            "skipped", "not checked")


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def _scratch(group: str) -> Path:
    """A copy of src/, tests/, benchmarks/ (some tests read its published figures), scripts/
    (tests run its fact readers) and pyproject.toml with mutmut's settings for `group`."""
    files, tests = GROUPS[group]
    where = Path(tempfile.mkdtemp(prefix=f"shardwise-mutation-{group}-"))
    for name in ("src", "tests", "benchmarks", "scripts"):
        shutil.copytree(ROOT / name, where / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config = (ROOT / "pyproject.toml").read_text() + f"""
[tool.mutmut]
source_paths = ["src/shardwise/"]
also_copy = ["benchmarks/", "scripts/"]
only_mutate = {_toml_list([f"src/shardwise/{f}" for f in files])}
pytest_add_cli_args_test_selection = {_toml_list(tests)}
pytest_add_cli_args = {_toml_list(PYTEST_ARGS)}
"""
    (where / "pyproject.toml").write_text(config)
    return where


def _mutmut(where: Path, *args: str, check: bool = True) -> str:
    # mutmut puts mutants/src first on the path itself (a PYTHONPATH entry that does not
    # exist yet when Python starts would be cached as empty)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # torch on one thread: mutmut forks a child per mutant, and a child's first parallel torch
    # op hangs (futex) once the parent has run one with OpenMP threads
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([str(Path(sys.executable).with_name("mutmut")), *args], cwd=where,
                         env=env, capture_output=True, text=True)
    if check and run.returncode:
        raise RuntimeError(f"mutmut {' '.join(args)} failed in {where}:\n"
                           f"{(run.stdout + run.stderr)[-3000:]}")
    return run.stdout


def _results(where: Path) -> dict[str, str]:
    """{mutant name: status} of every mutant of the scratch copy."""
    out = _mutmut(where, "results", "--all", "true")
    return dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+?)\s*$", out, flags=re.MULTILINE))


def _constants(path: Path) -> list[tuple[int, int, int, str]]:
    """(line, start column, end column, mutated literal) of every numeric literal in a
    module-level or class-level assignment of the file at `path` (not in functions: mutmut
    mutates those): an int n → n + 1, a float x → 1.1·x (0.0 → 1.0); booleans left alone."""
    import ast

    out = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for lit in ast.walk(node.value):
                    if (isinstance(lit, ast.Constant) and type(lit.value) in (int, float)
                            and lit.lineno == lit.end_lineno):
                        value = lit.value
                        assert isinstance(value, (int, float)) and lit.end_col_offset
                        new = value + 1 if isinstance(value, int) else (value * 1.1 or 1.0)
                        out.append((lit.lineno, lit.col_offset, lit.end_col_offset, repr(new)))

    visit(ast.parse(path.read_text()).body)
    return out


def constant_names(group: str) -> list[str]:
    """The names of the group's constant mutants (`_constants`), as `run_constants` gives them."""
    files, _ = GROUPS[group]
    paths = sorted({p for f in files for p in SRC.glob(f) if p.suffix == ".py"})
    return [f"{_dotted(str(path.relative_to(SRC)))}.constant_L{line}_C{start}"
            for path in paths for line, start, _, _ in _constants(path)]


def run_constants(where: Path, group: str, timeout: float = 600,
                  chosen: set[str] | None = None) -> dict[str, str]:
    """{constant mutant: status}: each literal of `_constants` (those in `chosen` if given)
    changed in turn in the scratch copy's src/ and the group's tests run on it (in-process
    tests, stop at the first failure): killed when they fail, survived when they pass, "no
    tests" when none is selected."""
    files, tests = GROUPS[group]
    env = dict(os.environ, PYTHONPATH=str(where / "src"))
    # the files running torch in-process last: `-x` stops at a kill sooner
    torch_last = sorted(tests, key=lambda t: t.split("/")[1] in ("runtime", "emulate", "demos"))
    command = [sys.executable, "-m", "pytest", "-x", *PYTEST_ARGS, *torch_last]
    results = {}
    paths = sorted({p for f in files for p in (where / "src" / "shardwise").glob(f)
                    if p.suffix == ".py"})
    for path in paths:
        original = path.read_text()
        lines = original.splitlines(keepends=True)
        module = _dotted(str(path.relative_to(where / "src" / "shardwise")))
        for line, start, end, new in _constants(path):
            name = f"{module}.constant_L{line}_C{start}"
            if chosen is not None and name not in chosen:
                continue
            mutated = list(lines)
            text = mutated[line - 1]
            mutated[line - 1] = text[:start] + new + text[end:]
            path.write_text("".join(mutated))
            try:
                run = subprocess.run(command, cwd=where, env=env, capture_output=True,
                                     timeout=timeout)
                results[name] = {0: "survived", 5: "no tests"}.get(run.returncode, "killed")
            except subprocess.TimeoutExpired:
                results[name] = "timeout"
            finally:
                path.write_text(original)
    return results


def run_group(group: str, sample: int | None, seed: int) -> dict[str, object]:
    where = _scratch(group)
    start = time.monotonic()
    if sample is None:
        _mutmut(where, "run")
        constant_runs = run_constants(where, group)
    else:  # generate every mutant (and the test map), then run a seeded sample of them and
        # of the constant mutants together
        _mutmut(where, "run", "no-such-mutant", check=False)  # exits 1: no such mutant
        names = sorted(_results(where)) + constant_names(group)
        constant_runs = _run_named(where, group,
                                   random.Random(seed).sample(names, min(sample, len(names))))
    generated = _results(where)
    results = generated | constant_runs
    checked = {name: status for name, status in results.items() if status != "not checked"}
    counts = {status: sum(s == status for s in checked.values()) for status in STATUSES}
    constants = {s: sum(st == s for n, st in checked.items() if ".constant_L" in n)
                 for s in ("killed", "survived", "no tests", "timeout")}
    files, tests = GROUPS[group]
    return {"group": group, "where": str(where), "files": files, "tests": tests,
            "mutants": len(generated) + len(constant_names(group)),
            "checked": len(checked), "counts": counts, "constants": constants,
            "seconds": time.monotonic() - start,
            "survivors": sorted(name for name, s in checked.items()
                                if s in ("survived", "no tests"))}


def _run_named(where: Path, group: str, names: list[str]) -> dict[str, str]:
    """Run the mutants `names` in a scratch copy whose mutants are generated: mutmut's (it
    keeps their statuses, `_results`) and the script's constant ones, whose {name: status} it
    returns."""
    picked = {name for name in names if ".constant_L" in name}
    mutmut_names = sorted(set(names) - picked)
    for i in range(0, len(mutmut_names), 200):  # keep the command line short
        _mutmut(where, "run", *mutmut_names[i:i + 200])
    return run_constants(where, group, chosen=picked)


def run_group_or_failure(group: str, sample: int | None, seed: int) -> dict[str, object]:
    """`run_group`'s record, or, when it raises (a mutmut pass failing on one group), a record
    of the failure: the group's files and tests, no counts, and `failed` = the error's first
    line and mutmut's last, so that the other groups still run."""
    start = time.monotonic()
    try:
        return run_group(group, sample, seed)
    except Exception as error:  # any failure of one group: record it, go on
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[0] if lines else type(error).__name__
        if len(lines) > 1:  # mutmut's own last word (its output's last line)
            reason += f" … {lines[-1]}"
        where = re.search(r" in (\S+):", reason)
        files, tests = GROUPS[group]
        return {"group": group, "where": where.group(1) if where else "", "files": files,
                "tests": tests, "failed": f"{type(error).__name__}: {reason}",
                "seconds": time.monotonic() - start}


def _sources_changed(group: str, commit: str) -> bool:
    """Whether `group`'s sources differ now from those at `commit` (a record's; uncommitted
    sources count as changed)."""
    files, _ = GROUPS[group]
    return " " in commit or bool(subprocess.run(
        ["git", "diff", "--quiet", commit.split()[0], "--",
         *(f"src/shardwise/{f}" for f in files)], cwd=ROOT).returncode)


def recheck(group: str, record: dict[str, object]) -> dict[str, Any] | None:
    """The record's survivors (those not listed equivalent) run again against today's tests:
    {commit, date, killed}; None when the group's sources changed since the record's commit
    (its mutants' names would then name other mutants)."""
    commit = str(record["commit"])
    if _sources_changed(group, commit):
        return None
    survivors = record["survivors"]
    assert isinstance(survivors, list)
    names = [name for name in survivors if name not in EQUIVALENT]
    results: dict[str, str] = {}
    if names:  # else nothing to run again
        where = _scratch(group)
        try:
            _mutmut(where, "run", "no-such-mutant", check=False)  # exits 1: no such mutant
            constants = _run_named(where, group, names)
            results = _results(where) | constants
        finally:
            shutil.rmtree(str(where), ignore_errors=True)
    return {"commit": _commit(), "date": datetime.date.today().isoformat(),
            "killed": sorted(n for n in names if results.get(n) in ("killed", "timeout"))}


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + (" (with uncommitted changes)" if dirty else "")


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{len(os.sched_getaffinity(0))} cores ({cpu}), load average {load:.1f} at the end, "
            f"Python {platform.python_version()}")


def survival(record: dict[str, object], equivalent: dict[str, str]) -> tuple[int, int]:
    """(survivors, mutants) of one group's record: unreached ("no tests") mutants survive, a
    timeout is killed, the mutants listed as equivalent leave both counts."""
    c = record["counts"]
    assert isinstance(c, dict)
    survivors = record["survivors"]
    assert isinstance(survivors, list)
    listed = sum(name in equivalent for name in survivors)
    reached = c["killed"] + c["survived"] + c["timeout"] + c["no tests"]
    return c["survived"] + c["no tests"] - listed, reached - listed


def _killed_since(record: dict[str, object], equivalent: dict[str, str]) -> set[str]:
    """The record's survivors (not listed equivalent) its recheck found killed."""
    again = record.get("recheck")
    killed = set(again["killed"]) if isinstance(again, dict) else set()
    survivors = record["survivors"]
    assert isinstance(survivors, list)
    return {name for name in survivors if name in killed and name not in equivalent}


def write_report(records: dict[str, dict[str, object]]) -> None:
    """docs/accuracy/mutation.md from every group's latest record, in GROUPS order."""
    import mutmut

    equivalent = EQUIVALENT | {k: str(v) for k, v in records.get("equivalent", {}).items()}
    groups = [records[g] for g in GROUPS if g in records]
    runs: dict[tuple[str, str, str], list[str]] = {}  # (command, commit, date) -> groups
    for g in groups:
        load = re.search(r"load average ([\d.]+)", str(g["machine"]))
        runs.setdefault((str(g["command"]), str(g["commit"]), str(g["date"])), []).append(
            f"{g['group']} (load average {load.group(1) if load else '?'} at its end)")
    lines = ["# Mutation testing of the analytic core", "",
             "Written by `benchmarks/mutation.py` (do not edit by hand). Each mutant is one "
             "small change to a formula's code (mutmut "
             f"{getattr(mutmut, '__version__', '3')}), or to a module- or class-level "
             "numeric constant (the script's own operator: an int n → n + 1, a float "
             "x → 1.1·x); *killed* means a test failed on it, *survived* that none did, "
             "*no tests* that none of the group's tests runs it — counted as a survivor. "
             "Each group runs against every test file that imports its modules, except arch and "
             "layout, which nearly every test imports: they run against the tests whose "
             "subject they are (SUBJECT_TESTS: arch's counts against transformers' models, "
             "config.json readers and presets; layout's parsing, derived degrees and "
             "validation messages) (in-process tests; the multi-process ones, tests/runtime's launches and the CLI's "
             "subprocesses, are out of mutmut's reach, so what only they check survives "
             "here). Mutants listed by hand as equivalent (benchmarks/mutation_equivalent.py: mutant → "
             "reason) leave the numerator and the denominator. CI mutates the offload "
             "group whole (tests/test_mutation_subset.py, ~1 minute on a loaded 2-core "
             "machine) and fails on any survivor not listed as equivalent.", "",
             "Runs:", ""]
    machine = re.sub(r", load average [\d.]+ at the end", "", str(groups[-1]["machine"])
                     ) if groups else "?"
    for (command, commit, date), where in runs.items():
        lines.append(f"- `{command}` — commit {commit}, {date}: {', '.join(where)}")
    rechecks: dict[tuple[str, str, str], list[str]] = {}
    for g in groups:
        if isinstance(again := g.get("recheck"), dict):
            rechecks.setdefault((str(again["command"]), str(again["commit"]),
                                 str(again["date"])), []).append(str(g["group"]))
    for (command, commit, date), where in rechecks.items():
        lines.append(f"- `{command}` — the survivors of {', '.join(where)} run again against "
                     f"the tests at commit {commit}, {date} (column *after recheck*)")
    missing = [g for g in GROUPS if g not in records]
    # the latest run: by its UTC time (runs before it was recorded: by date only)
    latest = max(groups, key=lambda g: (str(g["date"]), str(g.get("time", ""))), default=None)
    if latest is not None:
        now = [str(g["group"]) for g in groups if g["commit"] == latest["commit"]]
        older = [g for g in groups if g["commit"] != latest["commit"]]
        same = [str(g["group"]) for g in older
                if not _sources_changed(str(g["group"]), str(g["commit"]))]
        changed = [str(g["group"]) for g in older if str(g["group"]) not in same]
        lines += ["", f"Run at the latest commit ({latest['commit']}, {latest['date']}): "
                  f"{', '.join(now)}. Not run this time, their sources the same as at their "
                  f"rows' commits above: {', '.join(same) or 'none'}. Not run this time, "
                  f"their sources changed since: {', '.join(changed) or 'none'}."]
    lines += ["", f"Machine: {machine}.", "",
              "Never run: " + (", ".join(missing) or "none") + "."]
    lines += ["", "| group | mutated | tests | mutants | checked | killed | survived | no tests "
              "| timeout | equivalent | constants killed/all | survival | after recheck | minutes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    total = [0, 0]
    for g in groups:
        files, tests = g.get("files"), g.get("tests")  # as run (not today's GROUPS)
        assert isinstance(files, list) and isinstance(tests, list)
        shown = tests if len(tests) <= 3 else [*tests[:3], f"… {len(tests) - 3} more"]
        if "failed" in g:  # the run of this group failed: its reason, no counts
            lines.append(f"| {g['group']} | {', '.join(files)} | {', '.join(shown)} | "
                         f"failed: {str(g['failed']).replace('|', '/')} |  |  |  |  |  |  |  "
                         f"| - | - | {float(str(g['seconds'])) / 60:.1f} |")
            continue
        c = g["counts"]
        assert isinstance(c, dict)
        alive, denominator = survival(g, equivalent)
        listed = survival(g, {})[1] - denominator  # equivalent mutants left out
        k = g.get("constants") or {}
        assert isinstance(k, dict)
        consts = f"{k.get('killed', 0)}/{sum(k.values())}" if k else "-"
        rate = f"{alive / denominator:.1%}" if denominator else "-"
        later = (f"{(alive - len(_killed_since(g, equivalent))) / denominator:.1%}"
                 if denominator and "recheck" in g else "-")
        lines.append(f"| {g['group']} | {', '.join(files)} | {', '.join(shown)} | "
                     f"{g['mutants']} | {g['checked']} | {c['killed']} | {c['survived']} | "
                     f"{c['no tests']} | {c['timeout']} | {listed} | {consts} | {rate} | {later} | "
                     f"{float(str(g['seconds'])) / 60:.1f} |")
        total[0] += alive
        total[1] += denominator
    if total[1]:
        lines += ["", f"Survival over every checked mutant, unreached ones included: "
                      f"{total[0]:,} of {total[1]:,} = {total[0] / total[1]:.1%} (a timeout "
                      "counts as killed; equivalent mutants left out). Rows of runs made before "
                      "this rule counted no constants (\"-\")."]
    lines += ["", "## Surviving mutants, per function", "",
              "`mutmut show shardwise.<module>.x_<function>__mutmut_<n>` in a scratch copy "
              "(`--keep`) prints one; `constant_L<line>_C<col>` is the script's constant "
              "mutant at that place.", ""]
    for g in groups:
        if "failed" in g:
            lines.append(f"- **{g['group']}**: the run failed ({g['failed']})")
            continue
        every = g["survivors"]
        assert isinstance(every, list)
        since = _killed_since(g, equivalent)
        survivors = [n for n in every if n not in equivalent and n not in since]
        per_function: dict[str, int] = {}
        for name in survivors:
            function = re.sub(r"^x_?|__mutmut_\d+$", "", name.split(".")[-1])
            function = function.replace("ǁ", ".").strip(".")
            per_function[function] = per_function.get(function, 0) + 1
        killed = f", {len(since)} more killed since" if since else ""
        lines.append(f"- **{g['group']}** ({len(survivors)}{killed}): " + (", ".join(
            f"`{f}` {n}" for f, n in sorted(per_function.items(), key=lambda kv: -kv[1]))
            or "none"))
    if equivalent:
        lines += ["", "## Equivalent mutants (listed by hand)", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in sorted(equivalent.items())]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--sample", type=int, default=None, help="mutants per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--list", action="store_true", help="print the groups and tests")
    parser.add_argument("--recheck", action="store_true",
                        help="run each recorded group's survivors again against today's "
                             "tests (sources unchanged since its run)")
    parser.add_argument("--report", action="store_true",
                        help="rewrite the page from mutation.json only (after listing "
                             "equivalent mutants by hand)")
    args = parser.parse_args()
    if args.report:
        write_report(json.loads(RECORDS.read_text()))
        return 0
    if args.list:
        for name, (files, tests) in GROUPS.items():
            print(f"{name}: {', '.join(files)} <- {', '.join(tests) or 'no test file'}")
        return 0
    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    command = "python benchmarks/mutation.py " + " ".join(sys.argv[1:])
    if args.recheck:
        for group in (g for g in args.only if g in records and "failed" not in records[g]):
            try:
                again = recheck(group, records[group])
            except Exception as error:  # one group's failure: say so, go on with the next
                print(f"{group:<10} not rechecked: {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}", flush=True)
                continue
            print(f"{group:<10} " + (f"{len(again['killed'])} survivors killed since"
                                     if again else "not rechecked: its sources changed"),
                  flush=True)
            if again:
                records[group]["recheck"] = again | {"command": command.strip()}
                RECORDS.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
        write_report(records)
        return 0
    for group in args.only:
        commit = _commit()  # what the scratch copy is made of
        result = run_group_or_failure(group, args.sample, args.seed)
        if "failed" in result:
            print(f"{group:<10} failed: {result['failed']}", flush=True)
        else:
            print(f"{group:<10} {result['checked']:>5} of {result['mutants']:>5} mutants: "
                  f"{result['counts']} ({float(str(result['seconds'])):.0f} s, "
                  f"{result['where']})", flush=True)
        if not args.keep:
            shutil.rmtree(str(result.pop("where")), ignore_errors=True)
        else:
            result.pop("where")
        records[group] = result | {"command": command.strip(), "commit": commit,
                                   "date": datetime.date.today().isoformat(),
                                   "time": datetime.datetime.now(datetime.timezone.utc)
                                   .strftime("%H:%M UTC"),
                                   "machine": _machine()}
        RECORDS.parent.mkdir(parents=True, exist_ok=True)
        RECORDS.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
        write_report(records)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
