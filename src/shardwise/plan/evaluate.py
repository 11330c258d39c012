"""Evaluation: step time, rates and per-stage memory of arrays of layouts (the planner's
kernel), and of one layout with the scalar models."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.estimate.compute import RC_CODES, ComputeContext
from shardwise.estimate.geometry import StageGeometry, candidate_stages, distinct_geometries
from shardwise.estimate.goodput import Reliability, checkpoint_timing, estimate_goodput
from shardwise.estimate.memory import (
    activation_bytes_per_layer,
    peak_stage_total,
    peak_stage_total_runs,
    training_memory_per_gpu,
)
from shardwise.estimate.rows import equal_rows
from shardwise.estimate.stages import StageShape, stage_shape
from shardwise.estimate.step import (
    Links,
    compute_costs,
    dp_total,
    estimate_step,
    finish,
    flops_per_token,
    simulated_bubble_floor,
    step_terms,
)
from shardwise.estimate.uncertainty import generation
from shardwise.hardware import Cluster
from shardwise.layout import (
    CP_KINDS,
    Layout,
    Partition,
    TrainSpec,
    stage_extremes,
    ulysses_degree,
)
from shardwise.partition import fixed_or_balanced
from shardwise.plan.grid import _wide
from shardwise.plan.lines import _dense_ids, _one_of_each
from shardwise.plan.results import PlanEntry
from shardwise.plan.space import DEFAULT_HEADROOM
from shardwise.schedules.registry import (
    get_schedule,
)

RC_NAMES = {code: name for name, code in RC_CODES.items()}
SIMULATED_ACTIONS = 4_000  # pipelines of up to pp·m·chunks actions are simulated (the figure)
# what `step_terms` takes for arrays of layouts (`Layout.codes()`; the stage partition as
# `first_less`/`last_less`, `_partition`)
_STEP_KEYS = (*Layout().codes(), "m")
# a second evaluation's fixed cost is about this many grid cells' work (benchmarks/
# bench_planner.py): below it, copying sp = 0 into sp = 1 for tp = 1 rows does not pay
_SPLIT_MIN_CELLS = 16_384
# numpy's array loops release the GIL: the grid's blocks run on this many threads, each
# block at least `_THREAD_MIN_CELLS` cells (smaller grids are not worth a thread's start)
_THREADS = min(4, os.cpu_count() or 1)
_THREAD_MIN_CELLS = 32_768


def _gathered(value: Any, size: int, index: Any) -> Any:
    """`value` (an array over `size` distinct pairs, a scalar, None, or a tuple or named tuple
    of them) taken at `index`, one per layout."""
    if value is None:
        return None
    if isinstance(value, tuple):
        parts = (_gathered(x, size, index) for x in value)
        return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)
    return np.broadcast_to(value, (size,))[index]


def evaluate_candidates(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                        cand: dict[str, Any], calib: Calibration | None = None,
                        keys: Sequence[str] | None = None) -> dict[str, Any]:
    """Step-time terms (only `keys` when given), rates and peak memory for arrays of layouts
    (the planner's kernel).

    `cand` holds int arrays `t p c e dp b m sched v zero zg sp rc cp_kind ulysses` (codes as in
    `estimate.step`) and, from the grid, the searched partitions `first_less last_less`
    (`Balanced`; without them the default partition), flat or broadcastable against each
    other (the planner passes outer combinations as a column and the `(sp, rc)` pairs as a
    row, so terms that do not depend on them are computed once per row). Compute costs and
    activations are evaluated once per distinct `(t, c, b, e, etp, all-to-all degree)` and
    `(sp, rc)` and gathered. On the planner's grid, rows with tp = 1 are evaluated on their
    sp = 0 columns only and copied into the sp = 1 ones: sequence parallelism without TP is
    the same layout (the grid marks those cells invalid). Large grids are evaluated in row
    blocks on a few threads (`_blocks`).
    """
    cal = calib or default_calibration(cluster.accelerator.calibration_name)
    cand = {k: v if k.startswith("_") else _wide(v) for k, v in cand.items()}
    shared = _per_pair(model, cluster, train, cand, cal)
    blocks = _blocks(cand)
    if blocks is None:
        terms = _terms(model, cluster, train, cand, shared, shared.inverse)
        return {k: terms[k] for k in keys} if keys is not None else terms

    def run(block: tuple[Any, Any, Any]) -> dict[str, Any]:
        rows, columns, _ = block
        return _terms(model, cluster, train, _take(cand, rows, columns), shared,
                      shared.inverse[rows])

    with ThreadPoolExecutor(min(len(blocks), _THREADS)) as pool:
        results = list(pool.map(run, blocks))
    shape = (np.shape(cand["tp"])[0], np.shape(cand["sp"])[1])
    out = {}
    for key in keys if keys is not None else results[0]:
        full = np.empty(shape)
        for (rows, columns, same), terms in zip(blocks, results, strict=True):
            width = shape[1] if columns is None else len(columns)
            value = np.broadcast_to(terms[key], (len(rows), width))
            full[rows] = value if same is None else value[:, same]
        out[key] = full
    return out


def _blocks(cand: dict[str, Any]) -> list[tuple[Any, Any, Any]] | None:
    """The planner's rows × (sp, rc) grid as blocks of (row indices, the columns evaluated or
    None for all, for each column the evaluated one it copies or None), a few per thread;
    None for flat arrays and for a grid that is one block as it is. Rows with tp = 1
    evaluate their sp = 0 columns only where that saves `_SPLIT_MIN_CELLS` (`_without_sp`)."""
    tp, sp = np.asarray(cand["tp"]), np.asarray(cand["sp"])
    if tp.ndim != 2 or tp.shape[1] != 1 or sp.ndim != 2 or sp.shape[0] != 1:
        return None
    split = _without_sp(cand)
    if split is None:
        parts = [(np.arange(tp.shape[0]), None, None)]
    else:
        lone, columns, same = split
        parts = [(np.nonzero(lone)[0], columns, same), (np.nonzero(~lone)[0], None, None)]
    out = []
    for rows, columns, same in parts:
        cells = len(rows) * (sp.shape[1] if columns is None else len(columns))
        pieces = max(1, min(_THREADS, cells // _THREAD_MIN_CELLS))
        out += [(chunk, columns, same) for chunk in np.array_split(rows, pieces)]
    return out if len(out) > 1 or split is not None else None


class _PerPair(NamedTuple):
    """Compute costs and activation bytes per distinct `(t, c, b, e, etp, all-to-all degree)`
    × (sp, rc), each layout's index into them before its (sp, rc) offset (`inverse`), and on
    the planner's grid each (structure, micro-batch) pair's index (`of_pair`)."""

    ctx: ComputeContext
    links: Links
    costs: dict[str, Any]
    act: dict[str, Any]
    inverse: Any
    size: int
    of_pair: Any = None


def _per_pair(model: ModelSpec, cluster: Cluster, train: TrainSpec, cand: dict[str, Any],
              cal: Calibration) -> _PerPair:
    ctx = ComputeContext.of(model, cluster.accelerator, train, cal)
    # distinct (t, c, b, e, etp, all-to-all degree): of the enumeration's (structure,
    # micro-batch) pairs when known (many pairs differ only in pp, dp or the partition),
    # else of a packed integer key; the costs are elementwise, so evaluating each once and
    # gathering gives the same bits
    of_pair = None
    if "pair" in cand and "_pairs" in cand:
        pairs = cand["_pairs"]
        keys = np.stack([pairs["tp"], pairs["cp"], pairs["micro_batch"], pairs["ep"],
                         pairs["etp"],
                         ulysses_degree(pairs["cp"], pairs["cp_kind"], pairs["ulysses"])])
        of_pair = _dense_ids(list(keys))  # `np.unique(keys, axis=1)`'s ids, without its sort
        uniq = keys[:, _one_of_each(of_pair)]
        inverse = of_pair[np.asarray(cand["pair"])]
    else:
        a2a = ulysses_degree(cand["cp"], cand["cp_kind"], cand["ulysses"])
        cols = [np.asarray(cand[k], dtype=np.int64)
                for k in ("tp", "cp", "micro_batch", "ep", "etp")]
        cols.append(np.asarray(np.broadcast_to(a2a, cols[0].shape), dtype=np.int64))
        packed = np.zeros_like(cols[0])
        for col in cols:
            packed = packed * (int(col.max()) + 1) + col
        _, first, inverse = np.unique(packed, return_index=True, return_inverse=True)
        uniq = np.stack([col[first] for col in cols])
        inverse = inverse.reshape(cols[0].shape)
    n_rc = len(RC_CODES)
    sp_rc = np.array([(sp, rc) for sp in (0, 1) for rc in range(n_rc)], dtype=np.int64)
    g_idx, q_idx = np.divmod(np.arange(uniq.shape[1] * 2 * n_rc), 2 * n_rc)
    small = {"tp": uniq[0, g_idx], "cp": uniq[1, g_idx], "micro_batch": uniq[2, g_idx],
             "ep": uniq[3, g_idx], "etp": uniq[4, g_idx], "sp": sp_rc[q_idx, 0],
             "recompute": sp_rc[q_idx, 1], "a2a": uniq[5, g_idx]}
    costs = compute_costs(ctx, small["tp"], small["cp"], small["micro_batch"], small["sp"],
                          small["recompute"], small["ep"], small["etp"])

    def per_layer(moe: bool) -> Any:
        return activation_bytes_per_layer(
            model, train.seq_len, small["micro_batch"], tp=small["tp"], sp=small["sp"],
            cp=small["cp"], recompute=small["recompute"], flash=train.flash_attention,
            dtype=train.dtype, moe=moe, impl=train.profile, etp=small["etp"],
            a2a=small["a2a"],
            fp8_inputs=ctx.fp8.saved_input_bytes() if ctx.fp8 else 0.0,
            modules=train.recompute_modules, act_fp8_store=train.act_fp8_store,
            offload_modules=train.offload_modules, routed_load=train.routed_load,
            full_share=train.recompute_share)

    act = {"dense": per_layer(False), "moe": per_layer(True) if model.is_moe else 0.0}
    return _PerPair(ctx, Links.of(cluster, cal), costs, act, inverse, len(g_idx), of_pair)


def _terms(model: ModelSpec, cluster: Cluster, train: TrainSpec, cand: dict[str, Any],
           shared: _PerPair, inverse: Any, memory: bool = True) -> dict[str, Any]:
    """`evaluate_candidates` of the layouts `cand`, their per-pair indices `inverse` (the
    peak memory only with `memory`)."""
    ctx, n_rc = shared.ctx, len(RC_CODES)
    index = inverse * 2 * n_rc + cand["sp"] * n_rc + cand["recompute"]

    def gather(value: Any) -> Any:
        return _gathered(value, shared.size, index)

    full_costs = {k: gather(v) for k, v in shared.costs.items()}
    partition = _partition(cand)
    terms = step_terms(ctx, shared.links, train, **{k: cand[k] for k in _STEP_KEYS},
                       costs=full_costs, partition=partition)
    model_flops, hardware = flops_per_token(model, train.seq_len)
    hw = np.array([hardware[i] for i in range(n_rc)])[cand["recompute"]]
    tokens = cand["m"] * cand["micro_batch"] * cand["dp"] * train.seq_len
    terms.update(finish(terms, model_flops, hw, tokens, cluster.n_gpus, ctx.peak,
                        flops_per_token(model, train.seq_len, causal=True)[0]))
    if memory:
        terms["memory"] = peak_stage_total(model, train, **{k: cand[k] for k in _STEP_KEYS},
                                           act={k: gather(v) for k, v in shared.act.items()},
                                           partition=partition, generation=ctx.generation)
    return terms


def _without_sp(cand: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """(rows with tp = 1, the sp = 0 columns, for each column the sp = 0 column of its
    recompute) of a rows × (sp, rc) grid (`_blocks`) where skipping tp = 1 rows' sp = 1
    columns saves at least `_SPLIT_MIN_CELLS`; None otherwise."""
    tp, sp, rc = (np.asarray(cand[k]) for k in ("tp", "sp", "recompute"))
    if sp.shape != rc.shape:
        return None
    lone, columns = tp[:, 0] == 1, np.nonzero(sp[0] == 0)[0]
    saved = int(lone.sum()) * (sp.shape[1] - len(columns))
    if lone.all() or saved < _SPLIT_MIN_CELLS:
        return None
    of_rc = {int(rc[0, j]): i for i, j in enumerate(columns)}
    if set(of_rc) != {int(x) for x in rc[0]}:
        return None
    return lone, columns, np.array([of_rc[int(x)] for x in rc[0]])


def _take(cand: dict[str, Any], rows: Any, columns: Any) -> dict[str, Any]:
    """The grid's `rows` (and `columns`, when given) of every array in `cand`."""
    n_rows, n_cols = np.shape(cand["tp"])[0], np.shape(cand["sp"])[1]
    out = {}
    for key, value in cand.items():
        if not key.startswith("_") and np.ndim(value) == 2:
            value = value[rows] if np.shape(value)[0] == n_rows else value
            if columns is not None and np.shape(value)[1] == n_cols:
                value = value[:, columns]
            value = _wide(value)
        out[key] = value
    return out


