"""How stacks split the layers over pipeline stages (`Stack.split`): torchtitan's rule
(`titan_split`, `titan_partition`), Megatron-DeepSpeed's (`deepspeed_split`), GPT-NeoX's (`neox_split`), or
any."""

from __future__ import annotations

from itertools import pairwise


def titan_split(stages: int, n_layers: int, first_less: int, last_less: int) -> list[int]:
    """Layers per virtual stage as torchtitan 0.3.0 splits them (distributed/
    pipeline_parallel.py `_generate_llm_fqn_per_model_part`): `L + first_less + last_less`
    units, `units // stages` each, the remainder one more on the first stages, the first stage
    `first_less` layers short and the last `last_less`."""
    units = n_layers + first_less + last_less
    q, r = divmod(units, stages)
    sizes = [q + (i < r) for i in range(stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    return sizes


def titan_partition(n_layers: int, sizes: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(`pipeline_parallel_layers_per_stage`, `first_stage_less_layers`,
    `last_stage_less_layers`) that make torchtitan 0.3.0 split `n_layers` as `sizes` (layers
    per virtual stage), the most symmetric first; None when no setting does. torchtitan makes
    `ceil((L + first + last) / layers_per_stage)` virtual stages and refuses a first or last
    weight above `units // stages` (`_get_pipeline_metadata`, `_generate_llm_fqn_...`)."""
    stages = len(sizes)
    pairs = sorted(((a, b) for a in range(max(sizes) + 1) for b in range(max(sizes) + 1)),
                   key=lambda ab: (abs(ab[0] - ab[1]), ab))
    for first, last in pairs:
        units = n_layers + first + last
        if units // stages < max(first, last, 1) or titan_split(stages, n_layers, first,
                                                                 last) != list(sizes):
            continue
        for per_stage in range(max(1, units // stages), units + 1):
            if -(-units // per_stage) == stages:
                return per_stage, first, last
    return None


def deepspeed_split(n_layers: int, pp: int) -> list[int]:
    """Megatron-DeepSpeed's stages: `GPTModelPipe` hands DeepSpeed `partition_method=
    'type:transformer'` (megatron/model/gpt_model.py:463 @4efb479), which balances the blocks
    only (`deepspeed.runtime.utils.partition_balanced` on 0/1 weights, 0.19.8): `L // pp` each,
    the first `L mod pp` stages one more (tests/integration recompute it with DeepSpeed)."""
    q, r = divmod(n_layers, pp)
    return [q + (i < r) for i in range(pp)]


def neox_split(n_layers: int, pp: int) -> list[int]:
    """GPT-NeoX's stages: it hands DeepSpeed `partition_method='type:transformer|mlp'`
    (neox_args.py default @ea7aefd), whose regex also matches the functions
    `_pre_transformer_block` (after the embedding) and `_post_transformer_block` (before the
    final norm) of GPT2ModelPipe's specs: `L + 2` units of weight 1 split like Megatron-
    DeepSpeed's blocks, so torchtitan's rule with one unit off the first and the last stage,
    `titan_split(pp, L, 1, 1)` (tests/test_stacks_pipe.py recomputes it with DeepSpeed's
    `partition_balanced`)."""
    return titan_split(pp, n_layers, 1, 1)


def neox_uniform(n_layers: int, pp: int) -> list[int]:
    """GPT-NeoX's stages with `pipe_partition_method: uniform`: DeepSpeed's
    `partition_uniform` over GPT2ModelPipe's `L + 5` specs (embedding, _pre_transformer_block,
    the blocks, _post_transformer_block, norm, head), `N // pp` each and the first `N mod pp`
    one more; the blocks each stage gets (items 2 … L+1)."""
    q, r = divmod(n_layers + 5, pp)
    bounds = [k * q + min(k, r) for k in range(pp + 1)]
    return [max(0, min(hi, n_layers + 2) - max(lo, 2)) for lo, hi in pairwise(bounds)]


SPLIT_RULES = {
    "any": "any layers per stage",
    "torchtitan": "torchtitan 0.3.0 spreads L + first + last units evenly, the extra units on "
                  "the first stages, and shortens only the first and the last stage "
                  "(distributed/pipeline_parallel.py)",
    "deepspeed": "Megatron-DeepSpeed's GPTModelPipe splits the blocks with DeepSpeed's "
                 "'type:transformer' partition, the first L mod pp stages one block more "
                 "(megatron/model/gpt_model.py:463); 4efb479's parser has no "
                 "--pp-partition-method (BigScience's fork had one; BLOOM's "
                 "'type:transformer|embedding' split needs that fork)",
    "neox": "GPT-NeoX's default pipe_partition_method 'type:transformer|mlp' weighs its "
            "blocks and the _pre/_post_transformer_block functions at the two ends: L + 2 "
            "units, the first (L+2) mod pp stages one more, the first and the last stage one "
            "block short (megatron/neox_arguments/neox_args.py, model/gpt2_model.py "
            "@ea7aefd), or with 'uniform' L + 5 specs evenly; 'parameters' is not modelled"}


def stack_split(split: str, n_layers: int, pp: int, chunks: int = 1
                ) -> tuple[int, ...] | None:
    """The stage partition a stack splitting as `split` makes by default over `pp` stages of
    `chunks` virtual stages each (None: it runs any): DeepSpeed's (no chunks), or torchtitan's
    over its `pp·chunks` virtual stages with the embedding and the head one layer each (its
    `first/last_stage_less_layers` default of 1)."""
    if split == "deepspeed" and chunks == 1:
        return tuple(deepspeed_split(n_layers, pp))
    if split == "neox" and chunks == 1 and n_layers + 2 >= 2 * pp:
        return tuple(neox_split(n_layers, pp))
    if split == "torchtitan" and n_layers + 2 >= 2 * pp * chunks:
        return tuple(titan_split(pp * chunks, n_layers, 1, 1))
    return None


def balanced_ends(split: str, n_layers: int, pp: int
                  ) -> tuple[tuple[int, int], tuple[int, ...]] | None:
    """((first_less, last_less), sizes): the `partition.Balanced` counts in [-2, 2] whose
    `stage_partition` is the one split `split` makes over `pp` stages (`stack_split`), for the
    planner's grid; None when the stack has none or no such counts give it."""
    from shardwise.partition import Balanced, stage_partition

    own = stack_split(split, n_layers, pp)
    for a in range(-2, 3):
        for z in range(-2, 3):
            if own is not None and stage_partition(n_layers, pp, 1, Balanced(a, z)) == own:
                return (a, z), own
    return None


def split_refuses(split: str, n_layers: int, sizes: tuple[int, ...], pp: int) -> bool:
    """Whether a stack splitting as `split` (`SPLITS`) cannot run `sizes` (layers per virtual
    stage, `Layout.stage_sizes`) over `pp` ranks."""
    if split == "torchtitan":
        return titan_partition(n_layers, sizes) is None
    if split == "deepspeed":
        return len(sizes) != pp or list(sizes) != deepspeed_split(n_layers, pp)
    if split == "neox":
        return len(sizes) != pp or list(sizes) not in (neox_split(n_layers, pp),
                                                       neox_uniform(n_layers, pp))
    return False

