"""What every export shares: the framework ↔ stack map, the refusals (what a framework cannot run
of a plan, in one line, with the nearest layout it runs and that layout's predicted step time,
`nearest`) and the launch-script helpers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

from shardwise.arch import ModelSpec
from shardwise.emit.launchers import Launch, torchrun_script
from shardwise.emit.models import FRAMEWORKS, VERSIONS, model_refusal
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules.registry import get_schedule
from shardwise.stacks import STACKS, Stack, stack_split


@dataclass(frozen=True)
class Emitted:
    """The configuration text and what else the run needs (DeepSpeed: the launch line)."""

    framework: str
    text: str
    notes: tuple[str, ...] = ()
    launch: Launch | None = None  # what each node runs (`emit.launchers`)


def framework_stack(framework: str) -> Stack:
    """The stack whose export `framework` is (`Stack.export`)."""
    key = framework.lower()
    for stack in STACKS.values():
        if stack.export == key:
            return stack
    raise ShardwiseError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")


def layout_text(layout: Layout) -> str:
    """`layout` as `--layout` text: every field but dp that differs from `Layout()`."""
    default = Layout()
    parts = []
    for f in fields(Layout):
        value = getattr(layout, f.name)
        if f.name == "dp" or value == getattr(default, f.name):
            continue
        if f.name == "partition":
            parts.append("partition=" + ":".join(map(str, value)))
        else:
            parts.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
    return ",".join(parts) or "dp only"


# ------------------------------------------------------------------------------- refusals
def _vocab_problems(framework: str, model: ModelSpec, layout: Layout) -> list[str]:
    """Megatron's vocabulary-parallel embedding splits V evenly over tp and pads V up to a
    multiple of `make_vocab_size_divisible_by · tp` (Megatron-LM megatron/training/tokenizer
    `_vocab_size_with_padding`; Megatron-DeepSpeed megatron/tokenizer/tokenizer.py:58): V % tp
    rows more than the plan counts."""
    if framework == "torchtitan" or model.vocab % layout.tp == 0:
        return []
    padded = -(-model.vocab // layout.tp) * layout.tp
    return [f"{framework} splits the vocabulary evenly over tp={layout.tp}: it pads "
            f"{model.vocab} to {padded} rows, which the plan does not count (plan a model with "
            f"vocab {padded} to run this layout)"]


def _refusals(framework: str | None, model: ModelSpec, layout: Layout, train: TrainSpec
              ) -> list[str]:
    """Everything the run's stack (and `framework`'s export of it) cannot run of this valid
    layout and run, one sentence each."""
    out = train.stack.layout_problems(layout, model.n_layers, train)
    if framework in ("torchtitan", "deepspeed") and layout.expert_tp != layout.tp:
        out.append(f"{VERSIONS[framework]} has no expert tensor parallelism (etp={layout.etp} "
                   f"≠ tp={layout.tp}); use etp=0")
    if framework == "deepspeed" and model.is_moe and layout.sp:
        out.append("DeepSpeed-MoE takes the tensor-parallel ranks' tokens as duplicates and "
                   "drops all but a share (deepspeed/moe/sharded_moe.py:686-698 @0.19.8), which "
                   "Megatron sequence parallelism makes distinct; use sp=0")
    if framework == "deepspeed" and model.is_moe and layout.zero == 3:
        out.append("DeepSpeed refuses its MoE under ZeRO-3 (deepspeed/runtime/engine.py:2215 "
                   "@0.19.8); use zero ≤ 2")
    return out if framework is None else out + _vocab_problems(framework, model, layout)


def _edits(stack: Stack, model: ModelSpec, layout: Layout) -> Iterator[Layout]:
    """`layout` changed toward what `stack` runs, one choice at a time: each schedule, ZeRO
    stage and recompute policy it has, no shard groups, SP toggled, a degree folded into data
    parallelism or (tp, cp) into pipeline stages, the default or the stack's own partition."""
    for name in stack.schedules():
        if layout.pp > 1 and name != layout.schedule:
            chunks = (layout.chunks if layout.chunks > 1 else next(
                (v for v in range(2, model.n_layers + 1)
                 if model.n_layers % (layout.pp * v) == 0), 2)
                      ) if get_schedule(name).chunked else 1
            yield layout.with_(schedule=name, chunks=chunks)
    for z in stack.zero:
        if z != layout.zero:
            keep = layout.zero_group if z in stack.zero_hybrid else 0
            yield layout.with_(zero=z, zero_group=keep if z else 0)
    if layout.zero_group:
        yield layout.with_(zero_group=0)
    for name in stack.recompute:
        if name != layout.recompute:
            yield layout.with_(recompute=name)
    if layout.tp > 1:
        yield layout.with_(sp=not layout.sp)
    for axis in ("tp", "cp", "ep", "pp"):
        degree = getattr(layout, axis)
        if degree > 1:
            changes: dict[str, object] = {axis: 1}
            if axis == "tp":
                changes["sp"] = False
            if axis == "pp":
                changes.update(schedule="1f1b", chunks=1, partition=())
            yield layout.with_(**changes)
            if axis in ("tp", "cp") and layout.pp * degree <= model.n_layers:  # into stages
                yield layout.with_(**{axis: 1, "pp": layout.pp * degree, "partition": (),
                                      "sp": layout.sp and axis == "cp"})
    if layout.partition:
        yield layout.with_(partition=())
    own = stack_split(stack.split, model.n_layers, layout.pp)
    if layout.pp > 1 and layout.chunks == 1 and own and own != layout.stage_partition(
            model.n_layers):
        yield layout.with_(partition=own)


