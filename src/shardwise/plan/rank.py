"""Ranking by the step time the report shows (or by the effective step time, step ÷ goodput:
`--rank-by goodput`), ties to the simpler layout, variants folded.

Each layout's figure is its step time times a factor that does not depend on the step time
(1, or 1/goodput). For uneven pipelines small enough to simulate the bubble comes from the
schedule simulator; the closed form bounds it above and the closed form less its bubble below,
so `Ranking.top` simulates, cheapest bound first, every layout that could still place among
the rows asked for (the makespan is monotone and homogeneous of degree 1 in the per-micro-batch
times: one simulation bounds every layout of the same schedule, stages and partition). Step
times within `TIE` are broken by `SIMPLER`; layouts differing only in `SECOND_ORDER` knobs fold
into one row. The proofs: docs/concepts/planner.md#ranking. Tiers and the recommendation:
`plan.tiers`."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.step import simulated_bubble
from shardwise.layout import (
    AXES,
    RECOMPUTE,
    RECOMPUTE_LIGHTEST_FIRST,
    Balanced,
    Layout,
    stage_extremes,
)
from shardwise.partition import fixed_or_balanced
from shardwise.plan.evaluate import _layout_of, simulated
from shardwise.plan.grid import partition_ends, searched_split
from shardwise.schedules.registry import DEFAULT_SCHEDULE, SCHEDULE_CODES, select

TIE = 1e-9
_TIE_DIGITS = 9  # TIE as decimal places of the figure over the fastest one
SIMPLER = ("cp", "pp", "tp", "ep", "cp_kind", "etp", "zero", "zero_group", "recompute", "sp",
           "schedule", "chunks", "partition", "micro_batch")
SECOND_ORDER = ("zero_group", "partition")
# the fields that name a layout apart from its second-order knobs (dp follows from the rest)
_FIRST_ORDER = ("tp", "pp", "cp", "ep", "etp", "cp_kind", "ulysses", "micro_batch", "schedule",
                "chunks", "zero", "sp", "recompute")


def rounded(totals: Any, fastest: float) -> Any:
    """Step times as the ranking compares them: over the fastest, to `TIE` (equal: a tie)."""
    return np.round(np.asarray(totals) / fastest, _TIE_DIGITS)


def _ordinal(columns: list[Any]) -> np.ndarray:
    """One int64 per row that sorts as the rows of `columns` do lexicographically (first
    column most significant): a mixed-radix number, renumbered when it would overflow."""
    code = np.zeros(len(columns[0]), dtype=np.int64)
    bound = 1
    for column in columns:
        col = np.asarray(column, dtype=np.int64)
        col = col - col.min() if len(col) else col
        radix = int(col.max()) + 1 if len(col) else 1
        if bound * radix >= 2**62:  # renumber the prefix 0..k-1, order kept
            _, code = np.unique(code, return_inverse=True)
            bound = int(code.max()) + 1
        code = code * radix + col
        bound *= radix
    return code


def _dense(columns: list[Any]) -> np.ndarray:
    """Ids 0..k-1 of the distinct rows of `columns`."""
    return np.unique(_ordinal(columns), return_inverse=True)[1].ravel()


def _searched(cand: dict[str, Any]) -> Any:
    """Which layouts have a searched, not the default, stage partition (`Balanced.default`)."""
    if "first_less" not in cand:
        return np.zeros_like(cand["pp"])
    return Balanced(cand["first_less"], cand["last_less"]).searched(cand["_n_layers"], cand["pp"])


def _ends(cand: dict[str, Any]) -> list[Any]:
    zero = np.zeros_like(cand["pp"])
    return [cand.get("first_less", zero), cand.get("last_less", zero)]


def simplicity(cand: dict[str, Any]) -> np.ndarray:
    """The tie-break `SIMPLER` as one sortable integer per layout (smaller: simpler)."""
    not_default = cand["schedule"] != SCHEDULE_CODES[DEFAULT_SCHEDULE]
    lighter = np.array([RECOMPUTE_LIGHTEST_FIRST.index(name) for name in RECOMPUTE])
    return _ordinal([cand["cp"], cand["pp"], cand["tp"], cand["ep"], cand["cp_kind"],
                     cand["etp"], cand["zero"], cand["zero_group"],
                     lighter[np.asarray(cand["recompute"])], cand["sp"], not_default,
                     cand["schedule"], cand["chunks"], _searched(cand), *_ends(cand),
                     cand["micro_batch"]])


def nontrivial_axes(cand: dict[str, Any]) -> np.ndarray:
    """How many of dp, tp, pp, cp, ep are > 1 (the explanation's "simplest layout")."""
    return np.sum([np.asarray(cand[axis]) > 1 for axis in AXES], axis=0)


class Ranking:
    """The fitting layouts of a search, ranked by their exact figure (module docstring).

    `cand` and `terms` are the flat arrays of the search (`grid._flatten`; terms `total`,
    `bubble`, `t_forward`, `t_backward`, `t_wgrad`); the exact figure is computed on demand.
    """

    def __init__(self, model: ModelSpec, cand: dict[str, Any], terms: dict[str, Any],
                 fits: np.ndarray, scale: Any = 1.0) -> None:
        self.model, self.cand, self.terms, self.fits = model, cand, terms, fits
        self.scale = np.broadcast_to(np.asarray(scale, dtype=float), fits.shape)
        upper = np.where(fits, terms["total"], np.inf)
        most = stage_extremes(model.n_layers, cand["pp"], cand["chunks"], _partition(cand))[0]
        uneven = most * cand["pp"] != model.n_layers
        self.pending = fits & simulated(cand) & uneven  # the figure is the simulator's
        self.known = upper.copy()  # exact, or (while pending) the closed form's upper bound
        self.lower = np.where(self.pending, upper - terms["bubble"], upper)
        self.simple = simplicity(cand)
        self.family = _dense([cand[k] for k in _FIRST_ORDER])
        # layouts whose simulations differ only in their per-micro-batch times
        self.group = _dense([cand["schedule"], cand["pp"], cand["chunks"], cand["m"],
                             *_ends(cand)])
        split = select(cand["schedule"], lambda info: info.splits_backward).astype(bool)
        t_b, t_w = terms["t_backward"], terms["t_wgrad"]
        # the simulator's action times, (layouts, 3): F, B (input gradient when split), W
        self.times = np.stack([np.broadcast_to(terms["t_forward"], t_b.shape),
                               np.where(split, t_b - t_w, t_b),
                               np.where(split, t_w, np.inf)], axis=1)
        self.busy = cand["m"] * (terms["t_forward"] + t_b)  # the busiest stage's work
        self.simulations = 0

    def figure(self, idx: Any) -> Any:
        """The ranked figure of layouts `idx`: the step time known × `scale`."""
        return self.known[idx] * self.scale[idx]

    def _simulate(self, i: int) -> None:
        """The exact figure of layout `i`, and the bound it gives its group (docstring)."""
        bubble = simulated_bubble(_layout_of(self.cand, i), int(self.cand["m"][i]),
                                  float(self.terms["t_forward"][i]),
                                  float(self.terms["t_backward"][i]),
                                  float(self.terms["t_wgrad"][i]), self.model.n_layers)
        base = self.known[i] - self.terms["bubble"][i]
        self.known[i] = self.lower[i] = base + bubble
        self.pending[i] = False
        self.simulations += 1
        same = np.nonzero((self.group == self.group[i]) & self.pending)[0]
        if len(same):
            with np.errstate(invalid="ignore"):  # inf/inf: a schedule without W
                ratios = self.times[same] / self.times[i]
                ratio, most = np.nanmin(ratios, axis=1), np.nanmax(ratios, axis=1)  # λ
            makespan = ratio * (bubble + self.busy[i])
            floor = self.known[same] - self.terms["bubble"][same] \
                + np.maximum(makespan - self.busy[same], 0.0)
            self.lower[same] = np.maximum(self.lower[same], floor)
            # times λ× layout i's: the whole timeline scales, the floor is the exact figure
            exact = same[most <= ratio * (1 + 1e-12)]
            self.known[exact] = self.lower[exact]
            self.pending[exact] = False

    def top(self, n: int, within: np.ndarray | None = None, fold: bool = True,
            refine: bool = True) -> np.ndarray:
        """The indices of the first `n` rows among the fitting layouts (`within` them), fastest
        first by the exact figure, ties `SIMPLER`; `fold`: one row per family (its best).
        `refine=False` ranks by the figures known so far (the closed form's upper bound for
        uneven pipelines not yet simulated) and makes only the returned rows' figures exact:
        cheap, and no row shown faster than it is (the explanation's alternatives)."""
        idx = np.nonzero(self.fits if within is None else self.fits & within)[0]
        if not len(idx):
            return idx
        # the best known figure of each row (family, when folding): a bound on its exact best
        row = np.unique(self.family[idx], return_inverse=True)[1] if fold else np.arange(len(idx))
        best = np.full(int(row.max()) + 1, np.inf)
        np.minimum.at(best, row, self.figure(idx))
        k = min(n, len(best)) - 1
        while True:
            threshold = float(np.partition(best, k)[k]) * (1 + 2 * TIE)
            open_ = self.pending[idx] & (self.lower[idx] * self.scale[idx] <= threshold) & refine
            if not open_.any():
                near = idx[self.figure(idx) <= threshold]
                rows = near[self._order(near)]
                if fold:
                    _, first = np.unique(self.family[rows], return_index=True)
                    rows = rows[np.sort(first)]
                rows = rows[:n]
                open_ = np.isin(idx, rows[self.pending[rows]])  # a row's own figure: exact
                if not open_.any():
                    return rows
            j = int(np.argmin(np.where(open_, self.lower[idx], np.inf)))
            self._simulate(int(idx[j]))
            best[row[j]] = min(best[row[j]], self.figure(idx[j]))

    def _order(self, idx: np.ndarray) -> np.ndarray:
        """Positions of `idx` in rank order: the figure to `TIE`, then `SIMPLER`."""
        known = self.figure(idx)
        return np.lexsort((self.simple[idx], rounded(known, known.min())))

    def variants(self, rows: np.ndarray) -> list[int]:
        """For each row, how many other fitting layouts its family holds."""
        counts = np.bincount(self.family[self.fits], minlength=int(self.family.max()) + 1)
        return [int(counts[self.family[i]]) - 1 for i in rows]

    def position(self, layout: Layout, n_layers: int) -> int | None:
        """1-based rank of `layout` among all fitting layouts (variants counted), by the figure
        known (exact within the ranked rows; elsewhere the closed form); None if absent."""
        hit = _find(self.cand, layout, n_layers)
        if hit is None or not self.fits[hit]:
            return None
        idx = np.nonzero(self.fits)[0]
        figure = rounded(self.figure(idx), self.figure(idx).min())
        mine = figure[idx == hit][0]
        ahead = (figure < mine) | ((figure == mine) & (self.simple[idx] < self.simple[hit]))
        return int(ahead.sum()) + 1


def _partition(cand: dict[str, Any]) -> Any:
    return fixed_or_balanced(cand) if "first_less" in cand else ()


def _find(cand: dict[str, Any], layout: Layout, n_layers: int) -> int | None:
    """The index of `layout` among the candidates (None if the search does not hold it)."""
    mask = np.ones(len(cand["tp"]), dtype=bool)
    for key, value in layout.codes().items():
        mask &= cand[key] == value
    if "first_less" in cand:
        ends = partition_ends(cand, layout, n_layers)
        mask &= np.any([(cand["first_less"] == a) & (cand["last_less"] == z) for a, z in ends]
                       or [False], axis=0)
    elif searched_split(layout, n_layers):  # a grid of the default split only
        return None
    hits = np.nonzero(mask)[0]
    return int(hits[0]) if len(hits) else None
