"""The planner's enumeration against one written here, point by point: every point of a small
grid (itertools over the axes, dp = GPUs / (tp·pp·cp)) is either a layout the search keeps or
lands in exactly one rejected region, the first rule it breaks level by level (structure,
micro-batch, schedule, ZeRO, per-rank options: docs/concepts/planner.md#search), and the
counts per reason are the planner's `_Rejections` — not its arrays, masks or region
products. The grid is not degenerate: an MoE with a shared expert and a dense first layer
(tiny-deepseek, 6 layers), 24 GPUs in nodes of 4, tp·cp·ep > 1, uneven pipelines (pp 4 of 6
layers, and a searched 5+1 split of pp 2), interleaving, ZeRO groups below, at and above
dp·cp, sequence parallelism where tp·cp does not divide the sequence, and every cp kind.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

from shardwise.arch import get_model
from shardwise.hardware import Cluster
from shardwise.layout import CP_KINDS, Layout, TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _flatten, _Rejections
from shardwise.plan.grid import _partitions

MODEL = get_model("tiny-deepseek").with_(n_layers=6, vocab=2048)  # 4 heads, 8 experts
N_GPUS, PER_NODE = 24, 4
CLUSTER = Cluster.of(N_GPUS, "h100", gpus_per_node=PER_NODE)
# 44 tokens: 2·cp divides it for cp 2 (not 4), tp·cp = 8 does not (sequence parallel)
TRAIN = TrainSpec(seq_len=44, global_batch=18, impl="shardwise")
TP, PP, CP, EP, ETP = (1, 2, 4), (1, 2, 4, 6), (1, 2, 4), (1, 2, 4), (0, 1)
KINDS = ("ring", "ulysses", "hybrid")
MB = (1, 2, 3)
# (schedule, chunks): 1F1B, interleaved with 2 and 3 chunks, ZB-H1
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1))
ZERO = ((0, 0), (1, 0), (3, 0), (1, 2), (1, 4), (3, 2), (3, 4))
SP, RECOMPUTE = (0, 1), ("none", "full")
SPACE = SearchSpace(tp=TP, pp=PP, cp=CP, ep=EP, etp=ETP, cp_kinds=KINDS, micro_batch=MB,
                    zero=(0, 1, 3), zero_groups=(2, 4), sp=(False, True), recompute=RECOMPUTE,
                    schedules=("1f1b", "interleaved", "zb-h1"), chunks=(2, 3))
CODES = {"1f1b": 1, "interleaved": 2, "zb-h1": 3}  # the schedule registry's codes
RC = {"none": 0, "full": 2}  # estimate.compute.RC_CODES
# the region of a `Layout.problems` sentence (the first one), by what it names
STRUCTURE = (("Ulysses", "the Ulysses degree does not divide the heads"),
             ("etp·ep", "etp·ep does not divide tp·dp·cp"),
             ("dp·cp", "ep does not divide dp·cp"))


def _structure(t: int, p: int, c: int, kind: str, e: int, et: int) -> tuple[str | None, int]:
    """(the region a structure is rejected in, None if kept; the Ulysses degree)."""
    if et and et == t:
        return "etp equal to tp (same as etp=0)", 0
    if et and e == 1:
        return "etp without ep (routed experts replicated over tp; not searched)", 0
    if N_GPUS % (t * p * c):
        return "tp·pp·cp does not divide the GPU count", 0
    # the hybrid's all-to-all over the cp ranks of one node: tp ranks fill a node first
    u = min(c, max(PER_NODE // t, 1)) if kind == "hybrid" else 0
    if kind == "hybrid" and not 1 < u < c:
        return "hybrid cp with every cp rank in one node or one per node (same as Ulysses or " \
               "ring)", 0
    dp = N_GPUS // (t * p * c)
    problems = Layout(dp=dp, tp=t, pp=p, cp=c, ep=e, etp=et, cp_kind=kind,
                      ulysses=u).problems(MODEL)
    if c > 1 and TRAIN.seq_len % (2 * c):
        problems.append(f"2·cp={2 * c} does not divide the sequence")
    if problems:
        if problems[0].startswith("2·cp"):
            return "2·cp does not divide the sequence length", 0
        return next(region for key, region in STRUCTURE if key in problems[0]), 0
    if dp > TRAIN.global_batch:
        return "more data-parallel replicas than sequences per step", 0
    return None, u


def _reference() -> tuple[Counter, Counter]:
    """(rejected points per reason, kept layouts as field tuples) of the whole grid."""
    gb, s, n_layers = TRAIN.global_batch, TRAIN.seq_len, MODEL.n_layers
    rejected: Counter = Counter()
    kept: Counter = Counter()
    inner = list(itertools.product(MB, SCHEDULES, ZERO, SP, RECOMPUTE))
    for t, p, c, e, et in itertools.product(TP, PP, CP, EP, ETP):
        for kind in KINDS if c > 1 else ("ring",):
            reason, u = _structure(t, p, c, kind, e, et)
            dp = N_GPUS // (t * p * c)
            for (a, z), split in _partitions(MODEL, p).items():
                if reason:
                    rejected[reason] += len(inner)
                    continue
                for mb, (name, v), (zero, group), sp, rc in inner:
                    if gb % (dp * mb):
                        why = "global batch is not a multiple of dp·micro-batch"
                    elif p == 1 and name != "1f1b":
                        why = "pp=1 has no pipeline schedule (same as 1F1B)"
                    elif p > 1 and name == "interleaved" and n_layers % (p * v):
                        why = "pp·chunks does not divide the layers"
                    elif p > 1 and name == "interleaved" and split:  # not the default
                        why = "searched uneven partitions need chunks=1"
                    elif p > 1 and name == "interleaved" and (gb // (dp * mb)) % p:
                        why = ("interleaved 1F1B needs micro-batches divisible by pp (groups "
                               "of p per chunk)")
                    elif dp * c == 1 and zero:
                        why = "ZeRO with a single data-parallel replica (same as stage 0)"
                    elif group and group >= dp * c:
                        why = "hybrid shard group ≥ dp·cp (same as full shard)"
                    elif group and (dp * c) % group:
                        why = "hybrid shard group does not divide dp·cp"
                    elif sp and t == 1:
                        why = "sequence parallelism without tp (same as without)"
                    elif sp and s % (t * c):
                        why = "tp·cp does not divide the sequence (sequence parallel)"
                    else:
                        kept[(t, p, c, e, et, dp, mb, CODES[name], v if p > 1 else 1, zero,
                              group, sp, RC[rc], a, z, CP_KINDS.index(kind), u)] += 1
                        continue
                    rejected[why] += 1
    return rejected, kept


def _searched() -> tuple[_Rejections, int, dict]:
    """The planner's enumeration of the grid (called in each test, not a fixture: mutmut
    maps a mutant to the tests whose own call reaches it)."""
    rejections = _Rejections()
    cand, grid = _enumerate(MODEL, CLUSTER, TRAIN, SPACE, rejections)
    flat, _ = _flatten(cand)
    return rejections, grid, flat


def test_every_grid_point_is_kept_or_rejected_once_for_the_first_rule_it_breaks():
    rejections, grid, flat = _searched()
    rejected, kept = _reference()
    assert grid == sum(rejected.values()) + sum(kept.values())
    # not degenerate: every region of the reference is reached, and a searched uneven split
    assert len(rejected) == 19 and all(rejected.values())
    assert any(split for p in PP for split in _partitions(MODEL, p).values())
    assert {r.reason: r.count for r in rejections.result()} == dict(rejected)
    fields = ("tp", "pp", "cp", "ep", "etp", "dp", "micro_batch", "schedule", "chunks", "zero",
              "zero_group", "sp", "recompute", "first_less", "last_less", "cp_kind", "ulysses")
    got = Counter(zip(*(flat[k].tolist() for k in fields), strict=True))
    assert got == kept
    # the micro-batches per step follow: global batch = dp · micro-batch · m
    assert (flat["dp"] * flat["micro_batch"] * flat["m"] == TRAIN.global_batch).all()


def test_rejections_are_sorted_by_count_with_one_example_and_category_each():
    rejections, _, _ = _searched()
    result = rejections.result()
    counts = [r.count for r in result]
    assert counts == sorted(counts, reverse=True)
    by = {r.reason: r for r in result}
    duplicate = {"etp equal to tp (same as etp=0)",
                 "etp without ep (routed experts replicated over tp; not searched)",
                 "hybrid cp with every cp rank in one node or one per node (same as Ulysses or "
                 "ring)", "pp=1 has no pipeline schedule (same as 1F1B)",
                 "ZeRO with a single data-parallel replica (same as stage 0)",
                 "hybrid shard group ≥ dp·cp (same as full shard)",
                 "sequence parallelism without tp (same as without)"}
    assert {r for r, x in by.items() if x.category == "duplicate"} == duplicate
    assert {x.category for r, x in by.items() if r not in duplicate} == {"constraint"}
    # the examples name the first offending point's numbers
    assert by["tp·pp·cp does not divide the GPU count"].example.endswith(f"∤ {N_GPUS}")
    assert by["hybrid shard group does not divide dp·cp"].example == \
        "zero_group=4, dp·cp=6"
    assert by["2·cp does not divide the sequence length"].example == \
        f"2·cp=8 does not divide seq_len={TRAIN.seq_len}"
    assert by["more data-parallel replicas than sequences per step"].example == \
        f"dp={N_GPUS} > global batch {TRAIN.global_batch}"
    # a micro-batch count the interleaved schedule cannot run: m not a multiple of pp
    example = by["interleaved 1F1B needs micro-batches divisible by pp (groups of p per "
                 "chunk)"].example
    found = re.fullmatch(r"pp=(\d+), (\d+) micro-batch(es)?", example)
    assert found, example
    p, m = int(found.group(1)), int(found.group(2))
    assert m % p and (found.group(3) is not None) == (m != 1)
    assert by["pp·chunks does not divide the layers"].example in (
        f"pp={p} chunks={v}" for p in PP for v in (2, 3) if MODEL.n_layers % (p * v))


def test_rejections_add_counts_and_keep_the_first_example():
    r = _Rejections()
    r.add("x", 3, "first")
    r.add("x", 4, "second", category="user")
    r.add("y", 0, "never")  # an empty region is not a region
    r.add("z", 9)
    (z, x) = r.result()
    assert (z.reason, z.count, z.category) == ("z", 9, "constraint")
    assert (x.reason, x.count, x.example, x.category) == ("x", 7, "first", "constraint")
