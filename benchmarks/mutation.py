"""Mutation testing of the analytic core (mutmut 3): how many small changes to the formulas
(an operator swapped, a constant moved by one, a condition negated…) the unit tests notice.

Each module group is mutated on its own, in a scratch copy of the repository, against a small
fast selection of its unit tests (in-process, not `slow` or `integration`; mutmut runs, per
mutant, only the selected tests that call the mutated function). `--sample N` draws N mutants
per group (seeded) instead of all of them. Each group's result, with the commit, date,
machine and command of its run, is kept in docs/accuracy/mutation.json (a later run of some
groups replaces theirs only); docs/accuracy/mutation.md, the table and the surviving mutants,
is written from it.

Run on demand, not in CI (the `mutation` extra installs mutmut):

    .venv/bin/python benchmarks/mutation.py                  # every mutant, every group
    .venv/bin/python benchmarks/mutation.py --sample 200     # 200 per group
    .venv/bin/python benchmarks/mutation.py --only comm memory   # some groups

`mutmut show NAME`, run in the scratch copy the script names, prints a survivor's diff.
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

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "accuracy" / "mutation.md"
RECORDS = OUT.with_suffix(".json")
# group: (files to mutate under src/shardwise/, the tests that check them)
GROUPS = {
    "comm": (["estimate/comm.py"], ["tests/estimate/test_comm.py"]),
    "memory": (["estimate/memory.py"], ["tests/estimate/test_memory.py"]),
    "compute": (["estimate/compute.py"], ["tests/estimate/test_compute.py"]),
    "step": (["estimate/step.py"], ["tests/estimate/test_step.py"]),
    "context": (["estimate/context.py"], ["tests/estimate/test_context.py"]),
    "profiles": (["estimate/profiles.py"], ["tests/estimate/test_profiles.py"]),
    "check": (["estimate/check.py"], ["tests/estimate/test_check.py"]),
    "plan": (["plan/*"], ["tests/test_plan.py", "tests/test_searched_partitions.py"]),
    "schedules": (["schedules/*"], ["tests/schedules/"]),
    "emit": (["emit.py"], ["tests/test_emit.py"]),
}
PYTEST_ARGS = ["-p", "no:cacheprovider", "-q", "-m", "not slow and not integration",
               "-k", "not cli"]  # the CLI tests run a subprocess, which mutmut cannot trace
STATUSES = ("killed", "survived", "timeout", "no tests", "suspicious", "segfault",
            "skipped", "not checked")


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def _scratch(group: str) -> Path:
    """A copy of src/, tests/, benchmarks/ (some tests read its published figures) and
    pyproject.toml with mutmut's settings for `group`."""
    files, tests = GROUPS[group]
    where = Path(tempfile.mkdtemp(prefix=f"shardwise-mutation-{group}-"))
    for name in ("src", "tests", "benchmarks"):
        shutil.copytree(ROOT / name, where / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config = (ROOT / "pyproject.toml").read_text() + f"""
[tool.mutmut]
source_paths = ["src/shardwise/"]
also_copy = ["benchmarks/"]
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


def run_group(group: str, sample: int | None, seed: int) -> dict[str, object]:
    where = _scratch(group)
    start = time.monotonic()
    if sample is None:
        _mutmut(where, "run")
    else:  # generate every mutant (and the test map), then run a seeded sample of them
        _mutmut(where, "run", "no-such-mutant", check=False)  # exits 1: no such mutant
        names = sorted(_results(where))
        chosen = random.Random(seed).sample(names, min(sample, len(names)))
        for i in range(0, len(chosen), 200):  # keep the command line short
            _mutmut(where, "run", *chosen[i:i + 200])
    results = _results(where)
    checked = {name: status for name, status in results.items() if status != "not checked"}
    counts = {status: sum(s == status for s in checked.values()) for status in STATUSES}
    return {"group": group, "where": str(where), "mutants": len(results),
            "checked": len(checked), "counts": counts, "seconds": time.monotonic() - start,
            "survivors": sorted(name for name, s in checked.items() if s == "survived")}


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


def write_report(records: dict[str, dict[str, object]]) -> None:
    """docs/accuracy/mutation.md from every group's latest record, in GROUPS order."""
    import mutmut

    groups = [records[g] for g in GROUPS if g in records]
    runs: dict[tuple[str, str, str], list[str]] = {}  # (command, commit, date) -> groups
    for g in groups:
        load = re.search(r"load average ([\d.]+)", str(g["machine"]))
        runs.setdefault((str(g["command"]), str(g["commit"]), str(g["date"])), []).append(
            f"{g['group']} (load average {load.group(1) if load else '?'} at its end)")
    lines = ["# Mutation testing of the analytic core", "",
             "Written by `benchmarks/mutation.py` (do not edit by hand). Each mutant is one "
             "small change to a formula's code (mutmut "
             f"{getattr(mutmut, '__version__', '3')}); *killed* means a unit test failed on "
             "it, *survived* that none did, *no tests* that none of the group's selected "
             "tests runs the function. Many survivors are equivalent mutants (a changed "
             "error message no test reads word for word, a default no caller relies on), "
             "and functions checked only by the multi-process tests (`check`'s rows, "
             "tests/runtime) count as survivors here.", "", "Runs:", ""]
    machine = re.sub(r", load average [\d.]+ at the end", "", str(groups[-1]["machine"])
                     ) if groups else "?"
    for (command, commit, date), where in runs.items():
        lines.append(f"- `{command}` — commit {commit}, {date}: {', '.join(where)}")
    lines += ["", f"Machine: {machine}."]
    lines += ["", "| group | mutated | tests | mutants | checked | killed | survived | no tests "
              "| timeout | survival | minutes |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    total = {"checked": 0, "survived": 0}
    for g in groups:
        files, tests = GROUPS[str(g["group"])]
        c = g["counts"]
        assert isinstance(c, dict)
        tested = c["killed"] + c["survived"] + c["timeout"]
        rate = f"{c['survived'] / tested:.1%}" if tested else "-"
        lines.append(f"| {g['group']} | {', '.join(files)} | {', '.join(tests)} | "
                     f"{g['mutants']} | {g['checked']} | {c['killed']} | {c['survived']} | "
                     f"{c['no tests']} | {c['timeout']} | {rate} | "
                     f"{float(str(g['seconds'])) / 60:.1f} |")
        total["checked"] += tested
        total["survived"] += c["survived"]
    if total["checked"]:
        lines += ["", f"Survival rate over the mutants the tests reach: "
                      f"{total['survived']:,} of {total['checked']:,} = "
                      f"{total['survived'] / total['checked']:.1%} (a timeout counts as killed)."]
    lines += ["", "## Surviving mutants, per function", "",
              "`mutmut show shardwise.<module>.x_<function>__mutmut_<n>` in a scratch copy "
              "(`--keep`) prints one.", ""]
    for g in groups:
        survivors = g["survivors"]
        assert isinstance(survivors, list)
        per_function: dict[str, int] = {}
        for name in survivors:
            function = re.sub(r"^x_?|__mutmut_\d+$", "", name.split(".")[-1])
            function = function.replace("ǁ", ".").strip(".")
            per_function[function] = per_function.get(function, 0) + 1
        lines.append(f"- **{g['group']}** ({len(survivors)}): " + (", ".join(
            f"`{f}` {n}" for f, n in sorted(per_function.items(), key=lambda kv: -kv[1]))
            or "none"))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--sample", type=int, default=None, help="mutants per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = parser.parse_args()
    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    command = "python benchmarks/mutation.py " + " ".join(sys.argv[1:])
    for group in args.only:
        commit = _commit()  # what the scratch copy is made of
        result = run_group(group, args.sample, args.seed)
        print(f"{group:<10} {result['checked']:>5} of {result['mutants']:>5} mutants: "
              f"{result['counts']} ({float(str(result['seconds'])):.0f} s, {result['where']})",
              flush=True)
        if not args.keep:
            shutil.rmtree(str(result.pop("where")), ignore_errors=True)
        else:
            result.pop("where")
        records[group] = result | {"command": command.strip(), "commit": commit,
                                   "date": datetime.date.today().isoformat(),
                                   "machine": _machine()}
        RECORDS.parent.mkdir(parents=True, exist_ok=True)
        RECORDS.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
        write_report(records)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
