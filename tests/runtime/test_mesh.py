"""The named mesh: rank arithmetic (pure) and real process groups per axis."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import spawn
from shardwise.runtime.mesh import AXES, MESH_AXES, Mesh, MeshShape


@pytest.mark.parametrize("shape", [MeshShape(dp=2, tp=2, pp=2), MeshShape(pp=2, dp=3, cp=2, tp=2),
                                   MeshShape(dp=4, cp=2, ep=4), MeshShape()])
def test_groups_partition_the_ranks(shape: MeshShape) -> None:
    world = set(range(shape.world_size))
    for axis in AXES:
        groups = shape.groups(axis)
        assert all(len(g) == shape.size(axis) for g in groups)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world) and len(flat) == len(world)
    for r in world:
        assert shape.rank_of(**shape.coord(r)) == r


def test_megatron_order_tp_fastest() -> None:
    s = MeshShape.from_layout(Layout(dp=2, tp=2, pp=2))
    assert s.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert s.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert s.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert s.coord(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert MESH_AXES == ("pp", "dp", "cp", "tp")


def test_expert_groups_inside_dp_cp() -> None:
    s = MeshShape(dp=2, cp=2, ep=2)
    assert s.groups("dp_cp") == [(0, 1, 2, 3)]
    assert s.groups("ep") == [(0, 1), (2, 3)]
    assert s.groups("edp") == [(0, 2), (1, 3)]
    with pytest.raises(ShardwiseError, match=r"etp·ep=1·3 must divide tp·dp·cp=2"):
        MeshShape(dp=2, ep=3)


def _mesh_check(layout: Layout) -> dict[str, object]:
    mesh = Mesh.from_layout(layout)
    out: dict[str, object] = {"coord": mesh.coord}
    for axis in AXES:
        t = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
        C.all_reduce(t, axis)
        out[axis] = (mesh.ranks(axis), mesh.size(axis), mesh.rank(axis),
                     mesh.group(axis) is None, float(t.item()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [Layout(dp=2, tp=2, pp=2), Layout(dp=2, cp=2, ep=2, tp=2)])
def test_real_groups_match_the_arithmetic(layout: Layout) -> None:
    shape = MeshShape.from_layout(layout)
    for r, res in enumerate(spawn(_mesh_check, 8, layout)):
        assert res["coord"] == shape.coord(r)
        for axis in AXES:
            ranks, size, idx, is_none, total = res[axis]
            expected = shape.group_of(axis, r)
            assert tuple(ranks) == expected and size == len(expected)
            assert idx == expected.index(r)
            assert is_none == (size == 1)  # degree-1 axes create no group
            assert total == sum(expected)  # the all-reduce really ran inside that group
