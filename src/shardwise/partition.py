"""Stage partitions: which layers each pipeline stage (and each virtual chunk) holds, for one
layout or arrays of them (the planner's `Balanced` partitions).

Even when `pp·chunks` divides the layers; otherwise balanced by cost with the embedding and
the head counted as a layer each (torchtitan's `pipeline_parallel_first/last_stage_less_layers`),
or an explicit count per stage or per virtual stage (Megatron's
`--decoder-first/last-pipeline-num-layers`, `--pipeline-model-parallel-layout`).
See docs/concepts/schedules.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.schedules.actions import Placement, virtual_stage


@dataclass(frozen=True)
class Balanced:
    """A stage partition balanced by cost, for one layout or arrays of them: `L + a + z`
    layer units spread evenly over the `pp` stages, the first stage `a = first_less` layers
    short (room for the embedding), the last `z = last_less` (the head) — torchtitan's
    `pipeline_parallel_first/last_stage_less_layers`, Megatron's shortened first and last
    stages (`--decoder-first/last-pipeline-num-layers`). (0, 0) is the even split when `pp`
    divides the layers (interleaved ones too); other counts need chunks = 1 (`chunk_span`)."""

    first_less: Any = 1
    last_less: Any = 1

    @staticmethod
    def default(n_layers: int, pp: Any, chunks: Any = 1) -> Balanced:
        """A `Layout` without an explicit partition: even when `pp·chunks` divides the
        layers, else the embedding and the head one layer each (`stage_partition`)."""
        units = np.where(n_layers % (pp * chunks) == 0, 0, 1)
        return Balanced(units, units)

    def searched(self, n_layers: int, pp: Any) -> Any:
        """Where these counts are not the default partition's (`default`; array-generic)."""
        default = Balanced.default(n_layers, pp).first_less
        return (self.first_less != default) | (self.last_less != default)


Partition = tuple[int, ...] | Balanced
"""An explicit partition (layers per stage; () for the default) or a `Balanced` one."""

FIXED = (-9, -9)
"""The planner's `(first_less, last_less)` key of a partition `--fix` pins that its grid does
not enumerate (uneven interleaved ones): the partition is used as given (`fixed_or_balanced`)."""


def fixed_or_balanced(cand: dict[str, Any]) -> Partition:
    """The partition of the planner's arrays of layouts: the one `--fix` pinned (`FIXED`), or
    `Balanced(first_less, last_less)`."""
    if np.any(np.asarray(cand["first_less"]) == FIXED[0]):
        return next(split for (_, a, _z), split in cand["_partitions"].items() if a == FIXED[0])
    return Balanced(cand["first_less"], cand["last_less"])


def _one(value: Any) -> int:
    """`value` as one integer: an explicit partition is one layout's, so the planner's arrays
    that come with it hold a single pp (chunks)."""
    values = np.unique(np.asarray(value))
    if len(values) != 1:
        raise ShardwiseError(f"an explicit partition belongs to one layout, got {values}")
    return int(values[0])


