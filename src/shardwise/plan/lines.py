"""Reductions over the planner's broadcast grid (rows × (sp, recompute) columns) that the
pruned search (`plan.prune`) runs once or once per round: small codes of an axis per line,
the lines grouped by code, the least value per line and per code, dense ids of combinations,
and the `top`-th best step time (of the families' bests when folding, `rank.SECOND_ORDER`).
Each returns the numbers the plain numpy reduction would, in fewer passes over the grid."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwise.layout import CP_KINDS

# the fields that name a family (`rank._FIRST_ORDER`): all but zero_group and the partition
_PAIR_FAMILY = ("tp", "pp", "cp", "ep", "etp", "cp_kind", "ulysses", "micro_batch")
_ROW_FAMILY = ("schedule", "chunks", "zero")


def _dense_ids(columns: list[np.ndarray]) -> np.ndarray:
    """Ids 0..k-1 of the distinct rows of `columns` (1-D arrays of one length), in the rows'
    lexicographic order (`np.unique`'s): small integer columns by their offset from the
    least value (their rank among the values present where those are sparse), the ids by a
    table of the codes present (`_ranks`)."""
    code = np.zeros(len(columns[0]), dtype=np.int64)
    for column in columns:
        low, high = (int(column.min()), int(column.max())) if len(column) else (0, 0)
        if column.dtype.kind in "iu" and high - low < 1 << 16:
            shifted = column.astype(np.int64) - low
            if high - low > 256:  # sparse values (ZeRO groups, micro-batches): their ranks
                shifted = _ranks(shifted)
            code = code * (int(shifted.max(initial=0)) + 1) + shifted
        else:
            values, inverse = np.unique(column, return_inverse=True)
            code = code * len(values) + inverse.ravel()
        if code.max(initial=0) > 2**40:
            code = _ranks(code)
    return _ranks(code)


def _one_of_each(ids: np.ndarray) -> np.ndarray:
    """A position of each id 0..k-1 of dense `ids` (`_dense_ids`; the last), in id order:
    `np.unique(ids, return_index=True)[1]` up to which of equal rows, without its sort."""
    at = np.zeros(int(ids.max(initial=-1)) + 1, dtype=np.int64)
    at[ids] = np.arange(len(ids))
    return at


def _ranks(code: np.ndarray) -> np.ndarray:
    """`np.unique(code, return_inverse=True)[1]` of non-negative int64 codes: through a table
    of the codes present where the codes are few enough to index one."""
    top = int(code.max(initial=0))
    if top > 4 * len(code) + 1024:
        return np.unique(code, return_inverse=True)[1].ravel()
    present = np.zeros(top + 1, dtype=bool)
    present[code] = True
    return (np.cumsum(present) - 1)[code]


def _codes(cand: dict[str, Any], axis: str) -> np.ndarray:
    """Small non-negative codes of `axis` on the grid ((rows, 1) or (1, cols)); cp_kind of
    layouts without context parallelism gets a code of its own (no alternative)."""
    value = np.asarray(cand[axis], dtype=np.int64)
    if axis == "cp_kind":
        value = np.where(np.asarray(cand["cp"]) > 1, value, len(CP_KINDS))
    # int16 where the values allow (GPU counts ≤ 16,384): a quarter of the bytes to gather
    return value.astype(np.int16) if value.max(initial=0) < 1 << 15 else value


class _Runs:
    """Values per row reduced per run of rows (`starts`: where each run begins; the grid's
    runs of ZeRO variants share every other row axis). The last line reduced is kept: the
    groups of several axes reduce the same line in turn."""

    def __init__(self, starts: np.ndarray) -> None:
        self.starts = starts
        self._last: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def reduce(self, ufunc: np.ufunc, value: np.ndarray) -> np.ndarray:
        """`ufunc.reduceat(value, starts)` (`value` non-empty), of the same `value` once."""
        last = self._last.get(ufunc.__name__)
        if last is None or last[0] is not value:
            last = self._last[ufunc.__name__] = (value, ufunc.reduceat(value, self.starts))
        return last[1]


class _Groups:
    """A line's positions (an axis' code per row, or per column) grouped by code: the codes
    present, the least value per code and the first position of each code's least (no sort:
    `ufunc.at`). `runs`: the rows' runs (`_Runs`), where each run shares its code: values
    are reduced per run first."""

    def __init__(self, code: np.ndarray, runs: _Runs | None = None) -> None:
        self.on_rows = code.shape[1] == 1
        line = code[:, 0] if self.on_rows else code[0]
        self.runs = runs
        self.line = line if runs is None else line[runs.starts]
        self.size = int(self.line.max()) + 1 if len(self.line) else 0

    def present(self, valid: np.ndarray) -> list[int]:
        """The codes of the positions where `valid` (one per position) holds, ascending."""
        if self.runs is not None and len(valid):
            valid = self.runs.reduce(np.logical_or, valid)
        return [int(v) for v in np.flatnonzero(np.bincount(self.line[valid],
                                                           minlength=self.size))]

    def min(self, value: np.ndarray) -> np.ndarray:
        """The least `value` (one per position of the line) of each code `0..max` (inf
        where none)."""
        if self.runs is not None and len(value):
            value = self.runs.reduce(np.minimum, value)
        per = np.full(self.size, np.inf, dtype=value.dtype)  # one dtype: ufunc.at's fast loop
        np.minimum.at(per, self.line, value)
        return per.astype(np.float64)

    def firsts(self, value: np.ndarray, target: np.ndarray) -> dict[int, int]:
        """For each code whose `target` (one per code) is finite, the first position of the
        line with that code whose `value` is its target."""
        target = np.where(np.isfinite(target), target, np.nan)  # nan: equal to nothing
        reduced = value if self.runs is None else self.runs.reduce(np.minimum, value)
        hits = np.flatnonzero(reduced == target[self.line])
        codes, at = np.unique(self.line[hits], return_index=True)
        out = {int(c): int(hits[i]) for c, i in zip(codes, at, strict=True)}
        if self.runs is not None:  # the run's first position of its least
            starts = self.runs.starts
            ends = np.append(starts[1:], len(value))
            out = {c: int(starts[r]) + int(np.argmax(
                value[starts[r]:ends[r]] == target[c])) for c, r in out.items()}
        return out


class _Least:
    """The least value of a grid per row and per column, and where (`_row_argmin`,
    `_col_argmin` of the grid, given as `rows` and `cols`): for each code of an axis, the
    flat index of a cell of least value (`cells`)."""

    def __init__(self, rows: tuple[np.ndarray, np.ndarray], cols: tuple[np.ndarray, np.ndarray]
                 ) -> None:
        self.n_cols = len(cols[0])
        self.low = {True: rows[0], False: cols[0]}
        self.arg = {True: rows[1], False: cols[1]}

    def cells(self, groups: _Groups, present: list[int]) -> list[int]:
        on_rows = groups.on_rows
        low, arg = self.low[on_rows], self.arg[on_rows]
        first = groups.firsts(low, groups.min(low))
        out = []
        for v in present:
            if v not in first:
                continue
            at = first[v]
            out.append(at * self.n_cols + int(arg[at]) if on_rows
                       else int(arg[at]) * self.n_cols + at)
        return out


def _row_min(grid: np.ndarray) -> np.ndarray:
    """`grid.min(axis=1)` of a grid of few columns, a column at a time (numpy reduces a
    short inner axis slowly); the same numbers."""
    out = grid[:, 0].copy()
    for j in range(1, grid.shape[1]):
        np.minimum(out, grid[:, j], out=out)
    return out


def _row_any(grid: np.ndarray) -> np.ndarray:
    """`grid.any(axis=1)` of a boolean grid of few columns, a column at a time."""
    out = grid[:, 0].copy()
    for j in range(1, grid.shape[1]):
        np.logical_or(out, grid[:, j], out=out)
    return out


def _col_min(grid: np.ndarray) -> np.ndarray:
    """`grid.min(axis=0)` of a grid of few columns, a column at a time (numpy reduces the
    outer axis of a short inner one several times slower); the same numbers."""
    return np.array([grid[:, j].min() for j in range(grid.shape[1])], dtype=grid.dtype)


def _col_any(grid: np.ndarray) -> np.ndarray:
    """`grid.any(axis=0)` of a boolean grid of few columns, a column at a time (each stops
    at its first true)."""
    return np.array([grid[:, j].any() for j in range(grid.shape[1])], dtype=bool)


def _row_argmin(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(`grid.min(axis=1)`, `grid.argmin(axis=1)`: the first column of the least) of a grid of
    few columns, a column at a time; the same numbers."""
    low, arg = grid[:, 0].copy(), np.zeros(grid.shape[0], dtype=np.intp)
    for j in range(1, grid.shape[1]):
        less = grid[:, j] < low
        np.copyto(low, grid[:, j], where=less)
        arg[less] = j
    return low, arg