def nearest(framework: str | None, model: ModelSpec, layout: Layout, train: TrainSpec,
            cluster: Cluster, depth: int = 3) -> tuple[Layout, float, bool] | None:
    """The layout `framework`'s export (None: the run's stack) runs that is reached from
    `layout` by at most `depth` edits of distinct fields (`_edits`; dp takes the GPUs left)
    and differs from it in the fewest fields, one that fits in memory before one that does
    not, then the fastest: (layout, predicted step time in s, fits); None when none is."""
    from shardwise.plan.evaluate import evaluate_layout

    edits = [(_changed(layout, new), new) for new in _edits(train.stack, model, layout)]
    found: dict[Layout, int] = {}
    for k in range(1, depth + 1):
        for combo in itertools.combinations(edits, k):
            touched = [name for names, _ in combo for name in names]
            if len(touched) != len(set(touched)):  # two edits of one field
                continue
            cand = layout
            for _, new in combo:
                cand = _merge(cand, layout, new)
            if cand in found or cand.problems(model, cluster, train) or _refusals(
                    framework, model, cand, train):
                continue
            found[cand] = len(_changed(layout, cand))
    best: tuple[tuple[bool, int, float], Layout] | None = None
    for distance in sorted(set(found.values())):
        for cand in (c for c, d in found.items() if d == distance):
            entry = evaluate_layout(model, cluster, train, cand, simulate=False)
            key = (not entry.fits, distance, entry.estimate.total)
            if best is None or key < best[0]:
                best = (key, cand)
        if best is not None and not best[0][0]:
            break  # a fitting layout at the fewest changes that have one
    if best is None:
        return None
    entry = evaluate_layout(model, cluster, train, best[1])
    return best[1], entry.estimate.total, entry.fits


def _changed(base: Layout, new: Layout) -> tuple[str, ...]:
    """The fields (dp aside) in which `new` differs from `base`."""
    return tuple(f.name for f in fields(Layout)
                 if f.name != "dp" and getattr(new, f.name) != getattr(base, f.name))


