"""How sure a predicted step time is: a calibrated band from the out-of-sample errors of the
nearest group of published runs, what the layout relies on that no run measured, and the
resolution at which two predictions can be told apart (the planner's tiers).

`benchmarks/validate_published.py` writes `data/validation.json`: per published run its group
(accelerator generation · stack · parallelism family) and its leave-one-source-out (LOSO)
error, the ground the runs cover, and per group the factor that makes the band's LOSO
coverage nominal. The band at coverage `c` (0.8 printed, 0.95 reported):

    band_c = conformal_c(|LOSO errors| of the nearest group with ≥ needed(c) runs)
             × factor_c(group) × WIDEN^(steps up to a parent group) + PER_FEATURE × unvalidated

with conformal_c the ⌈(n+1)·c⌉-th smallest of n errors. No group with enough runs, or a
group band over ±`MAX_BAND`: no band, "not validated". docs/concepts/step-time.md derives it;
docs/accuracy/bands.md measures it.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from shardwise.calibration import default_calibration
from shardwise.hardware import BORROWED, generation, get_accelerator

__all__ = ["COVERAGE", "COVERAGES", "DOCS", "Uncertainty", "band_of", "bands", "bounds",
           "cap_for",
           "conformal",
           "family", "generation", "group_names", "needed", "resolution", "uncertainty",
           "validation_data"]

COVERAGE = 0.8  # the band printed: the truth inside it for 80 % of out-of-sample runs
COVERAGES = (0.8, 0.95)  # both measured and reported
MIN_RUNS = 5  # a smaller group says too little: its parent group, widened, gives the band
WIDEN = 1.5  # per step up to a parent group (group → generation · stack → stack)
PER_FEATURE = 0.05  # per feature no validation run measured
MAX_BAND = 0.5  # a group band wider than ±50 % says nothing: "not validated" instead
MIN_PAIRS = 10  # pairs of runs the resolution needs at a level before it relaxes
DOCS = "docs/accuracy/bands.md"  # where each group's band and coverage are published


@dataclass(frozen=True)
class Uncertainty:
    """A band around a predicted step time: `band` the relative half-width at `coverage`
    (0.06 = ±6 %; None: no group of published runs backs it, `validated` False), `band_95`
    the same at 95 % (its group `group_95`), the group and run count the band comes from,
    how it was formed (`basis`), and the layout's features no validation run measured
    (`unvalidated`, one phrase each; each widens the band by `PER_FEATURE`)."""

    band: float | None
    group: str
    runs: int
    unvalidated: tuple[str, ...] = field(default=())
    band_95: float | None = None
    group_95: str = ""
    coverage: float = COVERAGE
    validated: bool = True
    basis: str = ""
    docs: str = DOCS

    @property
    def on_ground(self) -> bool:
        """No feature of the layout lies outside what the published runs measured."""
        return not self.unvalidated

    def to_dict(self) -> dict[str, Any]:
        return {"band": self.band, "group": self.group, "runs": self.runs,
                "unvalidated": list(self.unvalidated), "band_95": self.band_95,
                "group_95": self.group_95, "coverage": self.coverage,
                "validated": self.validated, "basis": self.basis, "docs": self.docs}


def family(tp: int, pp: int, cp: int, ep: int, zero: int) -> str:
    """The parallelism family: the non-trivial axes, e.g. "tp+pp", "fsdp", "dp"."""
    parts = [name for name, on in (("tp", tp > 1), ("pp", pp > 1), ("cp", cp > 1),
                                   ("ep", ep > 1), ("fsdp", zero == 3)) if on]
    return "+".join(parts) or "dp"


def group_names(gen: str, stack: str, fam: str) -> tuple[str, str, str]:
    """The group and its parents, nearest first: "hopper · megatron-te · tp+pp",
    "hopper · megatron-te", "megatron-te"."""
    return f"{gen} · {stack} · {fam}", f"{gen} · {stack}", stack


def _names(run: dict[str, Any]) -> tuple[str, str, str]:
    return group_names(run["generation"], run["stack"], run["family"])


@cache
def validation_data() -> dict[str, Any]:
    """`data/validation.json` (written by benchmarks/validate_published.py)."""
    text = resources.files("shardwise").joinpath("data/validation.json").read_text()
    return json.loads(text)


def needed(coverage: float) -> int:
    """The fewest runs whose conformal quantile at `coverage` exists (⌈(n+1)c⌉ ≤ n), and at
    least `MIN_RUNS`: 5 at 80 %, 19 at 95 %."""
    return max(MIN_RUNS, math.ceil(coverage / (1 - coverage) - 1e-9))


def conformal(errors: list[float], coverage: float) -> float | None:
    """The ⌈(n+1)·c⌉-th smallest |error| of n (split-conformal: a new run exchangeable with
    these lies within it with probability ≥ c); None when n is too small for `c`."""
    n = len(errors)
    k = math.ceil((n + 1) * coverage - 1e-9)
    return float(np.sort(np.abs(errors))[k - 1]) if 0 < k <= n else None


def band_of(runs: list[dict[str, Any]], names: tuple[str, ...], coverage: float,
            factors: dict[str, float | None] | None = None, start: int = 0,
            cap: float | None = None) -> tuple[float | None, str, int, int]:
    """(half-width, group, runs, steps up) of the band at `coverage` from `runs` (validation
    runs: `generation`, `stack`, `family`, `loso_error`) for a layout of groups `names`
    (`group_names`), from level `start` on: the nearest group with `needed(coverage)` runs,
    × its `factors` entry (1 without; a group whose entry is None — its sources' coverage
    could not be calibrated — is passed over) × `WIDEN` per step up. (None, group, runs, -1)
    when none qualifies or the band is wider than `cap`: not validated."""
    for step in range(start, len(names)):
        name = names[step]
        errors = [r["loso_error"] for r in runs if _names(r)[step] == name]
        factor = (factors or {}).get(name, 1.0)
        if len(errors) >= needed(coverage) and factor is not None:
            quantile = conformal(errors, coverage)
            assert quantile is not None
            width = quantile * factor * WIDEN ** (step - start)
            if cap is not None and width > cap:
                return None, name, len(errors), -1
            return width, name, len(errors), step
    return None, names[start], 0, -1


def cap_for(coverage: float) -> float:
    """The widest band still given at `coverage`: `MAX_BAND` for the printed one, ±100 % (a
    band that admits a zero step time) at 95 %."""
    return MAX_BAND if coverage == COVERAGE else 1.0


def bands(runs: list[dict[str, Any]], names: tuple[str, ...],
          factors: dict[str, dict[str, float | None]] | None = None
          ) -> dict[float, tuple[float | None, str, int, int]]:
    """`band_of` at each of `COVERAGES` (`factors` by coverage as "0.8"; capped by `cap_for`),
    the 95 % band never narrower than the 80 % one (a parent's can be) and none without
    it."""
    out = {c: band_of(runs, names, c, (factors or {}).get(f"{c:g}"), cap=cap_for(c))
           for c in COVERAGES}
    low, high = out[COVERAGES[0]], out[COVERAGES[-1]]
    if low[0] is None:
        out[COVERAGES[-1]] = (None, high[1], high[2], -1)
    elif high[0] is not None and high[0] < low[0]:
        out[COVERAGES[-1]] = low
    return out


def _factors() -> dict[str, dict[str, float | None]]:
    """Per coverage and group, the widening that makes its LOSO coverage nominal."""
    return validation_data().get("band_factors", {})


def uncertainty(accelerator: str, stack: str, layout: Any, train: Any,
                calibration: Any = None) -> Uncertainty:
    """The band of one layout's predicted step time (`layout`: a `Layout`; `train`: a
    `TrainSpec`; `calibration`: the constants it was timed with, default the built-in ones)."""
    runs = validation_data()["runs"]
    names = group_names(generation(accelerator), stack,
                        family(layout.tp, layout.pp, layout.cp, layout.ep, layout.zero))
    missing = unvalidated(accelerator, stack, layout, train, calibration)
    extra = PER_FEATURE * len(missing)
    found = bands(runs, names, _factors())
    width, group, n, step = found[COVERAGE]
    band = None if width is None else round(width + extra, 4)
    if band is None:
        why = (f"the out-of-sample errors of {group} ({n} runs) exceed ±{MAX_BAND:.0%}" if n
               else f"no group of published runs on {stack} has {needed(COVERAGE)} runs whose "
                    "sources cover each other")
        return Uncertainty(None, names[0], 0, missing, None, "", COVERAGE, False,
                           f"{why}: not validated")
    factor = _factors().get(f"{COVERAGE:g}", {}).get(group) or 1.0
    basis = (f"{COVERAGE:.0%} conformal quantile of the {n} leave-one-source-out errors of "
             f"{group}" + (f", × {factor:g} for its sources' spread" if factor > 1 else "")
             + (f", × {WIDEN:g}^{step} (the nearest group with enough runs whose sources "
                "cover each other)" if step else "")
             + (f", + {PER_FEATURE:.0%} × {len(missing)} unvalidated" if missing else ""))
    high, group_95 = found[COVERAGES[-1]][:2]
    return Uncertainty(band, group, n, missing, None if high is None else round(high + extra, 4),
                       group_95 if high is not None else "", COVERAGE, True, basis)


def bounds(total: float, sure: dict[str, Any] | None) -> dict[str, float | None]:
    """{low, high, low_95, high_95}: seconds of the bands around `total` (None where the
    band is; `sure`: an `Uncertainty` as a dict)."""
    out: dict[str, float | None] = {}
    for key, suffix in (("band", ""), ("band_95", "_95")):
        width = sure.get(key) if sure else None
        out["low" + suffix] = None if width is None else total * max(0.0, 1 - width)
        out["high" + suffix] = None if width is None else total * (1 + width)
    return out


@cache
def _pair_errors() -> dict[tuple[str, ...], list[float]]:
    """|predicted ratio / published ratio − 1| of every pair of runs from the same source in
    the same group, keyed by the group's names (`group_names`)."""
    by_cell: dict[tuple[str, ...], list[float]] = {}
    for run in validation_data()["runs"]:
        by_cell.setdefault((run["source"], *_names(run)), []).append(run["loso_error"])
    out: dict[tuple[str, ...], list[float]] = {}
    for (_, *names), errors in by_cell.items():
        pairs = [abs((1 + a) / (1 + b) - 1) for a, b in itertools.combinations(errors, 2)]
        out.setdefault(tuple(names), []).extend(pairs)
    return out


