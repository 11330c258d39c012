"""`estimate.rows`: equal rows found by a hash of their bits, against the rows' own values
(numpy's exact comparison), with hash collisions constructed by hand."""

import warnings

import numpy as np

from shardwise.estimate.rows import bits_hash, equal_rows

K0, K1 = 0x9E3779B97F4A7C15, 0x9E3779B97F4A7C15 + 2  # the hash's multipliers of columns 0, 1


def _bits(x: float) -> int:
    return int(np.array([x]).view(np.uint64)[0])


def _float(bits: int) -> float:
    return float(np.array([bits % 2**64], dtype=np.uint64).view(np.float64)[0])


def _sound(columns, first, group):
    """Every row's group starts with a row of the same values (bit for bit)."""
    table = np.stack([np.asarray(c, dtype=np.float64) for c in columns], axis=1)
    assert (table[first[group]].view(np.uint64) == table.view(np.uint64)).all()


def test_distinct_rows_hash_apart():
    """20,000 distinct rows of the planner's kind (parameter counts that differ in their last
    bits, small integer degrees, lengths) give 20,000 hashes, with no overflow warning."""
    rng = np.random.default_rng(0)
    base = 6.57e9 * (1 + rng.integers(0, 10_000, 20_000) * np.finfo(float).eps)
    degrees = rng.integers(1, 9, 20_000)
    columns = [base, degrees, rng.integers(1, 3, 20_000).astype(np.int64)]
    table = np.stack(columns, axis=1)
    distinct = len(np.unique(table, axis=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(np.unique(bits_hash(columns))) == distinct > 15_000


def test_integer_and_boolean_columns_hash_as_their_values():
    """An int32 or bool column reads as float64: it hashes as the same values in float64."""
    values = np.array([0, 1, 2, 7, 1])
    assert (bits_hash([values.astype(np.int32)]) == bits_hash([values.astype(np.float64)])).all()
    flags = np.array([True, False, True])
    assert (bits_hash([flags]) == bits_hash([flags.astype(np.float64)])).all()


def test_collisions_are_groups_of_their_own():
    """Rows 1 and 2 hash like row 0 (column 0's bits one and two more, column 1's K1 and 2·K1
    less, column 2 the same) but differ from it and from each other: groups of their own (row 4, equal to row 2,
    may be one more: a collision only groups less); row 3 repeats row 0, row 5 hashes apart."""
    a, b = _bits(1.5), _bits(4.0)
    col0 = [_float(a), _float(a + 1), _float(a + 2), _float(a), _float(a + 2), 9.0]
    col1 = [_float(b), _float(b - K1), _float(b - 2 * K1), _float(b), _float(b - 2 * K1), 9.0]
    same = [3.0] * 6  # a last column the colliding rows share: every column is compared
    columns = [np.array(col0), np.array(col1), np.array(same)]
    codes = bits_hash(columns)
    assert codes[0] == codes[1] == codes[2] != codes[5]  # the constructed collision
    first, group = equal_rows(columns)
    _sound(columns, first, group)
    assert len(set(group[:3].tolist())) == 3 and group[3] == group[0]
    assert len(first) == len(set(first.tolist())) == group.max() + 1  # ids 0..k-1, k rows
