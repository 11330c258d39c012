"""Leave-one-source-out coverage of the step-time bands (issue 44), their calibration, and the
accuracy plots: what `validate_published.py` writes after the errors.

For every published run r (source family F) the band is rebuilt from the runs of the other
families only (`estimate.uncertainty.band_of` on them) and r is covered when its own
out-of-sample |error| lies inside. Per group (at each level: generation · stack · family,
generation · stack, stack) and coverage c, the factor

    factor_c(group) = max(1, conformal_c(|e_r| / LOSO band_r over the group's runs))

widens the band until the group's sources cover each other at c; a group whose runs have no
band from the other sources often enough (too few families) gets None — the planner passes
it over for its parent. A band wider than ±`MAX_BAND` is "not validated". Written: `band_factors` in data/validation.json, the coverage table
(docs/generated/accuracy-bands.md) and two PNGs in docs/accuracy/ (`bands-scatter.png`,
`bands-coverage.png`). The coverage measured with the factors uses the factors fitted on these
same scores: nominal by construction; the raw column is the honest out-of-sample figure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from shardwise.estimate.uncertainty import (
    COVERAGE,
    COVERAGES,
    MAX_BAND,
    MIN_RUNS,
    band_of,
    bands,
    conformal,
    group_names,
    needed,
)

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "docs" / "accuracy"
Factors = dict[str, dict[str, float | None]]


def _names(run: dict[str, Any]) -> tuple[str, str, str]:
    return group_names(run["generation"], run["stack"], run["family"])


def _others(runs: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in runs if r["family_of_sources"] != run["family_of_sources"]]


def loso_band(runs: list[dict[str, Any]], run: dict[str, Any], coverage: float,
              factors: Factors | None = None) -> float | None:
    """`run`'s band at `coverage` from the other source families' runs only, as the planner
    forms it (`estimate.uncertainty.bands`)."""
    return bands(_others(runs, run), _names(run), factors)[coverage][0]


def calibrate(runs: list[dict[str, Any]]) -> Factors:
    """Per coverage (as "0.8", "0.95") and group name: the widening its LOSO coverage needs
    (module docstring; None: not enough runs with a band from other sources)."""
    out: Factors = {}
    for coverage in COVERAGES:
        factors: dict[str, float | None] = {}
        for level in range(3):
            members: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for run in runs:
                members[_names(run)[level]].append(run)
            for name, group in sorted(members.items()):
                if len(group) < needed(coverage):
                    continue
                scores = []
                for run in group:
                    band = band_of(_others(runs, run), _names(run), coverage, start=level)[0]
                    scores.append(math.inf if band is None else abs(run["loso_error"]) / band)
                factor = conformal(scores, coverage)
                factors[name] = (None if factor is None or math.isinf(factor)
                                 else round(max(1.0, factor), 3))
        out[f"{coverage:g}"] = factors
    return out


def coverage_rows(runs: list[dict[str, Any]], factors: Factors) -> list[list[Any]]:
    """Per exact group: runs, source families, the band (all runs, calibrated) and the LOSO
    coverage raw and calibrated at each coverage; then all runs."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[_names(run)[0]].append(run)
    rows = []
    for name, group in [*sorted(groups.items()), ("all runs", runs)]:
        row: list[Any] = [name, len(group), len({r["family_of_sources"] for r in group})]
        full = bands(runs, _names(group[0]), factors)
        for coverage in COVERAGES:
            if name != "all runs":
                band, used, _, _ = full[coverage]
                row.append("not validated" if band is None else
                           f"±{band:.1%}" + ("" if used == name else f" ({used})"))
            else:
                row.append("")
            for scale in (None, factors):
                judged = [abs(r["loso_error"]) <= b for r in group
                          if (b := loso_band(runs, r, coverage, scale)) is not None]
                row.append(f"{sum(judged)}/{len(judged)}" + (
                    f" ({sum(judged) / len(judged):.0%})" if judged else ""))
        rows.append(row)
    return rows


HEADER = ["group", "runs", "source families", "80 % band", "LOSO covered (raw)",
          "LOSO covered (calibrated)", "95 % band", "LOSO covered (raw) ", "LOSO covered "
          "(calibrated) "]