def _partition(cand: dict[str, Any]) -> Partition:
    """The searched stage partitions of arrays of layouts (`grid._partitions`), () for the
    default one."""
    if "first_less" not in cand:
        return ()
    return fixed_or_balanced(cand)


def _layout_of(cand: dict[str, Any], i: int) -> Layout:
    """Layout `i` of the arrays, a searched partition as its explicit layers per stage."""
    values: dict[str, Any] = {key: int(cand[key][i]) for key in _STEP_KEYS if key != "m"}
    values.update(sp=bool(values["sp"]), schedule=get_schedule(values["schedule"]).name,
                  recompute=RC_NAMES[values["recompute"]], cp_kind=CP_KINDS[values["cp_kind"]])
    if "first_less" in cand:
        key = (values["pp"], int(cand["first_less"][i]), int(cand["last_less"][i]))
        values["partition"] = cand["_partitions"][key]
    return Layout(**values)


def simulated(cand: dict[str, Any]) -> Any:
    """Which layouts' step time takes its bubble from the schedule simulator (pp > 1 and at
    most `SIMULATED_ACTIONS`): `evaluate_layout`'s figure; array-generic."""
    return (cand["pp"] > 1) & (cand["pp"] * cand["m"] * cand["chunks"] <= SIMULATED_ACTIONS)


