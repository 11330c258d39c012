"""Predicted against published training runs: in-sample and leave-one-source-out (issue 30).

The validation set is `validation_runs.json` (sources with citations, rows with model, cluster,
layout, stack settings and the published figure; loader: `validation_rows.py`). Component
constants come from component benchmarks (`fit_components.py`); published runs fix three
end-to-end constants per GPU generation — `sustained_compute`, `overlap_contention`,
`tp_overlap_efficiency` — fitted on the generation's bf16/fp16 dense rows (FP8 and MoE rows
only validate). Reported per family, generation and stack: in-sample errors and
leave-one-family-out errors (the out-of-sample figure), written to
`docs/generated/accuracy-published.md` and `src/shardwise/data/validation.json` (each run's
group and out-of-sample error, the ground the runs cover); `--fit` also writes the constants
into `src/shardwise/data/calibration.json`. Method: docs/accuracy/index.md. Held out — never read here, never fitted on: Megatron-LM README's H100 weak-scaling table;
Llama 3 paper Table 4; Korthikanti et al. 2022 tables; BLOOM-176B's training README;
torchtitan's `benchmarks/` and the TorchTitan paper's tables (and docs/performance.md, which
carries them); Nemotron-4 15B and 340B reports' tables; MT-NLG 530B; GPT-NeoX-20B; the
DeepSeek-V2/V3 reports' throughput; Megatron-MoE-ModelZoo; Megatron's DeepSeek-V3-on-GB200 guide.

Run: `python benchmarks/validate_published.py` (a few minutes) or `--fit` (refit, then report).
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

import band_coverage
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
SHAPE = "matmul_half_dim"  # fitted end to end only where no GEMM sweep measured it
BOUNDS = {"sustained_compute": (0.55, 1.0), "overlap_contention": (0.0, 1.0),
          "tp_overlap_efficiency": (0.3, 1.0), SHAPE: (16.0, 256.0)}
SCALE = {SHAPE: 256.0}  # a search step is this many units of the constant (else 1)
Params = dict[str, float]
NEUTRAL: Params = {"sustained_compute": 1.0, "overlap_contention": 0.5,
                   "tp_overlap_efficiency": 0.8}
"""Where every fit starts (each fold too, so a left-out family leaves no trace in its fit)."""


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


def fit(rows: list[Case], steps: tuple[float, ...] = (0.08, 0.04, 0.02, 0.01),
        rounds: int = 2) -> dict[str, Params]:
    """Each generation's three constants by coordinate search on its dense bf16/fp16 rows
    (`_score`), from `NEUTRAL`; a generation without such rows takes Hopper's."""
    by_gen: dict[str, list[Case]] = defaultdict(list)
    for case in rows:
        if case.train.fp8 is None and not case.model.is_moe:
            by_gen[generation(case.cluster.accelerator.name)].append(case)
    out: dict[str, Params] = {}
    for gen, group in sorted(by_gen.items(), key=lambda item: item[0] != "hopper"):
        free = (*PARAMS, SHAPE) if shape_transferred(group[0]) else PARAMS
        current = dict(NEUTRAL) | ({SHAPE: BOUNDS[SHAPE][1]} if SHAPE in free else {})
        for step in steps:
            for _ in range(rounds):
                for name in free:
                    low, high = BOUNDS[name]
                    trials = sorted({min(high, max(low, current[name] + k * step *
                                                   SCALE.get(name, 1.0)))
                                     for k in (-2, -1, 0, 1, 2)})
                    scores = {x: _score([error(c, {gen: current | {name: x}}) for c in group])
                              for x in trials}
                    current[name] = min(scores, key=lambda x: (scores[x], abs(x - current[name])))
        out[gen] = {k: round(v, 3) for k, v in current.items()}
    for gen in {generation(c.cluster.accelerator.name) for c in rows} - set(out):
        out[gen] = dict(out["hopper"])
    return out


def shape_transferred(case: Case) -> bool:
    """Did `fit_components.py` transfer this accelerator's GEMM shape constant instead of
    fitting it on a sweep of its own (its `sources` entry says so)?"""
    data = json.loads(CALIBRATION.read_text())
    return "d½ from" in data["sources"].get(case.cluster.accelerator.calibration_name, "")


def _builtin(case: Case) -> Params:
    cal = default_calibration(case.cluster.accelerator.calibration_name)
    names = (*PARAMS, SHAPE) if shape_transferred(case) else PARAMS
    return {name: getattr(cal, name) for name in names}


def builtin_params(rows: list[Case]) -> dict[str, Params]:
    """The constants data/calibration.json holds now, per generation of the rows."""
    return {generation(c.cluster.accelerator.name): _builtin(c) for c in rows}


