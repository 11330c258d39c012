"""Rank placement: which global ranks form each parallel group, and which share a node.

One rule for the whole project (the runtime's `runtime/mesh.py` numbers ranks the same way;
`tests/test_placement.py` checks the groups are identical), pure arithmetic, no torch:

    rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i          (Megatron-LM's order, tp fastest)

The MoE layers lay the same ranks out again as Megatron-Core 0.16.1's expert rank generator
(etp fastest, then ep, then edp); hybrid context parallelism cuts each cp group into all-to-all
and ring groups. Nodes hold `gpus_per_node` consecutive ranks; `members_per_node` counts a
group's members per node for arrays of layouts. The derivation, with its sources and an
example: docs/concepts/communication.md, "Rank placement".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError

__all__ = ["GROUP_AXES", "MESH_AXES", "MeshShape", "expert_tp_degree", "members_per_node",
           "stride"]

MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Rank numbering, outermost first (tp varies fastest)."""
GROUP_AXES: tuple[str, ...] = (*MESH_AXES, "ep", "edp", "dp_cp", "cp_a2a", "cp_ring")
"""Every kind of group: the mesh axes, the expert / replica groups inside `dp × cp`, and the
hybrid context-parallel groups inside `cp`."""


def expert_tp_degree(etp: Any, tp: Any) -> Any:
    """The expert-tensor-parallel degree: `etp`, or `tp` where it is 0 (Megatron-Core's
    default: `expert_tensor_parallel_size = None` becomes `tensor_model_parallel_size`,
    model_parallel_config.py and parallel_state.py, 0.16.1). Numbers or arrays."""
    if np.ndim(etp) or np.ndim(tp):
        return np.where(np.asarray(etp) > 0, etp, tp)
    return etp or tp