def candidate_goodput(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                      cand: dict[str, Any], reliability: Reliability) -> dict[str, Any]:
    """`estimate.goodput.checkpoint_timing` of arrays of layouts (the search's flat `cand`)."""
    return checkpoint_timing(model, cluster, train, reliability,
                             **{k: cand[k] for k in _STEP_KEYS if k != "m"},
                             partition=_partition(cand))


def evaluate_layout(model: ModelSpec, cluster: Cluster, train: TrainSpec, layout: Layout,
                    calib: Calibration | None = None, headroom: float = DEFAULT_HEADROOM,
                    *, simulate: bool = True, reliability: Reliability | None = None
                    ) -> PlanEntry:
    """One layout, evaluated with the scalar model (its bubble from the simulator when the
    schedule is small enough to simulate quickly: `simulated`); with `reliability`, its
    goodput too (`estimate.goodput.estimate_goodput`)."""
    stages = training_memory_per_gpu(
        model, layout, train, generation=generation(cluster.accelerator.calibration_name))
    peak = max(stages, key=lambda st: st.total)
    # equal stages: the closed forms equal it (tested); uneven: the exact bubble
    run = simulated({"pp": layout.pp, "m": layout.microbatches(train), "chunks": layout.chunks})
    estimate = estimate_step(model, cluster, layout, train, calib,
                             simulate=simulate and bool(run))
    goodput = (None if reliability is None else
               estimate_goodput(model, cluster, layout, train, estimate.total, reliability))
    return PlanEntry(layout, estimate, peak, cluster.accelerator.memory_bytes * headroom,
                     goodput=goodput)