def report(runs: list[dict[str, Any]], factors: Factors, markdown_table: Any) -> str:
    """The coverage table and the factors, as markdown."""
    lines = ["Each run's band rebuilt from the other source families' runs only; covered: its "
             "out-of-sample |error| inside. Raw: the conformal band alone; calibrated: × the "
             "group's factor (fitted on these same scores, so nominal by construction where "
             f"a factor exists). Groups under {MIN_RUNS} runs (19 at 95 %) take their "
             "parent's band (named in brackets), widened; an 80 % band over "
             f"±{MAX_BAND:.0%} is not validated (a 95 % one over ±100 %), and its runs are "
             "left out of the counts; the 95 % band is never narrower than the 80 % one.\n",
             markdown_table(HEADER, coverage_rows(runs, factors)),
             "\nFactors (the widening each group's sources need; None: too few runs with a "
             "band from another source, the group is passed over):\n",
             markdown_table(["group", *(f"{c:.0%}" for c in COVERAGES)],
                            [[name, *(factors[f"{c:g}"].get(name, "") for c in COVERAGES)]
                             for name in sorted({n for f in factors.values() for n in f})])]
    return "\n".join(lines)


def plots(runs: list[dict[str, Any]], published: dict[str, tuple[float, str]],
          factors: Factors) -> list[Path]:
    """predicted vs published per source family with each run's 80 % band as an error bar,
    and the LOSO coverage per group at 80 % and 95 % (raw and calibrated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_family: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_family[run["family_of_sources"]].append(run)
    cols = 4
    rows = math.ceil(len(by_family) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.8 * rows), squeeze=False)
    for ax, (fam, group) in zip(axes.flat, sorted(by_family.items())):
        for run in group:
            value, quantity = published[run["id"]]
            predicted = value * (1 + run["loso_error"])
            band = bands(runs, _names(run), factors)[COVERAGE][0]
            inside = band is not None and abs(run["loso_error"]) <= band
            ax.errorbar(value, predicted, yerr=None if band is None else [[predicted * band],
                                                                           [predicted * band]],
                        fmt="o" if quantity == "step_time_s" else "s", ms=3,
                        color="tab:blue" if inside else "tab:red", alpha=0.6, lw=0.6)
        values = [published[r["id"]][0] for r in group]
        low, high = min(values) * 0.7, max(values) * 1.4
        ax.plot([low, high], [low, high], color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{fam} ({len(group)} runs)", fontsize=9)
        ax.set_xlabel("published", fontsize=8)
        ax.set_ylabel("predicted, out of sample", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(by_family):]:
        ax.axis("off")
    fig.suptitle("Predicted (leave-one-source-out) vs published, in each source's quantity "
                 "(circles: step time; squares: rates); bars: the 80 % band; red: outside it",
                 fontsize=10)
    fig.tight_layout()
    scatter = PLOTS / "bands-scatter.png"
    fig.savefig(scatter, dpi=110)
    plt.close(fig)

    table = [r for r in coverage_rows(runs, factors) if r[0] != "all runs" and r[1] >= MIN_RUNS]
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(table) + 1.6))
    labels = [f"{r[0]} ({r[1]})" for r in table]

    def share(text: str) -> float:
        done, total = text.split(" ")[0].split("/")
        return int(done) / int(total) if int(total) else float("nan")

    y = range(len(table))
    for offset, column, colour, label in ((-0.3, 4, "#9ecae1", "80 % raw"),
                                          (-0.1, 5, "#3182bd", "80 % calibrated"),
                                          (0.1, 7, "#fdae6b", "95 % raw"),
                                          (0.3, 8, "#e6550d", "95 % calibrated")):
        ax.barh([k + offset for k in y], [share(r[column]) for r in table], height=0.2,
                color=colour, label=label)
    for nominal in COVERAGES:
        ax.axvline(nominal, color="black", lw=0.8, ls="--")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("share of the group's runs inside the band rebuilt without their source")
    ax.set_title("Leave-one-source-out coverage per group (runs); dashed: nominal 80 % / 95 %",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    coverage = PLOTS / "bands-coverage.png"
    fig.savefig(coverage, dpi=110)
    plt.close(fig)
    return [scatter, coverage]
