"""`--fix` and `--max`: the grid they search against the unconstrained one filtered by hand,
the memory rejection's count, and one clear error for each bad constraint."""

import re

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.compute import RC_CODES
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import (
    Constraint,
    SearchSpace,
    _enumerate,
    _flatten,
    _Rejections,
    plan,
)
from tests.test_plan import _brute_force


def test_fix_searches_only_what_it_allows():
    """`plan llama3-70b --gpus 512 --fix tp=8,pp=4`: only tp8 pp4 layouts, exactly the ones
    the unconstrained search holds with tp=8 and pp=4 (filtered after the fact: the
    reference), over the same grid, the rest counted as excluded by the constraint."""
    model, cluster = get_model("llama3-70b"), Cluster.of(512, "h100")
    train = TrainSpec(seq_len=8192, global_batch=512)
    rule = Constraint.parse("tp=8,pp=4")
    fixed = plan(model, cluster, train, top=10, space=SearchSpace(constraint=rule))
    assert all(e.layout.tp == 8 and e.layout.pp == 4 for e in fixed.ranked)
    assert fixed.constraint == "fix tp=8,pp=4"
    free_grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    free, _ = _flatten(free_grid)
    inside = int(((free["tp"] == 8) & (free["pp"] == 4)).sum())
    assert fixed.stats.evaluated == inside
    excluded = [r for r in fixed.rejected if r.category == "user"]
    assert len(excluded) == 1 and "fix tp=8,pp=4" in excluded[0].reason
    structural = sum(r.count for r in fixed.rejected if r.category != "memory")
    grid = SearchSpace().resolve(model, cluster, train)
    assert structural + fixed.stats.evaluated == fixed.stats.grid
    assert fixed.stats.grid > 0 and len(grid["tp"]) > 1


@pytest.mark.parametrize(("text", "field", "code"), [("sp=1", "sp", 1), ("sp=0", "sp", 0),
                                                     ("recompute=full", "recompute", 2),
                                                     ("zero=2", "zero", 2)])
def test_fix_of_a_per_cell_field_searches_only_its_value(text, field, code):
    """`--fix` of a field the grid varies inside each structure (sequence parallelism,
    recompute, ZeRO stage): exactly the unconstrained search's layouts with that value
    (filtered after the fact: the reference), and no alternative with another value."""
    model, cluster = get_model("llama3-8b"), Cluster.of(16, "h100")
    train = TrainSpec(seq_len=4096, global_batch=64)
    fixed = plan(model, cluster, train, top=3,
                 space=SearchSpace(constraint=Constraint.parse(text)))
    free_grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    free, _ = _flatten(free_grid)
    assert code == {"sp": int, "recompute": RC_CODES.get, "zero": int}[field](
        text.split("=")[1])
    assert fixed.stats.evaluated == int((free[field] == code).sum()) > 0
    assert int((free[field] != code).sum()) > 0  # not degenerate: the value excludes some
    assert not [a for a in fixed.alternatives if a.axis == field]


@pytest.mark.parametrize("prune_above", [0, 10**12])
def test_the_memory_rejection_counts_every_layout_that_does_not_fit(prune_above):
    """The rejected region "does not fit in GPU memory" holds exactly the valid layouts over
    the budget, in the pruned search and in the one that times every layout."""
    from shardwise.report.builders import run_plan

    result = run_plan(get_model("mixtral-8x22b"), gpus=32, seq=4096, global_batch="64",
                      prune_above=prune_above)
    (memory,) = [r for r in result.rejected if r.category == "memory"]
    assert memory.reason == "does not fit in GPU memory"
    assert memory.count == result.stats.evaluated - result.stats.fits > 0