def _sizes(axis: str, pp: Any, dp: Any, cp: Any, tp: Any, ep: Any, etp: Any = 0,
           ulysses: Any = 1
           ) -> tuple[Any, Any]:
    """(group size, rank stride between consecutive members) of `axis`."""
    et = expert_tp_degree(etp, tp)
    table = {"tp": (tp, 1), "cp": (cp, tp), "dp": (dp, tp * cp), "pp": (pp, tp * cp * dp),
             "dp_cp": (dp * cp, tp), "ep": (ep, et), "edp": (tp * dp * cp // (et * ep), et * ep),
             "cp_a2a": (ulysses, tp), "cp_ring": (cp // ulysses, tp * ulysses)}
    if axis not in table:
        raise ShardwiseError(f"unknown mesh axis {axis!r}; valid: {', '.join(GROUP_AXES)}")
    return table[axis]


def stride(axis: str, *, pp: Any = 1, dp: Any = 1, cp: Any = 1, tp: Any = 1, ep: Any = 1,
           etp: Any = 0, ulysses: Any = 1) -> Any:
    """Ranks between consecutive members of an `axis` group (numbers or arrays)."""
    return _sizes(axis, pp, dp, cp, tp, ep, etp, ulysses)[1]


def members_per_node(axis: str, gpus_per_node: int, *, pp: Any = 1, dp: Any = 1, cp: Any = 1,
                     tp: Any = 1, ep: Any = 1, etp: Any = 0, ulysses: Any = 1) -> Any:
    """How many members of one `axis` group share a node: `min(n, max(1, gpn // stride))`
    (see the module docstring; numbers or NumPy arrays of degrees; `ulysses`: the hybrid
    context-parallel groups' all-to-all degree)."""
    n, step = _sizes(axis, pp, dp, cp, tp, ep, etp, ulysses)
    return np.minimum(n, np.maximum(gpus_per_node // step, 1))


@dataclass(frozen=True)
class MeshShape:
    """Degrees of the mesh axes and the rank ↔ coordinate arithmetic of one layout."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 0  # expert tensor parallel; 0: tp
    ulysses: int = 1  # the all-to-all degree inside cp (`Layout.ulysses_degree`)

    def __post_init__(self) -> None:
        for axis in ("pp", "dp", "cp", "tp", "ep", "ulysses"):
            if getattr(self, axis) < 1:
                raise ShardwiseError(f"mesh axis {axis} must be ≥ 1, got {getattr(self, axis)}")
        if self.etp < 0:
            raise ShardwiseError(f"etp must be ≥ 0 (0: tp), got {self.etp}")
        et = expert_tp_degree(self.etp, self.tp)
        if (self.tp * self.dp * self.cp) % (et * self.ep):
            raise ShardwiseError(f"etp·ep={et}·{self.ep} must divide tp·dp·cp="
                                 f"{self.tp * self.dp * self.cp}")
        if self.cp % self.ulysses:
            raise ShardwiseError(f"ulysses={self.ulysses} must divide cp={self.cp}")

    @classmethod
    def from_layout(cls, layout: Any) -> MeshShape:
        """The mesh of a `Layout` (anything with pp, dp, cp, tp, ep and optionally etp and
        `ulysses_degree`)."""
        return cls(pp=layout.pp, dp=layout.dp, cp=layout.cp, tp=layout.tp, ep=layout.ep,
                   etp=getattr(layout, "etp", 0), ulysses=getattr(layout, "ulysses_degree", 1))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def dims(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    def coord(self, rank: int) -> dict[str, int]:
        """Global rank → {"pp": i, "dp": j, "cp": k, "tp": l} (tp varies fastest)."""
        if not 0 <= rank < self.world_size:
            raise ShardwiseError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        return dict(zip(MESH_AXES, (int(i) for i in np.unravel_index(rank, self.dims())),
                        strict=True))

    def rank_of(self, **coord: int) -> int:
        """{"pp": i, …} → global rank (missing axes: 0)."""
        return int(np.ravel_multi_index(tuple(coord.get(a, 0) for a in MESH_AXES), self.dims()))

    def size(self, axis: str) -> int:
        return int(_sizes(axis, self.pp, self.dp, self.cp, self.tp, self.ep, self.etp,
                          self.ulysses)[0])

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group of `axis`, each a tuple of global ranks in group-rank order; groups
        ordered by the coordinates of the other axes (outermost first)."""
        self.size(axis)  # validates the name
        ranks = np.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)
        if axis in MESH_AXES:
            rows = np.moveaxis(ranks, MESH_AXES.index(axis), -1).reshape(-1, self.size(axis))
        elif axis in ("cp_a2a", "cp_ring"):  # cp as (ring, a2a), the a2a members consecutive
            split = ranks.reshape(self.pp, self.dp, self.cp // self.ulysses, self.ulysses,
                                  self.tp)
            rows = np.moveaxis(split, 3 if axis == "cp_a2a" else 2, -1)
            rows = rows.reshape(-1, self.size(axis))
        elif axis == "dp_cp":
            n = self.dp * self.cp
            rows = ranks.reshape(self.pp, n, self.tp).transpose(0, 2, 1).reshape(-1, n)
        else:  # the expert layout: (pp, edp, ep, etp), etp fastest; rows by (pp, etp, …)
            et = expert_tp_degree(self.etp, self.tp)
            experts = ranks.reshape(self.pp, -1, self.ep, et)
            order = (0, 3, 1, 2) if axis == "ep" else (0, 3, 2, 1)  # ep: (pp, etp, edp, ep)
            rows = experts.transpose(order).reshape(-1, self.size(axis))
        return [tuple(int(r) for r in row) for row in rows]

    def group_of(self, axis: str, rank: int) -> tuple[int, ...]:
        for group in self.groups(axis):
            if rank in group:
                return group
        raise ShardwiseError(f"rank {rank} outside a mesh of {self.world_size} ranks")

    def node_counts(self, axis: str, gpus_per_node: int) -> set[int]:
        """The distinct numbers of one group's members found together on a node."""
        return {count for group in self.groups(axis)
                for count in Counter(rank // gpus_per_node for rank in group).values()}
