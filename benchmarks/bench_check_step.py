"""Predicted versus measured step time on this machine, per layout (issue 15's target: ±20 %).

Calibrates once (`shardwise calibrate --ranks 8`), then runs `shardwise check --json
--calibration FILE` per layout `--repeats` times, round-robin (fresh ranks, the `tiny` models,
`check`'s defaults), and reads its step-time row: the prediction against the measured median
step, and the two predictions re-timed beside the run (`runtime.step_time`: the host cost
refitted, then also the collectives' per-call costs). Reported per layout: the median of the
measured medians, their spread (the noise), each prediction's error against the median and
against the fastest step, the model's largest components. `dp1 (reference)` is `check`'s own
one-rank configuration: its ratio shows the machine's drift since calibrating. Details:
docs/accuracy/index.md.

Run: `PYTHONPATH=src python benchmarks/bench_check_step.py [--repeats 7] [--calibration FILE]
[--json results.json]`; writes `docs/generated/bench_check_step.md`. About 2 minutes to
calibrate, then roughly 15 s per layout and round on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from results import markdown_table, write_result

from shardwise.runtime.measure import (
    CALL_ROW,
    EXPERT_LOAD_ROWS,
    IN_STEP_ROW,
    REFERENCE_ROW,
    WAITED_ROW,
)
from shardwise.runtime.step_time import COMPONENTS, HOST_RETIMED, OUTSIDE, RETIMED

LAYOUTS = {
    "dp1 (reference)": [],
    "dp2": ["--dp", "2"],
    "tp2": ["--tp", "2"],
    "tp2+sp": ["--tp", "2", "--sp"],
    "pp2 1f1b": ["--pp", "2"],
    "pp2 interleaved×2": ["--pp", "2", "--schedule", "interleaved", "--chunks", "2"],
    "cp2": ["--cp", "2"],
    "dp2×ep2 (tiny-moe)": ["--model", "tiny-moe", "--dp", "2", "--ep", "2"],
    "dp2×tp2×pp2": ["--dp", "2", "--tp", "2", "--pp", "2"],
}


def _shardwise(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True,
                          text=True, env=os.environ | {"COLUMNS": "200"}, check=False)
    if done.returncode not in (0, 1):  # 1: a byte/activation row missed (reported anyway)
        raise SystemExit(f"shardwise {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def _step_rows(out: str) -> dict[str, Any]:
    """A check's step-time rows: the prediction, the measured median and fastest step, the
    predicted components, the predictions re-timed beside the run (host, all), the costs
    timed beside it, and the clock's rows (time in each axis's collectives, the rest)."""
    rows = {r["what"]: r for r in json.loads(out)["rows"] if r["item"] == "step time"}
    return {
        "predicted": rows["step (s)"]["predicted"], "measured": rows["step (s)"]["measured"],
        "fastest": rows["fastest step (s)"]["measured"],
        "parts": {label: rows[f"{label} (s)"]["predicted"] for label in COMPONENTS.values()
                  if f"{label} (s)" in rows},
        "retimed": (rows[HOST_RETIMED]["predicted"],  # one rank: no collectives re-timed
                    rows.get(RETIMED, rows[HOST_RETIMED])["predicted"]),
        "beside": {what: r["measured"] for what, r in rows.items()
                   if what.startswith(CALL_ROW)
                   or what in (REFERENCE_ROW, IN_STEP_ROW, *EXPERT_LOAD_ROWS.values())},
        "clock": {what.removesuffix(" (s)"): (r["predicted"], r["measured"])
                  for what, r in rows.items() if what.startswith(WAITED_ROW) or what == OUTSIDE},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calibration", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="Comma-separated subset of: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    path = args.calibration
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="bench-check-step-"), "calibration.json")
        start = time.perf_counter()
        _shardwise("calibrate", "--ranks", "8", "--out", path)
        print(f"calibrated in {time.perf_counter() - start:.0f} s -> {path}", flush=True)
    names = args.layouts.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for repeat in range(args.repeats):  # round-robin: a change of load hits every layout
        for name in names:
            run = _step_rows(_shardwise("check", "--json", "--calibration", path,
                                        *LAYOUTS[name]))
            run["load"] = os.getloadavg()[0]
            runs[name].append(run)
            print(f"  repeat {repeat + 1}: {name:22s} median {run['measured'] * 1e3:7.1f} ms, "
                  f"fastest {run['fastest'] * 1e3:7.1f} ms, load {run['load']:.0f}", flush=True)
    reference = "dp1 (reference)"
    drift = [r["measured"] / r["predicted"] for r in runs.get(reference, [])]
    results = []
    for name in names:
        predicted, parts = runs[name][0]["predicted"], runs[name][0]["parts"]
        measured = [r["measured"] for r in runs[name]]
        fastest = min(r["fastest"] for r in runs[name])
        median = statistics.median(measured)
        # the predictions re-timed beside each run, each against that run's median
        host, both = (statistics.median(r["retimed"][i] / r["measured"] - 1 for r in runs[name])
                      for i in (0, 1))
        # the clock's rows: the median over runs of each measured figure
        clock = {what: (pm[0], statistics.median(r["clock"][what][1] for r in runs[name]))
                 for what, pm in runs[name][0]["clock"].items()}
        row = {"layout": name, "predicted_s": predicted, "measured_s": measured,
               "measured_median_s": median, "spread": (max(measured) - min(measured)) / median,
               "error": (predicted - median) / median,
               "fastest_s": fastest, "error_vs_fastest": (predicted - fastest) / fastest,
               "error_host_retimed": host, "error_retimed": both,
               "predicted_host_retimed_s": [r["retimed"][0] for r in runs[name]],
               "predicted_retimed_s": [r["retimed"][1] for r in runs[name]],
               "timed_beside_s": [r["beside"] for r in runs[name]],
               "clock_s": {what: {"predicted": p, "measured_median": m}
                           for what, (p, m) in clock.items()},
               "components_s": parts, "load_average": [r["load"] for r in runs[name]]}
        results.append(row)
        print(f"  {name}: predicted {predicted * 1e3:.1f} ms, measured {median * 1e3:.1f} ms",
              flush=True)
    table = markdown_table(
        ["layout", "predicted (file)", "measured median (rounds)", "spread", "error: file",
         "host re-timed", "all re-timed", "vs fastest", "largest predicted terms (ms)"],
        [[r["layout"], f"{r['predicted_s'] * 1e3:.1f} ms",
          f"{r['measured_median_s'] * 1e3:.1f} ms "
          f"({' / '.join(f'{m * 1e3:.0f}' for m in r['measured_s'])})",
          f"{r['spread']:.0%}", f"{r['error']:+.1%}", f"{r['error_host_retimed']:+.1%}",
          f"{r['error_retimed']:+.1%}", f"{r['error_vs_fastest']:+.1%}",
          ", ".join(f"{k} {v * 1e3:.0f}"
                    for k, v in sorted(r["components_s"].items(), key=lambda kv: -kv[1])[:3])]
         for r in results], "lrrrrrrrl")
    clocks = markdown_table(
        ["layout", "measured / predicted (ms)"],
        [[r["layout"], ", ".join(
            f"{what} {c['measured_median'] * 1e3:.0f} / "
            + (f"{c['predicted'] * 1e3:.0f}" if c["predicted"] is not None else "–")
            for what, c in r["clock_s"].items())] for r in results if r["clock_s"]], "ll")
    counts = [sum(abs(r[key]) <= 0.2 for r in results)
              for key in ("error", "error_host_retimed", "error_retimed")]
    text = (
        f"{args.repeats} rounds, layouts round-robin; tiny models, s=64, global batch 8, fp32, "
        f"gloo. Error = (predicted − measured) / measured, against the median of the rounds' "
        f"medians; the re-timed predictions per round, then the median. Target ±20 %.\n\n"
        f"{table}\n\nWithin ±20 % of {len(results)} layouts: {counts[0]} from the calibration "
        f"file alone, {counts[1]} host re-timed, {counts[2]} all re-timed. The machine's drift "
        f"since the calibration (the one-rank reference, measured ÷ predicted from the file, "
        f"per round): {' '.join(f'{d:.2f}' for d in drift) or 'not run'}.\n\n"
        f"Where the step's time went (rank 0's median step; the time blocked in each axis's "
        f"collectives and the rest, measured against the model's terms for them):\n\n{clocks}")
    print(text)
    write_result("bench_check_step", text)
    if args.json_path:
        with open(path, encoding="utf-8") as f:
            calibration = json.load(f)
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"calibration": calibration, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
