"""One prepared run that checks shardwise's CUDA and NCCL path and calibrates the GPU (issue 38).

`run` takes every step in order within the budget; `main` is the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpu_check.config import (
    DRY,
    DRY_BUDGET_S,
    GLOBAL_BUDGET_S,
    GPU,
    MIN_STEP_S,
    SCHEMA,
    TOLERANCE,
    Context,
)
from gpu_check.notebook import _error_text
from gpu_check.report import Report, accelerator_label
from gpu_check.steps import STEPS, StepFailed, StepSkipped

PRELOAD = ("torch", "torch.distributed", "shardwise.runtime.collectives",
           "shardwise.runtime.train", "shardwise.runtime.measure")


def _warm_forkserver() -> None:
    """Start the forkserver `launch.spawn` forks its ranks from with `PRELOAD` imported (it
    starts once per process; `launch` then finds it running)."""
    import multiprocessing.forkserver

    import torch.multiprocessing

    if "forkserver" in torch.multiprocessing.get_all_start_methods():
        torch.multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()


def run(out: Path, dry_run: bool, budget: float, accelerator: str | None,
        only: tuple[str, ...]) -> dict[str, Any]:
    """Every step in order within `budget` seconds; the report after each."""
    start = time.monotonic()
    sizes = DRY if dry_run else GPU
    report = Report(out, {
        "schema": SCHEMA, "dry_run": dry_run, "command": " ".join(sys.argv),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "budget_s": budget, "tolerances": {f"{what} {dtype}": tol for (what, dtype), tol
                                           in TOLERANCE.items()},
        "environment": {}, "checks": {},
        "sections": {step.section: {"status": "pending", "steps": {}} for step in STEPS}})
    report.write()
    scratch = tempfile.mkdtemp(prefix="gpu_check-")
    results: dict[str, Any] = {"__out__": str(out), "__gpus__": 0}
    ctx = Context(dry_run, sizes, accelerator or ("h200" if dry_run else None), scratch)
    for step in STEPS:
        key = f"{step.section}.{step.name}"
        entry: dict[str, Any] = {"timeout_s": step.timeout_s, "expect_s": step.expect_s}
        left = budget - (time.monotonic() - start)
        timeout = min(step.timeout_s if not dry_run else 60.0, left)
        reason = None
        if only and step.section not in only and key not in only and step.name != "env":
            reason = f"not asked for (--only {','.join(only)})"
        elif step.gpus and results["__gpus__"] < step.gpus and not dry_run:
            reason = (f"needs {step.gpus} GPUs, this machine has {results['__gpus__']}: "
                      "NCCL collectives and the dp/tp/pp checks need two")
        elif timeout < MIN_STEP_S:
            reason = f"global budget spent ({left:.0f} s of {budget:.0f} s left)"
        elif key == "calibration.fit" and ctx.accelerator is None:
            reason = "unknown accelerator: pass --accelerator PRESET"
        if reason:
            report.step(step, entry | {"status": "skipped", "reason": reason})
            continue
        began = time.monotonic()
        if key == "environment.env":
            with contextlib.suppress(Exception):  # else `launch` starts its own
                _warm_forkserver()
        print(f"[{began - start:6.1f} s] {key} (timeout {timeout:.0f} s)", flush=True)
        try:
            items, checks = step.run(ctx, timeout, results)
            entry |= {"status": "measured", "items": items, "checks": checks}
        except StepSkipped as exc:
            entry |= {"status": "skipped", "reason": str(exc)}
        except StepFailed as exc:
            entry |= {"status": "failed", "error": str(exc), "items": exc.items,
                      "checks": exc.checks}
        except Exception as exc:  # any error is recorded; the run goes on
            entry |= {"status": "failed", "error": _error_text(exc) + "\n"
                      + "".join(traceback.format_tb(exc.__traceback__)[-3:])}
        entry["wall_s"] = time.monotonic() - began
        results[key] = entry.get("items", {})
        if key == "environment.env":
            env = entry.get("items", {})
            results["__gpus__"] = env.get("gpus", 0)
            report.data["environment"] = env
            if env.get("devices") and accelerator is None:
                ctx = replace(ctx, accelerator=accelerator_label(
                    env["devices"][0]["name"], env["devices"][0]["memory_bytes"]))
            if not dry_run and not env.get("gpus"):
                report.data["note"] = "no GPU found: every GPU step fails; use --dry-run on a CPU"
            report.data["accelerator"] = ctx.accelerator
        report.data["wall_s"] = time.monotonic() - start
        report.step(step, entry)
    report.data["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    report.data["wall_s"] = time.monotonic() - start
    report.write()
    shutil.rmtree(scratch, ignore_errors=True)  # every notebook is in the JSON
    return report.data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.json, summary.md and the "
                                               "calibration file (created)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU at tiny sizes (gloo, no CUDA)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {GLOBAL_BUDGET_S:.0f}; "
                             f"dry run {DRY_BUDGET_S:.0f})")
    parser.add_argument("--accelerator", default=None,
                        help="the hardware preset this GPU is (default: from its name)")
    parser.add_argument("--only", default="",
                        help="comma-separated sections or section.step to run (env always)")
    args = parser.parse_args()
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        print(f"gpu_check: cannot write to {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    if args.accelerator is not None:
        from shardwise.hardware import ACCELERATORS

        if args.accelerator not in ACCELERATORS:
            print(f"gpu_check: unknown accelerator {args.accelerator!r}; valid: "
                  f"{', '.join(ACCELERATORS)}", file=sys.stderr)
            return 2
    budget = (args.budget if args.budget is not None
              else DRY_BUDGET_S if args.dry_run else GLOBAL_BUDGET_S)
    if not budget > 0:
        print(f"gpu_check: --budget must be > 0 seconds, got {args.budget}", file=sys.stderr)
        return 2
    only = tuple(s for s in args.only.split(",") if s)
    data = run(args.out, args.dry_run, budget, args.accelerator, only)
    counts = data["checks"]
    print(f"wrote {args.out / 'gpu_check.json'} and summary.md in {data['wall_s']:.0f} s: "
          f"{counts.get('passed', 0)} checks passed, {counts.get('failed', 0)} failed, "
          f"{counts.get('reported', 0)} reported")
    return 0


