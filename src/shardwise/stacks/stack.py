"""The `Stack` type: one training code at a pinned version and what decides a step's memory and
time there (its choices, the layouts it refuses as `Rule`s, its offloads), and `Settings`, a
run's stack with every choice resolved. The stacks themselves: `stacks.definitions`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.stacks.splits import SPLIT_RULES, split_refuses

OFFLOADS = ("none", "optimizer", "params")
"""What lives in host memory: nothing; the optimizer state (fp32 master weights and moments,
with the optimizer step on the CPU); or every sharded state class (parameters, gradients,
optimizer), fetched per layer (ZeRO-3 / FSDP)."""

TP_OVERLAPS = ("none", "bulk", "async")
"""Tensor-parallel communication: exposed; pipelined with the adjacent GEMMs in chunks
(Transformer Engine userbuffers, Megatron `--tp-comm-overlap`; Wang et al. 2022); or
micro-pipelined all-gather-matmul / matmul-reduce-scatter (PyTorch async TP, torchtitan
`compile.enable_async_tensor_parallel`, which needs `torch.compile`)."""

ATTENTION_KERNELS = ("cudnn", "fa2", "fa3", "flex", "triton", "math")
"""Fused attention kernels (cuDNN fused attention, FlashAttention-2 (Dao 2023; PyTorch SDPA's
flash backend), FlashAttention-3 (Shah et al. 2024, Hopper), FlexAttention (PyTorch),
flash-attn's Triton FlashAttention (llm-foundry's `attn_impl: triton`)) and the materialised
softmax (`math`: scores in HBM; `--no-flash`)."""

KERNEL_MODES = ("fused", "eager", "compiled")
"""How a layer's memory-bound work runs: hand-fused kernels (Transformer Engine, Megatron's
fused bias-GeLU/SwiGLU, bias-dropout-add, RoPE and softmax), one PyTorch kernel per aten op
(eager), or Inductor's fused kernels (`torch.compile`)."""


CP_KIND_TEXT = {"ring": "ring attention", "ulysses": "Ulysses (an all-to-all over heads)",
                "hybrid": "Ulysses inside groups with a ring across them",
                "allgather": "an all-gather of K/V"}
"""The context-parallel kinds of `Stack.cp_kinds`, in words."""

SPLITS = ("any", "torchtitan", "deepspeed", "neox")
"""How a stack can split the layers over its pipeline stages (`Stack.split`): any count per
(virtual) stage (Megatron-LM's `--pipeline-model-parallel-layout`), torchtitan's rule
(`titan_split`), DeepSpeed's `type:transformer` partition as Megatron-DeepSpeed names it, or
GPT-NeoX's `type:transformer|mlp` (`neox_split`; `split_refuses`)."""


# One decoder layer's eager elementwise traffic per token (`Stack.elementwise`,
# `stacks.definitions`): (h, q + kv, f) coefficients of bytes read, then written.
Traffic = tuple[tuple[float, float, float], tuple[float, float, float]]


@dataclass(frozen=True)
class Rule:
    """A combination of layout fields a stack cannot run, written once and array-generic like
    the schedule registry's rules: `refuses(v, train)` is true where the layout (or each of
    arrays of layouts) cannot run, `v` holding its fields as `Layout.codes()` gives them
    (`schedule` as its registry code, `recompute` as its index in `RECOMPUTE`, `sp` 0/1).
    `reason` is formatted with the same fields; `source` is the framework code that refuses."""

    refuses: Callable[[Mapping[str, Any], Any], Any]
    reason: str
    source: str

    def message(self, stack: str, fields: Mapping[str, Any]) -> str:
        return f"{stack} " + self.reason.format(**fields) + f" ({self.source})"


@dataclass(frozen=True)
class Offload:
    """How a stack moves training state to host memory (`TrainSpec.offload`): `kind` (one of
    `OFFLOADS`), the ZeRO stages it runs with, the CPU optimizer
    (`estimate.offload.CPU_OPTIMIZERS`), how the optimizer offload's gradient copy, CPU step
    and parameter copy overlap ("backward": the gradient copy behind the backward, the rest
    exposed; "pipelined": the three pipelined over parameter groups; parameter offload always
    prefetches each layer's parameters beside the compute), and the framework's switch."""

    kind: str
    zero: tuple[int, ...]
    cpu_optimizer: str
    overlap: str
    flag: str
    fraction: bool = False  # a share of the optimizer state may stay on the GPU


