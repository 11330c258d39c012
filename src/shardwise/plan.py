"""The layout planner: an exhaustive, vectorised search over every layout (SPEC §7).

    plan(model, cluster, train, top=10) -> PlanResult

The search space is the Cartesian product of

    tp (divisors of gpus-per-node) × pp (divisors of n_layers) × cp (powers of two) ×
    ep (divisors of n_experts) × micro-batch (1..16) × schedule (1F1B, ZB-H1, interleaved
    with every v that divides the layers) × ZeRO (0-3, and hybrid shard over groups of
    2, 4, 8, … ranks for stages 1-3) × sequence parallel × recompute (none, selective, full)

with `dp = GPUs / (tp·pp·cp)`. It is pruned level by level (structure, micro-batch, schedule,
ZeRO, per-rank options), each rejected region counted with its reason (the rules are
`Layout.problems`'), and the survivors are evaluated *as arrays*: the step-time model of
`estimate.step` (the same `step_terms` function the scalar `estimate_step` calls, with the
per-layer compute costs evaluated once per distinct `(tp, cp, micro-batch, sp, recompute)` and
gathered) and per-stage memory (the formulas of `estimate.memory.training_memory_per_gpu`,
vectorised here and tested equal to it). Layouts whose largest stage exceeds GPU memory ×
headroom are rejected with the amount they miss by; the rest are ranked by step time (ties:
the simpler layout). The top `k` are re-evaluated with the scalar code (`estimate_step`,
`training_memory_per_gpu`, the schedule simulator for the bubble) and explained.

`choose_parallelism` is SPEC §7's decision procedure, kept as the baseline the search is
compared with.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.calibration import Calibration, default_calibration
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.compute import RC_CODES, ComputeContext
from shardwise.estimate.memory import (
    MemoryBreakdown,
    activation_bytes_per_layer,
    bytes_per_param_training,
    training_memory_per_gpu,
)
from shardwise.estimate.step import (
    SCHEDULE_CODES,
    Links,
    StepEstimate,
    compute_costs,
    estimate_step,
    finish,
    flops_per_token,
    step_terms,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.units import dtype_bytes

__all__ = [
    "PlanEntry",
    "PlanResult",
    "Rejection",
    "SearchSpace",
    "choose_parallelism",
    "evaluate_candidates",
    "evaluate_layout",
    "plan",
]

RC_NAMES = {code: name for name, code in RC_CODES.items()}
SCHEDULE_NAMES = {code: name for name, code in SCHEDULE_CODES.items()}
DEFAULT_HEADROOM = 0.85


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------- search space
@dataclass(frozen=True)
class SearchSpace:
    """The values each axis may take (`None`: the default described in the module docstring)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    zero_groups: tuple[int, ...] | None = None
    sp: tuple[bool, ...] = (False, True)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "zb-h1", "interleaved")
    chunks: tuple[int, ...] | None = None
    max_cp: int = 32
    max_micro_batch: int = 16

    def resolve(self, model: ModelSpec, cluster: Cluster, train: TrainSpec) -> dict[str, list]:
        """Concrete value lists for this model and cluster."""
        n = cluster.n_gpus
        tp = list(self.tp or _divisors(cluster.gpus_per_node))
        pp = list(self.pp or [d for d in _divisors(model.n_layers) if d <= n])
        cp = list(self.cp or [c for c in (2**k for k in range(0, 16))
                              if (c <= min(self.max_cp, n) and train.seq_len % (2 * c) == 0)
                              or c == 1])
        ep = list(self.ep or (_divisors(model.n_experts) if model.is_moe else [1]))
        mb = list(self.micro_batch or range(1, self.max_micro_batch + 1))
        chunks = list(self.chunks or [d for d in _divisors(model.n_layers) if d >= 2])
        groups = list(self.zero_groups or [2**k for k in range(1, 20) if 2**k < n])
        sched: list[tuple[int, int]] = []
        for name in self.schedules:
            if name not in SCHEDULE_CODES:
                raise ShardwiseError(f"unknown schedule {name!r}; valid: "
                                     f"{', '.join(SCHEDULE_CODES)}")
            if name == "interleaved":
                sched += [(SCHEDULE_CODES[name], v) for v in chunks if v >= 2]
            else:
                sched.append((SCHEDULE_CODES[name], 1))
        zero: list[tuple[int, int]] = [(z, 0) for z in self.zero]
        zero += [(z, g) for z in self.zero if z >= 1 for g in groups]
        for name in self.recompute:
            if name not in RC_CODES:
                raise ShardwiseError(f"unknown recompute {name!r}; valid: none, selective, full")
        return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "mb": mb, "sched": sched,
                "zero": zero, "sp": [int(bool(x)) for x in self.sp],
                "rc": [RC_CODES[r] for r in self.recompute]}


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Rejection:
    """A rejected region of the search space: why, how many grid points, an example."""

    reason: str
    count: int
    example: str = ""
    category: str = "constraint"


