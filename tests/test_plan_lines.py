"""The pruned search's grid reductions (`plan.lines`) against numpy's own: dense ids of the
distinct rows of several columns are `np.unique(..., axis=0)`'s inverse."""

import numpy as np

from shardwise.plan.lines import _dense_ids, _Groups, _Runs
from shardwise.plan.prune import BLOCK_CELLS, SEED_CELLS, _floor_lines


def test_dense_ids_are_numpys_unique_rows_inverse():
    rng = np.random.default_rng(7)
    # small codes (negative too), GPU-count values, codes too wide to offset, wide int32
    # columns, several at once (the 2**40 re-ranking on the way)
    makers = [lambda n: rng.integers(-3, 5, n).astype(np.int16),
              lambda n: rng.choice([1, 2, 4, 8, 16_384, 2**20], n).astype(np.int64),
              lambda n: rng.integers(0, 2**40, n).astype(np.int64),
              lambda n: rng.integers(0, 70_000, n).astype(np.int32)]
    widths = set()
    for _ in range(150):
        n, k = int(rng.integers(1, 3_000)), int(rng.integers(1, 9))
        columns = [makers[int(rng.integers(0, len(makers)))](n) for _ in range(k)]
        expected = np.unique(np.stack(columns, axis=1).astype(np.int64), axis=0,
                             return_inverse=True)[1].ravel()
        got = _dense_ids(columns)
        assert np.array_equal(got, expected)
        widths.add(int(got.max()) + 1 == n)
    assert widths == {True, False}  # all rows distinct in some draws, repeats in others


def _floor_reference(fits: np.ndarray, floor: np.ndarray):
    """The seeds' reductions written plainly over the whole grid: numpy's min and first
    argmin per row and per column of the fitting floors, the first least non-fitting cell,
    the cells at most the SEED_CELLS-th least fitting floor (first 4·SEED_CELLS)."""
    fit_floor = np.where(fits, floor, np.float32(np.inf))
    over = np.where(fits, np.float32(np.inf), floor).ravel()
    k = min(SEED_CELLS, int(fits.sum())) - 1
    smallest = (np.flatnonzero(fit_floor.ravel() <= np.sort(fit_floor.ravel())[k])
                [:4 * SEED_CELLS] if k >= 0 else np.zeros(0, dtype=np.int64))
    return ((fit_floor.min(axis=1), fit_floor.argmin(axis=1)),
            (fit_floor.min(axis=0), fit_floor.argmin(axis=0)),
            int(over.argmin()) if np.isfinite(over.min()) else None, smallest)


def test_floor_lines_over_row_slices_are_the_whole_grids():
    """`prune._floor_lines` reduces slices of rows on threads and merges them: the same cells
    as over the whole grid, on grids of several slices (8·BLOCK_CELLS cells each) whose few
    distinct floors tie across slices (the first row wins), with a first slice holding fewer
    fitting cells than SEED_CELLS, more tied cells than 4·SEED_CELLS, grids where nothing or
    everything fits, and floors that never tie."""
    rng = np.random.default_rng(3)
    n_cols = 6
    n_rows = 3 * 8 * BLOCK_CELLS // n_cols + 1_000  # three full slices and a short one
    floor = rng.integers(1, 20, (n_rows, n_cols)).astype(np.float32)
    fits = rng.random((n_rows, n_cols)) < 0.3
    first = 8 * BLOCK_CELLS // n_cols  # the first slice's rows
    fits[:first] &= rng.random((first, n_cols)) < 0.001
    floor[:first] += 1  # no least floor in it: each least is first found in a later slice
    floor[5, 2], fits[5, 2] = np.inf, False  # an invalid cell: no floor, does not fit
    distinct = rng.permutation(floor.size).reshape(floor.shape).astype(np.float32)
    for case, values in ((fits, floor), (np.zeros_like(fits), floor), (np.ones_like(fits), floor),
                         (fits, distinct)):  # no ties: exactly SEED_CELLS cells, none twice
        least, over, smallest = _floor_lines(case, values)
        rows, cols, over_want, smallest_want = _floor_reference(case, values)
        for on_rows, (low, arg) in ((True, rows), (False, cols)):
            np.testing.assert_array_equal(least.low[on_rows], low)
            np.testing.assert_array_equal(least.arg[on_rows], arg)
        assert over == over_want
        np.testing.assert_array_equal(smallest, smallest_want)
    # not degenerate: ties across slices, a truncated tie, a slice short of SEED_CELLS fits,
    # each column's least and the least cell that does not fit first in a later slice
    least, over, _ = _floor_lines(fits, floor)
    fit_floor = np.where(fits, floor, np.inf)
    assert (fit_floor.ravel() <= np.sort(fit_floor.ravel())[SEED_CELLS - 1]).sum() \
        > 4 * SEED_CELLS
    assert fits[:first].sum() < SEED_CELLS
    assert least.arg[False].min() >= first and over >= first * n_cols


def test_groups_sharing_runs_reduce_each_line_given():
    """Several axes' groups share one `_Runs`, which keeps the last line it reduced: a new
    line in between is reduced afresh (numpy's per-code least over the rows one by one)."""
    rng = np.random.default_rng(5)
    starts = np.array([0, 3, 4, 9, 10])  # runs of 3, 1, 5, 1 and 2 rows
    run = np.repeat(np.arange(5), np.diff(np.append(starts, 12)))
    runs = _Runs(starts)
    codes = [np.array([0, 1, 0, 2, 1])[run][:, None], np.array([1, 1, 0, 0, 1])[run][:, None]]
    groups = [_Groups(code.astype(np.int16), runs) for code in codes]
    for value in (rng.random(12), rng.random(12), rng.random(12)):
        for code, grouped in zip(codes, groups, strict=True):
            want = [value[code[:, 0] == c].min() for c in range(code.max() + 1)]
            assert grouped.min(value).tolist() == want
            first = {c: int(np.flatnonzero((code[:, 0] == c) & (value == want[c]))[0])
                     for c in range(code.max() + 1)}
            assert grouped.firsts(value, np.array(want)) == first