@dataclass(frozen=True)
class Stack:
    """One training code at a pinned version and its step-time behaviours.

    Tuples of choices list the default first. `dp_overlap_zero`: the ZeRO stages whose DP/FSDP
    traffic overlaps compute by default; `dp_overlap_settable`: a flag turns it on or off.
    `pipeline_engine` names the `ScheduleInfo` attribute of the schedules it runs (None: no
    pipeline parallelism). `axes`: the parallel axes it can run beyond data parallelism.
    `zero_hybrid`: the ZeRO stages it shards in groups (`Layout.zero_group`). `grad_dtypes`:
    per training dtype, the gradient dtypes it accumulates and reduces in (the first is what a
    run that names none gets, `TrainSpec`; None: not restricted). `split`: how it splits the
    layers over pipeline stages (`SPLITS`). `rules`: the combinations it refuses (`Rule`).
    `cp_gather_kept`: with `cp_kind` "allgather" the attention keeps the gathered K/V for
    backward (torchtitan's FlexAttention) instead of gathering them again (Transformer Engine's
    `AttnFuncWithCPAndKVAllGather`). `pipe_costs`: the `stacks.pipe_engine.PIPE_ENGINES` entry
    whose costs its pipeline adds to Megatron's batched 1F1B (None: none).
    """

    name: str
    title: str
    version: str
    source: str
    profile: str
    kernels: str
    compile: tuple[bool, ...]
    tp_overlap: tuple[str, ...]
    dp_overlap_zero: tuple[int, ...]
    dp_overlap_settable: bool
    attention: tuple[str, ...]
    recompute: tuple[str, ...]
    zero: tuple[int, ...]
    zero_hybrid: tuple[int, ...]
    cp_kinds: tuple[str, ...]
    cp_overlap: bool
    axes: tuple[str, ...]
    pipeline_engine: str | None
    p2p_overlap: str  # "never", "interleaved" (Megatron: only the interleaved schedule), "always"
    dtypes: tuple[str, ...]
    export: str | None
    grad_dtypes: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    split: str = "any"
    cp_gather_kept: bool = False
    rules: tuple[Rule, ...] = ()
    # eager stacks: memory-bound bytes per token of one layer (bf16) as coefficients of
    # (h, q + kv, f), forward and backward, and the kernels a layer launches besides GEMMs and
    # attention, per block variant (RoPE, gated MLP) — counted on the stack's own layer code
    # (tests/estimate/test_stack_traffic.py); `eager_traffic` picks the model's
    elementwise: tuple[tuple[tuple[bool, bool], Traffic], ...] | None = None
    eager_kernels: tuple[tuple[tuple[bool, bool], tuple[float, float]], ...] = ()
    notes: tuple[str, ...] = field(default=())
    # FP8 recipes it runs (`shardwise.fp8`, by its framework's names) and that framework
    fp8: tuple[str, ...] = ()
    fp8_framework: str = ""
    offloads: tuple[Offload, ...] = ()
    pipe_costs: str | None = None

    def validate(self) -> Stack:
        problems = []
        if self.kernels not in ("fused", "eager"):
            problems.append(f"kernels {self.kernels!r} must be fused or eager")
        if not set(self.tp_overlap) <= set(TP_OVERLAPS):
            problems.append(f"tp_overlap {self.tp_overlap} not in {TP_OVERLAPS}")
        if not set(self.attention) <= set(ATTENTION_KERNELS):
            problems.append(f"attention {self.attention} not in {ATTENTION_KERNELS}")
        if self.p2p_overlap not in ("never", "interleaved", "always"):
            problems.append(f"p2p_overlap {self.p2p_overlap!r} unknown")
        if "async" in self.tp_overlap and True not in self.compile:
            problems.append("async TP needs torch.compile")
        from shardwise.fp8 import RECIPES

        problems += [f"fp8 recipe {name!r} is not one of {self.fp8_framework or 'no'} "
                     "framework's" for name in self.fp8 if (self.fp8_framework, name)
                     not in RECIPES]
        problems += [f"offload {o.kind!r} not in {OFFLOADS[1:]}" for o in self.offloads
                     if o.kind not in OFFLOADS[1:]]
        if self.split not in SPLITS:
            problems.append(f"split {self.split!r} not in {SPLITS}")
        from shardwise.stacks.pipe_engine import PIPE_ENGINES

        if self.pipe_costs is not None and self.pipe_costs not in PIPE_ENGINES:
            problems.append(f"pipe_costs {self.pipe_costs!r} not in {tuple(PIPE_ENGINES)}")
        if self.grad_dtypes is not None and {d for d, _ in self.grad_dtypes} != set(self.dtypes):
            problems.append(f"grad_dtypes {self.grad_dtypes} do not cover {self.dtypes}")
        if problems:
            raise ShardwiseError(f"stack {self.name}: " + "; ".join(problems))
        return self

    def eager_traffic(self, model: Any) -> tuple[Traffic, tuple[float, float]]:
        """The (traffic, kernels) tables of `model`'s block variant: RoPE unless it has
        learned positions, gated unless its MLP is not."""
        variant = (not model.learned_positions, bool(model.gated_mlp))
        return dict(self.elementwise or ())[variant], dict(self.eager_kernels)[variant]

    @property
    def label(self) -> str:
        """`name@version`, as `--impl` accepts it (a second version of a stack is registered
        under that label as its name, `stacks.titan_versions`)."""
        return self.name if "@" in self.name else f"{self.name}@{self.version.split()[-1]}"

    def fp8_recipe(self, name: str) -> Any:
        """The `fp8.Fp8Recipe` this stack runs as `name`; one line when it has none."""
        from shardwise.fp8 import get_recipe

        if name not in self.fp8:
            if not self.fp8:
                raise ShardwiseError(f"{self.name} has no FP8 training; stacks with FP8: "
                                     + ", ".join(f"{s.name} ({', '.join(s.fp8)})"
                                                 for s in STACKS.values() if s.fp8))
            raise ShardwiseError(f"{self.name} has no FP8 recipe {name!r}; valid: "
                                 f"{', '.join(self.fp8)}")
        return get_recipe(self.fp8_framework, name)

    def offload_kinds(self) -> tuple[str, ...]:
        """"none" and the kinds of offload this stack runs."""
        return ("none", *(o.kind for o in self.offloads))

    def offload_support(self, kind: str) -> Offload | None:
        """How this stack offloads `kind` (None for "none"); one line when it cannot."""
        if kind == "none":
            return None
        if kind not in OFFLOADS:
            raise ShardwiseError(f"offload {kind!r} unknown; valid: {', '.join(OFFLOADS)}")
        found = next((o for o in self.offloads if o.kind == kind), None)
        if found is None:

            have = ", ".join(o.kind for o in self.offloads) or "nothing"
            others = [s.name for s in STACKS.values() if any(o.kind == kind for o in s.offloads)]
            raise ShardwiseError(f"{self.name} has no {kind} offload (it offloads: {have}); "
                                 f"stacks that offload the {kind}: {', '.join(others)}")
        return found

    def schedules(self) -> tuple[str, ...]:
        """The pipeline schedules this stack's engine runs (the schedule registry's names)."""
        from shardwise.schedules.registry import SCHEDULE_REGISTRY

        if self.pipeline_engine is None:
            return ()
        if self.pipeline_engine == "shardwise":  # this package's executor
            return tuple(name for name, info in SCHEDULE_REGISTRY.items() if info.trainable)
        return tuple(name for name, info in SCHEDULE_REGISTRY.items()
                     if getattr(info, self.pipeline_engine) is not None)

    def grad_choices(self, dtype: str) -> tuple[str, ...] | None:
        """The gradient dtypes this stack runs with `dtype` weights, the default first (None:
        not modelled, any)."""
        return None if self.grad_dtypes is None else dict(self.grad_dtypes).get(dtype)

    def layout_problems(self, layout: Any, n_layers: int | None = None,
                        train: Any = None) -> list[str]:
        """What in `layout` this stack cannot run, one sentence each (issue 33: the search and
        a forced `--layout` only take what the stack runs); with `n_layers` also its stage
        partition, with `train` also the rules that read the run's dtypes."""
        out = []
        for axis in ("tp", "pp", "cp", "ep"):
            if getattr(layout, axis) > 1 and axis not in self.axes:
                out.append(f"{self.name} has no {axis.upper()} ({axis}={getattr(layout, axis)}); "
                           f"it runs {', '.join(self.axes) or 'data parallelism only'}")
        if layout.pp > 1 and "pp" in self.axes and layout.schedule not in self.schedules():
            from shardwise.schedules.registry import get_schedule
            none = get_schedule(layout.schedule).no_stack  # DualPipe: no stack runs it
            out.append(f"{self.name} has no {layout.schedule} pipeline schedule; valid: "
                       f"{', '.join(self.schedules())}" + (f" ({none})" if none else ""))
        if layout.zero not in self.zero:
            out.append(f"{self.name} has no ZeRO-{layout.zero}; valid: "
                       f"{', '.join(map(str, self.zero))}")
        elif layout.zero_group and layout.zero not in self.zero_hybrid:
            out.append(f"{self.name} cannot shard ZeRO-{layout.zero} in groups "
                       f"(zero_group={layout.zero_group}); "
                       + (f"it can at ZeRO {', '.join(map(str, self.zero_hybrid))}"
                          if self.zero_hybrid else "use zero_group=0"))
        if layout.cp > 1 and "cp" in self.axes and layout.cp_kind not in self.cp_kinds:
            kinds = " or ".join(CP_KIND_TEXT[kind] for kind in self.cp_kinds)
            out.append(f"{self.name}'s context parallelism is {kinds}, not "
                       f"{CP_KIND_TEXT[layout.cp_kind]} (cp_kind={layout.cp_kind}, planned for "
                       f"cp={layout.cp})")
        if layout.recompute not in self.recompute:
            out.append(f"{self.name} has no {layout.recompute} recompute; valid: "
                       f"{', '.join(self.recompute)}")
        if n_layers is not None and layout.pp > 1 and split_refuses(
                self.split, n_layers, layout.stage_sizes(n_layers), layout.pp):
            out.append(f"{self.name} cannot split {n_layers} layers as "
                       f"{','.join(map(str, layout.stage_sizes(n_layers)))} "
                       f"({SPLIT_RULES[self.split]})")
        codes = layout.codes()
        out += [rule.message(self.name, codes) for rule in self.rules
                if bool(rule.refuses(codes, train))]
        return out

    def refused(self, v: Mapping[str, Any], train: Any = None) -> list[tuple[Rule, Any]]:
        """Each rule with the mask of the layouts it refuses among arrays `v` (the planner's
        grid: its fields as integer arrays, `Rule`)."""
        return [(rule, np.asarray(rule.refuses(v, train), dtype=bool)) for rule in self.rules]