@dataclass(frozen=True)
class PlanEntry:
    """One evaluated layout: its step estimate, its largest stage's memory, the budget."""

    layout: Layout
    estimate: StepEstimate
    memory: MemoryBreakdown
    budget: float
    rank: int | None = None

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "layout": self.layout.to_dict(), "short": self.layout.short(),
                "estimate": self.estimate.to_dict(),
                "memory": self.memory.as_dict() | {"stage": self.memory.stage,
                                                   "in_flight": self.memory.in_flight},
                "budget_bytes": self.budget, "fits": self.fits}


@dataclass(frozen=True)
class Alternative:
    """The best layout when one axis is held at another value (for the explanation)."""

    axis: str
    value: Any
    best_total: float | None
    best_layout: str | None
    min_memory: float | None


@dataclass(frozen=True)
class SearchStats:
    grid: int
    evaluated: int
    fits: int
    seconds: float
    evaluation_seconds: float

    @property
    def layouts_per_s(self) -> float:
        return self.evaluated / self.evaluation_seconds if self.evaluation_seconds else 0.0


@dataclass(frozen=True)
class PlanResult:
    model: ModelSpec
    cluster: Cluster
    train: TrainSpec
    headroom: float
    budget: float
    calibration: Calibration
    ranked: list[PlanEntry]
    rejected: list[Rejection]
    stats: SearchStats
    baseline: PlanEntry | None = None
    baseline_note: str = ""
    given: PlanEntry | None = None
    given_note: str = ""
    alternatives: list[Alternative] = field(default_factory=list)

    @property
    def best(self) -> PlanEntry:
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "cluster": {"gpus": self.cluster.n_gpus, "gpus_per_node": self.cluster.gpus_per_node,
                        "accelerator": self.cluster.accelerator.name,
                        "intra": self.cluster.intra.name, "inter": self.cluster.inter.name},
            "train": asdict(self.train), "headroom": self.headroom, "budget_bytes": self.budget,
            "ranked": [e.to_dict() for e in self.ranked],
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "baseline_note": self.baseline_note,
            "given": self.given.to_dict() if self.given else None, "given_note": self.given_note,
            "rejected": [asdict(r) for r in self.rejected],
            "alternatives": [asdict(a) for a in self.alternatives],
            "stats": asdict(self.stats) | {"layouts_per_s": self.stats.layouts_per_s},
            "calibration": self.calibration.to_dict(),
        }


# ---------------------------------------------------------------------------- enumeration
class _Rejections:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.examples: dict[str, str] = {}
        self.category: dict[str, str] = {}

    def add(self, reason: str, count: int, example: str = "", category: str = "constraint"
            ) -> None:
        if count <= 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + int(count)
        self.examples.setdefault(reason, example)
        self.category.setdefault(reason, category)

    def result(self) -> list[Rejection]:
        return sorted((Rejection(r, c, self.examples[r], self.category[r])
                       for r, c in self.counts.items()), key=lambda r: -r.count)


def _structure_reason(problem: str) -> str:
    """A region name for a `Layout.problems` sentence (numbers stripped)."""
    rules = (("n_heads", "tp does not divide the attention heads"),
             ("n_kv_heads", "tp does not fit the key/value heads"),
             ("d_ff", "tp does not divide the FFN width"),
             ("n_layers", "pp does not divide the layers"),
             ("n_experts", "ep does not divide the experts"),
             ("dp·cp", "ep does not divide dp·cp"),
             ("2·cp", "2·cp does not divide the sequence length"),
             ("ring attention", "context parallelism needs FlashAttention"))
    for key, reason in rules:
        if key in problem:
            return reason
    return problem


