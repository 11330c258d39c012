"""The pruned evaluation: the exhaustive search's answer from a fraction of the step times.

Every valid layout's peak memory is evaluated (in blocks of one pp and chunk count, so only
their stages are), so the counts of fitting layouts, the least memory per axis value and the
variants stay exact. A step time is at least its terms that depend on neither the ZeRO stage
nor its group (`evaluate.step_floor`, once per run of ZeRO variants) plus its DP/ZeRO traffic
where the stack does not overlap it (`evaluate.dp_floor`, per row), so a layout whose floor
is above every threshold the report asks about — the `top`-th row's step time plus the 1 %
the simplest layout may lose, each axis value's best, the fastest layout that does not fit, a
ranked layout's own — cannot change it. The thresholds come from timed layouts (upper bounds
of the exact ones); the layouts under them are timed best first until none is left, and the
ranking (`rank.Ranking`) runs on them as on all. A rank that needs more than `POSITION_CELLS`
step times is given as the bounds it lies between. Details: docs/concepts/planner.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import CP_KINDS, Layout, TrainSpec
from shardwise.plan.evaluate import (
    _THREADS,
    RunGeometries,
    cell_terms,
    dp_floor,
    flat_cells,
    memory_grid,
    run_shapes,
    shared_costs,
    step_floor,
)
from shardwise.plan.grid import _Rejections, _structures, partition_ends
from shardwise.plan.lines import (
    _PAIR_FAMILY,
    _ROW_FAMILY,
    _codes,
    _col_any,
    _col_argmin,
    _col_min,
    _dense_ids,
    _Groups,
    _kth_best,
    _Least,
    _one_of_each,
    _pair_family,
    _row_any,
    _row_argmin,
    _row_min,
    _Runs,
)
from shardwise.plan.space import SearchSpace

# valid layouts above which `plan` prunes: below it timing every layout is as fast or
# faster (benchmarks/bench_planner.py's third table, 2026-12-06; from 120 K to 370 K the
# faster one depends on the grid: its pipeline depths cost the pruned search most)
PRUNE_ABOVE = 250_000
BLOCK_CELLS = 1 << 17  # cells per floor block and timed piece (bounds the temporaries)
# cells per memory block: its per-run work is many short numpy calls, which hold the GIL
# between them; blocks this large keep the threads in numpy's loops (2 M cells: ~16 MB per
# float64 temporary)
MEMORY_BLOCK_CELLS = 1 << 21
_THREAD_CELLS = 16_384  # the least cells a thread times at once (below: not worth a start)
SEED_CELLS = 4_096  # the first step times: the fitting layouts of smallest floor
POSITION_CELLS = 100_000  # step times a rank may add before it is reported as bounds
MARGIN = 1e-6  # relative slack on every threshold (the ranking's ties are 1e-9)
_KEYS = ("total", "memory", "bubble", "t_forward", "t_backward", "t_wgrad")
_ROW_AXES = ("tp", "pp", "cp", "ep", "cp_kind", "zero", "schedule", "micro_batch")
_COL_AXES = ("recompute", "sp")
# the row axes that are the same on every row of a run of ZeRO variants (all but zero)
_RUN_AXES = tuple(axis for axis in _ROW_AXES if axis != "zero")


# the search's resident memory: the interpreter and its modules, and per cell of
# `SearchSize.cells` (benchmarks/bench_planner.py's MoE rows, 2026-12-05: peak RSS less the
# base over the cells, 17-27 B; rounded up)
BASE_BYTES = 150e6
BYTES_PER_CELL = 30.0


@dataclass(frozen=True)
class SearchSize:
    """How big a search is before it runs (`search_size`): grid points, an upper bound on
    the cells it holds (the valid structures × every other axis' values), and the peak
    resident bytes that predicts."""

    grid: int
    cells: int
    bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"grid": self.grid, "cells": self.cells, "bytes": self.bytes}


def search_size(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                space: SearchSpace | None = None) -> SearchSize:
    """The size of `plan`'s search from the grid's first two levels (the structures and the
    micro-batches that split the batch; well under a second): what a server checks before
    it accepts a search (`--fix`/`--max` shrink it). `bytes = BASE_BYTES + BYTES_PER_CELL ·
    cells`."""
    if train.global_batch is None:
        raise ShardwiseError("planning needs a global batch (e.g. --global-batch 4M-tokens)")
    space = space or SearchSpace()
    rows, grid, axes, _ = _structures(model, cluster, train, space, _Rejections())
    per = math.prod(len(axes[k]) for k in ("schedule", "zero", "sp", "recompute"))
    dp = np.array([row[4] for row in rows], dtype=np.int64)[:, None]
    mb = np.array(axes["micro_batch"], dtype=np.int64)[None, :]
    cells = int((train.global_batch % (dp * mb) == 0).sum()) * per if len(rows) else 0
    return SearchSize(grid, cells, BASE_BYTES + BYTES_PER_CELL * cells)


class BoundBroken(Exception):
    """A step time below its floor: the step model changed; search exhaustively."""


@dataclass
class Pruned:
    """The evaluated layouts (flat, in the exhaustive search's order) and the full grid's
    aggregates the report needs."""

    cand: dict[str, Any]
    terms: dict[str, Any]  # `memory` only where the report reads it (`_State.memory_of`)
    fits: np.ndarray
    n_valid: int
    n_fit: int
    values: dict[str, list[int]]  # each alternative axis' values among valid layouts
    least: dict[tuple[str, int], float]  # least memory of the valid layouts with axis = value
    evaluated: int  # step times evaluated
    grid: dict[str, Any] = field(repr=False, default_factory=dict)


def prune_evaluate(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                   cand: dict[str, Any], calib: Calibration, budget: float, top: int,
                   fold: bool, within: float, layouts: tuple[Layout | None, ...] = ()
                   ) -> Pruned:
    """The pruned evaluation of the grid `cand` (`grid._enumerate`) for a search that shows
    `top` rows (`fold`: one per family), the simplest layout `within` of the best, and the
    ranks of `layouts` (module docstring). Raises `BoundBroken` if a step time is under its
    floor."""
    valid = cand["_valid"]
    n_rows, n_cols = valid.shape
    shared = shared_costs(model, cluster, train, cand, calib)
    geometries = RunGeometries(model, cand)
    step = max(1, MEMORY_BLOCK_CELLS // n_cols)
    blocks = [rows[start:start + step] for rows in geometries.by_stages()
              for start in range(0, len(rows), step)]
    # the memory grid is reduced block by block, never held whole: which cells fit, the
    # least per row and per column, and the leanest cell (least, then first row-major)
    fits = np.zeros(valid.shape, dtype=bool)
    row_low = np.full(n_rows, np.inf)

    def fill(block: np.ndarray) -> tuple[np.ndarray, tuple[float, int]]:
        memory = memory_grid(model, train, cand, shared, block, geometries)
        np.putmask(memory, ~valid.take(block, axis=0), np.inf)
        fits[block] = memory <= budget
        row_low[block] = _row_min(memory)
        at = int(np.argmin(memory))  # the block's rows ascend: its first least cell
        return _col_min(memory), (float(memory.ravel()[at]),
                                    int(block[at // n_cols]) * n_cols + at % n_cols)

    with ThreadPoolExecutor(_THREADS) as pool:  # numpy's loops release the GIL
        # started, the floor's blocks first (the longer ones); meanwhile what needs neither
        floor_of = _floor(model, cluster, train, cand, shared, pool, geometries.first)
        pending = pool.map(fill, blocks)
        codes = {axis: _codes(cand, axis) for axis in (*_ROW_AXES, *_COL_AXES)}
        # a run's axes are reduced per run, then per code
        runs = _Runs(geometries.first)
        groups = {axis: _Groups(code, runs if axis in _RUN_AXES else None)
                  for axis, code in codes.items()}
        lines = {True: _row_any(valid), False: _col_any(valid)}  # per row, per column
        # cp_kind's code for layouts without context parallelism names no alternative
        values = {axis: [v for v in groups[axis].present(lines[groups[axis].on_rows])
                         if not (axis == "cp_kind" and v == len(CP_KINDS))] for axis in codes}
        floor = floor_of()
        reduced = list(pending)
    state = _State(model, cluster, train, cand, shared, floor, fits, valid)
    lines = {True: row_low, False: np.min([col for col, _ in reduced], axis=0)}
    least: dict[tuple[str, int], float] = {}
    for axis, present in values.items():
        per = groups[axis].min(lines[groups[axis].on_rows])
        least |= {(axis, v): float(per[v]) for v in present}
    del lines
    leanest = min(lean for _, lean in reduced)[1]
    del reduced  # the cells timed carry their memory (`cell_terms`)
    # seeds: the least memory (named when nothing fits), the ranked layouts, the fitting
    # layouts of least floor, and for each axis value the fitting layout of least floor and
    # the valid one of least floor that does not fit: every threshold below is then finite
    # from the first round on, and only falls
    seeds = [leanest]
    seeds += [hit for hit in (find_cell(cand, layout, model.n_layers) if layout else None
                              for layout in layouts) if hit is not None]
    least_of, over, smallest = _floor_lines(fits, floor)
    for axis, grouped in groups.items():
        seeds += least_of.cells(grouped, values[axis])
    seeds += [] if over is None else [over]
    seeds += list(smallest)
    state.add(np.unique(np.array(seeds, dtype=np.int64)))
    positions = [state.rank_threshold(layout) for layout in layouts]
    live = None
    while True:
        thresholds = state.thresholds(top, fold, within, codes, values, positions)
        if live is None:  # the cells under the first (loosest) thresholds; later ones fall
            live = _Live(state, codes, thresholds, geometries)
        need = live.needed(state, thresholds)
        if not len(need):
            break
        state.add(need)
    state.memory_of()
    idx = np.sort(state.index)
    cells = flat_cells(cand, *np.divmod(idx, n_cols))
    terms = {k: state.terms[k][np.argsort(state.index)] for k in _KEYS}
    return Pruned(cells, terms, fits.ravel()[idx], int(np.count_nonzero(valid)),
                  int(np.count_nonzero(fits)),
                  {a: [int(v) for v in vals] for a, vals in values.items()}, least, len(idx),
                  {"cand": cand, "fits": fits, "floor": floor, "evaluated": state.done,
                   "index": idx, "total": terms["total"]})


class _State:
    """The evaluated cells (flat grid indices) and their step-time terms."""

    def __init__(self, model: ModelSpec, cluster: Cluster, train: TrainSpec,
                 cand: dict[str, Any], shared: Any, floor: np.ndarray, fits: np.ndarray,
                 valid: np.ndarray) -> None:
        self.model, self.cluster, self.train, self.cand = model, cluster, train, cand
        self.shared, self.floor, self.fits, self.valid = shared, floor, fits, valid
        self.done = np.zeros(valid.shape, dtype=bool)
        self.index = np.zeros(0, dtype=np.int64)
        self.terms: dict[str, Any] = {k: np.zeros(0) for k in _KEYS}
        self.of_pair: np.ndarray | None = None

    def add(self, flat: np.ndarray) -> None:
        """Evaluate the valid, not yet evaluated cells `flat` (flat grid indices)."""
        flat = flat[self.valid.ravel()[flat] & ~self.done.ravel()[flat]]
        if not len(flat):
            return
        n_cols = self.valid.shape[1]
        rows, cols = np.divmod(flat, n_cols)
        new = {k: np.full(len(flat), np.nan) for k in _KEYS}  # memory: `memory_of`
        # pieces of at most `BLOCK_CELLS`, at least a few per thread when there are enough
        # cells: the step time is elementwise and, unlike the memory grid, evaluates no
        # stage one by one, so pipelines of every depth share a piece (the same numbers)
        step = min(BLOCK_CELLS, max(_THREAD_CELLS, -(-len(flat) // _THREADS)))
        chunks = [np.arange(start, min(start + step, len(flat)))
                  for start in range(0, len(flat), step)]

        def run(chunk: np.ndarray) -> dict[str, Any]:
            cells = flat_cells(self.cand, rows[chunk], cols[chunk])
            return cell_terms(self.model, self.cluster, self.train, cells, self.shared,
                              [k for k in _KEYS if k != "memory"])

        if len(chunks) > 1:
            with ThreadPoolExecutor(min(_THREADS, len(chunks))) as pool:
                results = list(pool.map(run, chunks))
        else:
            results = [run(chunk) for chunk in chunks]
        for chunk, terms in zip(chunks, results, strict=True):
            for k, value in terms.items():
                new[k][chunk] = value
        below = new["total"] < self.floor.ravel()[flat] * (1 - 1e-9)
        if below.any():
            raise BoundBroken(f"step time under its floor at cell {flat[below][0]}")
        self.done.ravel()[flat] = True
        self.index = np.concatenate([self.index, flat])
        self.terms = {k: np.concatenate([self.terms[k], new[k]]) for k in _KEYS}

    def memory_of(self) -> None:
        """The peak memory where the report reads it (`Pruned.terms`): of the fastest timed
        layouts that do not fit (ties all), or when nothing fits of every timed layout (the
        leanest among them)."""
        over = ~self.fits.ravel()[self.index]
        if not over.any():
            return
        total = self.terms["total"]
        if self.fits.any():
            over &= total == total[over].min()
        at = np.flatnonzero(over)
        rows, cols = np.divmod(self.index[at], self.valid.shape[1])
        self.terms["memory"][at] = cell_terms(self.model, self.cluster, self.train,
                                              flat_cells(self.cand, rows, cols), self.shared,
                                              ("memory",))["memory"]

    def thresholds(self, top: int, fold: bool, within: float, codes: dict[str, Any],
                   values: dict[str, Any], positions: list[float | None]
                   ) -> tuple[float, dict[str, np.ndarray], float]:
        """(the step time under which any fitting layout may be shown or rank a given layout,
        per axis the step time under which a fitting layout with each value may be that
        value's best, the step time under which a layout that does not fit may be the fastest
        such), from the layouts evaluated so far (each an upper bound of the exact one)."""
        n_cols = self.valid.shape[1]
        idx, total = self.index, self.terms["total"]
        rows, cols = np.divmod(idx, n_cols)
        fit = self.fits.ravel()[idx]
        if self.of_pair is None:  # the pairs' family ids, the same every round
            self.of_pair = _pair_family(self.cand)
        ahead = _kth_best(self.cand, rows[fit], cols[fit], total[fit], top, fold,
                          self.of_pair)
        fit_threshold = ahead * (1 + within) * (1 + MARGIN)  # inf: fewer rows than asked
        for threshold in positions:
            if threshold is not None:
                fit_threshold = max(fit_threshold, threshold)
        per_axis = {}
        for axis, code in codes.items():
            mine = code[rows, 0] if axis in _ROW_AXES else code[0, cols]
            best = np.full(int(code.max()) + 1, np.inf)
            np.minimum.at(best, mine[fit], total[fit])
            named = np.zeros(len(best), dtype=bool)
            named[values[axis]] = True  # cp_kind without context parallelism: no alternative
            per_axis[axis] = np.where(named, best * (1 + MARGIN), -np.inf)
        over = ~fit
        fastest_over = float(total[over].min()) * (1 + MARGIN) if over.any() else -np.inf
        return fit_threshold, per_axis, fastest_over

    def rank_threshold(self, layout: Layout | None) -> float | None:
        """The step time under which every fitting layout must be timed to rank `layout`
        exactly, unless that would take more than `POSITION_CELLS` step times."""
        hit = find_cell(self.cand, layout, self.model.n_layers) if layout else None
        if hit is None or not self.fits.ravel()[hit]:
            return None
        at = np.flatnonzero(self.index == hit)
        thr = float(self.terms["total"][at[0]]) * (1 + MARGIN)
        if int((self.fits & ~self.done & (self.floor <= thr)).sum()) > POSITION_CELLS:
            return None
        return thr


class _Live:
    """The unevaluated cells under the first thresholds, as flat arrays: the later rounds
    look only at them."""

    def __init__(self, state: _State, codes: dict[str, Any],
                 thresholds: tuple[float, dict[str, np.ndarray], float],
                 runs: RunGeometries) -> None:
        fit_threshold, per_axis, fastest_over = thresholds
        # a run's axes' thresholds are worked out per run
        run_thr = np.full(len(runs.first), fit_threshold)
        col_thr = np.full(state.valid.shape[1], fit_threshold)
        for axis, best in per_axis.items():
            if axis in _COL_AXES:
                col_thr = np.maximum(col_thr, best[codes[axis][0]])
            elif axis in _RUN_AXES:
                run_thr = np.maximum(run_thr, best[codes[axis][runs.first, 0]])
        row_thr = np.maximum(run_thr[runs.run], per_axis["zero"][codes["zero"][:, 0]])
        # float32 like the floor, rounded up (the thresholds only widen); rounding and the
        # cast are monotone, so scaling and casting each line before the maximum gives the
        # same numbers without a float64 grid
        row32, col32 = ((x * (1 + 1e-6)).astype(np.float32) for x in (row_thr, col_thr))
        over32 = np.float32(fastest_over * (1 + 1e-6))
        # only rows whose least floor is under their highest threshold can hold a live cell
        most = np.maximum(row32, max(col32.max(initial=-np.inf), over32))
        keep = np.flatnonzero(_row_min(state.floor) <= most)
        thr = np.maximum(row32[keep, None], col32[None, :])
        # (`take` of whole rows: several times numpy's fancy indexing of few columns)
        np.copyto(thr, over32, where=~state.fits.take(keep, axis=0))
        left = state.valid.take(keep, axis=0) & ~state.done.take(keep, axis=0) \
            & (state.floor.take(keep, axis=0) <= thr)
        at_row, cols = np.nonzero(left)
        rows = keep[at_row]
        self.index = rows * state.valid.shape[1] + cols
        del thr, left
        self.floor = state.floor.ravel()[self.index]
        self.fits = state.fits.ravel()[self.index]
        # each cell's combination of row-axis values among the live rows' (`rid`) and its
        # column: a threshold is worked out per combination and gathered once, not per axis
        # and cell
        starts = np.empty(len(rows), dtype=bool)  # `rows` ascend (flat indices do)
        starts[:1] = True
        np.not_equal(rows[1:], rows[:-1], out=starts[1:])
        lines, line_of = rows[starts], np.cumsum(starts) - 1
        # per run, then with each line's zero
        run_combo = _dense_ids([codes[axis][runs.first, 0] for axis in _RUN_AXES])
        combo = _dense_ids([run_combo[runs.run[lines]], codes["zero"][lines, 0]]) \
            if len(lines) else np.zeros(0, dtype=np.int64)
        at = lines[_one_of_each(combo)]  # a line of each combination
        self.rid = combo[line_of].astype(np.int32)
        self.cid = cols.astype(np.int16)
        self.codes = {axis: code[at, 0] if axis in _ROW_AXES else code[0]
                      for axis, code in codes.items()}
        self.done = np.zeros(len(self.index), dtype=bool)

    def needed(self, state: _State, thresholds: tuple[float, dict[str, np.ndarray], float]
               ) -> np.ndarray:
        """The next cells to time (flat grid indices), best first: at most as many as are
        timed, those furthest under their threshold; none when every threshold is
        settled."""
        fit_threshold, per_axis, fastest_over = thresholds
        row_thr = np.full(len(self.codes[_ROW_AXES[0]]), fit_threshold)
        col_thr = np.full(len(self.codes[_COL_AXES[0]]), -np.inf)
        for axis, best in per_axis.items():  # the maximum of them all, line by line
            if axis in _ROW_AXES:
                row_thr = np.maximum(row_thr, best[self.codes[axis]])
            else:
                col_thr = np.maximum(col_thr, best[self.codes[axis]])
        thr = np.where(self.fits, np.maximum(row_thr[self.rid], col_thr[self.cid]),
                       fastest_over)
        under = ~self.done & (self.floor <= thr)
        pick = np.flatnonzero(under)
        batch = max(len(state.index), SEED_CELLS)
        if len(pick) > batch:
            ratio = self.floor[pick] / thr[pick]
            pick = pick[np.argpartition(ratio, batch - 1)[:batch]]
        out = self.index[pick]
        under[pick] = False
        # the thresholds only fall: a cell above its own now is never needed; drop those
        if 2 * len(out) + 2 * int(under.sum()) < len(under):
            self.index, self.floor, self.fits = (x[under] for x in
                                                 (self.index, self.floor, self.fits))
            self.rid, self.cid = self.rid[under], self.cid[under]
            self.done = np.zeros(len(self.index), dtype=bool)
        else:
            self.done[pick] = True
        return out


def rank_bounds(pruned: Pruned, position: int | None, figure: float) -> tuple[int, int]:
    """(lowest, highest) rank of a layout whose rank among the evaluated layouts is `position`
    and whose figure is `figure`: the unevaluated fitting layouts whose floor is under it may
    each be ahead."""
    grid = pruned.grid
    unknown = grid["fits"] & ~grid["evaluated"] & (grid["floor"] <= figure * (1 + MARGIN))
    low = position or 1
    return low, low + int(unknown.sum())


def family_fits(pruned: Pruned, layout: Layout) -> int:
    """How many fitting layouts of the whole grid share `layout`'s family (they differ only
    in the ZeRO group or the stage partition)."""
    cand, fits = pruned.grid["cand"], pruned.grid["fits"]
    codes = layout.codes()
    count = 0
    for rows in _pair_rows(cand, {k: codes[k] for k in _PAIR_FAMILY}):
        mask = np.ones(len(rows), dtype=bool)
        for key in _ROW_FAMILY:
            mask &= np.asarray(cand[key])[rows, 0] == codes[key]
        col = (np.asarray(cand["sp"])[0] == codes["sp"]) \
            & (np.asarray(cand["recompute"])[0] == codes["recompute"])
        count += int(fits[rows[mask]][:, col].sum())
    return count


def find_cell(cand: dict[str, Any], layout: Layout, n_layers: int) -> int | None:
    """The flat grid index of `layout` (`rank._find`'s rule for its partition), or None."""
    codes = layout.codes()
    ends = partition_ends(cand, layout, n_layers)
    n_cols = np.shape(cand["sp"])[1]
    col = np.flatnonzero((np.asarray(cand["sp"])[0] == codes["sp"])
                         & (np.asarray(cand["recompute"])[0] == codes["recompute"]))
    if not len(col):
        return None
    for a, z in ends:
        pair = {k: codes[k] for k in (*_PAIR_FAMILY, "dp")} | {"first_less": a, "last_less": z}
        for rows in _pair_rows(cand, pair):
            mask = np.ones(len(rows), dtype=bool)
            for key in (*_ROW_FAMILY, "zero_group"):
                mask &= np.asarray(cand[key])[rows, 0] == codes[key]
            hits = rows[mask]
            if len(hits):
                return int(hits[0]) * n_cols + int(col[0])
    return None


def _floor(model: ModelSpec, cluster: Cluster, train: TrainSpec, cand: dict[str, Any],
           shared: Any, pool: ThreadPoolExecutor, first: np.ndarray
           ) -> Callable[[], np.ndarray]:
    """Each cell's floor, in float32 rounded down so that it stays a lower bound (inf where
    not valid): `evaluate.step_floor` once per run of rows that differ only in ZeRO (stage,
    group), plus each row's `evaluate.dp_floor` from its run's stage shape; in blocks of
    runs started on `pool`'s threads, assembled by the function returned (which waits for
    them). `first`: each run's first row (`evaluate.RunGeometries`)."""
    valid = cand["_valid"]
    n_rows, n_cols = valid.shape
    step = max(1, BLOCK_CELLS // n_cols)
    ends = np.append(first[1:], n_rows)  # each run's rows: first[i] to ends[i]
    per_run = np.empty((len(first), n_cols), dtype=np.float32)
    per_row = np.empty(n_rows, dtype=np.float32)

    def fill(start: int) -> None:
        block, stop = first[start:start + step], ends[start:start + step]
        shapes = run_shapes(model, cand, shared, block)
        per_run[start:start + step] = step_floor(model, cluster, train, cand, shared, block,
                                                 shapes) * (1 - 1e-6)
        rows = np.arange(block[0], stop[-1])
        of_row = np.repeat(np.arange(len(block)), stop - block)  # each row's run in `block`
        per_row[rows] = dp_floor(train, cand, shared, shapes, rows, of_row) * (1 - 1e-6)

    pending = pool.map(fill, range(0, len(first), step))

    def assemble() -> np.ndarray:
        list(pending)
        floor = np.repeat(per_run, ends - first, axis=0)  # the run's floor on each of its rows
        floor += per_row[:, None]
        floor[~valid] = np.inf
        return floor

    return assemble


def _floor_lines(fits: np.ndarray, floor: np.ndarray
                 ) -> tuple[_Least, int | None, np.ndarray]:
    """The seeds' reductions of the floors, over slices of rows on threads (numpy's loops
    release the GIL): of the fitting cells' floors (inf elsewhere) the least per row and per
    column and where (`_Least`), and the cells (flat, ascending, at most 4·`SEED_CELLS`)
    whose floor is at most the `SEED_CELLS`-th least; the first cell of least floor that
    does not fit (None when none is finite). Each slice keeps the cells at most its own
    `SEED_CELLS`-th least, which holds every cell at most the grid's."""
    n_rows, n_cols = fits.shape
    k = min(SEED_CELLS, int(np.count_nonzero(fits))) - 1
    step = max(1, 8 * BLOCK_CELLS // n_cols)  # rows per slice
    starts = range(0, n_rows, step)
    row_low = np.empty(n_rows, dtype=floor.dtype)
    row_arg = np.empty(n_rows, dtype=np.intp)

    def reduce(start: int) -> tuple[Any, Any, float, int, Any, Any]:
        stop = min(start + step, n_rows)
        fit = fits[start:stop]
        fit_floor = np.where(fit, floor[start:stop], np.float32(np.inf))
        row_low[start:stop], row_arg[start:stop] = _row_argmin(fit_floor)
        col = _col_argmin(fit_floor)
        over = np.where(fit, np.float32(np.inf), floor[start:stop]).ravel()
        at = int(np.argmin(over))
        flat = fit_floor.ravel()
        n_fit = int(np.count_nonzero(fit))
        if k < 0:
            few = np.zeros(0, dtype=np.int64)
        elif n_fit <= k + 1:  # every fitting cell of the slice
            few = np.flatnonzero(fit.ravel())
        else:
            few = np.flatnonzero(flat <= np.partition(flat, k)[k])
        return (col[0], col[1] + start, float(over[at]), start * n_cols + at,
                flat[few], few + start * n_cols)

    with ThreadPoolExecutor(_THREADS) as pool:
        parts = list(pool.map(reduce, starts))
    col_lows = np.array([p[0] for p in parts])
    first = np.argmin(col_lows, axis=0)  # the first slice of each column's least
    cols = np.arange(n_cols)
    least = _Least((row_low, row_arg), (col_lows[first, cols],
                                        np.array([p[1] for p in parts])[first, cols]))
    over_low = np.array([p[2] for p in parts])
    over = int(parts[int(np.argmin(over_low))][3]) if np.isfinite(over_low.min()) else None
    if k < 0:
        return least, over, np.zeros(0, dtype=np.int64)
    values, cells = (np.concatenate([p[i] for p in parts]) for i in (4, 5))
    smallest = cells[values <= np.partition(values, k)[k]][:4 * SEED_CELLS]
    return least, over, smallest


def _pair_rows(cand: dict[str, Any], want: dict[str, int]) -> list[np.ndarray]:
    """For each (structure, micro-batch) pair matching `want`, its grid rows (the grid's rows
    are sorted by pair)."""
    pairs = cand["_pairs"]
    mask = np.ones(len(pairs["tp"]), dtype=bool)
    for key, value in want.items():
        mask &= pairs[key] == value
    column = np.asarray(cand["pair"])[:, 0]
    want_pairs = np.flatnonzero(mask)
    # one search for all of them (each call would copy the strided column)
    lows, highs = (np.searchsorted(column, want_pairs, side) for side in ("left", "right"))
    return [np.arange(lo, hi) for lo, hi in zip(lows, highs, strict=True) if hi > lo]
