"""Predicted against published training runs: in-sample and leave-one-family-out (issue 30).

The validation set is `validation_runs.json` beside this file (sources with citations, rows
with model, cluster, layout, stack settings and the published figure; loader and conventions:
`validation_rows.py`). The step model's component constants (GEMMs, attention kernels, HBM,
links) come from component benchmarks (`fit_components.py`); published runs fix three
end-to-end constants per accelerator generation, which nothing else measures:

    sustained_compute      the share of the benchmarks' tensor-core rate a long job sustains
    overlap_contention     how much overlapped communication slows the compute beside it
    tp_overlap_efficiency  the GEMM share that hides TP traffic under bulk TP overlap

fitted by coordinate search on the generation's rows (objective: median |error| + ¼ mean
|error|). A generation with no row of its own takes Hopper's (said in the output).

Reported, per family (sources that share rows, e.g. the DGXC versions), generation and stack:
in-sample errors (constants fitted on every row) and leave-one-family-out errors (each family
predicted with constants fitted without it) — the out-of-sample figure. Written:
`docs/generated/accuracy-published.md` (the tables, stamped with commit, date and machine) and
`src/shardwise/data/validation.json` (each run's group and out-of-sample error, and the ground
the runs cover: what `estimate.uncertainty` widens the band for). `--fit` also writes the
fitted constants into `src/shardwise/data/calibration.json`.

Held out — never read here, never fitted on: Megatron-LM README's H100 weak-scaling table;
Llama 3 paper Table 4; Korthikanti et al. 2022 tables; BLOOM-176B's training README;
torchtitan's `benchmarks/` folder and the TorchTitan paper's tables (so torchtitan's
docs/performance.md, which carries them, is excluded too); Nemotron-4 15B and 340B technical
reports' tables; Megatron-Turing NLG 530B paper; GPT-NeoX-20B paper.

Run: `python benchmarks/validate_published.py` (report with the built-in constants and the
leave-one-family-out refits, a few minutes) or `--fit` (refit, then report).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from validation_rows import Case, build, load, to_published

from shardwise.calibration import Calibration, default_calibration
from shardwise.errors import ShardwiseError
from shardwise.estimate.step import estimate_step
from shardwise.estimate.uncertainty import family, generation

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "src/shardwise/data/calibration.json"
VALIDATION = ROOT / "src/shardwise/data/validation.json"
EXCLUDED_FAMILIES = {"torchtitan-docs": "carries the TorchTitan paper's tables (held out)"}
PARAMS = ("sustained_compute", "overlap_contention", "tp_overlap_efficiency")
BOUNDS = {"sustained_compute": (0.55, 1.0), "overlap_contention": (0.0, 1.0),
          "tp_overlap_efficiency": (0.3, 1.0)}
Params = dict[str, float]


def cases() -> tuple[list[Case], dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """(the rows shardwise can express, the sources, (row id, reason) of the others)."""
    _, sources, rows = load()
    out, skipped = [], []
    for row in rows:
        fam = sources[row["source"]]["family"]
        if fam in EXCLUDED_FAMILIES:
            continue
        try:
            case = build(row)
        except ShardwiseError as exc:
            skipped.append((row["id"], str(exc)))
            continue
        out.append(replace(case, row={**case.row, "family": fam}))
    return out, sources, skipped


def calibration(case: Case, params: dict[str, Params]) -> Calibration:
    """The built-in constants of the row's accelerator with its generation's fitted ones."""
    acc = case.cluster.accelerator
    cal = default_calibration(acc.calibration_name)
    return replace(cal, **params.get(generation(acc.name), {}))


def error(case: Case, params: dict[str, Params]) -> float:
    est = estimate_step(case.model, case.cluster, case.layout, case.train,
                        calibration(case, params))
    value = case.row["published"]["value"]
    return (to_published(case, est) - value) / value


def _score(errors: list[float]) -> float:
    magnitudes = [abs(e) for e in errors]
    return statistics.median(magnitudes) + 0.25 * statistics.fmean(magnitudes)


def fit(rows: list[Case], start: dict[str, Params]) -> dict[str, Params]:
    """Each generation's three constants by coordinate search on its rows (`_score`)."""
    by_gen: dict[str, list[Case]] = defaultdict(list)
    for case in rows:
        by_gen[generation(case.cluster.accelerator.name)].append(case)
    out = {gen: dict(values) for gen, values in start.items()}
    for gen, group in by_gen.items():
        current = dict(out.get(gen) or out.get("hopper") or _builtin(group[0]))
        for step in (0.08, 0.04, 0.02, 0.01):
            for _ in range(2):
                for name in PARAMS:
                    low, high = BOUNDS[name]
                    trials = sorted({min(high, max(low, current[name] + k * step))
                                     for k in (-2, -1, 0, 1, 2)})
                    scores = {x: _score([error(c, {gen: current | {name: x}}) for c in group])
                              for x in trials}
                    current[name] = min(scores, key=lambda x: (scores[x], abs(x - current[name])))
        out[gen] = {k: round(v, 3) for k, v in current.items()}
    return out


