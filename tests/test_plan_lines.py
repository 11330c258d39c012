"""The pruned search's grid reductions (`plan.lines`) against numpy's own: dense ids of the
distinct rows of several columns are `np.unique(..., axis=0)`'s inverse."""

import numpy as np

from shardwise.plan.lines import _dense_ids


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