def _merge(current: Layout, base: Layout, changed: Layout) -> Layout:
    """`current` with the fields `changed` changed from `base` (edits applied one after
    another; dp takes the GPUs the other axes leave)."""
    values = {f.name: getattr(current, f.name) for f in fields(Layout)}
    values.update({name: getattr(changed, name) for name in _changed(base, changed)})
    values["dp"] = base.world_size // (values["tp"] * values["pp"] * values["cp"])
    return Layout(**values)


def unrunnable(model: ModelSpec, layout: Layout, train: TrainSpec, cluster: Cluster,
               framework: str | None = None) -> ShardwiseError | None:
    """The one-line refusal of a valid layout the run's stack (with `framework`: that
    framework's export) cannot run — what, the nearest layout it runs and that layout's
    predicted step time — or None when it runs."""
    problems = _refusals(framework, model, layout, train)
    if not problems:
        return None
    who = (f"{framework} ({VERSIONS[framework]})" if framework else
           f"{train.stack.name} ({train.stack.version})")
    head = f"{who} cannot run this layout: {'; '.join(problems)}"
    found = nearest(framework, model, layout, train, cluster)
    if found is None:
        return ShardwiseError(head + "; no layout within three changes runs")
    near, seconds, fits = found
    return ShardwiseError(
        f"{head}; nearest it runs: {near.short()} (--layout {layout_text(near)}), "
        f"{seconds:.3g} s per step predicted{'' if fits else ', over the memory budget'}")


def _checked(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec,
             cluster: Cluster | None, gpus_per_node: int) -> tuple[int, str]:
    """(global batch, gradient dtype) of a layout and run `framework` runs exactly, else the
    refusal."""
    layout.validate(model)
    train.validate()
    if train.global_batch is None:
        raise ShardwiseError("emitting a launch configuration needs a global batch")
    stack = framework_stack(framework)
    if train.stack.name != stack.name:
        own = (f"its own export is --emit {train.stack.export}" if train.stack.export
               else f"{train.stack.name} has no export")
        raise ShardwiseError(
            f"this plan is for the {train.stack.name} stack ({own}); --emit {framework} runs "
            f"{stack.name}: plan with --impl {stack.name}")
    refusal = model_refusal(framework, model, train)
    if refusal:
        raise ShardwiseError(f"{framework} ({VERSIONS[framework]}) cannot run this plan: "
                             f"{refusal}")
    refusal_of_layout = unrunnable(
        model, layout, train, cluster or Cluster.of(layout.world_size, gpus_per_node=min(
            gpus_per_node, layout.world_size)), framework)
    if refusal_of_layout is not None:
        raise refusal_of_layout
    layout.validate(model, train=train)
    return train.global_batch, train.grad_dtype or train.dtype


def _nodes(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node) of a `layout.world_size`-rank launch."""
    per_node = min(gpus_per_node, layout.world_size)
    return math.ceil(layout.world_size / per_node), per_node


def _launched(header: str, env: list[str], program: tuple[str, ...], args: list[str],
              layout: Layout, gpus_per_node: int, files: dict[str, str] | None = None
              ) -> tuple[str, Launch]:
    """The `Launch` of `program args` on the layout's nodes and its torchrun script (the
    configuration's text: `emit.launchers.torchrun_script`)."""
    nodes, per_node = _nodes(layout, gpus_per_node)
    launch = Launch(nodes, per_node, tuple(env), program, tuple(args), header, files or {})
    return torchrun_script(launch), launch


def _header(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec, gb: int) -> str:
    return (f"# shardwise: {model.name}, {layout.short()}, s={train.seq_len}, global batch {gb} "
            f"sequences, {train.dtype} — {train.stack.label} for {VERSIONS[framework]}")


def _vocab_divisor(model: ModelSpec, tp: int) -> int:
    """The `--make-vocab-size-divisible-by` that keeps V unpadded: the largest power of two
    d ≤ 128 with `d·tp | V`, gcd(V/tp, 128) (Megatron pads V to a multiple of d·tp, default
    d = 128; V % tp == 0 is checked before, `_vocab_problems`)."""
    return math.gcd(model.vocab // tp, 128)