def _builtin(case: Case) -> Params:
    cal = default_calibration(case.cluster.accelerator.calibration_name)
    return {name: getattr(cal, name) for name in PARAMS}


def builtin_params(rows: list[Case]) -> dict[str, Params]:
    """The constants data/calibration.json holds now, per generation of the rows."""
    return {generation(c.cluster.accelerator.name): _builtin(c) for c in rows}


def leave_one_family_out(rows: list[Case], params: dict[str, Params]
                         ) -> dict[str, float]:
    """Row id → error when its family's rows are left out of the fit."""
    out = {}
    for fam in sorted({c.row["family"] for c in rows}):
        rest = [c for c in rows if c.row["family"] != fam]
        fitted = fit(rest, {g: p for g, p in params.items() if g == "hopper"})
        for case in (c for c in rows if c.row["family"] == fam):
            gen = generation(case.cluster.accelerator.name)
            use = fitted if gen in fitted else {**fitted, gen: fitted.get("hopper", {})}
            out[case.row["id"]] = error(case, use)
        print(f"  left out {fam}", file=sys.stderr)
    return out


# -------------------------------------------------------------------------------- report
def _stats(errors: list[float]) -> tuple[int, float, float, float]:
    mags = [abs(e) for e in errors]
    return len(errors), statistics.median(mags), max(mags), statistics.median(errors)


def _line(name: str, ins: list[float], out: list[float]) -> str:
    n, med, worst, signed = _stats(ins)
    _, o_med, o_worst, o_signed = _stats(out)
    return (f"| {name} | {n} | {med:.1%} | {worst:.1%} | {signed:+.1%} | {o_med:.1%} | "
            f"{o_worst:.1%} | {o_signed:+.1%} |")


def group_of(case: Case) -> dict[str, Any]:
    lay = case.layout
    return {"generation": generation(case.cluster.accelerator.name),
            "stack": case.train.impl,
            "family": family(lay.tp, lay.pp, lay.cp, lay.ep, lay.zero)}


def ground(rows: list[Case]) -> dict[str, Any]:
    """What the runs measured, per stack: schedules, largest degrees, shortest CP sequence,
    ZeRO stages, recompute policies, TP overlap modes, compile."""
    stacks: dict[str, dict[str, Any]] = {}
    for case in rows:
        lay, settings = case.layout, case.train.settings()
        g = stacks.setdefault(case.train.impl, {
            "schedules": [], "max_tp": 1, "max_pp": 1, "max_cp": 1, "max_ep": 1, "cp_seq": 0,
            "zero": [], "recompute": [], "tp_overlap": [], "compile": False})
        if lay.pp > 1 and lay.schedule not in g["schedules"]:
            g["schedules"].append(lay.schedule)
        for axis in ("tp", "pp", "cp", "ep"):
            g[f"max_{axis}"] = max(g[f"max_{axis}"], getattr(lay, axis))
        if lay.cp > 1:
            seq = case.train.seq_len
            g["cp_seq"] = seq if not g["cp_seq"] else min(g["cp_seq"], seq)
        for key, value in (("zero", lay.zero), ("recompute", lay.recompute),
                           ("tp_overlap", settings.tp_overlap)):
            if value not in g[key]:
                g[key].append(value)
        g["compile"] = g["compile"] or settings.compile
    gens = sorted({generation(c.cluster.accelerator.name) for c in rows})
    return {"generations": gens, "stacks": stacks}


