"""A layout's pipeline stages and data-parallel groups as the step model reads them
(`stage_shape`): the busiest, first and last stage's layers, the busiest stage's parameters
per rank, the dp·cp replicas and their placement — the inputs of `estimate.step.step_terms`
that depend on neither the ZeRO stage and group nor (sp, recompute), so the planner's floor
(`plan.evaluate.dp_floor`) evaluates them once per run of ZeRO variants. Array-polymorphic.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.geometry import StageGeometry, param_geometry
from shardwise.estimate.memory import candidate_stages, placement_of, stage_param_counts
from shardwise.estimate.rows import equal_rows
from shardwise.layout import Partition, stage_extremes
from shardwise.partition import Balanced
from shardwise.placement import expert_tp_degree, members_per_node
from shardwise.schedules.actions import Placement


def busiest_stage_params(model: ModelSpec, t: Any, p: Any, e: Any, v: Any,
                         partition: Partition = (), etp: Any = 0, placement: Placement = "loop"
                         ) -> tuple[Any, Any]:
    """(dense, expert) parameters per rank of the pipeline stage holding the most, counted
    per stage by the memory model (`memory.stage_param_counts`): every stage of an explicit
    partition; of a `Balanced` one (the default) the memory model's `candidate_stages` — the
    first (embedding), the second (the busiest when the balanced split gives it an extra
    layer) and the last (head), or every stage where MoE layers are not spread evenly (dense
    first layers, `moe_every > 1`: DeepSeek-V3's pp = 16 stage 2 holds more than stage 1).
    Their layers are counted once per distinct pipeline (`_candidate_geometry`)."""
    if isinstance(partition, tuple) and partition:  # explicit: one pp
        stages = np.arange(int(np.max(p))).reshape((-1,) + (1,) * np.ndim(p))
        dense, expert = stage_param_counts(model, tp=t, pp=p, ep=e, chunks=v, stage=stages,
                                           partition=partition, etp=etp, placement=placement)
    else:
        dense, expert = _candidate_geometry(model, p, v, partition, placement).params(
            model, t, e, etp)
    dense, expert = np.broadcast_arrays(dense, expert)
    pick = np.expand_dims(np.argmax(dense + expert, axis=0), 0)
    return (np.take_along_axis(dense, pick, 0)[0], np.take_along_axis(expert, pick, 0)[0])


def _candidate_geometry(model: ModelSpec, p: Any, v: Any, partition: Partition,
                        placement: Any) -> StageGeometry:
    """`param_geometry` of the `candidate_stages` (stacked on a first axis) of layouts with a
    `Balanced` or the default partition, worked out once per distinct (pp, chunks,
    placement, ends) and spread back: the same numbers, elementwise."""
    ends = (partition.first_less, partition.last_less) if isinstance(partition, Balanced) else ()
    inputs = (p, v, np.asarray(placement) == "v", *ends)
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
    if not shape:
        return param_geometry(model, p, v, np.stack(candidate_stages(model, p)), partition,
                              placement=placement)
    columns = [np.broadcast_to(x, shape).ravel() for x in inputs]
    first, group = equal_rows(columns)
    pp, chunks, v_placed, *ends_of = (column[first] for column in columns)
    stages = np.stack(candidate_stages(model, pp))  # (stages, distinct)
    one = param_geometry(model, pp, chunks, stages, Balanced(*ends_of) if ends else (),
                         placement=np.where(v_placed, "v", "loop"))
    spread: dict[str, Any] = {
        name: value if not np.ndim(value) else np.broadcast_to(value, stages.shape)[:, group]
        .reshape(stages.shape[:1] + shape) for name, value in vars(one).items()}
    return StageGeometry(**spread)


class StageShape(NamedTuple):
    """What the step model reads of a layout's pipeline stages and data-parallel groups
    (`stage_shape`), the same for every ZeRO stage and group and every (sp, recompute): the
    layers of the busiest, first and last stage relative to L/p (`most`, `first`, `last`;
    1 for even stages), the busiest stage's layers and its (dense, expert) parameters per
    rank, the dp·cp `replicas`, how many of them share a node, and the experts' `shift`
    (their data-parallel group is dp·cp/shift)."""

    most: Any
    first: Any
    last: Any
    layers: Any
    dense: Any
    expert: Any
    replicas: Any
    in_node: Any
    shift: Any

    def param_groups(self, model: ModelSpec) -> list[tuple[Any, Any]]:
        """`dp_time`'s groups: (dense parameters, 1) and for an MoE model (experts, shift)."""
        return [(self.dense, 1)] + ([(self.expert, self.shift)] if model.n_moe_layers else [])

    def shard_group(self, zero_group: Any) -> Any:
        """The ZeRO shard group of a `zero_group` code (0: all dp·cp replicas)."""
        return np.where(zero_group > 0, zero_group, self.replicas)


def stage_shape(model: ModelSpec, gpus_per_node: int, *, tp: Any, pp: Any, cp: Any, ep: Any,
                dp: Any, chunks: Any, schedule: Any, partition: Partition = (), etp: Any = 0
                ) -> StageShape:
    """`StageShape` of layouts given as numbers or arrays (`step_terms`' codes)."""
    t, p, c, e, v = tp, pp, cp, ep, chunks
    placement = placement_of(schedule, partition)
    # uneven stages: the layers of the busiest, the first and the last stage relative to L/p
    # (exactly 1 for even stages)
    most, first, last = (n * p / model.n_layers
                         for n in stage_extremes(model.n_layers, p, v, partition, placement))
    dense, expert = busiest_stage_params(model, t, p, e, v, partition, etp, placement)
    # the experts' replicas: the expert-data-parallel group tp·dp·cp/(etp·ep) = dp·cp/shift
    shift = e * expert_tp_degree(etp, t) / t
    return StageShape(most, first, last, most * model.n_layers / p, dense, expert, dp * c,
                      members_per_node("dp_cp", gpus_per_node, pp=p, dp=dp, cp=c, tp=t, ep=e,
                                       etp=etp), shift)
