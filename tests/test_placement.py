"""One placement: the pure mesh arithmetic equals the runtime mesh's groups, and the step
model's per-node counts equal the counts over the real groups."""

import itertools

import numpy as np
import pytest

from shardwise.arch import get_model
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.placement import GROUP_AXES, MeshShape, members_per_node

LAYOUTS = [Layout(dp=2, tp=2, pp=2), Layout(dp=4, cp=2, tp=2, ep=4),
           Layout(dp=2, cp=2, tp=2, pp=2, ep=2), Layout(dp=8, ep=8), Layout(dp=3, tp=2, pp=2),
           Layout(dp=6, cp=2, ep=3), Layout(pp=4, tp=4, dp=2, ep=2), Layout(dp=16, tp=8, ep=4),
           Layout(dp=2, cp=8, tp=2, cp_kind="hybrid", ulysses=4),
           Layout(cp=4, pp=2, cp_kind="ulysses"), Layout(dp=2, cp=6, cp_kind="hybrid", ulysses=3)]


def enumerated_groups(layout: Layout, axis: str) -> list[tuple[int, ...]]:
    """The groups written out coordinate by coordinate from the documented numbering
    `rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i` (an independent reference for the
    array arithmetic that the estimate and the runtime mesh share)."""
    dims = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}

    def rank(pp=0, dp=0, cp=0, tp=0):
        return ((pp * dims["dp"] + dp) * dims["cp"] + cp) * dims["tp"] + tp

    if axis in ("cp_a2a", "cp_ring"):  # Megatron's hierarchical cp groups: a2a consecutive
        u = layout.ulysses_degree
        inner = axis == "cp_a2a"
        size, count = (u, layout.cp // u) if inner else (layout.cp // u, u)
        return [tuple(rank(pp, dp, j * u + i if inner else i * u + j, tp) for i in range(size))
                for pp, dp in itertools.product(range(layout.pp), range(layout.dp))
                for j in range(count) for tp in range(layout.tp)]
    if axis in dims:
        others = [a for a in dims if a != axis]
        return [tuple(rank(**dict(zip(others, rest)), **{axis: i}) for i in range(dims[axis]))
                for rest in itertools.product(*(range(dims[a]) for a in others))]
    out = []
    for pp_i, tp_i in itertools.product(range(layout.pp), range(layout.tp)):
        block = [rank(pp=pp_i, dp=j // layout.cp, cp=j % layout.cp, tp=tp_i)
                 for j in range(layout.dp * layout.cp)]
        if axis == "dp_cp":
            out.append(tuple(block))
        elif axis == "ep":
            out.extend(tuple(block[i:i + layout.ep]) for i in range(0, len(block), layout.ep))
        else:  # edp: the same position inside every ep group
            out.extend(tuple(block[i::layout.ep]) for i in range(layout.ep))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.short)
def test_groups_equal_the_documented_numbering(layout):
    shape = MeshShape.from_layout(layout)
    for axis in GROUP_AXES:
        assert shape.groups(axis) == enumerated_groups(layout, axis), axis
    for rank in range(shape.world_size):
        assert shape.rank_of(**shape.coord(rank)) == rank


def test_the_documented_example_by_hand():
    shape = MeshShape.from_layout(Layout(dp=2, tp=2, pp=2))
    assert shape.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shape.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert shape.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    moe = MeshShape.from_layout(Layout(dp=4, cp=2, tp=2, ep=4))
    assert moe.group_of("ep", 0) == (0, 2, 4, 6)  # all four in node 0 of 8 GPUs
    assert moe.group_of("edp", 0) == (0, 8)


@pytest.mark.parametrize("gpn", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.short)
def test_closed_form_counts_equal_the_groups(layout, gpn):
    shape = MeshShape.from_layout(layout)
    degrees = {a: getattr(layout, a) for a in ("pp", "dp", "cp", "tp", "ep")}
    degrees["ulysses"] = layout.ulysses_degree
    for axis in GROUP_AXES:
        counts = shape.node_counts(axis, gpn)
        if gpn % shape.world_size and shape.world_size % gpn:
            continue  # partial nodes: not a cluster the planner builds
        n = shape.size(axis)
        step = {"tp": 1, "cp": layout.tp, "dp": layout.tp * layout.cp, "dp_cp": layout.tp,
                "ep": layout.tp, "edp": layout.tp * layout.ep,
                "pp": layout.tp * layout.cp * layout.dp, "cp_a2a": layout.tp,
                "cp_ring": layout.tp * layout.ulysses_degree}[axis]
        if (step % gpn and gpn % step) or (n * step % gpn and gpn % (n * step)):
            continue  # the closed form's assumption (documented) does not hold
        assert counts == {int(members_per_node(axis, gpn, **degrees))}, (axis, counts)
    # arrays give the same as scalars
    arrays = {a: np.array([v, v]) for a, v in degrees.items()}
    assert members_per_node("ep", gpn, **arrays).tolist() == [
        int(members_per_node("ep", gpn, **degrees))] * 2


def test_step_model_puts_the_ep_group_of_dp4_cp2_tp2_ep4_inside_a_node():
    """The all-to-all of ep group (0, 2, 4, 6) runs on NVLink only: the same time as on a
    cluster whose nodes are large enough to hold every rank (nothing crosses a node)."""
    model = get_model("mixtral-8x7b")
    train = TrainSpec(seq_len=4096, global_batch=64)
    layout = Layout(dp=4, cp=2, tp=2, ep=4)
    eight = estimate_step(model, Cluster.of(16, "h100"), layout, train)
    sixteen = estimate_step(model, Cluster.of(16, "h100", gpus_per_node=16), layout, train)
    assert eight.ep_comm == pytest.approx(sixteen.ep_comm, rel=1e-12)


def test_every_rank_in_exactly_one_group():
    for layout, axis in itertools.product(LAYOUTS, GROUP_AXES):
        shape = MeshShape.from_layout(layout)
        ranks = sorted(r for g in shape.groups(axis) for r in g)
        assert ranks == list(range(shape.world_size))