@dataclass(frozen=True)
class Settings:
    """A run's stack and every time behaviour resolved to a value (`resolve`); `assumed`
    names the ones the run did not state (the stack's defaults)."""

    stack: Stack
    compile: bool
    kernels: str  # `KERNEL_MODES`
    tp_overlap: str
    dp_overlap: bool | None  # None: the stack's default for the layout's ZeRO stage
    attention: str
    assumed: tuple[str, ...]

    def dp_overlapped(self, zero: Any) -> Any:
        """Does DP/ZeRO traffic overlap compute at ZeRO stage `zero` (number or array)?"""
        import numpy as np

        if self.dp_overlap is not None:
            return np.full(np.shape(zero), self.dp_overlap) if np.ndim(zero) else self.dp_overlap
        return np.isin(zero, self.stack.dp_overlap_zero) if np.ndim(zero) else \
            int(zero) in self.stack.dp_overlap_zero

    def p2p_overlapped(self, chunks: Any) -> Any:
        """Are steady-state pipeline sends/receives overlapped (Megatron: interleaved only)?"""
        import numpy as np

        rule = self.stack.p2p_overlap
        if rule == "interleaved":
            return np.asarray(chunks) > 1 if np.ndim(chunks) else chunks > 1
        return rule == "always"

    def to_dict(self) -> dict[str, Any]:
        """The stack and its resolved settings for `--json` (`assumed`: the stack's defaults
        the run did not state)."""
        return {"name": self.stack.name, "title": self.stack.title,
                "version": self.stack.version, "source": self.stack.source,
                "compile": self.compile, "kernels": self.kernels,
                "tp_overlap": self.tp_overlap, "dp_overlap": self.dp_overlap,
                "dp_overlap_by_default_at_zero": list(self.stack.dp_overlap_zero),
                "attention": self.attention, "assumed": list(self.assumed),
                "export": self.stack.export}

    def describe(self) -> str:
        """One line: the stack and its settings, the assumed ones marked."""
        def mark(name: str, text: str) -> str:
            return f"{text} (assumed)" if name in self.assumed else text
        dp = ("default" if self.dp_overlap is None else "on" if self.dp_overlap else "off")
        parts = [mark("compile", "torch.compile" if self.compile else f"{self.kernels} kernels"),
                 mark("tp_overlap", f"TP overlap {self.tp_overlap}"),
                 mark("dp_overlap", f"DP overlap {dp}"),
                 mark("attention", f"attention {self.attention}")]
        return f"{self.stack.title} ({self.stack.version}): " + ", ".join(parts)


