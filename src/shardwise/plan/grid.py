"""Enumeration: every layout of the grid, pruned level by level with a counted reason
for each rejected region; the survivors as broadcast integer arrays."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.memory import layer_params
from shardwise.hardware import Cluster
from shardwise.layout import CP_KINDS, Balanced, Layout, TrainSpec, stage_partition
from shardwise.layout_checks import layout_problems
from shardwise.partition import FIXED, partition_problems
from shardwise.plan.lines import _row_any
from shardwise.plan.results import Rejection
from shardwise.plan.space import Constraint, SearchSpace
from shardwise.schedules.registry import (
    DEFAULT_SCHEDULE,
    SCHEDULE_CODES,
    SCHEDULE_REGISTRY,
    select,
)
from shardwise.stacks import SPLIT_RULES, balanced_ends, split_refuses


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
    rules = (("Ulysses", "the Ulysses degree does not divide the heads"),  # names n_heads too
             ("n_heads", "tp does not divide the attention heads"),
             ("n_kv_heads", "tp does not fit the key/value heads"),
             ("d_ff", "tp does not divide the FFN width"),
             ("n_layers", "pp does not split the layers"),
             ("n_experts", "ep does not divide the experts"),
             ("etp·ep", "etp·ep does not divide tp·dp·cp"),
             ("dp·cp", "ep does not divide dp·cp"),
             ("2·cp", "2·cp does not divide the sequence length"),
             ("ring attention", "context parallelism needs FlashAttention"))
    for key, reason in rules:
        if key in problem:
            return reason
    return problem


def _partitions(model: ModelSpec, pp: int, rule: str = "any"
                ) -> dict[tuple[int, int], tuple[int, ...]]:
    """The searched stage partitions of `pp` stages, `Balanced(a, z)` → layers per stage (()
    for the default, `Layout.stage_partition`), distinct and ≥ 1 layer per stage: the default,
    the other of (0, 0) and (1, 1) (even / torchtitan's embedding and head as one layer each),
    and (0, z) with the head's cost in layers, `z = round(V·h / N_layer)` (its GEMM against a
    layer's, both 6·N FLOPs per token trained; the embedding is a gather, ≈ 0 layers), at most
    what leaves the last stage one layer. A stack whose split `rule` is "deepspeed" runs one,
    the first `L mod pp` stages one layer more (`stacks.deepspeed_split`): Balanced(-1, 0)."""
    n_layers = model.n_layers
    default = stage_partition(n_layers, pp)
    if rule == "neox":  # GPT-NeoX's one split as a Balanced one (`stacks.balanced_ends`)
        found = balanced_ends(rule, n_layers, pp)
        return {} if found is None else {found[0]: () if found[1] == default else found[1]}
    if rule == "deepspeed":
        ends = (-1, 0) if n_layers % pp else (0, 0)
        own = stage_partition(n_layers, pp, 1, Balanced(*ends))
        return {ends: () if own == default else own}
    dense, moe, experts = layer_params(model, 1, 1)
    per_layer = (model.n_dense_layers * dense + model.n_moe_layers
                 * (moe + experts * model.top_k / max(model.n_experts, 1))) / n_layers
    head = min(round(model.vocab * model.d_model / per_layer), n_layers)
    while head > 1 and min(stage_partition(n_layers, pp, 1, Balanced(0, head))) < 1:
        head -= 1
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    default_ends = int(Balanced.default(n_layers, pp).first_less)
    for a, z in ((default_ends, default_ends), (0, 0), (1, 1), (0, head)):
        split = stage_partition(n_layers, pp, 1, Balanced(a, z))
        if min(split) >= 1 and split not in out.values() and (split != default or not out):
            out[(a, z)] = () if split == default else split
    return out


def _enumerate(model: ModelSpec, cluster: Cluster, train: TrainSpec, space: SearchSpace,
               rejections: _Rejections) -> tuple[dict[str, np.ndarray], int]:
    """All valid candidates as flat int arrays (and the grid size)."""
    rows, grid, axes, partitions = _structures(model, cluster, train, space, rejections)
    if not rows:
        return {}, grid
    return _expand(model, train, rows, grid, axes, partitions, rejections)


def _structures(model: ModelSpec, cluster: Cluster, train: TrainSpec, space: SearchSpace,
                rejections: _Rejections) -> tuple[list[tuple[int, ...]], int, dict[str, list],
                                                  dict[int, dict[tuple[int, int], tuple]]]:
    """Level 1 of the enumeration: the valid structures (rows `(t, p, c, e, dp, a, z, etp,
    cp kind, ulysses)`), the grid size, the allowed axis values and the searched
    partitions."""
    full, axes = space.constrained(space.resolve(model, cluster, train))
    rule = space.constraint or Constraint()
    outside = f"outside the constraints ({rule.describe()})"
    split_wanted = dict(rule.fixed).get("partition")  # () is the default partition
    if split_wanted:  # written out, the default partition is still the default
        n_stages = len(split_wanted)
        if dict(rule.fixed).get("pp", n_stages) == n_stages and (  # not pp·chunks counts
                split_wanted == stage_partition(model.n_layers, n_stages)):
            split_wanted = ()
    n_gpus, gb, s = cluster.n_gpus, train.global_batch, train.seq_len
    assert gb is not None
    inner_keys = ("micro_batch", "schedule", "zero", "sp", "recompute")
    inner = [len(axes[k]) for k in inner_keys]

    # level 1: structures (tp, pp, cp, cp kind, ep, etp, partition) and dp = GPUs / (tp·pp·cp);
    # the searched partitions of each pp (`_partitions`) as Balanced(first_less, last_less);
    # with cp > 1 each kind of `cp_kind` (the hybrid's all-to-all over the cp ranks of one
    # node). The constraint's exclusions are counted first, on the grid with its fixed values
    # added.
    stack = train.stack
    partitions = {p: _partitions(model, p, stack.split) for p in full["pp"]}
    default_split = {p: stage_partition(model.n_layers, p) for p in full["pp"]}
    if split_wanted and not any(split_wanted in options.values() for options in partitions.values()):
        # a fixed partition the grid does not enumerate is used as given (`partition.FIXED`):
        # the one option of the fixed pp (pp·chunks virtual stages), else of pp = its counts
        one = dict(rule.fixed).get("pp", len(split_wanted))
        partitions = {p: {FIXED: split_wanted} if p == one > 1 else {} for p in full["pp"]}
    per_structure = math.prod(inner)
    per_full = math.prod(len(full[k]) for k in inner_keys)
    cp_kinds = [(c, k) for c in full["cp"] for k in (full["cp_kind"] if c > 1 else [0])]
    grid = (len(full["tp"]) * sum(map(len, partitions.values())) * len(cp_kinds)
            * len(full["ep"]) * len(full["etp"]) * per_full)
    rows: list[tuple[int, ...]] = []
    # each axis' values the constraint allows, asked once per value, not per structure
    allowed = {k: {v for v in full[k] if rule.allows(k, v)} for k in ("tp", "pp", "cp", "ep",
                                                                     "etp")}
    allowed["cp_kind"] = {k for k in range(len(CP_KINDS)) if rule.allows("cp_kind", CP_KINDS[k])}
    # per pp: the partitions the constraint keeps, those the stack can split, and an example
    # of one it cannot
    wanted = {p: [ends for ends, split in options.items()
                  if split_wanted is None or split_wanted == split]
              for p, options in partitions.items()}
    splits = {p: [ends for ends in kept if p == 1 or not split_refuses(
        stack.split, model.n_layers, partitions[p][ends] or default_split[p], p)]
        for p, kept in wanted.items()}
    refused = {p: ",".join(map(str, next((partitions[p][ends] or default_split[p]
                                          for ends in kept if ends not in splits[p]), ())))
               for p, kept in wanted.items()}
    for t, p, (c, kind), e, et in itertools.product(full["tp"], full["pp"], cp_kinds,
                                                    full["ep"], full["etp"]):
        whole = per_full * len(partitions[p])
        dp = n_gpus // (t * p * c)
        kept = wanted[p]
        if (not (t in allowed["tp"] and p in allowed["pp"] and c in allowed["cp"]
                 and e in allowed["ep"] and et in allowed["etp"] and kind in allowed["cp_kind"])
                or (n_gpus % (t * p * c) == 0 and not rule.allows("dp", dp))):
            kept = []
        region = per_structure * len(kept)
        rejections.add(outside, whole - region, category="user")
        if not kept:
            continue
        if et and et == t:
            rejections.add("etp equal to tp (same as etp=0)", region, category="duplicate")
            continue
        if et and e == 1:
            rejections.add("etp without ep (routed experts replicated over tp; not searched)",
                           region, f"tp={t} etp={et} ep=1", category="duplicate")
            continue
        if n_gpus % (t * p * c):
            rejections.add("tp·pp·cp does not divide the GPU count", region,
                           f"tp={t} pp={p} cp={c}: {t * p * c} ∤ {n_gpus}")
            continue
        u = min(c, max(cluster.gpus_per_node // t, 1)) if CP_KINDS[kind] == "hybrid" else 0
        if CP_KINDS[kind] == "hybrid" and not 1 < u < c:
            rejections.add("hybrid cp with every cp rank in one node or one per node (same as "
                           "Ulysses or ring)", region, category="duplicate")
            continue
        problems = layout_problems(Layout(dp=dp, tp=t, pp=p, cp=c, ep=e, etp=et,
                                          cp_kind=CP_KINDS[kind], ulysses=u), model)
        if c > 1 and not train.flash_attention:
            problems.append("context parallelism (ring attention) needs FlashAttention")
        elif c > 1 and s % (2 * c):
            problems.append(f"2·cp={2 * c} does not divide seq_len={s}")
        if problems:
            rejections.add(_structure_reason(problems[0]), region, problems[0])
            continue
        if dp > gb:
            rejections.add("more data-parallel replicas than sequences per step", region,
                           f"dp={dp} > global batch {gb}")
            continue
        rejections.add(f"{stack.name} cannot split the layers so ({SPLIT_RULES[stack.split]})",
                       per_structure * (len(kept) - len(splits[p])),
                       f"pp={p}, layers {refused[p]}")
        rows += [(t, p, c, e, dp, a, z, et, kind, u) for a, z in splits[p]]
    return rows, grid, axes, partitions


def _expand(model: ModelSpec, train: TrainSpec, rows: list[tuple[int, ...]], grid: int,
            axes: dict[str, list], partitions: dict[int, dict[tuple[int, int], tuple]],
            rejections: _Rejections) -> tuple[dict[str, np.ndarray], int]:
    """Levels 2-5 of the enumeration, from the valid structures `rows`."""
    gb, s, stack = train.global_batch, train.seq_len, train.stack
    assert gb is not None
    inner_keys = ("micro_batch", "schedule", "zero", "sp", "recompute")
    inner = [len(axes[k]) for k in inner_keys]
    st = np.array(rows, dtype=np.int64)

    # level 2: × micro-batch — the global batch must split into dp·mb
    mb = np.array(axes["micro_batch"], dtype=np.int64)
    s_idx, m_idx = np.divmod(np.arange(len(st) * len(mb)), len(mb))
    dp_, b_ = st[s_idx, 4], mb[m_idx]
    ok = gb % (dp_ * b_) == 0
    rest = math.prod(inner[1:])
    rejections.add("global batch is not a multiple of dp·micro-batch", int((~ok).sum()) * rest,
                   _example(~ok, lambda i: f"dp={dp_[i]} mb={b_[i]}: {gb} sequences"))
    pair = np.nonzero(ok)[0]
    pairs = {"tp": st[s_idx[pair], 0], "pp": st[s_idx[pair], 1], "cp": st[s_idx[pair], 2],
             "ep": st[s_idx[pair], 3], "dp": dp_[pair], "micro_batch": b_[pair],
             "first_less": st[s_idx[pair], 5], "last_less": st[s_idx[pair], 6],
             "etp": st[s_idx[pair], 7], "cp_kind": st[s_idx[pair], 8],
             "ulysses": st[s_idx[pair], 9]}
    pairs["m"] = gb // (pairs["dp"] * pairs["micro_batch"])
    n_pairs = len(pair)
    if not n_pairs:  # no (structure, micro-batch) pair splits the batch
        return {}, grid

    # level 3: × schedule (code, chunks)
    sched = np.array(axes["schedule"], dtype=np.int64).reshape(-1, 2)
    p_idx, k_idx = np.divmod(np.arange(n_pairs * len(sched)), len(sched))
    p3, m3 = pairs["pp"][p_idx], pairs["m"][p_idx]
    code, v = sched[k_idx, 0], sched[k_idx, 1]
    rest = math.prod(inner[2:])
    single = (p3 == 1) & ~((code == SCHEDULE_CODES[DEFAULT_SCHEDULE]) & (v == 1))
    rejections.add("pp=1 has no pipeline schedule (same as 1F1B)", int(single.sum()) * rest,
                   category="duplicate")
    inter = select(code, lambda info: info.chunked).astype(bool)  # interleaved
    bad_layers = ~single & inter & (model.n_layers % (p3 * v) != 0)
    fixed = [split for options in partitions.values() for ends, split in options.items()
             if ends == FIXED]
    problems: dict[tuple[int, int], list[str]] = {}
    if fixed:  # a fixed partition: where `partition_problems` accepts it, as given
        problems = {(p, c): partition_problems(model.n_layers, p, c, fixed[0])
                    for p, c in {(int(p), int(c)) for p, c in zip(p3, v, strict=True)}}
        bad_layers = ~single & np.array([bool(problems[int(p), int(c)])
                                         for p, c in zip(p3, v, strict=True)], dtype=bool)
    rejections.add("the fixed partition does not fit pp·chunks" if fixed else
                   "pp·chunks does not divide the layers", int(bad_layers.sum()) * rest,
                   _example(bad_layers, lambda i: f"pp={p3[i]} chunks={v[i]}" + "".join(
                       f": {problems[int(p3[i]), int(v[i])][0]}" for _ in fixed[:1])))
    a3, z3 = pairs["first_less"][p_idx], pairs["last_less"][p_idx]
    uneven_inter = (~single & inter & ~bad_layers & (a3 != FIXED[0])
                    & Balanced(a3, z3).searched(model.n_layers, p3))

    def stages(i: int) -> str:
        return ",".join(map(str, partitions[int(p3[i])][(int(a3[i]), int(z3[i]))]))

    rejections.add("searched uneven partitions need chunks=1", int(uneven_inter.sum()) * rest,
                   _example(uneven_inter, lambda i: f"pp={p3[i]} chunks={v[i]}, layers "
                                                    f"{stages(i)}"))
    bad_layers |= uneven_inter
    accepts = select(code, lambda info: info.accepts(p3, m3)).astype(bool)
    bad_m = ~single & ~bad_layers & ~accepts
    for info in SCHEDULE_REGISTRY.values():  # each schedule's micro-batch rule (registry)
        mask = bad_m & (code == info.code)
        rejections.add(f"{info.title} needs {info.microbatch_rule}", int(mask.sum()) * rest,
                       _example(mask, lambda i: f"pp={p3[i]}, {m3[i]} micro-batch"
                                                + ("es" if m3[i] != 1 else "")))
    keep = np.nonzero(~(single | bad_layers | bad_m))[0]
    lvl3 = {"pair": p_idx[keep], "schedule": code[keep], "chunks": v[keep]}

    # level 4: × ZeRO (stage, hybrid group): which options a row keeps depends on its dp·cp
    # only, so worked out per distinct dp·cp (a table) and spread to the level-3 rows
    zero = np.array(axes["zero"], dtype=np.int64).reshape(-1, 2)
    counts, of_pair = np.unique(pairs["dp"] * pairs["cp"], return_inverse=True)
    rid = of_pair.ravel()[lvl3["pair"]]  # each level-3 row's dp·cp, as its index in `counts`
    per_count = np.bincount(rid, minlength=len(counts))
    replicas, z, zg = counts[:, None], zero[None, :, 0], zero[None, :, 1]
    rest = math.prod(inner[3:])
    lone = (replicas == 1) & (z > 0)
    rejections.add("ZeRO with a single data-parallel replica (same as stage 0)",
                   int(per_count @ lone.sum(axis=1)) * rest, category="duplicate")
    whole = ~lone & (zg > 0) & (zg >= replicas)
    rejections.add("hybrid shard group ≥ dp·cp (same as full shard)",
                   int(per_count @ whole.sum(axis=1)) * rest, category="duplicate")
    bad_zg = ~lone & ~whole & (zg > 0) & (replicas % np.maximum(zg, 1) != 0)
    rejections.add("hybrid shard group does not divide dp·cp",
                   int(per_count @ bad_zg.sum(axis=1)) * rest,
                   _example(bad_zg.any(axis=1)[rid],
                            lambda i: f"zero_group={zero[np.argmax(bad_zg[rid[i]]), 1]}, "
                                      f"dp·cp={counts[rid[i]]}"))
    # the kept (row, option) cells row-major: each row's options in order
    keep = ~(lone | whole | bad_zg)
    kept = keep.sum(axis=1)[rid]
    a_idx = np.repeat(np.arange(len(rid)), kept)
    at = np.arange(len(a_idx)) - np.repeat(np.cumsum(kept) - kept, kept)  # within its row
    z_idx = np.argsort(~keep, axis=1, kind="stable")[rid[a_idx], at]
    lvl4 = {"l3": a_idx, "zero": zero[z_idx, 0], "zero_group": zero[z_idx, 1]}

    # level 5: × sequence parallel × recompute, kept as a broadcast inner axis: the outer
    # combinations are rows, the (sp, rc) pairs columns, and `valid` marks the layouts
    sp_rc = np.array([(sp, rc) for sp in axes["sp"] for rc in axes["recompute"]], dtype=np.int64)
    l3 = lvl4["l3"]
    pr = lvl3["pair"][l3]
    sp, rc = sp_rc[:, 0][None, :], sp_rc[:, 1][None, :]
    # per pair, gathered per row once: why sp is refused there (1: tp = 1, 2: tp·cp does not
    # divide the sequence; 0: it is not); the counts are rows × the columns with sp
    lone_tp = pairs["tp"] == 1
    sp_refused = np.where(lone_tp, 1, 2 * (s % (pairs["tp"] * pairs["cp"]) != 0))[pr]
    sp_cols = int((sp == 1).sum())
    rejections.add("sequence parallelism without tp (same as without)",
                   int((sp_refused == 1).sum()) * sp_cols, category="duplicate")
    bad_rows = (sp_refused == 2) & (sp_cols > 0)
    rejections.add("tp·cp does not divide the sequence (sequence parallel)",
                   int(bad_rows.sum()) * sp_cols,
                   _example(bad_rows, lambda i: f"tp={pairs['tp'][pr[i]]} "
                                                f"cp={pairs['cp'][pr[i]]}, s={s}"))
    # a row's valid columns: all, or (sp refused) those without sp; one gather of the two
    valid = np.stack([np.ones(sp.shape[1], dtype=bool), sp[0] != 1]).take(
        (sp_refused > 0).astype(np.intp), axis=0)
    # the pairs' fields, one gather of them all: (fields, pairs) -> (fields, rows)
    fields = ("tp", "pp", "cp", "ep", "etp", "dp", "micro_batch", "m", "first_less",
              "last_less", "cp_kind", "ulysses")
    # int32 per row where every value fits (half the bytes of the grid's largest arrays;
    # `evaluate._wide` widens what the models compute with)
    table = np.stack([pairs[key] for key in fields])
    narrow = np.int32 if max(int(table.max()), len(pairs["tp"]), int(zero.max())) < 2**31 \
        else np.int64
    table = table.astype(narrow)
    per_row = {"schedule": lvl3["schedule"].astype(narrow)[l3],
               "chunks": lvl3["chunks"].astype(narrow)[l3],
               "zero": lvl4["zero"].astype(narrow), "zero_group": lvl4["zero_group"].astype(narrow),
               "pair": pr.astype(narrow)}

    def rows_of(at: Any) -> dict[str, Any]:
        """The grid's fields of rows `at` (all: a slice), each `(rows, 1)`; sp, rc `(1, cols)`."""
        gathered = table.take(pr[at], axis=1)
        out: dict[str, Any] = {key: gathered[i][:, None] for i, key in enumerate(fields)}
        return out | {k: v[at][:, None] for k, v in per_row.items()} | {"sp": sp, "recompute": rc}

    # the combinations the stack refuses (`Stack.rules`), counted where the rest is valid; a
    # rule gathers only the fields it reads (`_Fields`)
    lazy = _Fields(table, fields, pr, per_row, {"sp": sp, "recompute": rc})
    for stack_rule, refused in stack.refused(lazy, train):
        if not refused.any():  # e.g. a rule on a setting this run does not use
            continue
        bad = np.broadcast_to(refused, valid.shape) & valid
        if bad.any():
            at = np.unravel_index(int(np.argmax(bad)), bad.shape)  # the first, row-major
            one = rows_of(np.array([at[0]]))
            rejections.add(f"{stack.name} cannot run it ({stack_rule.source})", int(bad.sum()),
                           stack_rule.message(stack.name, {
                               k: int(np.broadcast_to(v, (1, valid.shape[1]))[0, at[1]])
                               for k, v in one.items()}))
        valid = valid & ~bad
    del lazy
    # rows without a valid cell (a whole row the stack refuses) are left out, in order: every
    # later pass skips them, and the first valid cell row-major stays the first
    keep = _row_any(valid)
    if keep.any() and not keep.all():
        kept = np.flatnonzero(keep)
        cand = rows_of(kept)
        valid = valid.take(kept, axis=0)
    else:
        cand = rows_of(slice(None))
    cand["_pairs"] = pairs
    cand["_n_layers"] = model.n_layers
    cand["_partitions"] = {(p, a, z): split for p, options in partitions.items()
                           for (a, z), split in options.items()}
    cand["_valid"] = valid
    return cand, grid


def searched_split(layout: Layout, n_layers: int) -> tuple[int, ...]:
    """`layout`'s stage partition as the grid names it (`_partitions`): () for the default."""
    split = layout.partition
    if split and split == layout.with_(partition=()).stage_partition(n_layers):
        return ()
    return tuple(split)


def partition_ends(cand: dict[str, Any], layout: Layout, n_layers: int) -> list[tuple[int, int]]:
    """The (first_less, last_less) codes under which the grid `cand` holds `layout`'s stage
    partition; [] when it holds none."""
    split = searched_split(layout, n_layers)
    return [(a, z) for (p, a, z), option in cand["_partitions"].items()
            if p == layout.pp and option == split]


class _Fields(Mapping[str, Any]):
    """The grid's fields by name as `_expand` builds them, each gathered from the pairs' and
    the rows' tables when first read (a stack's rules read a few)."""

    def __init__(self, table: np.ndarray, fields: Sequence[str], pair: np.ndarray,
                 per_row: dict[str, np.ndarray], columns: dict[str, np.ndarray]) -> None:
        self.table, self.fields, self.pair = table, list(fields), pair
        self.per_row, self.columns = per_row, columns
        self.memo: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self.memo:
            if key in self.columns:
                self.memo[key] = self.columns[key]
            elif key in self.per_row:
                self.memo[key] = self.per_row[key][:, None]
            elif key in self.fields:
                self.memo[key] = self.table[self.fields.index(key)].take(self.pair)[:, None]
            else:
                raise KeyError(key)
        return self.memo[key]

    def __iter__(self) -> Iterator[str]:
        return iter([*self.fields, *self.per_row, *self.columns])

    def __len__(self) -> int:
        return len(self.fields) + len(self.per_row) + len(self.columns)


def _flatten(cand: dict[str, Any], terms: dict[str, Any] | None = None,
             keys: Sequence[str] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The valid layouts of a broadcast (outer × inner) grid as flat arrays (of `terms`, only
    `keys` when given)."""
    valid = cand["_valid"]
    per_row = valid.sum(axis=1) if valid.ndim == 2 else None

    def pick(value: Any) -> Any:
        value = np.asarray(value)
        if per_row is not None and value.shape == (valid.shape[0], 1):
            return _wide(np.repeat(value[:, 0], per_row))  # a row's value once per valid cell
        return _wide(np.broadcast_to(value, valid.shape)[valid])

    flat = {k: pick(v) for k, v in cand.items() if not k.startswith("_")}
    flat |= {k: v for k, v in cand.items() if k.startswith("_") and k != "_valid"}
    if terms is None:
        return flat, None
    out: dict[str, Any] = {}
    for key, value in terms.items():
        if keys is not None and key not in keys:
            continue
        out[key] = ({k: pick(v) for k, v in value.items()} if isinstance(value, dict)
                    else pick(value))
    return flat, out


def _wide(value: Any) -> Any:
    """An integer array as int64: the grid stores its fields as int32 (`_expand`), the models
    compute in int64 (products of degrees, batches and lengths)."""
    return value.astype(np.int64) if getattr(value, "dtype", None) == np.int32 else value


def _example(mask: np.ndarray, describe: Callable[[int], str]) -> str:
    hits = np.nonzero(mask)[0]
    return describe(int(hits[0])) if len(hits) else ""
