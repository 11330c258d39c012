"""Mutation testing of the analytic core (mutmut 3): how many small changes to the formulas
(an operator swapped, a constant moved by one, a condition negated…) the unit tests notice.

Each module group is mutated on its own, in a scratch copy of the repository, against every
test file that imports it (in-process tests only). Module- and class-level numeric constants
are mutated too by a small operator of our own (int n → n + 1, float x → 1.1·x). Unreached
mutants count as survivors; equivalent ones are listed by hand in `EQUIVALENT` (mutant →
reason). Results per group, with commit, date, machine and command,
live in docs/accuracy/mutation.json; docs/accuracy/mutation.md is written from it.

CI runs the offload group whole (tests/test_mutation_subset.py). Run on demand (the
`mutation` extra): `.venv/bin/python benchmarks/mutation.py` (every group),
`--sample 200`, `--only comm memory`, `--list` (groups and their tests), `--report` (the page
from the JSON); `mutmut show NAME` in the scratch copy prints a survivor's diff.
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
# group: files to mutate under src/shardwise/ (every module that computes an answer); the
# tests are every test file that imports one of them (`tests_of`)
MODULES = {
    "comm": ["estimate/comm.py"], "memory": ["estimate/memory.py"],
    "compute": ["estimate/compute.py"], "step": ["estimate/step.py"],
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
    "partition": ["partition.py"],
}
SRC = ROOT / "src" / "shardwise"
# Mutants no test can kill because the program computes the same thing (mutant -> why), read
# by hand from `mutmut show NAME`; they leave the numerator and the denominator. mutmut numbers
# a function's mutants in order: an edit to the function renumbers them, so recheck the list
# after changing a listed module.
_S, _A = "shardwise.estimate.state.x_", "shardwise.estimate.activations.x_"
_G = "shardwise.estimate.geometry.x_"
_LOWER = "dtype_bytes lower-cases the name: the same dtype"
EQUIVALENT: dict[str, str] = {
    f"{_S}bytes_per_param_training__mutmut_2": _LOWER + " (default \"BF16\")",
    f"{_S}bytes_per_param_training__mutmut_28": "weight >= 4: at 4 bytes the moments' factor "
                                                "weight/4 is 1",
    f"{_S}bytes_per_param_training__mutmut_29": "weight > 5: dtypes are 0.5, 1, 2, 4 or 8 bytes, "
                                                "none in (4, 5]",
    f"{_S}bytes_per_param_training__mutmut_44": _LOWER + " (\"FP32\")",
    f"{_S}bytes_per_param_training__mutmut_48": _LOWER + " (\"FP32\")",
    f"{_S}kv_cache_bytes_per_token__mutmut_2": _LOWER + " (default \"BF16\")",
    f"{_A}activation_bytes_per_layer__mutmut_9": _LOWER + " (default \"BF16\")",
    f"{_A}korthikanti_activation_bytes__mutmut_3": "default recompute renamed: any name but "
                                                   "full or selective is no recompute",
    f"{_A}korthikanti_activation_bytes__mutmut_4": "default recompute \"NONE\": any name but "
                                                   "full or selective is no recompute",
    f"{_A}gathered_kv_bytes__mutmut_9": "n_kv / tp for n_kv // tp: a valid layout's tp divides "
                                        "n_kv or exceeds it, and max(·, 1) then agrees",
    f"{_A}recompute_adjust__mutmut_26": "np.where on a scalar selective: a 0-d array of the same "
                                        "value",
    f"{_A}activation_bytes_per_layer__mutmut_108": "selective None for selective & False: "
                                                   "both false wherever layer_bytes reads it",
    **{f"{_A}activation_bytes_per_layer__mutmut_{n}": "the default module renamed: "
       "recompute_dropped reads no \"core_attn\" (the attention core is the profile's "
       "selective)" for n in (100, 101)},
    f"{_A}recompute_dropped__mutmut_5": "drop = … for drop |= …: the first update of an "
                                        "empty set",
    "shardwise.estimate.check.rows.x_merge_rows__mutmut_38": "peak memory's order 3 → 4: "
                                                             "still after state (2), before "
                                                             "any other item (9)",
    **{f"shardwise.estimate.check.traffic.x__wire_row__mutmut_{n}": "a default for an axis or "
       "call the counters lack: CommCounter counts a payload, its calls and its group's size "
       "together, so a counted payload always has both" for n in (24, 32)},
    "shardwise.estimate.memory.x_stage_memory__mutmut_71": "the MoE layer's bytes also worked "
                                                           "out for a dense model, which never "
                                                           "reads them",
    "shardwise.estimate.memory.x_peak_stage_total__mutmut_29": "partition None for (): neither "
                                                               "is an explicit partition",
    "shardwise.estimate.memory.x_peak_stage_total__mutmut_45": "the stage's geometry worked out "
                                                               "again instead of passed: the "
                                                               "same geometry",
    "shardwise.estimate.memory.x_training_memory_per_gpu__mutmut_4": "default generation "
                                                                     "\"HOPPER\": only "
                                                                     "\"blackwell\" is told "
                                                                     "apart",
    "shardwise.estimate.uncertainty.x_conformal__mutmut_17": "0 <= k for 0 < k: k = ⌈(n+1)·c⌉ "
                                                             "is at least 1 for any n ≥ 0, c > 0",
    "shardwise.estimate.uncertainty.x_uncertainty__mutmut_106": "COVERAGES[+1] for [-1]: the "
                                                                "same element of a pair",
    **{f"shardwise.estimate.uncertainty.x_resolution__mutmut_{n}": "the message of a raise "
       "after the \"all runs\" level, which always returns: unreachable" for n in (32, 33)},
    f"{_G}_distinct__mutmut_24": "dtype None for int64: the fields are ints and bools, and "
                                 "the key's int + bool arithmetic gives the same ints",
    f"{_G}distinct_geometries__mutmut_49": "dtype None for int64: every column (pp, chunks, "
                                           "codes, m, Balanced ends, stages) is already int",
    f"{_G}distinct_geometries__mutmut_67": "spread every field: StageGeometry.of on 1-D "
                                           "arrays gives 1-D fields only (else unreachable)",
    f"{_G}_unique_rows__mutmut_14": "1 << 63 for 1 << 62: a code is below the radices' "
                                    "product, so under 2^63 it still fits in int64",
    **{f"{_G}{name}": "\"LOOP\" for \"loop\": virtual_stage treats every placement but "
       "\"v\" as the loop" for name in ("placement_of__mutmut_23",
                                          "stage_layer_count__mutmut_2")},
    f"{_G}stage_param_counts__mutmut_47": "placement None in a geometry whose params() "
                                          "never reads its placement",
    "shardwise.estimate.memory.x_stage_memory__mutmut_7": "default generation \"HOPPER\": "
                                                          "only \"blackwell\" is told apart",
    "shardwise.estimate.memory.x_peak_stage_total_runs__mutmut_103": "partition None: with a "
        "geometry passed, stage_memory reads the partition only in StageGeometry.of, skipped",
    "shardwise.estimate.memory.x_peak_stage_total_runs__mutmut_101": "the geometry worked "
        "out again per row: it depends on no field a run varies (ZeRO stage and group)",
    # pipe-fix (schedules)
    "shardwise.schedules.registry.x__dualpipe_in_flight__mutmut_1": "+ 0·stage only gives the "
        "result the stage's array shape: - 0·stage is the same",
    "shardwise.schedules.registry.x__dualpipev_in_flight__mutmut_1": "+ 0·stage only gives the "
        "result the stage's array shape: - 0·stage is the same",
    "shardwise.schedules.metrics.x_microbatches_for_bubble__mutmut_8": "check_dimensions(p, 1, "
        "v) checks p and v; m = 1 is a placeholder, and m = 2 is as valid",
    "shardwise.schedules.validate.x_validate_schedule__mutmut_47": "the simulation only tells "
        "a deadlock from a finished run, which list scheduling decides by the order alone, "
        "whatever the positive durations (t_b 2 or 3)",
    "shardwise.schedules.simulate.x__deadlock_message__mutmut_1": "the one caller (simulate) "
        "passes span: the default is never used",
    "shardwise.schedules.simulate.x__deadlock_message__mutmut_41": "last=None only adds B(vs+1) "
        "after F(vs) for a backward at the last virtual stage; such a stuck action misses its "
        "F(vs) (else it, or its pair, would have run), which is named first either way",
    # mut-b
    **{f"shardwise.estimate.{name}": "0.0 / x for 0.0 * x: x is a degree (t, m) ≥ 1, "
       "so both are 0" for name in (
           "axes.x_tp_time__mutmut_141", "axes.x_dp_time__mutmut_37",
           "axes.x_dp_time__mutmut_47", "axes.x_dp_time__mutmut_383",
           "pipe_engine.x_pipe_engine_time__mutmut_2",
           "pipe_engine.x_pipe_engine_time__mutmut_4",
           "pipe_engine.x_pipe_engine_time__mutmut_142")},
    **{f"shardwise.estimate.{name}": "a threshold moved from > 1 to ≥ 1 ranks: a collective "
       "over one rank is 0 in the α-β form (no round, and no call: small_calls charges "
       "none either)" for name in (
           "axes.x_tp_time__mutmut_69", "axes.x_tp_time__mutmut_119",
           "axes.x_tp_time__mutmut_155", "axes.x_tp_time__mutmut_225",
           "axes.x_cp_time__mutmut_5", "axes.x_cp_time__mutmut_180",
           "axes.x_dp_time__mutmut_182", "axes.x_dp_time__mutmut_194",
           "axes.x_dp_time__mutmut_335", "pipe_engine.x_pipe_engine_time__mutmut_209")},
    "shardwise.estimate.axes.x_tp_overlapped__mutmut_13": "max(t, 2) for max(t, 1): at t = 1 "
                                                          "the window's t - 1 is 0 anyway",
    "shardwise.estimate.axes.x_cp_time__mutmut_16": "c / u for c // u: u divides c "
                                                    "(MeshShape refuses any other ulysses)",
    "shardwise.estimate.axes.x_cp_time__mutmut_37": "n_kv / t for n_kv // t: a valid layout's "
                                                    "tp divides n_kv or exceeds it, and "
                                                    "max(·, 1) then agrees",
    "shardwise.estimate.axes.x_cp_time__mutmut_85": "busy 2.0 without CP overlap: hidden() "
                                                    "returns the transfer without reading it",
    **{f"shardwise.estimate.axes.x_dp_time__mutmut_{n}": "the node size dropped from the "
       "node-speed Links: group_collective_time and busy_fraction never read gpus_per_node"
       for n in (4, 24)},
    "shardwise.estimate.pipe_engine.x_pipe_engine_time__mutmut_15": "the optimizer dropped "
        "(default adam): it sets only the master and moment bytes, which the engine's terms "
        "never read",
    **{f"shardwise.estimate.links.x_{name}": "a default None for NaN, or no declared output "
       "type, in an np.vectorize over call costs: NaN either way, and the measured costs are "
       "floats (seconds)" for name in (
           "group_collective_time__mutmut_6", "group_collective_time__mutmut_8",
           "group_collective_time__mutmut_11", "group_collective_time__mutmut_13",
           "small_calls__mutmut_12", "small_calls__mutmut_14")},
    "shardwise.estimate.links.x_group_collective_time__mutmut_16": "always through the "
        "measured branch: where no call of op was measured every element takes the plain "
        "α-β time there too",
    "shardwise.estimate.links.x_group_collective_time__mutmut_20": "call None for (): the "
        "plain Links' call is only tested for truth, and both are false",
    "shardwise.estimate.links.x_p2p_latency__mutmut_11": "call - 0.0·latency for "
                                                         "call + 0.0·latency: the same",
    "shardwise.estimate.links.x_small_calls__mutmut_8": "0.0 / ranks for 0.0 * ranks: ranks "
                                                        "≥ 1",
    "shardwise.estimate.step.x_compute_costs__mutmut_1": "etp's default 1 for 0: every "
        "caller (step_terms, plan.evaluate) passes etp",
    **{f"shardwise.estimate.step.constant_L{line}_C{col}": "a StepEstimate field's default "
       "(dp_comm_total, t_forward, t_backward, bubble_fraction): estimate_step, its only "
       "maker, passes every one" for line, col in ((373, 27), (374, 23), (375, 24), (376, 29))},
    # mut-c
    "shardwise.estimate.goodput.x_checkpoint_bytes_per_param__mutmut_1": "default ZeRO 2 for "
        "1: no stack's model_copy_at tells stage 1 from 2 (all list both or neither)",
    **{f"shardwise.estimate.goodput.x_checkpoint_writes__mutmut_{n}": "0.0 / tp for 0.0 * tp: "
       "both zero (tp >= 1), there only for the arrays' shape" for n in (25, 30, 32)},
    "shardwise.estimate.goodput.x_checkpoint_writes__mutmut_31": "the busiest rank's running "
        "max starts at tp bytes instead of 0: every stage's rank writes far more (a layer's "
        "norm alone is d_model·14 B)",
    "shardwise.estimate.goodput.x_wall_per_useful__mutmut_12": "x <= 30 for x < 30: at "
        "x = 30 exactly ln(e^30 - 1) and 30 differ by 9e-14 (3e-15 relative)",
    "shardwise.runtime.checkpoint.directory.xǁDirectoryLockǁ_refuse_or_clear__mutmut_18": "pid "
        "> 1 for pid > 0: pid 1 (init) is always alive, so neither clears its lock",
    "shardwise.runtime.collectives.calls.x_reduce_scatter__mutmut_4": "default impl "
        "\"NATIVE\": every impl but \"ring\" is the backend's",
    "shardwise.runtime.collectives.calls.x_reduce_scatter__mutmut_34": "numel / N for "
        "numel % N: an even split then also takes the p2p ring, which gives the same values "
        "and counts the same (N-1)/N·S bytes and payload (a speed difference only)",
    **{f"shardwise.runtime.collectives.calls.x_recv__mutmut_{n}": "the group passed on a "
       "group of one too: AxisGroup's group is None exactly when its size is 1"
       for n in (17, 18)},
    "shardwise.runtime.collectives.calls.x_wait__mutmut_11": "the poll's deadline with <= for "
        "<: the same polling up to one clock tick, then the same blocking wait",
    "shardwise.runtime.collectives.rings.x_ring_all_reduce_p2p__mutmut_8": "always through a "
        "contiguous copy: the same values, copied back into the tensor",
    "shardwise.runtime.checkpoint.save.x_save_checkpoint__mutmut_74": "shardwise.json without "
        "indentation: the same JSON to every reader (the manifest hashes the file as written)",
    # mut-a
    "shardwise.estimate.compute.constant_L87_C23": "LayerCost's default fp8_weights: its "
        "only constructor (layer_cost) passes it",
    **{f"shardwise.estimate.kernels.constant_L90_C{col}": "ComputeContext's default "
       "layer_kernels: ComputeContext.of, its only maker in src/, always passes the kernels "
       "(host_ops reads them); only test_host_ops' hand-built contexts, outside this "
       "group's tests, take the default" for col in (42, 47)},
    "shardwise.estimate.kernels.constant_L93_C22": "ComputeContext's default fp8_peak: read "
        "only by FP8 GEMMs, which need a recipe, which ComputeContext.of passes with its peak",
    **{f"shardwise.estimate.kernels.constant_L{line}": f"ComputeContext's default {name}: "
       "ComputeContext.of passes it; the contexts tests build by hand (test_host_ops) call "
       "host_ops only, which reads neither" for line, name in (
           ("86_C25", "expert_load"), ("95_C29", "recompute_share"))},
    "shardwise.estimate.kernels.constant_L87_C28": "ComputeContext's default experts_active: "
        "ComputeContext.of passes it; a context built by hand (test_host_ops) sets it or "
        "counts a dense layer, which does not read it",
    **{f"shardwise.estimate.kernels.constant_L{line}": f"Gemms' default {name}: every Gemms "
       "built (linear, +, *) passes fwd, dgrad and wgrad" for line, name in (
           ("174_C15", "fwd"), ("175_C17", "dgrad"), ("176_C17", "wgrad"))},
    **{f"shardwise.estimate.expert.x_ep_time__mutmut_{n}": "a collective over a group of one "
       "rank (allgather's tp·ep = 1, expert-TP et = 1) costs 0 (group_collective_time)"
       for n in (123, 219)},
    "shardwise.estimate.host.x_expert_host__mutmut_10": "0/local for 0·local: local = "
        "E/ep·a > 0 experts (experts_active is validated positive)",
    **{f"shardwise.estimate.host.x_expert_launches__mutmut_{n}": "the default kernels of a "
       "recipe outside _QUANTIZE_KERNELS: no stack runs the fused count with one (every "
       "impl × recipe × accelerator × compile tried)" for n in (12, 13)},
    # mut-d
    "shardwise.emit.launchers.x_slurm_script__mutmut_15": "words[i + 1:i - 1] = … for "
        "words[i + 1:i + 1] = …: a slice whose stop is before its start is the empty slice "
        "at its start, so the same insertion",
    "shardwise.partition.x_first_last_partition__mutmut_12": "g = -2 for -1 when no last "
        "stage is given: g is read only as g >= 0 and max(g, 0), the same for both",
    # mut-e
    "shardwise.partition.constant_L50_C14": "FIXED's last_less sentinel -9 → -10: every "
        "reader compares with FIXED itself (a key of _partitions) or its first_less, and no "
        "real count is negative",
    "shardwise.partition.x_chunk_span__mutmut_9": "dtype None for int64 in np.asarray of a "
        "tuple of Python ints: numpy's default integer, int64 on the 64-bit platforms run",
}


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


GROUPS = {name: (files, tests_of(files)) for name, files in MODULES.items()}
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
            mutated = list(lines)
            text = mutated[line - 1]
            mutated[line - 1] = text[:start] + new + text[end:]
            path.write_text("".join(mutated))
            name = f"{module}.constant_L{line}_C{start}"
            if chosen is not None and name not in chosen:
                continue
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
    picked: set[str] | None = None  # constant mutants to run (None: every one)
    if sample is None:
        _mutmut(where, "run")
    else:  # generate every mutant (and the test map), then run a seeded sample of them and
        # of the constant mutants together
        _mutmut(where, "run", "no-such-mutant", check=False)  # exits 1: no such mutant
        names = sorted(_results(where)) + constant_names(group)
        chosen = random.Random(seed).sample(names, min(sample, len(names)))
        picked = {name for name in chosen if ".constant_L" in name}
        mutmut_names = sorted(set(chosen) - picked)
        for i in range(0, len(mutmut_names), 200):  # keep the command line short
            _mutmut(where, "run", *mutmut_names[i:i + 200])
    generated = _results(where)
    results = generated | run_constants(where, group, chosen=picked)
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
             "Each group runs against every test file that imports its modules (in-process "
             "tests; the multi-process ones, tests/runtime's launches and the CLI's "
             "subprocesses, are out of mutmut's reach, so what only they check survives "
             "here). Mutants listed by hand as equivalent (the script's EQUIVALENT: mutant → "
             "reason) leave the numerator and the denominator. CI mutates the offload "
             "group whole (tests/test_mutation_subset.py, ~1 minute on a loaded 2-core "
             "machine) and fails on any survivor not listed as equivalent.", "",
             "Runs:", ""]
    machine = re.sub(r", load average [\d.]+ at the end", "", str(groups[-1]["machine"])
                     ) if groups else "?"
    for (command, commit, date), where in runs.items():
        lines.append(f"- `{command}` — commit {commit}, {date}: {', '.join(where)}")
    missing = [g for g in GROUPS if g not in records]
    # the latest run: by its UTC time (runs before it was recorded: by date only)
    latest = max(groups, key=lambda g: (str(g["date"]), str(g.get("time", ""))), default=None)
    if latest is not None:
        now = [str(g["group"]) for g in groups if g["commit"] == latest["commit"]]
        older = [str(g["group"]) for g in groups if g["commit"] != latest["commit"]]
        lines += ["", f"Run at the latest commit ({latest['commit']}, {latest['date']}): "
                  f"{', '.join(now)}. Not run this time (their rows are from the older "
                  f"commits above): {', '.join(older) or 'none'}."]
    lines += ["", f"Machine: {machine}.", "",
              "Never run: " + (", ".join(missing) or "none") + "."]
    lines += ["", "| group | mutated | tests | mutants | checked | killed | survived | no tests "
              "| timeout | equivalent | constants killed/all | survival | minutes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    total = [0, 0]
    for g in groups:
        files, tests = g.get("files"), g.get("tests")  # as run (not today's GROUPS)
        assert isinstance(files, list) and isinstance(tests, list)
        c = g["counts"]
        assert isinstance(c, dict)
        alive, denominator = survival(g, equivalent)
        listed = survival(g, {})[1] - denominator  # equivalent mutants left out
        k = g.get("constants") or {}
        assert isinstance(k, dict)
        consts = f"{k.get('killed', 0)}/{sum(k.values())}" if k else "-"
        shown = tests if len(tests) <= 3 else [*tests[:3], f"… {len(tests) - 3} more"]
        rate = f"{alive / denominator:.1%}" if denominator else "-"
        lines.append(f"| {g['group']} | {', '.join(files)} | {', '.join(shown)} | "
                     f"{g['mutants']} | {g['checked']} | {c['killed']} | {c['survived']} | "
                     f"{c['no tests']} | {c['timeout']} | {listed} | {consts} | {rate} | "
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
        every = g["survivors"]
        assert isinstance(every, list)
        survivors = [n for n in every if n not in equivalent]
        per_function: dict[str, int] = {}
        for name in survivors:
            function = re.sub(r"^x_?|__mutmut_\d+$", "", name.split(".")[-1])
            function = function.replace("ǁ", ".").strip(".")
            per_function[function] = per_function.get(function, 0) + 1
        lines.append(f"- **{g['group']}** ({len(survivors)}): " + (", ".join(
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
