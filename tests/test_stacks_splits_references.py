"""shardwise.stacks.splits against the frameworks' own split code over grids where every
term shows (remainders at each position, first/last weights 0–2, interleaved stages):
torchtitan 0.3.0's `_generate_llm_fqn_per_model_part` and its stage count
`ceil((L + first + last) / layers_per_stage)`, DeepSpeed 0.19.8's `partition_balanced` on
Megatron-DeepSpeed's 0/1 block weights and GPT-NeoX's L + 2 units, and its
`partition_uniform` over GPT2ModelPipe's L + 5 specs.
"""

from __future__ import annotations

import itertools
import math

import pytest

from shardwise.stacks.splits import (
    balanced_ends,
    deepspeed_split,
    neox_split,
    neox_uniform,
    split_refuses,
    stack_split,
    titan_partition,
    titan_split,
)

GRID = [(n, pp) for n in (3, 5, 7, 12, 26, 30) for pp in (2, 3, 4, 6) if n + 2 >= 2 * pp]


def _titan(stages: int, n_layers: int, first: int, last: int) -> list[int]:
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    parts = _generate_llm_fqn_per_model_part(stages, n_layers, first, last)
    return [sum(name.startswith("layers.") for name in part) for part in parts]


def _balanced(weights: list[int], pp: int) -> list[int]:
    """Weight-1 items per stage as DeepSpeed's partition_balanced splits `weights`."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.utils import partition_balanced

    bounds = partition_balanced(weights, pp)
    return [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(("n_layers", "pp"), GRID)
def test_titan_split_is_torchtitans(n_layers, pp):
    for first, last in itertools.product((0, 1, 2), repeat=2):
        try:
            theirs = _titan(pp, n_layers, first, last)
        except ValueError:  # torchtitan refuses the weights
            continue
        assert titan_split(pp, n_layers, first, last) == theirs, (first, last)


@pytest.mark.parametrize(("n_layers", "pp"), GRID)
def test_titan_partition_gives_torchtitan_the_split(n_layers, pp):
    """The settings found make torchtitan build `ceil(units / per_stage)` = the stages and
    split them as asked; None (and the stack refuses) only where no `layers_per_stage` makes
    pp stages, or for a split torchtitan cannot make (an extra layer in the middle)."""
    for first, last in itertools.product((0, 1, 2), repeat=2):
        try:
            sizes = tuple(_titan(pp, n_layers, first, last))
        except ValueError:
            continue
        found = titan_partition(n_layers, sizes)
        if found is None:  # torchtitan's options reach no pp stages with these weights
            units = n_layers + first + last
            assert all(math.ceil(units / p) != pp for p in range(1, units + 1))
            assert split_refuses("torchtitan", n_layers, sizes, pp)
            continue
        per_stage, a, z = found
        assert math.ceil((n_layers + a + z) / per_stage) == pp
        # the most symmetric of the first/last weights that give the split (titan_split is
        # torchtitan's, test above)
        options = [(x, y) for x, y in itertools.product(range(max(sizes) + 1), repeat=2)
                   if (n_layers + x + y) // pp >= max(x, y, 1)
                   and titan_split(pp, n_layers, x, y) == list(sizes)
                   and any(math.ceil((n_layers + x + y) / p) == pp
                           for p in range(1, n_layers + x + y + 1))]
        # ties of symmetry to the lighter weights (0, 0 before 1, 1)
        assert (a, z) == min(options, key=lambda xy: (abs(xy[0] - xy[1]), xy)), (options, found)
        assert tuple(_titan(pp, n_layers, a, z)) == sizes
        assert not split_refuses("torchtitan", n_layers, sizes, pp)
    if pp >= 3 and n_layers >= 2 * pp:  # one layer moved into a middle stage
        sizes = [n_layers // pp] * pp
        sizes[0] = n_layers - sum(sizes[1:]) - 1
        sizes[pp // 2] += 1
        if sizes not in [_titan(pp, n_layers, a, z) for a, z in
                         itertools.product(range(max(sizes) + 1), repeat=2)
                         if (n_layers + a + z) // pp >= max(a, z, 1)]:
            assert titan_partition(n_layers, tuple(sizes)) is None
            assert split_refuses("torchtitan", n_layers, tuple(sizes), pp)


@pytest.mark.parametrize(("n_layers", "pp"), GRID)
def test_deepspeed_and_neox_splits_are_deepspeeds(n_layers, pp):
    """Megatron-DeepSpeed: embedding, cast (0), L blocks (1), norm, head, cast (0);
    GPT-NeoX: embedding (0), _pre (1), L blocks (1), _post (1), norm, head (0); its uniform
    method: L + 5 specs evenly, the blocks being items 2 … L + 1."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.utils import partition_uniform

    assert deepspeed_split(n_layers, pp) == _balanced([0, 0] + [1] * n_layers + [0] * 3, pp)
    neox = _balanced([0, 1] + [1] * n_layers + [1, 0, 0], pp)
    # the _pre/_post units are not layers: the first and the last stage one short
    assert neox_split(n_layers, pp) == [neox[0] - 1, *neox[1:-1], neox[-1] - 1]
    bounds = partition_uniform(n_layers + 5, pp)
    blocks = set(range(2, n_layers + 2))
    assert neox_uniform(n_layers, pp) == [len(blocks & set(range(a, b)))
                                          for a, b in itertools.pairwise(bounds)]
    assert stack_split("deepspeed", n_layers, pp) == tuple(deepspeed_split(n_layers, pp))
    assert stack_split("neox", n_layers, pp) == tuple(neox_split(n_layers, pp))
    assert not split_refuses("deepspeed", n_layers, tuple(deepspeed_split(n_layers, pp)), pp)
    if n_layers % pp:  # the remainder on the last stages instead: not DeepSpeed's
        other = tuple(reversed(deepspeed_split(n_layers, pp)))
        assert split_refuses("deepspeed", n_layers, other, pp)


@pytest.mark.parametrize(("n_layers", "pp", "chunks"), [(26, 3, 2), (30, 4, 2), (12, 2, 3),
                                                         (7, 2, 1)])
def test_the_titan_stacks_default_is_torchtitans_over_virtual_stages(n_layers, pp, chunks):
    assert stack_split("torchtitan", n_layers, pp, chunks) == tuple(
        _titan(pp * chunks, n_layers, 1, 1))
    ends = balanced_ends("torchtitan", n_layers, pp)
    if ends is not None:
        assert ends[1] == tuple(_titan(pp, n_layers, 1, 1))
