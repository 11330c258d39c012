"""How sure a predicted step time is: a band from the validation residuals of the nearest group
of published runs, and what the layout relies on that no validation run measured.

`benchmarks/validate_published.py` predicts every published run of the validation set and
writes `data/validation.json`: per run its group (accelerator generation, stack, parallelism
family) and its leave-one-source-out error (the constants fitted without that run's source),
plus the validated ground (which schedules, context-parallel sequence lengths, ... any run
measured). `uncertainty` takes the group that matches the layout most closely and widens the
band for every step away from it and for every feature outside that ground:

    band = q90(|LOSO errors| of the nearest group with ≥ 3 runs) × 1.5^(relaxations)
           + 5 % per unvalidated feature

docs/concepts/step-time.md explains the groups and the widening rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from shardwise.calibration import default_calibration
from shardwise.hardware import generation, get_accelerator

__all__ = ["Uncertainty", "family", "generation", "uncertainty", "validation_data"]

MIN_RUNS = 3  # a group with fewer runs says too little: relax to the next one
WIDEN = 1.5  # per relaxation step (group → same stack and hardware → same stack → all)
PER_FEATURE = 0.05  # per feature no validation run measured
QUANTILE = 0.9


@dataclass(frozen=True)
class Uncertainty:
    """A band around a predicted step time (`low`, `high`: relative, e.g. 0.06 = ±6 %), the
    group of validation runs it comes from, how many runs that group has, and the features of
    the layout that no validation run measured (`unvalidated`, one phrase each)."""

    band: float
    group: str
    runs: int
    unvalidated: tuple[str, ...] = field(default=())

    @property
    def validated(self) -> bool:
        return not self.unvalidated

    def to_dict(self) -> dict[str, Any]:
        return {"band": self.band, "group": self.group, "runs": self.runs,
                "unvalidated": list(self.unvalidated)}


def family(tp: int, pp: int, cp: int, ep: int, zero: int) -> str:
    """The parallelism family: the non-trivial axes, e.g. "tp+pp", "fsdp", "dp"."""
    parts = [name for name, on in (("tp", tp > 1), ("pp", pp > 1), ("cp", cp > 1),
                                   ("ep", ep > 1), ("fsdp", zero == 3)) if on]
    return "+".join(parts) or "dp"


@cache
def validation_data() -> dict[str, Any]:
    """`data/validation.json` (written by benchmarks/validate_published.py)."""
    text = resources.files("shardwise").joinpath("data/validation.json").read_text()
    return json.loads(text)


def _quantile(errors: list[float]) -> float:
    return float(np.quantile(np.abs(errors), QUANTILE))


def uncertainty(accelerator: str, stack: str, layout: Any, train: Any,
                calibration: Any = None) -> Uncertainty:
    """The band of one layout's predicted step time (`layout`: a `Layout`; `train`: a
    `TrainSpec`; `calibration`: the constants it was timed with, default the built-in ones)."""
    data = validation_data()
    runs = data["runs"]
    gen = generation(accelerator)
    fam = family(layout.tp, layout.pp, layout.cp, layout.ep, layout.zero)
    levels = (
        (f"{gen} · {stack} · {fam}", lambda r: (r["generation"], r["stack"], r["family"])
         == (gen, stack, fam)),
        (f"{gen} · {stack}", lambda r: (r["generation"], r["stack"]) == (gen, stack)),
        (f"{stack}", lambda r: r["stack"] == stack),
        ("all runs", lambda r: True),
    )
    groups = [(name, [r["loso_error"] for r in runs if match(r)]) for name, match in levels]
    step = next(i for i, (_, errors) in enumerate(groups)
                if len(errors) >= MIN_RUNS or i == len(groups) - 1)
    name, errors = groups[step]
    missing = unvalidated(accelerator, stack, layout, train, calibration)
    band = _quantile(errors) * WIDEN ** step + PER_FEATURE * len(missing)
    return Uncertainty(round(band, 4), name, len(errors), missing)


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