def write_validation(rows: list[Case], insample: dict[str, float], loso: dict[str, float],
                     stamp: str) -> None:
    runs = [{"id": c.row["id"], "source": c.row["source"], "family_of_sources": c.row["family"],
             **group_of(c), "error": round(insample[c.row["id"]], 4),
             "loso_error": round(loso[c.row["id"]], 4)} for c in rows]
    VALIDATION.write_text(json.dumps({
        "_doc": "Written by benchmarks/validate_published.py: each expressible published run's "
                "group and its in-sample and leave-one-family-out errors (predicted/published - "
                "1 in the published quantity), and the ground the runs cover, per stack. "
                "estimate.uncertainty reads it.", "stamp": stamp, "runs": runs,
        "ground": ground(rows)}, indent=1) + "\n")


def write_fit(params: dict[str, Params]) -> None:
    """Each generation's constants into every calibration entry of that generation."""
    data = json.loads(CALIBRATION.read_text())
    for name, entry in data["accelerators"].items():
        values = params.get(generation(name))
        if values:
            entry.update(values)
    CALIBRATION.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def report(rows: list[Case], sources: dict[str, Any], skipped: list[tuple[str, str]],
           params: dict[str, Params], insample: dict[str, float], loso: dict[str, float]
           ) -> str:
    header = ("| group | runs | median | worst | median signed | LOFO median | LOFO worst | "
              "LOFO median signed |\n|---|---|---|---|---|---|---|---|")
    lines = ["# Accuracy against published runs\n",
             "Error = predicted/published − 1 in the quantity each source published (step time: "
             "positive = slower than published; rates: positive = faster). In-sample: the "
             "end-to-end constants fitted on every run; LOFO (leave one family out): each "
             "family predicted with the constants fitted without it — the out-of-sample "
             "figure.\n", "## Fitted end-to-end constants\n",
             "| generation | " + " | ".join(PARAMS) + " |", "|---" * (len(PARAMS) + 1) + "|"]
    lines += [f"| {gen} | " + " | ".join(f"{p[k]:g}" for k in PARAMS) + " |"
              for gen, p in sorted(params.items())]
    for title, key in (("family", lambda c: c.row["family"]),
                       ("generation", lambda c: generation(c.cluster.accelerator.name)),
                       ("stack", lambda c: c.train.impl),
                       ("source", lambda c: c.row["source"])):
        lines += [f"\n## By {title}\n", header]
        groups: dict[str, list[Case]] = defaultdict(list)
        for case in rows:
            groups[key(case)].append(case)
        for name, group in sorted(groups.items()):
            lines.append(_line(name, [insample[c.row["id"]] for c in group],
                               [loso[c.row["id"]] for c in group]))
    lines += ["\n## All runs\n", header,
              _line("all", list(insample.values()), list(loso.values())),
              f"\n{len(skipped)} published rows cannot be expressed yet (first reasons: "
              + "; ".join(sorted({r for _, r in skipped})[:8]) + ").",
              "\nSources: " + "; ".join(f"{s['id']} — {s['citation']}"
                                        for s in sources.values()
                                        if s["family"] not in EXCLUDED_FAMILIES) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="refit the end-to-end constants")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from results import stamp, write_result

    rows, sources, skipped = cases()
    params = builtin_params(rows)
    if args.fit:
        params = fit(rows, {"hopper": params.get("hopper", {})})
        write_fit(params)
    insample = {c.row["id"]: error(c, params) for c in rows}
    loso = leave_one_family_out(rows, params)
    write_validation(rows, insample, loso, stamp())
    text = report(rows, sources, skipped, params, insample, loso)
    write_result("accuracy-published", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