def resolution(accelerator: str, stack: str) -> tuple[float, str]:
    """(relative resolution, its basis): how far apart two predicted step times must be for
    the model to order them. A source that measured several runs of one group measured them
    the same way, so the error of a predicted *ratio* is what ranking layouts relies on:
    the `COVERAGE` quantile of |(1+e_a)/(1+e_b) − 1| over such pairs (LOSO errors) on this
    generation and stack, else this stack, else all runs."""
    pairs = _pair_errors()
    gen = generation(accelerator)
    for name, keep in ((f"{gen} · {stack}", lambda k: k[1] == f"{gen} · {stack}"),
                       (stack, lambda k: k[2] == stack), ("all runs", lambda k: True)):
        errors = [e for key, values in pairs.items() if keep(key) for e in values]
        if len(errors) >= MIN_PAIRS or name == "all runs":
            value = float(np.quantile(errors, COVERAGE))
            return round(value, 4), (f"{COVERAGE:.0%} of {len(errors)} same-source pairs of "
                                     f"published runs ({name}) have their step-time ratio "
                                     f"predicted within it")
    raise AssertionError("unreachable")


def unvalidated(accelerator: str, stack: str, layout: Any, train: Any,
                calibration: Any = None) -> tuple[str, ...]:
    """The features of this layout outside the validated ground (`data/validation.json`
    "ground": what any validation run on this stack measured), and an attention kernel no
    benchmark measured on this accelerator (timed with another kernel's curve), one phrase
    each."""
    ground = validation_data()["ground"]
    mine = ground.get("stacks", {}).get(stack)
    out = list(_borrowed_kernel(accelerator, train.settings().attention, calibration))
    if generation(accelerator) not in ground["generations"]:
        out.append(f"{generation(accelerator)} GPUs")
    elif accelerator.split("@")[0] in BORROWED:
        out.append(f"{accelerator} GPUs (timed with "
                   f"{get_accelerator(accelerator.split('@')[0]).calibration_name}'s constants)")
    if mine is None:
        return (*out, f"the {stack} stack")
    settings = train.settings()
    if layout.pp > 1 and layout.schedule not in mine["schedules"]:
        out.append(f"the {layout.schedule} schedule")
    if layout.cp > 1 and (not mine["cp_seq"] or train.seq_len < mine["cp_seq"]):
        floor = f" below {mine['cp_seq'] // 1024}k tokens" if mine["cp_seq"] else ""
        out.append(f"context parallelism{floor}")
    elif layout.cp > 1 and layout.cp_kind not in mine["cp_kinds"]:
        out.append(f"{layout.cp_kind} context parallelism")
    for axis in ("tp", "pp", "cp", "ep"):
        if getattr(layout, axis) > mine[f"max_{axis}"] and not (axis == "cp" and layout.cp > 1
                                                                  and not mine["cp_seq"]):
            out.append(f"{axis}={getattr(layout, axis)} (validated up to {mine[f'max_{axis}']})")
    if layout.zero not in mine["zero"]:
        out.append(f"ZeRO-{layout.zero}")
    if layout.recompute not in mine["recompute"]:
        out.append(f"{layout.recompute} recompute")
    if settings.tp_overlap != "none" and layout.tp > 1 and \
            settings.tp_overlap not in mine["tp_overlap"]:
        out.append(f"{settings.tp_overlap} TP overlap")
    if settings.compile and not mine["compile"]:
        out.append("torch.compile")
    return tuple(out)


def _borrowed_kernel(accelerator: str, kernel: str, calibration: Any) -> tuple[str, ...]:
    """("<kernel> attention (no kernel benchmark on <accelerator>: timed with …)",) when
    `Calibration.attention_curve` borrows another kernel's curve for `kernel` (a stated
    fraction of another kernel, FlexAttention's of FlashAttention-2, is not a borrowing)."""
    if kernel == "math":
        return ()
    if calibration is None:
        calibration = default_calibration(get_accelerator(accelerator).calibration_name)
    curve, factor = calibration.attention_curve(kernel)
    if curve == kernel or factor != (1.0, 1.0):
        return ()
    used = f"{curve}'s curve" if curve else "the generic attention efficiency"
    return (f"{kernel} attention (no kernel benchmark on {accelerator}: timed with {used})",)