# ------------------------------------------------------- the pruned search's pieces (`prune`)
def shared_costs(model: ModelSpec, cluster: Cluster, train: TrainSpec, cand: dict[str, Any],
                 calib: Calibration) -> _PerPair:
    """Compute costs and activation bytes per (structure, micro-batch) × (sp, rc) of the
    planner's grid, evaluated once for all the calls below."""
    return _per_pair(model, cluster, train, cand, calib)


class RunGeometries:
    """The stage geometries (`distinct_geometries`) of the grid's runs — rows that differ
    only in the ZeRO stage and group — worked out once per (pp, chunks) for all its runs and
    taken for each block of rows (`memory_grid`); thread-safe."""

    def __init__(self, model: ModelSpec, cand: dict[str, Any]) -> None:
        key = np.stack([np.asarray(cand[k])[:, 0] for k in ("pair", "schedule", "chunks")])
        starts = np.ones(key.shape[1], dtype=bool)
        np.any(key[:, 1:] != key[:, :-1], axis=0, out=starts[1:])
        self.first = np.flatnonzero(starts)  # each run's first row (runs are contiguous)
        self.run = np.cumsum(starts) - 1  # each row's run
        self.model, self.cand = model, cand
        self._heads = {k: np.asarray(cand[k])[self.first, 0]  # each run's fields
                       for k in ("pp", "chunks", "schedule", "m", "first_less", "last_less")
                       if k in cand}
        self._groups: dict[tuple[int, int], tuple[np.ndarray, list[StageGeometry]]] = {}
        self._lock = threading.Lock()

    def by_stages(self) -> list[np.ndarray]:
        """The grid's rows grouped by (pp, chunks), each group's ascending: the memory model
        evaluates every stage and chunk up to the largest in its arrays, so each group costs
        only its own (`memory_grid`). Worked out per run: a run shares them."""
        key = _dense_ids([self._heads[k] for k in ("pp", "chunks")])
        order = np.argsort(key.astype(np.uint16), kind="stable")  # few keys: a radix sort
        length = np.diff(np.append(self.first, len(self.run)))  # each run's rows
        out = []
        for runs in np.split(order, np.flatnonzero(np.diff(key[order])) + 1):
            n = length[runs]  # row r of the group: its run's first row + its place in the run
            out.append(np.arange(n.sum()) + np.repeat(self.first[runs] - (np.cumsum(n) - n), n))
        return out

    def of(self, runs: np.ndarray) -> list[StageGeometry]:
        """The geometries of `runs` (ascending run ids of one pp and chunk count), fields
        `(runs, 1)`; slots that only repeat the first stage for all of them left out."""
        pp, chunks = (int(self._heads[k][runs[0]]) for k in ("pp", "chunks"))
        with self._lock:
            if (pp, chunks) not in self._groups:
                self._groups[pp, chunks] = self._group(pp, chunks)
        position, geos = self._groups[pp, chunks]
        at = position[runs][:, None]
        out = [geo.take(at) for geo in geos]
        return out[:1] + [geo for geo in out[1:] if not np.array_equal(geo.stage, out[0].stage)]

    def _group(self, pp: int, chunks: int) -> tuple[np.ndarray, list[StageGeometry]]:
        """(each run's position among the group's runs, -1 elsewhere; their geometries)."""
        heads = self._heads
        mine = np.flatnonzero((heads["pp"] == pp) & (heads["chunks"] == chunks))
        one = {k: _wide(v[mine]) for k, v in heads.items()}
        position = np.full(len(self.first), -1)
        position[mine] = np.arange(len(mine))
        geos = distinct_geometries(self.model, one["pp"], candidate_stages(self.model, one["pp"]),
                                   chunks=one["chunks"], schedule=one["schedule"], m=one["m"],
                                   partition=_partition(one | {"_partitions": self.cand.get(
                                       "_partitions", {})}))
        return position, geos


