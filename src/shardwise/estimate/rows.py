"""Equal rows of columns of numbers, found by a hash of their bits (one sort of one column
instead of one per column); callers compare the rows a hash groups, so a collision only
groups less."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bits_hash(columns: Sequence[np.ndarray]) -> np.ndarray:
    """A uint64 per row of `columns` (1-D arrays of one length, read as float64): equal rows
    hash equal (−0.0 and 0.0 apart)."""
    code = np.zeros(len(columns[0]), dtype=np.uint64)
    for k, column in enumerate(columns):  # uint64 array arithmetic wraps, silently
        bits = np.ascontiguousarray(column, dtype=np.float64).view(np.uint64)
        code = code * np.uint64(0x9E3779B97F4A7C15 + 2 * k) + bits
    return code


def equal_rows(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(one row of each group, each row's group) of rows of `columns` grouped by `bits_hash`,
    groups in the order of their hashes; a row whose values differ from its group's first
    row's (a collision) is a group of its own, after the others."""
    code = bits_hash(columns)
    _, first, group = np.unique(code, return_index=True, return_inverse=True)
    group = group.ravel()
    same = np.ones(len(code), dtype=bool)
    for column in columns:
        column = np.asarray(column, dtype=np.float64)
        same &= column[first[group]] == column
    if not same.all():
        apart = np.flatnonzero(~same)
        group[apart] = len(first) + np.arange(len(apart))
        first = np.concatenate([first, apart])
    return first, group