def _col_argmin(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(`grid.min(axis=0)`, `grid.argmin(axis=0)`) of a grid of few columns, a column at a
    time (numpy copies the grid to reduce its outer axis); the least is the value at the
    first index of the least, so the same numbers."""
    arg = np.array([int(np.argmin(grid[:, j])) for j in range(grid.shape[1])], dtype=np.intp)
    return grid[arg, np.arange(grid.shape[1])], arg


def _pair_family(cand: dict[str, Any]) -> np.ndarray:
    """The pairs' fields of a family (`_PAIR_FAMILY`) as one id per pair."""
    return _dense_ids([np.asarray(cand["_pairs"][k]) for k in _PAIR_FAMILY])


def _kth_best(cand: dict[str, Any], rows: np.ndarray, cols: np.ndarray, total: np.ndarray,
              top: int, fold: bool, of_pair: np.ndarray | None = None) -> float:
    """The `top`-th smallest step time of the evaluated fitting layouts (of their families'
    bests when folding); inf when there are fewer. `of_pair`: `_pair_family(cand)`."""
    if not len(total):
        return np.inf
    if fold:
        # the pair's fields of a family as one id per pair (few pairs), then the row's and
        # the column's: the same families as the fields one by one
        if of_pair is None:
            of_pair = _pair_family(cand)
        keys = [of_pair[np.asarray(cand["pair"])[rows, 0]]]
        keys += [np.asarray(cand[k])[rows, 0] for k in _ROW_FAMILY]
        keys += [np.asarray(cand[k])[0, cols] for k in ("sp", "recompute")]
        family = _dense_ids(keys)
        best = np.full(int(family.max()) + 1, np.inf)
        np.minimum.at(best, family, total)
    else:
        best = total
    if len(best) < top:
        return np.inf
    return float(np.partition(best, top - 1)[top - 1])
