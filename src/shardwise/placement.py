"""Rank placement: which global ranks form each parallel group, and which share a node.

One rule for the whole project (the runtime's `runtime/mesh.py` numbers ranks the same way;
`tests/test_placement.py` checks the groups are identical), pure arithmetic, no torch:

    rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i          (Megatron-LM's order, tp fastest)

so a tensor-parallel group is `tp` consecutive ranks (inside one NVLink domain when
`tp ≤ gpus_per_node`). The MoE layers lay the same ranks out again, Megatron-Core's expert
rank generator (megatron/core/parallel_state.py, 0.16.1: `RankGenerator(tp=etp, ep=ep,
dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")`, the attention layers' order with cp folded
away): inside a pipeline stage, local rank `r = ((dp_i·cp + cp_i)·tp + tp_i)` is

    r = (edp_i·ep + ep_i)·etp + etp_i                      (etp fastest, then ep, then edp)

with `etp` the expert-tensor-parallel degree (0: tp, Megatron's default,
`ModelParallelConfig.expert_tensor_parallel_size`), `edp = tp·dp·cp/(etp·ep)` the ranks that
reduce one expert shard's gradients. With etp = tp (the default) this is the old rule: number
the `dp × cp` block `j = dp_i·cp + cp_i`; an `ep` group is `ep` consecutive values of `j`,
`edp` the ranks with the same position inside their ep group. `dp_cp` is the whole block (ZeRO
and the gradient reduction span it when cp > 1). Hybrid context parallelism (`Layout.cp_kind`
"hybrid") cuts each cp group into `cp_a2a` groups of `u = ulysses` consecutive members (its
all-to-alls) and `cp_ring` groups of the members `u` apart (its ring): Megatron-Core's
`create_hierarchical_groups` with `--hierarchical-context-parallel-sizes u cp/u`
(parallel_state.py, 0.16.1), the ring ranks Transformer Engine's a2a+p2p pairs.

Nodes hold `gpus_per_node` consecutive ranks. A group whose members are `stride` ranks apart
(tp: 1; cp, cp_a2a, dp_cp: tp; cp_ring: tp·u; ep: etp; edp: etp·ep; dp: tp·cp; pp:
tp·cp·dp) has

    members per node = min(n, max(1, gpus_per_node // stride))

when the stride, and the span `n·stride` of a group, each divide the node size or are
multiples of it (power-of-two layouts on 8-GPU nodes, for example; otherwise groups straddle
node boundaries unevenly and this is the count of the fullest node, an approximation); `members_per_node` evaluates that for arrays of layouts,
`MeshShape.node_counts` counts it exactly for one.

Example, dp4 cp2 tp2 ep4 on 8-GPU nodes: ep groups (0, 2, 4, 6), (8, 10, 12, 14), … — the four
members of an ep group share a node.
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
