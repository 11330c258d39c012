"""What would make a layout fit: the smallest change of one knob at a time (`shardwise memory`,
the Memory page)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.arch import ModelSpec
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.estimate.uncertainty import generation
from shardwise.hardware import Cluster
from shardwise.layout import RECOMPUTE_LIGHTEST_FIRST, Layout, TrainSpec

FIT_KNOBS = ("zero", "recompute", "tp", "pp")


@dataclass(frozen=True)
class FitHint:
    """One change that makes the layout fit: `knob` set to `value` (the rest kept; dp takes
    the GPUs a larger tp or pp leaves), and the largest stage's bytes with it."""

    knob: str
    value: Any
    layout: Layout
    total: float
    budget: float

    def to_dict(self) -> dict[str, Any]:
        return {"knob": self.knob, "value": self.value, "change": f"{self.knob}={self.value}",
                "layout": self.layout.to_dict(), "short": self.layout.short(),
                "total_bytes": self.total, "budget_bytes": self.budget,
                "margin_bytes": self.budget - self.total}


def fit_hints(model: ModelSpec, cluster: Cluster, train: TrainSpec, layout: Layout,
              budget: float, formula: str = "generalised") -> list[FitHint]:
    """For each knob of `FIT_KNOBS` — ZeRO stage, recompute, TP, PP, in that order (the least
    disruptive first) — the smallest change of that knob alone after which the largest stage
    holds at most `budget` bytes (`training_memory_per_gpu`, as the planner counts fitting);
    knobs where no valid value fits are left out; [] when `layout` fits already. A larger tp
    or pp keeps cp and takes its GPUs from dp; a changed pp drops an explicit partition.
    `formula`: the activation count (`training_memory_per_gpu`)."""
    gen = generation(cluster.accelerator.calibration_name)
    if _largest(model, train, layout, formula, gen) <= budget:
        return []
    n, rest = cluster.n_gpus, layout.cp
    options: dict[str, list[Layout]] = {
        "zero": [layout.with_(zero=z) for z in range(layout.zero + 1, 4)],
        "recompute": [layout.with_(recompute=r) for r in RECOMPUTE_LIGHTEST_FIRST[
            RECOMPUTE_LIGHTEST_FIRST.index(layout.recompute) + 1:]],
        "tp": [layout.with_(tp=t, dp=n // (t * layout.pp * rest))
               for t in _larger_divisors(n // (layout.pp * rest), layout.tp)],
        "pp": [layout.with_(pp=p, dp=n // (layout.tp * p * rest), partition=())
               for p in _larger_divisors(n // (layout.tp * rest), layout.pp)],
    }
    hints = []
    for knob in FIT_KNOBS:
        for option in options[knob]:
            if option.problems(model, cluster, train):
                continue
            total = _largest(model, train, option, formula, gen)
            if total <= budget:
                hints.append(FitHint(knob, getattr(option, knob), option, total, budget))
                break
    return hints


def _largest(model: ModelSpec, train: TrainSpec, layout: Layout, formula: str, gen: str
             ) -> float:
    return max(stage.total for stage in training_memory_per_gpu(model, layout, train,
                                                                 formula=formula,
                                                                 generation=gen))


def _larger_divisors(n: int, above: int) -> list[int]:
    return [d for d in range(above + 1, n + 1) if n % d == 0]