def leave_one_family_out(rows: list[Case]) -> dict[str, float]:
    """Row id → error when its family's rows are left out of the fit."""
    out = {}
    for fam in sorted({c.row["family"] for c in rows}):
        rest = [c for c in rows if c.row["family"] != fam]
        fitted = fit(rest)
        for gen in {generation(c.cluster.accelerator.name) for c in rows} - set(fitted):
            fitted[gen] = dict(fitted["hopper"])  # no run of its own left: Hopper's
        for case in (c for c in rows if c.row["family"] == fam):
            out[case.row["id"]] = error(case, fitted)
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
    """What the runs measured, per stack: schedules, largest degrees, shortest CP sequence and
    CP kinds, ZeRO stages, recompute policies, TP overlap modes, compile."""
    stacks: dict[str, dict[str, Any]] = {}
    for case in rows:
        lay, settings = case.layout, case.train.settings()
        g = stacks.setdefault(case.train.impl, {
            "schedules": [], "max_tp": 1, "max_pp": 1, "max_cp": 1, "max_ep": 1, "cp_seq": 0,
            "cp_kinds": [], "zero": [], "recompute": [], "tp_overlap": [], "compile": False})
        if lay.pp > 1 and lay.schedule not in g["schedules"]:
            g["schedules"].append(lay.schedule)
        for axis in ("tp", "pp", "cp", "ep"):
            g[f"max_{axis}"] = max(g[f"max_{axis}"], getattr(lay, axis))
        if lay.cp > 1:
            seq = case.train.seq_len
            g["cp_seq"] = seq if not g["cp_seq"] else min(g["cp_seq"], seq)
            if lay.cp_kind not in g["cp_kinds"]:
                g["cp_kinds"].append(lay.cp_kind)
        for key, value in (("zero", lay.zero), ("recompute", lay.recompute),
                           ("tp_overlap", settings.tp_overlap)):
            if value not in g[key]:
                g[key].append(value)
        g["compile"] = g["compile"] or settings.compile
    gens = sorted({generation(c.cluster.accelerator.name) for c in rows})
    return {"generations": gens, "stacks": stacks}


def write_validation(rows: list[Case], insample: dict[str, float], loso: dict[str, float],
                     stamp: str) -> list[dict[str, Any]]:
    """data/validation.json: the runs, the ground, the bands' factors (`band_coverage`)."""
    runs = [{"id": c.row["id"], "source": c.row["source"], "family_of_sources": c.row["family"],
             **group_of(c), "error": round(insample[c.row["id"]], 4),
             "loso_error": round(loso[c.row["id"]], 4)} for c in rows]
    VALIDATION.write_text(json.dumps({
        "_doc": "Written by benchmarks/validate_published.py: each expressible published run's "
                "group and its in-sample and leave-one-family-out errors (predicted/published - "
                "1 in the published quantity), the ground the runs cover, per stack, and per "
                "coverage and group the factor that makes the band's leave-one-source-out "
                "coverage nominal (benchmarks/band_coverage.py). estimate.uncertainty reads it.",
        "stamp": stamp, "runs": runs, "ground": ground(rows),
        "band_factors": band_coverage.calibrate(runs)}, indent=1) + "\n")
    return runs


def write_bands(rows: list[Case], runs: list[dict[str, Any]], factors: Any) -> None:
    """The bands' coverage table (docs/generated/accuracy-bands.md) and the plots."""
    from results import markdown_table, write_result

    published = {c.row["id"]: (c.row["published"]["value"], c.row["published"]["quantity"])
                 for c in rows}
    for path in band_coverage.plots(runs, published, factors):
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    write_result("accuracy-bands", band_coverage.report(runs, factors, markdown_table))


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
             "| generation | " + " | ".join(PARAMS) + f" | {SHAPE} |",
             "|---" * (len(PARAMS) + 2) + "|"]
    lines += [f"| {gen} | " + " | ".join(f"{p[k]:g}" for k in PARAMS)
              + f" | {p.get(SHAPE, 'component fit')} |" for gen, p in sorted(params.items())]
    for title, key in (("family", lambda c: c.row["family"]),
                       ("generation", lambda c: generation(c.cluster.accelerator.name)),
                       ("stack", lambda c: c.train.impl),
                       ("precision", lambda c: f"fp8 {c.train.fp8}" if c.train.fp8
                        else c.train.dtype),
                       ("source", lambda c: c.row["source"]),
                       ("model kind (MoE rows only validate)",
                        lambda c: "moe" if c.model.is_moe else "dense"),
                       ("MoE source", lambda c: c.row["source"] if c.model.is_moe else ""),
                       ("MoE group", lambda c: " · ".join(group_of(c).values())
                        if c.model.is_moe else "")):
        lines += [f"\n## By {title}\n", header]
        groups: dict[str, list[Case]] = defaultdict(list)
        for case in rows:
            groups[key(case)].append(case)
        for name, group in sorted(groups.items()):
            if not name:
                continue
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
    parser.add_argument("--bands-only", action="store_true",
                        help="only recalibrate the bands and redraw the plots from the errors "
                             "data/validation.json holds (no refits)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from results import stamp, write_result

    rows, sources, skipped = cases()
    if args.bands_only:
        data = json.loads(VALIDATION.read_text())
        data["band_factors"] = band_coverage.calibrate(data["runs"])
        VALIDATION.write_text(json.dumps(data, indent=1) + "\n")
        write_bands(rows, data["runs"], data["band_factors"])
        return 0
    params = builtin_params(rows)
    if args.fit:
        params = fit(rows)
        write_fit(params)
    insample = {c.row["id"]: error(c, params) for c in rows}
    loso = leave_one_family_out(rows)
    runs = write_validation(rows, insample, loso, stamp())
    write_bands(rows, runs, json.loads(VALIDATION.read_text())["band_factors"])
    text = report(rows, sources, skipped, params, insample, loso)
    write_result("accuracy-published", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