def memory_grid(model: ModelSpec, train: TrainSpec, cand: dict[str, Any], shared: _PerPair,
                rows: Any, geometries: RunGeometries | None = None) -> Any:
    """Peak per-stage memory (`peak_stage_total`) of the grid's `rows` (ascending) × every
    (sp, rc) column; `rows` should share one pp and chunk count, so that only its stages are
    evaluated. `geometries`: the grid's `RunGeometries`, when shared by several calls."""
    # runs: rows that differ only in the ZeRO stage and group (`peak_stage_total_runs`)
    runs = geometries or RunGeometries(model, cand)
    of_row = runs.run[rows]
    starts = np.ones(len(rows), dtype=bool)
    np.not_equal(of_row[1:], of_row[:-1], out=starts[1:])
    first, run = np.flatnonzero(starts), np.cumsum(starts) - 1
    heads = _take(cand, rows[first], None)  # each run's fields (runs, 1); sp, rc (1, cols)
    index = shared.inverse[rows[first]] * 2 * len(RC_CODES) + heads["sp"] * len(RC_CODES) \
        + heads["recompute"]
    act = {k: np.broadcast_to(v, (shared.size,))[index] for k, v in shared.act.items()}
    zero = {k: _wide(np.asarray(cand[k])[rows]) for k in ("zero", "zero_group")}  # (rows, 1)
    return peak_stage_total_runs(model, train, **{k: heads[k] for k in _STEP_KEYS} | zero,
                                 first=first, run=run, act=act,
                                 generation=shared.ctx.generation,
                                 geometries=runs.of(of_row[first]))


