"""The collectives' meter (`runtime.collectives.meter`) in one process: the counter's sums,
payloads, group sizes, rows and dict, labels, the clock of time blocked per axis, the sends
issued outside the layer, and one-line errors for an unknown op or axis."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from shardwise.errors import ShardwiseError
from shardwise.runtime.collectives import meter
from shardwise.runtime.mesh import AxisGroup

TP = AxisGroup("tp", object(), 4, 1, (0, 1, 2, 3))


def test_counter_keeps_payload_calls_and_group_sizes_apart():
    c = meter.CommCounter()
    c.add("tp", "all-reduce", 150.0, 100.0, 4)
    c.add("tp", "all-reduce", 30.0, 20.0, 4)
    c.add("dp", "send", 7.0)
    c.add("dp", "all-gather", 9.0, ranks=2)
    assert c.bytes("tp") == 180.0 and c.payload_bytes("tp") == 120.0
    assert c.payload_bytes("dp", "send") == 7.0  # no payload given: the bytes sent
    assert c.payload_bytes() == 120.0 + 7.0 + 9.0 and c.bytes(op="send") == 7.0
    assert c.calls() == 4 and c.calls("tp", "all-reduce") == 2 and c.calls(op="send") == 1
    assert c.sizes == {"tp": 4, "dp": 2}
    assert c.rows() == [{"axis": "dp", "op": "all-gather", "calls": 1, "bytes": 9.0},
                        {"axis": "dp", "op": "send", "calls": 1, "bytes": 7.0},
                        {"axis": "tp", "op": "all-reduce", "calls": 2, "bytes": 180.0}]
    assert c.as_dict() == {"dp/all-gather": 9.0, "dp/send": 7.0, "tp/all-reduce": 180.0}
    c.reset()
    assert (c.bytes(), c.payload_bytes(), c.calls(), c.sizes) == (0, 0, 0, {})


def test_labels_and_sends_outside_the_layer():
    with meter.counting() as c:
        with meter.labelled("all-to-all (counts)"):
            meter._record(TP, "all-to-all", 64.0, 48.0, None)
            with meter.labelled("inner"):
                meter.note_send(TP, 12.0)
        meter._record(TP, "all-to-all", 8.0, 6.0, None)
    assert c.bytes("tp", "all-to-all (counts)") == 48.0
    assert c.payload_bytes("tp", "all-to-all (counts)") == 64.0
    assert c.bytes("tp", "inner") == 12.0 and c.calls("tp", "inner") == 1
    assert c.bytes("tp", "all-to-all") == 6.0 and c.sizes == {"tp": 4}
    assert not meter._LABELS
    # an explicit counter takes the record instead of the active one
    mine = meter.CommCounter()
    with meter.counting() as active:
        meter._record(TP, "broadcast", 10.0, 5.0, mine)
    assert mine.bytes() == 5.0 and active.bytes() == 0


def test_the_clock_charges_the_axis_blocked_in():
    with meter.blocked_in("tp"):  # no clock: nothing to charge
        pass
    with meter.clocking() as outer:
        with meter.blocked_in("tp"):
            time.sleep(0.05)
        with meter.clocking() as inner:
            with meter.blocked_in("dp"):
                time.sleep(0.02)
            with meter.blocked_in(None):
                time.sleep(0.02)
    assert 0.05 <= outer["tp"] < 1.0 and 0.02 <= outer["dp"] < 1.0
    assert set(inner) == {"dp"} and inner["dp"] == pytest.approx(outer["dp"], abs=1e-3)
    assert not meter._CLOCKS


def test_unknown_ops_and_axes_are_one_line(monkeypatch):
    # no mesh in this process (an earlier in-process test may have left one current)
    import shardwise.runtime.mesh as mesh_module

    monkeypatch.setattr(mesh_module, "_CURRENT", None)
    with pytest.raises(ShardwiseError, match=r"^reduce op 'mean' unknown; valid: sum, max, "
                                             r"min, avg, product$"):
        meter._reduce_op("mean")
    assert meter._reduce_op("max") == meter.dist.ReduceOp.MAX
    assert meter.resolve(TP) is TP
    with pytest.raises(ShardwiseError, match=r"^axis 'pp' given but no mesh was built in "
                                             r"this process$"):
        meter.resolve("pp")
    with pytest.raises(ShardwiseError, match=r"^collectives take contiguous tensors"):
        meter._check_contiguous(meter.torch.empty(3, 2).t())
    assert meter._nbytes(meter.torch.empty(3, 5, dtype=meter.torch.float16)) == 30
    assert meter.chunk_sizes(10, 4) == [3, 3, 2, 2] and meter.chunk_sizes(3, 5) == [1, 1, 1, 0,
                                                                                  0]


def test_a_raw_process_group_resolves_to_its_own_ranks(monkeypatch):
    """A ProcessGroup given for an axis is counted under "group" with its own ranks and this
    rank's place in them: global rank 3 in a group of ranks (1, 3) of a world of 4 (torch's
    `get_process_group_ranks`, whose None is the world, stood in for)."""
    from types import SimpleNamespace

    import shardwise.runtime.mesh as mesh_module

    pair = object()
    monkeypatch.setattr(mesh_module, "dist", SimpleNamespace(
        get_process_group_ranks=lambda g: [1, 3] if g is pair else [0, 1, 2, 3],
        get_rank=lambda: 3))
    assert meter.resolve(pair) == AxisGroup("group", pair, 2, 1, (1, 3))