# ----------------------------------------------------------------------------------- registry
STACKS: dict[str, Stack] = {}
"""Every stack by name, the default first; `stacks.definitions` fills it (importing
`shardwise.stacks` imports it)."""

DEFAULT_STACK = "megatron-te"
"""What most large pretraining runs use (Megatron-LM, NeMo)."""


def stack_names() -> tuple[str, ...]:
    """The registered stacks' names, the default first."""
    return tuple(STACKS)


def get_stack(name: str) -> Stack:
    """The stack called `name` (or `name@version`, `parse_impl`)."""
    return STACKS[parse_impl(name)]


def parse_impl(text: str) -> str:
    """`name` or `name@version` → the stack's key in `STACKS`: a bare name is the stack's
    pinned version, `name@version` that version where it is registered (as
    `torchtitan@0.1.0`), else one line naming the versions modelled."""
    if not isinstance(text, str):
        raise ShardwiseError(f"stack must be a name, got {type(text).__name__}")
    if text in STACKS:
        return text
    name, _, version = text.partition("@")
    stack = STACKS.get(name)
    if stack is None:
        raise ShardwiseError(f"stack {name!r} unknown; valid: {', '.join(STACKS)}")
    if version and version != stack.label.split("@")[1]:
        keys = [name, *(key for key in STACKS if key.startswith(name + "@"))]
        raise ShardwiseError(f"stack {name} is modelled at "
                             f"{' and '.join(STACKS[key].version for key in keys)} only; use "
                             f"{', '.join(STACKS[key].label for key in keys)} or {name}")
    return name