def _enumerate(model: ModelSpec, cluster: Cluster, train: TrainSpec, space: SearchSpace,
               rejections: _Rejections) -> tuple[dict[str, np.ndarray], int]:
    """All valid candidates as flat int arrays (and the grid size)."""
    axes = space.resolve(model, cluster, train)
    n_gpus, gb, s = cluster.n_gpus, train.global_batch, train.seq_len
    assert gb is not None
    inner = [len(axes[k]) for k in ("mb", "sched", "zero", "sp", "rc")]
    grid = (len(axes["tp"]) * len(axes["pp"]) * len(axes["cp"]) * len(axes["ep"])
            * math.prod(inner))

    # level 1: structures (tp, pp, cp, ep) and dp = GPUs / (tp·pp·cp)
    per_structure = math.prod(inner)
    rows = []
    for t, p, c, e in itertools.product(axes["tp"], axes["pp"], axes["cp"], axes["ep"]):
        if n_gpus % (t * p * c):
            rejections.add("tp·pp·cp does not divide the GPU count", per_structure,
                           f"tp={t} pp={p} cp={c}: {t * p * c} ∤ {n_gpus}")
            continue
        dp = n_gpus // (t * p * c)
        problems = Layout(dp=dp, tp=t, pp=p, cp=c, ep=e).problems(model)
        if c > 1 and not train.flash_attention:
            problems.append("context parallelism (ring attention) needs FlashAttention")
        elif c > 1 and s % (2 * c):
            problems.append(f"2·cp={2 * c} does not divide seq_len={s}")
        if problems:
            rejections.add(_structure_reason(problems[0]), per_structure, problems[0])
            continue
        if dp > gb:
            rejections.add("more data-parallel replicas than sequences per step", per_structure,
                           f"dp={dp} > global batch {gb}")
            continue
        rows.append((t, p, c, e, dp))
    if not rows:
        return {}, grid
    st = np.array(rows, dtype=np.int64)

    # level 2: × micro-batch — the global batch must split into dp·mb
    mb = np.array(axes["mb"], dtype=np.int64)
    s_idx, m_idx = np.divmod(np.arange(len(st) * len(mb)), len(mb))
    dp_, b_ = st[s_idx, 4], mb[m_idx]
    ok = gb % (dp_ * b_) == 0
    rest = math.prod(inner[1:])
    rejections.add("global batch is not a multiple of dp·micro-batch", int((~ok).sum()) * rest,
                   _example(~ok, lambda i: f"dp={dp_[i]} mb={b_[i]}: {gb} sequences"))
    pair = np.nonzero(ok)[0]
    pairs = {"t": st[s_idx[pair], 0], "p": st[s_idx[pair], 1], "c": st[s_idx[pair], 2],
             "e": st[s_idx[pair], 3], "dp": dp_[pair], "b": b_[pair]}
    pairs["m"] = gb // (pairs["dp"] * pairs["b"])
    n_pairs = len(pair)

    # level 3: × schedule (code, chunks)
    sched = np.array(axes["sched"], dtype=np.int64).reshape(-1, 2)
    p_idx, k_idx = np.divmod(np.arange(n_pairs * len(sched)), len(sched))
    p3, m3 = pairs["p"][p_idx], pairs["m"][p_idx]
    code, v = sched[k_idx, 0], sched[k_idx, 1]
    rest = math.prod(inner[2:])
    single = (p3 == 1) & ~((code == SCHEDULE_CODES["1f1b"]) & (v == 1))
    rejections.add("pp=1 has no pipeline schedule (same as 1F1B)", int(single.sum()) * rest,
                   category="duplicate")
    inter = code == SCHEDULE_CODES["interleaved"]
    bad_layers = ~single & inter & (model.n_layers % (p3 * v) != 0)
    rejections.add("pp·chunks does not divide the layers", int(bad_layers.sum()) * rest,
                   _example(bad_layers, lambda i: f"pp={p3[i]} chunks={v[i]}"))
    bad_m = ~single & inter & ~bad_layers & (m3 % p3 != 0)
    rejections.add("interleaved 1F1B needs micro-batches divisible by pp",
                   int(bad_m.sum()) * rest,
                   _example(bad_m, lambda i: f"pp={p3[i]}, {m3[i]} micro-batches"))
    keep = np.nonzero(~(single | bad_layers | bad_m))[0]
    lvl3 = {"pair": p_idx[keep], "sched": code[keep], "v": v[keep]}

    # level 4: × ZeRO (stage, hybrid group)
    zero = np.array(axes["zero"], dtype=np.int64).reshape(-1, 2)
    a_idx, z_idx = np.divmod(np.arange(len(keep) * len(zero)), len(zero))
    pr = lvl3["pair"][a_idx]
    replicas = pairs["dp"][pr] * pairs["c"][pr]
    z, zg = zero[z_idx, 0], zero[z_idx, 1]
    rest = math.prod(inner[3:])
    lone = (replicas == 1) & (z > 0)
    rejections.add("ZeRO with a single data-parallel replica (same as stage 0)",
                   int(lone.sum()) * rest, category="duplicate")
    whole = ~lone & (zg > 0) & (zg >= replicas)
    rejections.add("hybrid shard group ≥ dp·cp (same as full shard)", int(whole.sum()) * rest,
                   category="duplicate")
    bad_zg = ~lone & ~whole & (zg > 0) & (replicas % np.maximum(zg, 1) != 0)
    rejections.add("hybrid shard group does not divide dp·cp", int(bad_zg.sum()) * rest,
                   _example(bad_zg, lambda i: f"zero_group={zg[i]}, dp·cp={replicas[i]}"))
    keep4 = np.nonzero(~(lone | whole | bad_zg))[0]
    lvl4 = {"l3": a_idx[keep4], "zero": z[keep4], "zg": zg[keep4]}

    # level 5: × sequence parallel × recompute, kept as a broadcast inner axis: the outer
    # combinations are rows, the (sp, rc) pairs columns, and `valid` marks the layouts
    sp_rc = np.array([(sp, rc) for sp in axes["sp"] for rc in axes["rc"]], dtype=np.int64)
    l3 = lvl4["l3"]
    pr = lvl3["pair"][l3]
    t5, c5 = pairs["t"][pr][:, None], pairs["c"][pr][:, None]
    sp, rc = sp_rc[:, 0][None, :], sp_rc[:, 1][None, :]
    no_tp = (sp == 1) & (t5 == 1)
    rejections.add("sequence parallelism without tp (same as without)", int(no_tp.sum()),
                   category="duplicate")
    bad_sp = ~no_tp & (sp == 1) & (s % (t5 * c5) != 0)
    rejections.add("tp·cp does not divide the sequence (sequence parallel)", int(bad_sp.sum()),
                   _example(bad_sp.any(axis=1), lambda i: f"tp={t5[i, 0]} cp={c5[i, 0]}, "
                                                          f"s={s}"))
    valid = ~(no_tp | bad_sp)
    cand = {key: pairs[key][pr][:, None] for key in ("t", "p", "c", "e", "dp", "b", "m")}
    cand.update(sched=lvl3["sched"][l3][:, None], v=lvl3["v"][l3][:, None],
                zero=lvl4["zero"][:, None], zg=lvl4["zg"][:, None], sp=sp, rc=rc,
                pair=pr[:, None])
    cand["_pairs"] = pairs  # type: ignore[assignment]
    cand["_valid"] = valid  # type: ignore[assignment]
    return cand, grid


