"""The search space's default axes (docs/concepts/planner.md#search, SPEC §7; and the default budget, 85 % of GPU memory) written out
here for a stack that runs every axis (shardwise's own): tp the divisors of the GPUs per
node; pp the divisors of the layers up to the GPUs, and the uneven pp that divide the GPUs
with at least one layer per stage (2·pp ≤ L + 2); cp the powers of two up to 32 (and the
GPUs) whose 2·cp divides the sequence; ep the divisors of the experts, etp 0 and 1;
micro-batches 1..16; 1F1B, ZB-H1 and interleaved with every chunk count ≥ 2 dividing the
layers (GPipe is not searched); ZeRO 0-3, stages 1-3 also over groups of 2, 4, 8, … ranks
below the GPU count; every recompute. Thresholds at each edge: 2·cp = the sequence, cp = 32."""

from __future__ import annotations

import pytest

from shardwise.arch import get_model
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace
from shardwise.plan.space import DEFAULT_HEADROOM, _divisors


def _divs(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize(("layers", "gpus", "per_node", "seq"),
                         [(10, 128, 8, 48), (12, 64, 4, 4096), (7, 6, 2, 2048)])
def test_default_axes_are_the_documented_ones(layers, gpus, per_node, seq):
    model = get_model("tiny-deepseek").with_(n_layers=layers)  # 8 routed experts
    cluster = Cluster.of(gpus, "h100", gpus_per_node=per_node)
    train = TrainSpec(seq_len=seq, global_batch=64, impl="shardwise")
    axes = SearchSpace().resolve(model, cluster, train)
    assert axes["tp"] == _divs(per_node)
    assert axes["pp"] == sorted({d for d in _divs(layers) if d <= gpus}
                                | {d for d in _divs(gpus) if 2 * d <= layers + 2})
    assert axes["cp"] == [c for c in (1, 2, 4, 8, 16, 32, 64, 128)
                          if c == 1 or (c <= min(32, gpus) and seq % (2 * c) == 0)]
    assert axes["ep"] == [1, 2, 4, 8] and axes["etp"] == [0, 1]
    assert axes["micro_batch"] == list(range(1, 17))
    assert sorted(axes["schedule"]) == sorted(
        [(1, 1), (3, 1)] + [(2, v) for v in _divs(layers) if v >= 2])  # 1F1B, ZB-H1, interleaved
    groups = [g for g in (2, 4, 8, 16, 32, 64, 128) if g < gpus]
    assert sorted(axes["zero"]) == sorted([(z, 0) for z in range(4)]
                                          + [(z, g) for z in (1, 2, 3) for g in groups])
    assert axes["sp"] == [0, 1] and sorted(axes["recompute"]) == [0, 1, 2]
    assert axes["cp_kind"] == [0, 1, 2]


def test_divisors_and_the_default_headroom():
    for n in (1, 2, 7, 12, 36, 97, 360, 1024, 2 * 3 * 5 * 7 * 11 * 13, 9973 * 2):
        assert _divisors(n) == _divs(n)
    # "85 % of it by default" (docs/getting-started.md): the budget `plan` ranks against
    from shardwise.plan import plan

    cluster = Cluster.of(8, "h100")
    result = plan(get_model("tiny-deepseek"), cluster,
                  TrainSpec(seq_len=64, global_batch=16, impl="shardwise"), top=1,
                  space=SearchSpace(tp=(1,), pp=(1,), ep=(8,), micro_batch=(2,), zero=(1,),
                                    recompute=("none",)), baseline=False)
    assert result.headroom == DEFAULT_HEADROOM == 0.85
    assert result.budget == cluster.accelerator.memory_bytes * 0.85
    assert result.best.budget == result.budget


@pytest.mark.parametrize("layers", [7, 8, 10, 11])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_a_deepspeed_stack_searches_its_one_split(layers, pp):
    """Megatron-DeepSpeed's stages (DeepSpeed's `partition_balanced` on the blocks alone):
    `L // pp` layers each, the first `L mod pp` stages one more — written out here; the
    default partition (written `()`) where that is the balanced default too."""
    from shardwise.layout import stage_partition
    from shardwise.plan.grid import _partitions

    model = get_model("tiny-deepseek").with_(n_layers=layers)
    q, r = divmod(layers, pp)
    split = tuple(q + (i < r) for i in range(pp))
    ((ends, got),) = _partitions(model, pp, "deepspeed").items()
    assert (got or stage_partition(layers, pp)) == split
    assert (got == ()) == (split == stage_partition(layers, pp))
    assert ends == ((-1, 0) if r else (0, 0))


def test_a_fixed_schedule_or_chunk_count_the_grid_lacks_is_searched():
    """`--fix schedule=gpipe` (GPipe is not in the default grid) searches GPipe alone;
    `--fix chunks=3` keeps only interleaving with 3 chunks per stage."""
    from shardwise.plan import plan
    from shardwise.plan.space import Constraint

    model = get_model("tiny-deepseek").with_(n_layers=12)
    cluster = Cluster.of(8, "h100")
    train = TrainSpec(seq_len=64, global_batch=32, impl="shardwise")
    base = dict(tp=(1,), pp=(2,), ep=(4,), micro_batch=(1,), zero=(1,), recompute=("none",))
    gpipe = plan(model, cluster, train, top=5, baseline=False, all_variants=True,
                 space=SearchSpace(**base, constraint=Constraint.parse("schedule=gpipe")))
    assert {e.layout.schedule for e in gpipe.ranked} == {"gpipe"}
    three = plan(model, cluster, train, top=5, baseline=False, all_variants=True,
                 space=SearchSpace(**base, chunks=(2, 3, 4),
                                   constraint=Constraint.parse("chunks=3")))
    assert {(e.layout.schedule, e.layout.chunks) for e in three.ranked} == {("interleaved", 3)}