def resolve(stack_name: str, *, compile: bool | None = None, tp_overlap: str | None = None,
            dp_overlap: bool | None = None, attention: str | None = None,
            flash: bool = True) -> Settings:
    """The run's settings on `stack_name`: each choice given is checked against the stack, each
    not given takes the stack's default (and is listed in `Settings.assumed`)."""
    stack = get_stack(stack_name)
    assumed = []
    problems = []

    def pick(name: str, value: Any, choices: tuple[Any, ...], show: Any = str,
             what: str = "") -> Any:
        if value is None:
            assumed.append(name)
            return choices[0]
        if value not in choices:
            problems.append(f"{stack.name} has no {what or name} {show(value)}; valid: "
                            f"{', '.join(show(c) for c in choices)}")
        return value

    compiled = pick("compile", compile, stack.compile,
                    lambda v: "torch.compile" if v else "eager", "kernel mode")
    tp = pick("tp_overlap", tp_overlap, stack.tp_overlap, what="TP overlap")
    if tp == "async" and not compiled:
        problems.append("async TP needs torch.compile (--compile)")
    if dp_overlap is None:
        assumed.append("dp_overlap")
    elif not stack.dp_overlap_settable and dp_overlap != bool(stack.dp_overlap_zero):
        problems.append(f"{stack.name} always {'overlaps' if stack.dp_overlap_zero else 'exposes'}"
                        " DP traffic; drop the DP-overlap setting")
    if not flash:
        if attention not in (None, "math"):
            problems.append(f"attention {attention} is a fused kernel; --no-flash means math")
        if "math" not in stack.attention:
            problems.append(f"{stack.name} always runs a fused attention kernel "
                            f"({stack.attention[0]}); drop --no-flash")
        kernel = "math"
    else:
        fused = tuple(k for k in stack.attention if k != "math") or stack.attention
        kernel = pick("attention", attention, fused, what="attention kernel")
    if problems:
        raise ShardwiseError("; ".join(problems))
    kernels = "compiled" if compiled else stack.kernels
    return Settings(stack, compiled, kernels, tp, dp_overlap, kernel, tuple(assumed))