def parse_partition(text: str) -> tuple[int, ...]:
    """`"7,8,8,7"` → (7, 8, 8, 7): layers per pipeline stage, first to last (every item a
    whole number: `,,,` or `7,,8` is refused, not read as fewer stages)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ShardwiseError(f"partition {text!r} must be layer counts per stage, e.g. 7,8,8,7"
                             ) from None


def resolve_partition(n_layers: int, pp: int, partition: str | tuple[int, ...] | None = None,
                      first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """The partition of the CLI options: `--partition 7,8,…,7` or Megatron's
    `--first-stage-layers F --last-stage-layers G` (`first_last_partition`), () for neither."""
    if isinstance(partition, str):
        partition = (parse_pipeline_layout(partition, pp) if is_pipeline_layout(partition)
                     else parse_partition(partition))
    if partition and (first is not None or last is not None):
        raise ShardwiseError("give either --partition or --first/--last-stage-layers, not both")
    if first is not None or last is not None:
        return first_last_partition(n_layers, pp, first, last)
    return tuple(partition or ())


def first_last_partition(n_layers: int, pp: int, first: int | None, last: int | None
                         ) -> tuple[int, ...]:
    """Megatron-LM's `--decoder-first-pipeline-num-layers F --decoder-last-pipeline-num-layers
    G`: the first stage `F` layers, the last `G`, the rest spread evenly over the middle stages
    (Megatron requires that they divide evenly; so do we)."""
    f = first if first is not None else -1
    g = last if last is not None else -1
    middle = pp - (f >= 0) - (g >= 0)
    rest = n_layers - max(f, 0) - max(g, 0)
    if pp < 2 or middle < 0 or rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise ShardwiseError(
            f"first/last stage layers {first}/{last} leave {rest} layers for {max(middle, 0)} "
            f"middle stages of pp={pp}; they must divide evenly (n_layers={n_layers})")
    each = rest // middle if middle else 0
    return tuple([*([f] if f >= 0 else []), *[each] * middle, *([g] if g >= 0 else [])])


def accounted_partition(n_layers: int, pp: int, chunks: int = 1, embedding: bool = True,
                        loss: bool = True) -> tuple[int, ...]:
    """Megatron's `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-
    pipeline-split`: the embedding and the loss count one layer each, every one of the `pp·v`
    virtual stages gets `(L + e + l)/(pp·v)` units, and the first (last) virtual stage builds
    one Transformer layer fewer (megatron-core 0.16.1 `get_num_layers_to_build`, which also
    requires the division). Layers per virtual stage in model order (`Layout.partition`)."""
    units = n_layers + int(embedding) + int(loss)
    stages = pp * chunks
    if pp < 2 or units % stages:
        raise ShardwiseError(
            f"accounting for the embedding/loss gives {units} layer units, which pp·chunks="
            f"{pp}·{chunks} must divide (megatron-core's rule); valid pp·chunks: divisors of "
            f"{units}")
    counts = [units // stages] * stages  # ≥ 1 each: units is a positive multiple of stages
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    return tuple(counts)


def partition_problems(n_layers: int, pp: int, chunks: int, partition: tuple[int, ...]
                       ) -> list[str]:
    """What is wrong with `partition` (or with the default one when it is empty): `pp` stage
    counts or, interleaved, `pp·chunks` virtual-stage counts (torchtitan's split; Megatron's
    `--pipeline-model-parallel-layout`). With `pp` counts and interleaving every stage's layers
    are a multiple of `chunks`, as megatron-core requires of
    `num_layers_in_first/last_pipeline_stage` and of the middle stages
    (`TransformerConfig.__post_init__`). A stage may be empty only at the ends of `pp` counts
    (embedding-only, loss-only); any virtual stage may (`parse_pipeline_layout`)."""
    if partition:
        out = []
        virtual = chunks > 1 and len(partition) == pp * chunks
        if len(partition) != pp and not virtual:
            out.append(f"partition has {len(partition)} stages but pp={pp}"
                       + (f" (or pp·chunks={pp * chunks} virtual stages)" if chunks > 1 else ""))
        if sum(partition) != n_layers:
            out.append(f"partition sums to {sum(partition)} layers but n_layers={n_layers}")
        inner = () if virtual else partition[1:-1]  # Megatron's layouts: empty E/m/L stages
        if min(inner, default=1) < 1 or min(partition, default=1) < 0:
            out.append(f"every pipeline stage but the first (embedding only) and the last "
                       f"(loss only) needs ≥ 1 layer, got partition "
                       f"{','.join(map(str, partition))}")
        elif chunks > 1 and not virtual and any(n % chunks for n in partition):
            out.append(f"with chunks={chunks} every stage's layers must be a multiple of "
                       f"{chunks} (each chunk holds an equal share, Megatron's rule), got "
                       f"partition {','.join(map(str, partition))}")
        return out
    if n_layers % (pp * chunks) == 0:
        return []
    if chunks > 1:
        return [f"pp·chunks={pp}·{chunks} does not divide n_layers={n_layers}; give uneven "
                f"interleaved stages explicitly (partition=…: {pp} stages each a multiple of "
                f"{chunks} layers, or {pp * chunks} virtual stages)"]
    if n_layers + 2 < 2 * pp:
        return [f"pp={pp} does not divide n_layers={n_layers} and the balanced partition would "
                "leave a stage without layers; use a smaller pp"]
    return []


def stage_partition(n_layers: int, pp: int, chunks: int = 1, partition: Partition = ()
                    ) -> tuple[int, ...]:
    """Layers on each of the `pp` stages (per chunk when interleaved): `partition` when given
    (÷ `chunks`: each chunk of a stage holds an equal share, Megatron's rule);
    `n_layers/(pp·chunks)` each when that divides; otherwise balanced by cost with the
    embedding and the head counted as one layer each (torchtitan's
    `pipeline_parallel_first/last_stage_less_layers = 1`): `L + 2` units spread as evenly as
    possible, the extras on the stages after the first, then the first and the last stage one
    layer short. Llama 3 405B (126 layers) over 16 stages: 7, 8 × 14, 7 (Llama 3 paper §3.3.2);
    BLOOM-176B (70 layers) over 12: 5, 6 × 10, 5 (BLOOM paper §3.4: embedding + 5 blocks on the
    first stage). Inputs checked: integers ≥ 1, a partition of non-negative counts; a
    stage that would hold a negative count (fewer layers than stages) is one line."""
    import shardwise.validate as validate

    validate.integer(n_layers, "n_layers", low=1, high=validate.MAX_LAYERS)
    validate.degree(pp, "pp")
    validate.degree(chunks, "chunks")
    if not isinstance(partition, Balanced) and not (isinstance(partition, tuple) and all(
            validate._is_int(n) and n >= 0 for n in partition)):
        raise ShardwiseError(f"partition must be a tuple of layer counts ≥ 0, got "
                             f"{partition!r}"[:200])
    if isinstance(partition, tuple) and partition and len(partition) not in (pp, pp * chunks):
        raise ShardwiseError(f"partition has {len(partition)} counts; give pp={pp} or "
                             f"pp·chunks={pp * chunks}")
    counts = tuple(int(n) for n in (layers_on_stage(n_layers, pp, chunks, stage, partition)
                                    for stage in range(pp)))
    if isinstance(partition, tuple) and min(counts) < 0:  # a `Balanced` probe may go below
        raise ShardwiseError(f"{n_layers} layers cannot fill pp={pp} stages × {chunks} "
                             f"chunk(s) (a stage would hold {min(counts)}); use pp·chunks ≤ "
                             f"{n_layers}")
    return counts


def stage_totals(pp: int, chunks: int, partition: tuple[int, ...],
                 placement: Placement = "loop") -> tuple[int, ...]:
    """Layers on each stage over all its chunks, of one layout's explicit `partition` (per
    stage, or per virtual stage in model order, laid out by `placement`)."""
    pp, chunks, placement = _one(pp), _one(chunks), _one_placement(placement)
    if len(partition) == pp:
        return partition
    return tuple(sum(partition[virtual_stage(i, c, pp, placement)] for c in range(chunks))
                 for i in range(pp))


def layers_on_stage(n_layers: int, pp: Any, chunks: Any, stage: Any,
                    partition: Partition = ()) -> Any:
    """Layers one chunk of pipeline `stage` holds (`stage_partition`), for numbers or arrays of
    layouts (the planner's `Balanced` partitions; an explicit one is one layout's)."""
    return chunk_span(n_layers, pp, chunks, stage, 0, partition)[1]


def chunk_span(n_layers: int, pp: Any, chunks: Any, stage: Any, chunk: Any,
               partition: Partition = (), placement: Placement = "loop") -> tuple[Any, Any]:
    """(first layer, layers) of virtual chunk `chunk` on pipeline `stage`, the chunk running
    virtual stage `s = virtual_stage(stage, chunk, p, placement)` ("loop" `c·p + stage`; "v",
    ZBV and DualPipeV, `2p-1-stage` for chunk 1; `placement` may be an array of them): even
    stages hold `[s·n, s·n + n)`, `n = L/(p·v)`; explicit ones the run of virtual stage `s` in
    `virtual_sizes` (per stage: each chunk `partition[i]/v`, megatron-core's
    `get_transformer_layer_offset` under "loop");
    a `Balanced` one (chunks = 1; the default is `Balanced.default`) spreads `L + a + z` units
    as evenly as possible, the extras on the stages after the first, then the first stage `a`
    layers short and the last `z`. Array-generic in `pp`, `chunks`, `stage` and the `Balanced`
    counts."""
    if isinstance(partition, tuple) and partition:
        pp, chunks = _one(pp), _one(chunks)
        sizes = np.asarray(virtual_sizes(pp, chunks, partition, _one_placement(placement)),
                           dtype=np.int64)  # per virtual stage, in model order
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        vs = virtual_stage(stage, _one(chunk), pp, _one_placement(placement))
        return starts[vs], sizes[vs]
    if not any(np.ndim(x) for x in (pp, chunks, stage, chunk, placement)) and not (
            isinstance(partition, Balanced) and np.ndim(partition.first_less)
            + np.ndim(partition.last_less)):
        return _chunk_span_of_one(n_layers, int(pp), int(chunks), int(stage), int(chunk),
                                  partition, str(placement))  # type: ignore[arg-type]
    per = n_layers // (pp * chunks)
    divides = n_layers % (pp * chunks) == 0
    ends = partition if isinstance(partition, Balanced) else Balanced.default(n_layers, pp, chunks)
    a, z = ends.first_less, ends.last_less
    even = divides & (a == 0) & (z == 0)
    q, r = np.divmod(n_layers + a + z, pp)  # L + a + z units: embedding a layers, head z
    first, last = stage == 0, stage == pp - 1
    count = q + ((stage >= 1) & (stage <= r)) - a * first - z * last
    start = stage * q + np.clip(np.minimum(stage - 1, r), 0, None) - a * (stage > 0)
    # the virtual stage it runs ("v" tests the chunk's parity: per element for an array)
    mirrored = (virtual_stage(stage, chunk, pp, "v") if not np.ndim(chunk)
                else np.vectorize(virtual_stage)(stage, chunk, pp, "v"))
    runs = np.where(np.asarray(placement) == "v", mirrored,
                    virtual_stage(stage, chunk, pp, "loop"))
    if not np.ndim(even) and even:
        return runs * per, per
    return (np.where(even, runs * per, start),
            np.where(even, per, count))


def _one_placement(placement: Any) -> Placement:
    """The placement of one layout (an explicit partition's; the planner's arrays that come
    with it hold one)."""
    if isinstance(placement, str):
        return placement  # type: ignore[return-value]
    values = np.unique(np.asarray(placement))
    if len(values) != 1:
        raise ShardwiseError(f"an explicit partition belongs to one layout, got placements "
                             f"{values}")
    return str(values[0])  # type: ignore[return-value]


def virtual_sizes(pp: int, chunks: int, partition: tuple[int, ...],
                  placement: Placement = "loop") -> tuple[int, ...]:
    """Layers of each of the `pp·chunks` virtual stages in model order, of an explicit
    `partition`: `pp·chunks` counts as given; `pp` counts each chunk of stage `i` holding
    `partition[i]/chunks`, the chunk running virtual stage `virtual_stage(i, c, pp,
    placement)` — "loop" `c·pp + i` (megatron-core's `get_transformer_layer_offset`), "v"
    mirrored on odd chunks (torchtitan's `_get_pp_rank_to_stage_indices_mapping`)."""
    if len(partition) != pp:
        return tuple(partition)
    sizes = [0] * (pp * chunks)
    for i, n in enumerate(partition):
        for c in range(chunks):
            sizes[virtual_stage(i, c, pp, placement)] = n // chunks
    return tuple(sizes)


def _chunk_span_of_one(n_layers: int, pp: int, chunks: int, stage: int, chunk: int,
                       partition: Partition, placement: Placement = "loop"
                       ) -> tuple[int, int]:
    """`chunk_span` of one layout in plain integers (the simulator asks it per stage);
    `partition` a `Balanced` one or () (an explicit one never reaches here)."""
    per, rest = divmod(n_layers, pp * chunks)
    if isinstance(partition, Balanced):
        a, z = int(partition.first_less), int(partition.last_less)
    else:
        a = z = int(rest != 0)
    if rest == 0 and a == z == 0:
        return virtual_stage(stage, chunk, pp, placement) * per, per
    q, r = divmod(n_layers + a + z, pp)
    count = q + (1 <= stage <= r) - a * (stage == 0) - z * (stage == pp - 1)
    return stage * q + max(min(stage - 1, r), 0) - a * (stage > 0), count


def stage_extremes(n_layers: int, pp: Any, chunks: Any, partition: Partition = (),
                   placement: Placement = "loop") -> tuple[Any, Any, Any]:
    """(the most layers any stage holds, the first stage's, the last stage's), over all chunks
    (`stage_partition`; array-generic for `Balanced` partitions, whose busiest stage is the
    first, the second or the last)."""
    if isinstance(partition, tuple) and partition:
        totals = stage_totals(pp, chunks, partition, placement)
        return max(totals), totals[0], totals[-1]

    def count(stage: Any) -> Any:
        return layers_on_stage(n_layers, pp, chunks, stage, partition) * chunks

    first, last = count(0 * pp), count(pp - 1)
    return np.maximum(np.maximum(first, count(np.minimum(1, pp - 1))), last), first, last


_LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def _unroll(text: str) -> str:
    """Expand Megatron's repetitions: `(x)*n` and `c*n` (innermost groups first)."""
    out, i = "", 0
    while i < len(text):
        char = text[i]
        if char == "(":
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ShardwiseError(f"pipeline layout {text!r}: unclosed '('")
            body, i = _unroll(text[i + 1:j - 1]), j
        else:
            body, i = char, i + 1
        if text[i:i + 1] == "*":
            digits = ""
            while i + 1 < len(text) and text[i + 1].isdigit():
                digits, i = digits + text[i + 1], i + 1
            if not digits:
                raise ShardwiseError(f"pipeline layout {text!r}: '*' needs a count")
            body, i = body * int(digits), i + 1
        out += body
    return out


def parse_pipeline_layout(text: str, pp: int | None = None) -> tuple[int, ...]:
    """Megatron-LM's `--pipeline-model-parallel-layout` (megatron-core 0.16.1,
    transformer/pipeline_parallel_layer_layout.py): virtual stages separated by `|` in model
    order (virtual stage `c·pp + i` is chunk `c` of rank `i`), `E` the embedding, `t` a
    Transformer layer, `m` an MTP layer, `L` the loss, `(…)*n` and `x*n` repeated, commas
    cosmetic. Returns the Transformer layers per virtual stage (`Layout.partition`); the
    embedding must open the first stage and the loss close the last, once each, and the MTP
    layers follow every Transformer layer (Megatron's `validate_layer_layout`)."""
    stages = _unroll(text.replace(",", "").replace(" ", "")).split("|")
    chars = "".join(stages)
    if bad := sorted(set(chars) - set(_LAYER_CHARS)):
        raise ShardwiseError(f"pipeline layout {text!r}: unknown layer character(s) "
                             f"{''.join(bad)}; known: E (embedding), t (layer), m (MTP), L (loss)")
    if not chars.startswith("E") or not chars.endswith("L") or chars.count("E") != 1 or (
            chars.count("L") != 1):
        raise ShardwiseError(f"pipeline layout {text!r}: the embedding E must open the first "
                             "stage and the loss L close the last, once each")
    if "m" in chars and "t" in chars[chars.index("m"):]:
        raise ShardwiseError(f"pipeline layout {text!r}: MTP layers m come after every "
                             "Transformer layer t")
    if pp is not None and len(stages) % pp:
        raise ShardwiseError(f"pipeline layout {text!r} has {len(stages)} stages, not a "
                             f"multiple of pp={pp}")
    return tuple(stage.count("t") for stage in stages)


def is_pipeline_layout(text: str) -> bool:
    """`text` is a Megatron layout string (it names the embedding), not layer counts."""
    return "E" in text