# the step-time terms that depend on neither the ZeRO stage (beyond FP8 weight casts under
# ZeRO-3, which only add) nor the ZeRO group, and are never simulated (the bubble is)
FLOOR_TERMS = ("compute", "tp_comm", "cp_comm_exposed", "ep_comm", "pp_comm")


def step_floor(model: ModelSpec, cluster: Cluster, train: TrainSpec, cand: dict[str, Any],
               shared: _PerPair, rows: Any, shapes: StageShape | None = None) -> Any:
    """A lower bound on the figure of every ZeRO variant of the grid's `rows` (× the (sp, rc)
    columns) less its exposed DP/ZeRO traffic (`dp_floor` bounds that): `FLOOR_TERMS` of
    `estimate.step.step_terms` at ZeRO stage 0, plus the closed-form bubble, or for the
    uneven pipelines the ranking simulates a lower bound on the simulator's
    (`simulated_bubble_floor`) — the step time is their sum plus the bubble, the exposed
    DP/ZeRO traffic and the optimizer step, each ≥ 0, and the ranking's figure is the step
    time, for those pipelines with the simulated bubble in place of the closed form's
    (`rank`). `prune` checks the bound on every layout it times. `shapes`: the rows'
    `run_shapes`, when already evaluated."""
    sub = _take(cand, rows, None)
    sub["zero"] = np.zeros_like(sub["zero"])
    sub["zero_group"] = np.zeros_like(sub["zero_group"])
    index = shared.inverse[rows] * 2 * len(RC_CODES) + sub["sp"] * len(RC_CODES) \
        + sub["recompute"]

    def gather(value: Any) -> Any:
        return _gathered(value, shared.size, index)

    shape = None if shapes is None else StageShape(*(np.asarray(x)[:, None] for x in shapes))
    terms = step_terms(shared.ctx, shared.links, train, **{k: sub[k] for k in _STEP_KEYS},
                       costs={k: gather(v) for k, v in shared.costs.items()},
                       partition=_partition(sub), shape=shape, floor=True)
    floor = sum(np.asarray(terms[k], dtype=float) for k in FLOOR_TERMS)
    # the closed-form bubble is the figure's too, except where the ranking simulates it
    most = stage_extremes(model.n_layers, sub["pp"], sub["chunks"], _partition(sub))[0]
    pending = simulated(sub) & (most * sub["pp"] != model.n_layers)
    return floor + np.where(pending, _simulated_floor(model, sub, terms, pending),
                            np.asarray(terms["bubble"], dtype=float))


def _simulated_floor(model: ModelSpec, sub: dict[str, Any], terms: dict[str, Any],
                     pending: Any) -> Any:
    """`estimate.step.simulated_bubble_floor` of the `pending` rows of `sub` (`(rows, 1)`,
    with their `step_terms` `terms`), one stage geometry at a time; 0 elsewhere."""
    shape = np.broadcast(terms["t_forward"], sub["m"]).shape
    t_f, t_b, t_w, m = (np.broadcast_to(np.asarray(x, dtype=float), shape) for x in (
        terms["t_forward"], terms["t_backward"], terms["t_wgrad"], sub["m"]))
    out = np.zeros(shape)
    rows = np.flatnonzero(np.ravel(pending))
    keys = [k for k in ("pp", "chunks", "schedule", "first_less", "last_less") if k in sub]
    geometry = _dense_ids([np.asarray(sub[k])[rows, 0] for k in keys])
    for at in _one_of_each(geometry):  # a row of each geometry
        one = {k: int(sub[k][rows[at], 0]) for k in keys}
        layout = Layout(pp=one["pp"], chunks=one["chunks"],
                        schedule=get_schedule(one["schedule"]).name,
                        partition=sub["_partitions"][one["pp"], one["first_less"],
                                                     one["last_less"]]
                        if "first_less" in one else ())
        mine = rows[geometry == geometry[at]]
        out[mine] = simulated_bubble_floor(layout, m[mine], t_f[mine], t_b[mine], t_w[mine],
                                           model.n_layers)
    return out