def _flatten(cand: dict[str, Any], terms: dict[str, Any] | None = None,
             keys: Sequence[str] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The valid layouts of a broadcast (outer × inner) grid as flat arrays (of `terms`, only
    `keys` when given)."""
    valid = cand["_valid"]
    flat = {k: np.broadcast_to(v, valid.shape)[valid] for k, v in cand.items()
            if not k.startswith("_")}
    flat["_pairs"] = cand["_pairs"]
    if terms is None:
        return flat, None
    out: dict[str, Any] = {}
    for key, value in terms.items():
        if keys is not None and key not in keys:
            continue
        if isinstance(value, dict):
            out[key] = {k: np.broadcast_to(v, valid.shape)[valid] for k, v in value.items()}
        else:
            out[key] = np.broadcast_to(value, valid.shape)[valid]
    return flat, out


def _example(mask: np.ndarray, describe: Callable[[int], str]) -> str:
    hits = np.nonzero(mask)[0]
    return describe(int(hits[0])) if len(hits) else ""


# ---------------------------------------------------------------------------- memory (arrays)
def _activation_per_layer(model: ModelSpec, train: TrainSpec, t: Any, c: Any, b: Any, sp: Any,
                          rc: Any, moe: bool) -> Any:
    """`estimate.memory.activation_bytes_per_layer` (the `train.impl` profile), for arrays."""
    return activation_bytes_per_layer(model, train.seq_len, b, tp=t, sp=sp == 1, cp=c,
                                      recompute=rc, flash=train.flash_attention,
                                      dtype=train.dtype, moe=moe, impl=train.impl)


def _in_flight(sched: Any, p: Any, m: Any, v: Any, stage: Any) -> Any:
    """`estimate.memory.in_flight_per_stage` for one stage index, for arrays."""
    one = np.minimum(p - stage, m)
    inter = np.minimum((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    return np.where(sched == SCHEDULE_CODES["gpipe"], m,
                    np.where(sched == SCHEDULE_CODES["interleaved"], inter, one))


def _moe_layers_on_stage(model: ModelSpec, p: Any, v: Any, stage: Any) -> Any:
    """MoE layers among those `estimate.memory.stage_layers` gives `stage` (arrays)."""
    if not model.is_moe:
        return 0 * p
    q = model.moe_every
    per_chunk = model.n_layers // (p * v)
    total = 0 * p
    for chunk in range(int(np.max(v))):
        start = (chunk * p + stage) * per_chunk
        end = start + per_chunk
        # layers k in [start, end) with k % q == q - 1, i.e. k + 1 in (start, end] a
        # multiple of q
        count = end // q - start // q
        total = total + np.where(chunk < v, count, 0)
    return total


def memory_arrays(model: ModelSpec, train: TrainSpec, cand: dict[str, Any],
                  act: dict[str, Any] | None = None) -> dict[str, Any]:
    """Peak per-GPU bytes over the pipeline stages, and that stage's parts, for arrays of
    layouts: the formulas of `estimate.memory.training_memory_per_gpu`, vectorised. Dense
    models peak on the first or the last stage; MoE models with `moe_every > 1` are checked
    stage by stage."""
    t, p, c, e, dp = cand["t"], cand["p"], cand["c"], cand["e"], cand["dp"]
    b, m, v, sp, rc = cand["b"], cand["m"], cand["v"], cand["sp"], cand["rc"]
    zero, zg, sched = cand["zero"], cand["zg"], cand["sched"]
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    ab = dtype_bytes(train.dtype)
    s, h = train.seq_len, model.d_model
    if act is None:
        act = {"dense": _activation_per_layer(model, train, t, c, b, sp, rc, False),
               "moe": (_activation_per_layer(model, train, t, c, b, sp, rc, True)
                       if model.is_moe else 0.0)}
    norm = model.norm_params()
    kv = np.maximum(model.n_kv_heads // t, 1) * model.head_dim
    attention = 2 * h * h / t + 2 * h * kv
    dense_layer = attention + model.mlp_params() / t + 2 * norm
    expert_layer = (model.n_experts / e * model.mlp_params(model.expert_d_ff) / t
                    if model.is_moe else 0.0 * t)
    moe_dense = (attention + 2 * norm + model.router_params()
                 + model.n_shared_experts * model.mlp_params(model.expert_d_ff) / t)
    zero_n = np.where(zg > 0, zg, dp * c)
    expert_n = np.maximum(zero_n // e, 1)
    layers = model.n_layers // p
    sb = s / c * b
    rep = np.where(sp == 1, t, 1)
    workspace = np.where(zero == 3, 2 * np.maximum(dense_layer, moe_dense + expert_layer)
                         * state.weight, 0.0)

    def shard(params: Any, n: Any) -> tuple[Any, Any, Any]:
        return (params * state.weight / np.where(zero >= 3, n, 1),
                params * state.grad / np.where(zero >= 2, n, 1),
                params * state.optimizer / np.where(zero >= 1, n, 1))

    def stage_total(stage: Any) -> dict[str, Any]:
        moe_layers = _moe_layers_on_stage(model, p, v, stage)
        first, last = stage == 0, stage == p - 1
        dense = (layers - moe_layers) * dense_layer + moe_layers * moe_dense
        dense = dense + np.where(first, model.vocab * h / t + model.learned_positions * h, 0.0)
        head = np.where((not model.tie_embeddings) | (p > 1), model.vocab * h / t, 0.0)
        dense = dense + np.where(last, norm + head, 0.0)
        w, g, o = shard(dense, zero_n)
        we, ge, oe = shard(moe_layers * expert_layer, expert_n)
        flight = _in_flight(sched, p, m, v, stage)
        activations = flight * ((layers - moe_layers) * act["dense"]
                                + moe_layers * act["moe"]) / v
        if model.dropout:
            activations = activations + np.where(first, flight * sb * h / rep, 0.0)
        last_flight = np.where(sched == SCHEDULE_CODES["gpipe"], m, 1)
        activations = activations + np.where(last, last_flight * 2 * sb * h * ab / rep, 0.0)
        logits = np.where(last, last_flight * sb * model.vocab * 4 / t, 0.0)
        parts = {"weights": w + we, "grads": g + ge, "optimizer": o + oe,
                 "activations": activations, "logits": logits, "workspace": workspace,
                 "stage": stage + 0 * p, "in_flight": flight}
        parts["total"] = (parts["weights"] + parts["grads"] + parts["optimizer"]
                          + activations + logits + workspace)
        return parts

    if model.is_moe and model.moe_every > 1:
        stages = [stage_total(np.minimum(i, p - 1)) for i in range(int(np.max(p)))]
    else:
        stages = [stage_total(0 * p), stage_total(p - 1)]
    best = stages[0]
    for other in stages[1:]:
        take = other["total"] > best["total"]
        best = {k: np.where(take, other[k], best[k]) for k in best}
    return best


# ---------------------------------------------------------------------------- evaluation
def evaluate_candidates(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                        cand: dict[str, Any], calib: Calibration | None = None
                        ) -> dict[str, Any]:
    """Step-time terms, rates and peak memory for arrays of layouts (the planner's kernel).

    `cand` holds int arrays `t p c e dp b m sched v zero zg sp rc` (codes as in
    `estimate.step`), flat or broadcastable against each other (the planner passes outer
    combinations as a column and the `(sp, rc)` pairs as a row, so terms that do not depend on
    them are computed once per row). Compute costs are evaluated once per distinct
    `(t, c, b, e)` and `(sp, rc)` and gathered.
    """
    cal = calib or default_calibration(cluster.accelerator.name)
    ctx = ComputeContext.of(model, cluster.accelerator, train, cal)
    links = Links.of(cluster, cal)
    # distinct (t, c, b, e) × (sp, rc) for the compute costs and activations: the
    # enumeration's (structure, micro-batch) pairs when known, else a packed integer key
    if "pair" in cand and "_pairs" in cand:
        pairs = cand["_pairs"]
        uniq = np.stack([pairs["t"], pairs["c"], pairs["b"], pairs["e"]])
        inverse = np.asarray(cand["pair"])
    else:
        cols = [np.asarray(cand[k], dtype=np.int64) for k in ("t", "c", "b", "e")]
        packed = np.zeros_like(cols[0])
        for col in cols:
            packed = packed * (int(col.max()) + 1) + col
        _, first, inverse = np.unique(packed, return_index=True, return_inverse=True)
        uniq = np.stack([col[first] for col in cols])
        inverse = inverse.reshape(cols[0].shape)
    n_u = uniq.shape[1]
    sp_rc = np.array([(sp, rc) for sp in (0, 1) for rc in (0, 1, 2)], dtype=np.int64)
    g_idx, q_idx = np.divmod(np.arange(n_u * 6), 6)
    small = {"t": uniq[0, g_idx], "c": uniq[1, g_idx], "b": uniq[2, g_idx],
             "e": uniq[3, g_idx], "sp": sp_rc[q_idx, 0], "rc": sp_rc[q_idx, 1]}
    costs = compute_costs(ctx, small["t"], small["c"], small["b"], small["sp"], small["rc"],
                          small["e"])
    act = {"dense": _activation_per_layer(model, train, small["t"], small["c"], small["b"],
                                          small["sp"], small["rc"], False),
           "moe": (_activation_per_layer(model, train, small["t"], small["c"], small["b"],
                                         small["sp"], small["rc"], True)
                   if model.is_moe else np.zeros(n_u * 6))}
    index = inverse * 6 + cand["sp"] * 3 + cand["rc"]

    def gather(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, tuple):
            return type(value)(*(gather(x) for x in value)) if hasattr(value, "_fields") \
                else tuple(gather(x) for x in value)
        return np.broadcast_to(value, (n_u * 6,))[index]

    full_costs = {k: gather(v) for k, v in costs.items()}
    terms = step_terms(ctx, links, train, t=cand["t"], p=cand["p"], c=cand["c"], e=cand["e"],
                       dp=cand["dp"], zero=cand["zero"], zg=cand["zg"], sp=cand["sp"],
                       sched=cand["sched"], v=cand["v"], rc=cand["rc"], b=cand["b"],
                       m=cand["m"], costs=full_costs)
    model_flops, hardware = flops_per_token(model, train.seq_len)
    hw = np.array([hardware[i] for i in range(3)])[cand["rc"]]
    tokens = cand["m"] * cand["b"] * cand["dp"] * train.seq_len
    terms.update(finish(terms, model_flops, hw, tokens, cluster.n_gpus, ctx.peak))
    memory = memory_arrays(model, train, cand, {k: gather(v) for k, v in act.items()})
    terms["memory"] = memory["total"]
    terms["memory_parts"] = memory
    return terms


def _layout_of(cand: dict[str, Any], i: int) -> Layout:
    return Layout(dp=int(cand["dp"][i]), tp=int(cand["t"][i]), pp=int(cand["p"][i]),
                  cp=int(cand["c"][i]), ep=int(cand["e"][i]), zero=int(cand["zero"][i]),
                  zero_group=int(cand["zg"][i]), sp=bool(cand["sp"][i]),
                  schedule=SCHEDULE_NAMES[int(cand["sched"][i])], chunks=int(cand["v"][i]),
                  recompute=RC_NAMES[int(cand["rc"][i])], micro_batch=int(cand["b"][i]))


def _complexity(cand: dict[str, Any]) -> np.ndarray:
    """Tie-break among equally fast layouts: fewer and smaller model-parallel axes, less
    sharding, less recomputation, the simpler schedule."""
    return (cand["c"] * 1000 + cand["p"] * 100 + cand["t"] * 10 + cand["e"] * 10
            + cand["zero"] * 3 + (cand["zg"] > 0) * 2 + cand["rc"] * 5 + cand["sp"]
            + (cand["sched"] != SCHEDULE_CODES["1f1b"]) * 4 + cand["v"]).astype(np.float64)


def evaluate_layout(model: ModelSpec, cluster: Cluster, train: TrainSpec, layout: Layout,
                    calib: Calibration | None = None, headroom: float = DEFAULT_HEADROOM,
                    *, simulate: bool = True) -> PlanEntry:
    """One layout, evaluated with the scalar model (its bubble from the simulator when the
    schedule is small enough to simulate quickly)."""
    stages = training_memory_per_gpu(model, layout, train)
    peak = max(stages, key=lambda st: st.total)
    m = layout.microbatches(train)
    small = layout.pp * m * layout.chunks <= 4_000  # the closed forms equal it (tested)
    estimate = estimate_step(model, cluster, layout, train, calib,
                             simulate=simulate and small and layout.pp > 1)
    return PlanEntry(layout, estimate, peak, cluster.accelerator.memory_bytes * headroom)


# ---------------------------------------------------------------------------- the search
def plan(model: ModelSpec, cluster: Cluster, train: TrainSpec, top: int = 10, *,
         headroom: float = DEFAULT_HEADROOM, calib: Calibration | None = None,
         space: SearchSpace | None = None, layout: Layout | None = None,
         baseline: bool = True, progress: Callable[[str], None] | None = None) -> PlanResult:
    """Search every layout of `model` on `cluster` for `train`, rank by step time.

    Returns the `top` fastest layouts that fit (GPU memory × `headroom` on every stage), the
    rejected regions with reasons and counts, the `choose_parallelism` baseline, and, when
    `layout` is given, that layout's evaluation and its rank. Raises `ShardwiseError` when no
    layout fits, saying by how much the leanest misses and what would help.
    """
    started = time.perf_counter()
    say = progress or (lambda message: None)
    model.validate()
    cluster.validate()
    train = train.validate()
    if train.global_batch is None:
        raise ShardwiseError("planning needs a global batch (e.g. --global-batch 4M-tokens)")
    if not 0 < headroom <= 1:
        raise ShardwiseError(f"headroom must be in (0, 1], got {headroom}")
    if top < 1:
        raise ShardwiseError(f"top must be ≥ 1, got {top}")
    cal = calib or default_calibration(cluster.accelerator.name)
    budget = cluster.accelerator.memory_bytes * headroom
    rejections = _Rejections()
    say("enumerating layouts")
    cand, grid = _enumerate(model, cluster, train, space or SearchSpace(), rejections)
    given = evaluate_layout(model, cluster, train, layout, cal, headroom) if layout else None
    if not cand or not cand["_valid"].any():
        reasons = "; ".join(f"{r.reason} ({r.example})" if r.example else r.reason
                            for r in rejections.result()[:3])
        raise ShardwiseError(
            f"no valid layout of {model.name} on {cluster.n_gpus} GPUs with a global batch of "
            f"{train.global_batch} sequences: {reasons}"
        )
    n = int(cand["_valid"].sum())
    say(f"evaluating {n:,} layouts")
    eval_start = time.perf_counter()
    terms = evaluate_candidates(model, cluster, train, cand, cal)
    cand, terms = _flatten(cand, terms, keys=("total", "memory"))
    eval_seconds = time.perf_counter() - eval_start
    fits = terms["memory"] <= budget
    n_fit = int(fits.sum())
    if n_fit < n:
        over = ~fits
        i = int(np.argmin(np.where(over, terms["total"], np.inf)))
        rejections.add("does not fit in GPU memory", int(over.sum()),
                       f"fastest such, {_layout_of(cand, i).short()}, needs "
                       f"{terms['memory'][i] / 2**30:.1f} GiB, {(terms['memory'][i] - budget) / 2**30:.1f} "
                       f"GiB over the {budget / 2**30:.1f} GiB budget", "memory")
    if n_fit == 0:
        raise ShardwiseError(_no_fit_message(model, cluster, train, cand, terms, budget,
                                             headroom))
    say("ranking")
    order = _rank(cand, terms, fits)
    ranked = []
    for position, i in enumerate(order[:top]):
        entry = evaluate_layout(model, cluster, train, _layout_of(cand, int(i)), cal, headroom)
        ranked.append(PlanEntry(entry.layout, entry.estimate, entry.memory, budget,
                                rank=position + 1))
    base, note = None, ""
    if baseline:
        try:
            base_layout = choose_parallelism(model, cluster, train, headroom=headroom)
            base = evaluate_layout(model, cluster, train, base_layout, cal, headroom)
            pos = _position(cand, terms, fits, order, base_layout)
            note = (f"rank {pos} of {n_fit:,} fitting layouts" if pos else
                    "outside the search space")
        except ShardwiseError as exc:
            note = f"the §7 procedure finds no layout: {exc}"
    given_note = ""
    if given is not None:
        pos = _position(cand, terms, fits, order, given.layout)
        given = PlanEntry(given.layout, given.estimate, given.memory, budget, rank=pos)
        given_note = (f"rank {pos} of {n_fit:,} fitting layouts" if pos else
                      "does not fit in GPU memory" if not given.fits else
                      "outside the search space")
    alternatives = _alternatives(cand, terms, fits, int(order[0]))
    seconds = time.perf_counter() - started
    return PlanResult(model, cluster, train, headroom, budget, cal, ranked, rejections.result(),
                      SearchStats(grid, n, n_fit, seconds, eval_seconds), base, note, given,
                      given_note, alternatives)


def _rank(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray) -> np.ndarray:
    """Indices of the fitting layouts, fastest first (ties: the simpler layout)."""
    idx = np.nonzero(fits)[0]
    total = terms["total"][idx]
    rounded = np.round(total / total.min(), 9)  # equal to 1e-9: a tie
    complexity = _complexity({k: v[idx] for k, v in cand.items() if k != "_pairs"})
    return idx[np.lexsort((complexity, rounded))]


def _position(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray,
              order: np.ndarray, layout: Layout) -> int | None:
    """1-based rank of `layout` among the fitting layouts (None if absent or not fitting)."""
    wanted = {"t": layout.tp, "p": layout.pp, "c": layout.cp, "e": layout.ep, "dp": layout.dp,
              "b": layout.micro_batch, "sched": SCHEDULE_CODES[layout.schedule],
              "v": layout.chunks, "zero": layout.zero, "zg": layout.zero_group,
              "sp": int(layout.sp), "rc": RC_CODES[layout.recompute]}
    mask = np.ones(len(cand["t"]), dtype=bool)
    for key, value in wanted.items():
        mask &= cand[key] == value
    hits = np.nonzero(mask & fits)[0]
    if not len(hits):
        return None
    where = np.nonzero(np.isin(order, hits))[0]
    return int(where[0]) + 1 if len(where) else None


_AXES = (("tp", "t"), ("pp", "p"), ("cp", "c"), ("ep", "e"), ("zero", "zero"),
         ("recompute", "rc"), ("schedule", "sched"), ("micro_batch", "b"), ("sp", "sp"))


def _alternatives(cand: dict[str, Any], terms: dict[str, Any], fits: np.ndarray,
                  best: int) -> list[Alternative]:
    """For each axis and each value other than the winner's: the best fitting layout with
    that value (or, if none fits, the least memory any such layout needs)."""
    out = []
    total, memory = terms["total"], terms["memory"]
    for axis, key in _AXES:
        values = np.unique(cand[key])
        for value in values:
            if value == cand[key][best]:
                continue
            mask = cand[key] == value
            ok = mask & fits
            shown: Any = int(value)
            if axis == "recompute":
                shown = RC_NAMES[int(value)]
            elif axis == "schedule":
                shown = SCHEDULE_NAMES[int(value)]
            elif axis == "sp":
                shown = bool(value)
            if ok.any():
                i = int(np.argmin(np.where(ok, total, np.inf)))
                out.append(Alternative(axis, shown, float(total[i]),
                                       _layout_of(cand, i).short(), None))
            else:
                out.append(Alternative(axis, shown, None, None,
                                       float(memory[mask].min())))
    return out


def _no_fit_message(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                    cand: dict[str, Any], terms: dict[str, Any], budget: float,
                    headroom: float) -> str:
    i = int(np.argmin(terms["memory"]))
    need = float(terms["memory"][i])
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    total_state = model.count_params().total * state.total
    gpus_for_state = math.ceil(total_state / budget)
    helps = []
    if gpus_for_state > cluster.n_gpus:
        helps.append(f"at least {gpus_for_state} GPUs just for the training state "
                     f"({total_state / 1e9:,.0f} GB with {state.total:g} B/param)")
    else:
        helps.append("more GPUs (more ways to shard)")
    helps.append("a shorter sequence or a smaller global batch per replica")
    if train.optimizer == "adam":
        helps.append("an 8-bit optimizer")
    return (f"no layout of {model.name} fits {cluster.n_gpus}× {cluster.accelerator.name} at "
            f"s={train.seq_len}: the leanest ({_layout_of(cand, i).short()}) needs "
            f"{need / 2**30:.1f} GiB per GPU, {(need - budget) / 2**30:.1f} GiB over the "
            f"{budget / 2**30:.1f} GiB budget ({headroom:.0%} of "
            f"{cluster.accelerator.memory_bytes / 2**30:.0f} GiB); would help: "
            + "; ".join(helps))


# ---------------------------------------------------------------------------- baseline
def choose_parallelism(model: ModelSpec, cluster: Cluster, train: TrainSpec, *,
                       headroom: float = DEFAULT_HEADROOM) -> Layout:
    """SPEC §7's decision procedure (the baseline the search must beat):

    1. TP inside the NVLink domain: `t ≤ min(8, gpus_per_node)`, `t | heads`, `t | kv heads`
       (or a multiple of them, replicated);
    2. PP across nodes, `p | layers`, 1F1B;
    3. DP with ZeRO-1 over the remaining ranks (FSDP, ZeRO-3, when ZeRO-1 fits nowhere);
    4. the smallest `t·p` whose largest stage fits GPU memory × headroom with selective
       recompute (sequence parallel when t > 1) and micro-batch 1; ties → larger `t`;
    5. CP only when the sequence forces it (nothing fits at cp = 1: try 2, 4, …), EP only for
       MoE (the most experts per replica group that divides dp·cp).
    """
    budget = cluster.accelerator.memory_bytes * headroom
    n = cluster.n_gpus
    tps = [t for t in _divisors(min(8, cluster.gpus_per_node)) if model.n_heads % t == 0
           and (model.n_kv_heads % t == 0 or t % model.n_kv_heads == 0)
           and model.d_ff % t == 0]
    pps = _divisors(model.n_layers)
    tried = []
    c = 1
    while c <= n and (c == 1 or train.seq_len % (2 * c) == 0):
        options = sorted(((t, p) for t in tps for p in pps if n % (t * p * c) == 0),
                         key=lambda tp: (tp[0] * tp[1], -tp[0]))
        for zero in (1, 3):
            for t, p in options:
                dp = n // (t * p * c)
                ep = 1
                if model.is_moe:
                    ep = max(e for e in _divisors(model.n_experts) if (dp * c) % e == 0)
                layout = Layout(dp=dp, tp=t, pp=p, cp=c, ep=ep, zero=zero if dp * c > 1 else 0,
                                sp=t > 1, schedule="1f1b", recompute="selective",
                                micro_batch=1)
                try:
                    layout.validate(model, cluster, train)
                except LayoutError:
                    continue
                peak = max(s.total for s in training_memory_per_gpu(model, layout, train))
                tried.append((peak, layout))
                if peak <= budget:
                    return layout
        c *= 2
    if not tried:
        raise ShardwiseError("no layout satisfies the divisibility rules")
    peak, layout = min(tried, key=lambda x: x[0])
    raise ShardwiseError(
        f"nothing fits: the leanest ({layout.short()}) needs {peak / 2**30:.1f} GiB of "
        f"{budget / 2**30:.1f} GiB"
    )

