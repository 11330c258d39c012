"""A named device mesh built from a `Layout`: which ranks talk to which, per parallel axis.

Rank numbering (Megatron's order, tp fastest so a tensor-parallel group sits inside one
NVLink domain): `rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i`. Expert parallelism reuses
the `dp × cp` ranks (SPEC notation: world = dp·tp·pp·cp): flatten `(dp_i, cp_i)` to
`j = dp_i·cp + cp_i`; an `ep` group is `ep` consecutive values of `j`, and `edp` (the
expert-data-parallel group that all-reduces an expert's gradients) takes the ranks with the same
position inside their ep group (`j mod ep`). `dp_cp` is the whole `dp × cp` block (ZeRO and the
gradient all-reduce span it when cp > 1).

Example, Layout(dp=2, tp=2, pp=2) on 8 ranks: tp groups (0,1) (2,3) (4,5) (6,7);
dp groups (0,2) (1,3) (4,6) (5,7); pp groups (0,4) (1,5) (2,6) (3,7).

Design notes: docs/concepts/runtime.md#runtime-mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout
from shardwise.placement import GROUP_AXES, MESH_AXES, MeshShape
from shardwise.runtime.launch import group_timeout

__all__ = [
    "AXES",
    "MESH_AXES",
    "AxisGroup",
    "Mesh",
    "MeshShape",
    "build_mesh",
    "current_mesh",
    "set_current_mesh",
]

AXES = GROUP_AXES


@dataclass(frozen=True)
class AxisGroup:
    """One rank's view of one axis: what the collectives layer needs to talk and to count.

    `group` is None exactly when `size == 1` (no process group; collectives are no-ops).
    `rank` is this rank's index inside the group; `ranks` the group's global ranks.
    """

    name: str
    group: Any
    size: int
    rank: int
    ranks: tuple[int, ...]

    @classmethod
    def world(cls) -> AxisGroup:
        n, r = dist.get_world_size(), dist.get_rank()
        return cls("world", dist.group.WORLD if n > 1 else None, n, r, tuple(range(n)))

    @classmethod
    def of(cls, group: Any, name: str = "group") -> AxisGroup:
        """Wrap a raw `ProcessGroup` (counted under `name`)."""
        ranks = tuple(dist.get_process_group_ranks(group))
        return cls(name, group if len(ranks) > 1 else None, len(ranks),
                   ranks.index(dist.get_rank()), ranks)

    def global_rank(self, index: int) -> int:
        """Global rank of the group member at `index` (taken modulo the size: ring peers)."""
        return self.ranks[index % self.size]


@dataclass
class Mesh:
    """This rank's process groups along every named axis of a `MeshShape`."""

    shape: MeshShape
    global_rank: int
    axes: dict[str, AxisGroup] = field(default_factory=dict)

    @classmethod
    def from_layout(cls, layout: Layout | MeshShape, *, make_current: bool = True) -> Mesh:
        """Create every group of every axis of degree > 1 (a collective call: all ranks, same
        order). Axes whose groups coincide with an earlier axis's reuse that process group."""
        shape = layout if isinstance(layout, MeshShape) else MeshShape.from_layout(layout)
        if not dist.is_initialized():
            raise ShardwiseError("Mesh.from_layout needs an initialised process group "
                                 "(launch.spawn or launch.init_from_env)")
        n = dist.get_world_size()
        if shape.world_size != n:
            raise ShardwiseError(
                f"layout needs pp·dp·cp·tp = {shape.pp}·{shape.dp}·{shape.cp}·{shape.tp} = "
                f"{shape.world_size} ranks but the process group has {n}")
        me = dist.get_rank()
        made: dict[tuple[int, ...], Any] = {}
        axes: dict[str, AxisGroup] = {}
        for axis in AXES:
            mine = shape.group_of(axis, me)
            if len(mine) == 1:
                axes[axis] = AxisGroup(axis, None, 1, 0, mine)
                continue
            for g in shape.groups(axis):
                if g not in made:
                    made[g] = dist.new_group(list(g), timeout=group_timeout())
            axes[axis] = AxisGroup(axis, made[mine], len(mine), mine.index(me), mine)
        mesh = cls(shape, me, axes)
        if make_current:
            set_current_mesh(mesh)
        return mesh

    @classmethod
    def alone(cls, *, world: bool = True) -> Mesh:
        """This rank by itself, every axis of degree 1, inside a larger process group. Made
        current. `world`: the "world" axis stays the whole group (`calibrate` and `check`
        train a one-rank model on every rank at once, the ranks meeting over it in the loss's
        and gradient norm's all-reduces); otherwise the
        world is this rank too and nothing its model does waits for another rank (`check`
        times `calibrate`'s one-rank step between a layout's steps, one rank at a time)."""
        me = dist.get_rank()
        names = AXES if world else (*AXES, "world")
        mesh = cls(MeshShape(), 0, {axis: AxisGroup(axis, None, 1, 0, (me,)) for axis in names})
        set_current_mesh(mesh)
        return mesh

    def axis(self, name: str) -> AxisGroup:
        if name == "world" and name not in self.axes:
            return AxisGroup.world()
        if name not in self.axes:
            raise ShardwiseError(f"unknown mesh axis {name!r}; valid: {', '.join(AXES)}")
        return self.axes[name]

    def group(self, name: str) -> Any:
        """The process group of `name` containing this rank; None for a degree-1 axis."""
        return self.axis(name).group

    def size(self, name: str) -> int:
        return self.axis(name).size

    def rank(self, name: str) -> int:
        """This rank's coordinate (index) along `name`."""
        return self.axis(name).rank

    def ranks(self, name: str) -> tuple[int, ...]:
        """Global ranks of this rank's `name` group, in group order."""
        return self.axis(name).ranks

    @property
    def coord(self) -> dict[str, int]:
        return self.shape.coord(self.global_rank)

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def __repr__(self) -> str:
        dims = " × ".join(f"{a}{getattr(self.shape, a)}" for a in MESH_AXES)
        return f"Mesh({dims}, ep{self.shape.ep}, rank {self.global_rank} at {self.coord})"


def build_mesh(layout: Layout | MeshShape, *, make_current: bool = True) -> Mesh:
    """`Mesh.from_layout`: the mesh of `layout` for this process (current when `make_current`)."""
    return Mesh.from_layout(layout, make_current=make_current)


_CURRENT: Mesh | None = None


def current_mesh() -> Mesh | None:
    """The mesh most recently built with `make_current=True` in this process (or None)."""
    return _CURRENT


def set_current_mesh(mesh: Mesh | None) -> None:
    """Make `mesh` the one `current_mesh` returns (None: no mesh)."""
    global _CURRENT
    _CURRENT = mesh