def run_shapes(model: ModelSpec, cand: dict[str, Any], shared: _PerPair, rows: Any
               ) -> StageShape:
    """`estimate.stages.stage_shape` of the grid's `rows` (flat arrays, one per row): the
    same for every ZeRO variant and (sp, rc) column of a row. Rows with equal inputs (runs
    that differ only in the micro-batch often share them) are evaluated once: the function
    is elementwise and the rows kept hold every pp and chunk count, so the bits agree."""
    cells = flat_cells(cand, rows, np.zeros_like(rows))
    keys = ("tp", "pp", "cp", "ep", "dp", "chunks", "schedule", "etp", "first_less",
            "last_less")
    ids = _dense_ids([cells[k] for k in keys if k in cells])
    first = _one_of_each(ids)  # a row of each id, in id order
    one = {k: v if k.startswith("_") else v[first] for k, v in cells.items()}
    shape = stage_shape(model, shared.links.gpus_per_node, tp=one["tp"], pp=one["pp"],
                        cp=one["cp"], ep=one["ep"], dp=one["dp"], chunks=one["chunks"],
                        schedule=one["schedule"], partition=_partition(one), etp=one["etp"])
    return StageShape(*(np.broadcast_to(x, np.shape(first))[ids] for x in shape))


def dp_floor(train: TrainSpec, cand: dict[str, Any], shared: _PerPair, shapes: StageShape,
             rows: Any, of_row: Any) -> Any:
    """A lower bound on the exposed DP/ZeRO seconds of every (sp, rc) column of the grid's
    `rows`, whose stage shapes are `shapes` at `of_row` (`run_shapes`): `dp_comm_total`
    (`estimate.step.dp_total`) where the stack does not overlap the row's ZeRO stage —
    `axes.dp_time` exposes all of it, and the pipeline engine's extra DP time only adds —
    and 0 where it does. It depends on no column. Rows with equal inputs (every field of
    the shape, m, the ZeRO stage and group: runs that differ in the partition or the CP kind
    often share them) are evaluated once; the function is elementwise, so the bits agree."""
    zero, group, m = (_wide(np.asarray(cand[k])[rows, 0]) for k in ("zero", "zero_group", "m"))
    at = _one_of_each(of_row)  # a row of each run (m is the run's)
    same_run = equal_rows([*(np.asarray(x, dtype=float) for x in shapes), m[at]])[1]
    ids = _dense_ids([same_run[of_row], zero, group])
    first = _one_of_each(ids)  # a row of each id, in id order
    out = np.zeros(len(first))
    overlapped = train.settings().dp_overlapped
    for stage in range(4):  # one stage at a time: `dp_total` evaluates only its collectives
        mine = zero[first] == stage
        pick = first[mine]
        if not len(pick) or overlapped(stage):
            continue
        shape = StageShape(*(x[of_row[pick]] for x in shapes))
        out[mine] = dp_total(shared.ctx, shared.links, train, shape, zero=stage,
                             zero_group=group[pick], m=m[pick])
    return out[ids]


def flat_cells(cand: dict[str, Any], rows: Any, cols: Any) -> dict[str, Any]:
    """The grid's cells (`rows[i]`, `cols[i]`) as flat arrays, the grid's tables kept."""
    n_cols = np.shape(cand["sp"])[1]
    out: dict[str, Any] = {}
    for key, value in cand.items():
        if key.startswith("_"):
            out[key] = value
        elif np.shape(value)[1] == n_cols and np.shape(value)[0] == 1:
            out[key] = _wide(value[0, cols])
        else:
            out[key] = _wide(value[rows, 0])
    out.pop("_valid", None)
    return out


def cell_terms(model: ModelSpec, cluster: Cluster, train: TrainSpec, cells: dict[str, Any],
               shared: _PerPair, keys: Sequence[str]) -> dict[str, Any]:
    """`evaluate_candidates`' `keys` of flat cells (`flat_cells`), with the costs `shared`
    (`memory` alone: the peak memory without the step time)."""
    inverse = shared.of_pair[cells["pair"]]
    if tuple(keys) == ("memory",):
        index = inverse * 2 * len(RC_CODES) + cells["sp"] * len(RC_CODES) + cells["recompute"]
        act = {k: _gathered(v, shared.size, index) for k, v in shared.act.items()}
        return {"memory": np.asarray(peak_stage_total(
            model, train, **{k: cells[k] for k in _STEP_KEYS}, act=act,
            partition=_partition(cells), generation=shared.ctx.generation), dtype=float)}
    terms = _terms(model, cluster, train, cells, shared, inverse, memory="memory" in keys)
    return {k: np.asarray(terms[k], dtype=float) for k in keys}