def test_max_and_fix_of_a_value_outside_the_default_axes():
    model, cluster = get_model("tiny").with_(n_layers=6), Cluster.of(8, "h100")
    train = TrainSpec(seq_len=64, global_batch=64)
    capped = plan(model, cluster, train, top=20, baseline=False, all_variants=True,
                  space=SearchSpace(constraint=Constraint.parse(None, "tp=2,pp=2")))
    assert all(e.layout.tp <= 2 and e.layout.pp <= 2 for e in capped.ranked)
    rows = _brute_force(model, cluster, train)
    inside = [(t, lay) for t, _, lay in rows if lay.tp <= 2 and lay.pp <= 2][:20]
    assert [e.estimate.total for e in capped.ranked] == pytest.approx(
        [t for t, _ in inside], rel=1e-8)
    # micro-batch 32 is beyond the default 1..16: fixing it searches it
    big = plan(model, cluster, train, top=3, baseline=False,
               space=SearchSpace(constraint=Constraint.parse("micro_batch=32,zero=1")))
    assert all(e.layout.micro_batch == 32 and e.layout.zero == 1 for e in big.ranked)


@pytest.mark.parametrize("fix, most, message", [
    ("tp=x", None, "layout tp='x' must be an integer"),
    ("speed=3", None, "cannot read layout item"),
    ("tp=0", None, "--fix tp must be an integer in [1,"),
    (None, "schedule=1f1b", "--max takes counts (dp, tp, pp, cp, ep, micro_batch, chunks, "
                            "zero, zero_group); use --fix schedule=…"),
    *((None, text, f"--max {text.split('=')[0]}: --max takes counts") for text in (
        "recompute=full", "sp=1", "partition=2:2", "cp_kind=ring")),
    ("recompute=some", None, "--fix recompute='some' unknown"),
    ("zero=4", None, "--fix zero must be an integer in [0, 3], got 4"),
    (None, "zero_group=-2", "--max zero_group must be an integer in [0, 1,048,576], got -2"),
    ("etp=-1", None, "--fix etp must be an integer in [0, 1,048,576], got -1"),
    ("cp_kind=bogus", None,
     "--fix cp_kind='bogus' unknown; valid: ring, ulysses, hybrid, allgather"),
])
def test_bad_constraints_are_one_clear_error(fix, most, message):
    with pytest.raises(ShardwiseError, match=re.escape(message)):
        Constraint.parse(fix, most)


@pytest.mark.parametrize("fix, most", [("dp=4", None), (None, "dp=2")])
def test_a_data_parallel_constraint_searches_only_the_replicas_it_allows(fix, most):
    """dp is no axis of the grid (it follows from the GPUs): `--fix dp=4` and `--max dp=2`
    keep exactly the unconstrained search's layouts with those replicas (filtered after the
    fact: the reference), and count every other cell of the grid as excluded by the user."""
    model, cluster = get_model("llama3-8b"), Cluster.of(16, "h100")
    train = TrainSpec(seq_len=4096, global_batch=64)
    rule = Constraint.parse(fix, most)
    fixed = plan(model, cluster, train, top=3, space=SearchSpace(constraint=rule))
    free_grid, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    free, _ = _flatten(free_grid)
    keep = free["dp"] == 4 if fix else free["dp"] <= 2
    assert fixed.stats.evaluated == int(keep.sum()) > 0 and int((~keep).sum()) > 0
    assert all(e.layout.dp == 4 if fix else e.layout.dp <= 2 for e in fixed.ranked)
    structural = sum(r.count for r in fixed.rejected if r.category != "memory")
    assert structural + fixed.stats.evaluated == fixed.stats.grid


def test_a_fixed_split_the_stack_cannot_run_is_refused_by_its_rule(capsys):
    """Megatron-DeepSpeed splits 32 blocks over 2 stages as 16 + 16 (DeepSpeed's
    'type:transformer' partition: the first L mod pp stages one block more): `--fix` of
    16:16 plans, of 20:12 is one line naming the stack, its rule and the split."""
    from tests.cli_helpers import run_in_process

    args = ("plan", "llama3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "64",
            "--impl", "megatron-deepspeed", "--fix")
    code, out, _ = run_in_process(capsys, *args, "pp=2,partition=16:16", "--json")
    assert code == 0 and '"pp": 2' in out
    code, _, err = run_in_process(capsys, *args, "pp=2,partition=20:12")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert ("megatron-deepspeed cannot split the layers so (Megatron-DeepSpeed's GPTModelPipe "
            "splits the blocks with DeepSpeed's 'type:transformer' partition") in err
    assert err.rstrip().endswith("(pp=2, layers 20,12)")
