"""Training stacks: the code a run uses, one value that decides memory, time, search and export.

A `Stack` names a training code at a pinned version and lists, as read from that code, what
decides a step's memory and time there: which tensors a layer keeps (its activation profile,
`estimate.profiles`), how many memory-bound passes a layer makes (fused kernels, eager PyTorch
or `torch.compile`), how TP, DP/FSDP and pipeline traffic overlap compute, which recompute
policies, attention kernels, ZeRO/FSDP forms, schedules and context-parallel kinds it has, and
which framework `--emit` writes for it. `TrainSpec.impl` holds the stack's name;
`resolve(train)` fills the choices a run did not state with the stack's defaults (the values
its argument parser or config class defaults to) and says which were assumed.

The per-stack facts and their sources are in `STACKS` below; docs/concepts/stacks.md explains
how each behaviour enters the step-time model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.schedules.registry import SCHEDULE_CODES

__all__ = ["ATTENTION_KERNELS", "CP_KIND_TEXT", "DEFAULT_STACK", "OFFLOADS", "SPLITS", "SPLIT_RULES",
           "STACKS", "TP_OVERLAPS", "Offload", "Rule", "Settings", "Stack", "deepspeed_split",
           "get_stack", "parse_impl", "split_refuses", "stack_names", "stack_split",
           "titan_partition", "titan_split"]

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
                "allgather": "an all-gather of K/V (FlexAttention)"}
"""The context-parallel kinds of `Stack.cp_kinds`, in words."""

SPLITS = ("any", "torchtitan", "deepspeed")
"""How a stack can split the layers over its pipeline stages (`Stack.split`): any count per
(virtual) stage (Megatron-LM's `--pipeline-model-parallel-layout`), torchtitan's rule
(`titan_split`), or DeepSpeed's `type:transformer` partition (`split_refuses`)."""


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
    `AttnFuncWithCPAndKVAllGather`).
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
        """`name@version`, as `--impl` accepts it."""
        return f"{self.name}@{self.version.split()[-1]}"

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
        if layout.pp > 1 and layout.schedule not in self.schedules():
            out.append(f"{self.name} has no {layout.schedule} pipeline schedule; valid: "
                       f"{', '.join(self.schedules())}")
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


SPLIT_RULES = {
    "any": "any layers per stage",
    "torchtitan": "torchtitan 0.3.0 spreads L + first + last units evenly, the extra units on "
                  "the first stages, and shortens only the first and the last stage "
                  "(distributed/pipeline_parallel.py)",
    "deepspeed": "Megatron-DeepSpeed's GPTModelPipe splits the blocks with DeepSpeed's "
                 "'type:transformer' partition, the first L mod pp stages one block more "
                 "(megatron/model/gpt_model.py:463)"}


def stack_split(split: str, n_layers: int, pp: int, chunks: int = 1
                ) -> tuple[int, ...] | None:
    """The stage partition a stack splitting as `split` makes by default over `pp` stages of
    `chunks` virtual stages each (None: it runs any): DeepSpeed's (no chunks), or torchtitan's
    over its `pp·chunks` virtual stages with the embedding and the head one layer each (its
    `first/last_stage_less_layers` default of 1)."""
    if split == "deepspeed" and chunks == 1:
        return tuple(deepspeed_split(n_layers, pp))
    if split == "torchtitan" and n_layers + 2 >= 2 * pp * chunks:
        return tuple(titan_split(pp * chunks, n_layers, 1, 1))
    return None


def split_refuses(split: str, n_layers: int, sizes: tuple[int, ...], pp: int) -> bool:
    """Whether a stack splitting as `split` (`SPLITS`) cannot run `sizes` (layers per virtual
    stage, `Layout.stage_sizes`) over `pp` ranks."""
    if split == "torchtitan":
        return titan_partition(n_layers, sizes) is None
    if split == "deepspeed":
        return len(sizes) != pp or list(sizes) != deepspeed_split(n_layers, pp)
    return False


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


_MEGATRON = "megatron-core 0.16.1; Megatron-LM main d98e8a6"
_MDS = "Megatron-DeepSpeed 4efb479"  # github.com/deepspeedai/Megatron-DeepSpeed, 2025-07-16
# Counted with a TorchDispatchMode over one decoder layer's forward and backward on CPU in bf16
# (tests/estimate/test_stack_traffic.py recounts them): bytes read + written per token by the
# ops that are neither GEMMs nor attention, fitted as (h, q + kv, f) coefficients over five
# shapes (within 1 %); kernels: those ops' count. One table per block variant (RoPE, gated
# MLP): the Llama block as the stack writes it; without its rotary embedding (learned or no
# positions: GPT-2/3, MPT); with `w2(gelu(w1 x))` for SwiGLU (MPT, GPT-2/3, BLOOM).
Traffic = tuple[tuple[float, float, float], tuple[float, float, float]]
TORCHTITAN_TRAFFIC: tuple[tuple[tuple[bool, bool], Traffic], ...] = (
    ((True, True), ((15.8, 27.9, 10.29), (27.4, 27.7, 18.86))),
    ((False, True), ((16.0, 8.0, 10.01), (28.0, 8.0, 18.01))),
    ((True, False), ((15.8, 27.9, 4.29), (21.4, 27.7, 6.86))),
    ((False, False), ((16.0, 8.0, 4.01), (22.0, 8.0, 6.01))),
)
TORCHTITAN_KERNELS = (((True, True), (15.0, 18.0)), ((False, True), (9.0, 10.0)),
                      ((True, False), (14.0, 15.0)), ((False, False), (8.0, 7.0)))
HF_TRAFFIC: tuple[tuple[tuple[bool, bool], Traffic], ...] = (
    ((True, True), ((89.4, 19.5, 9.79), (224.9, 32.0, 17.97))),
    ((False, True), ((87.4, 0.0, 9.79), (224.6, 0.0, 17.97))),
    ((True, False), ((89.4, 19.5, 3.79), (218.9, 32.0, 5.97))),
    ((False, False), ((87.4, 0.0, 3.79), (218.6, 0.0, 5.97))),
)
HF_KERNELS = (((True, True), (40.0, 57.0)), ((False, True), (20.0, 41.0)),
              ((True, False), (39.0, 54.0)), ((False, False), (19.0, 38.0)))


def _zb_h1(v: Mapping[str, Any]) -> Any:
    return (np.asarray(v["pp"]) > 1) & (np.asarray(v["schedule"]) == SCHEDULE_CODES["zb-h1"])


# Each fact names the code it was read from, in the stack's pinned version (Megatron-LM
# paths at d98e8a6, its own megatron/core); tests/integration check them against that code.
STACKS: dict[str, Stack] = {s.name: s.validate() for s in (
    Stack(
        "megatron-te", "Megatron-LM + Transformer Engine", _MEGATRON,
        "megatron/training/arguments.py (--overlap-grad-reduce, --overlap-param-gather default "
        "off; --no-overlap-p2p-communication: on, reset to off without a virtual pipeline), "
        "megatron/core/model_parallel_config.py (tp_comm_overlap: False), transformer_config.py "
        "(recompute_granularity full|selective, attention_backend auto → TE's cuDNN fused "
        "attention on Hopper)",
        profile="megatron-te", kernels="fused", compile=(False,),
        tp_overlap=("none", "bulk"), dp_overlap_zero=(), dp_overlap_settable=True,
        attention=("cudnn", "fa2", "fa3", "math"), recompute=("none", "selective", "full"),
        # ZeRO-1: the distributed optimizer, in groups with --num-distributed-optimizer-
        # instances (core/parallel_state.py:922); ZeRO-2/3: Megatron-FSDP's optim_grads /
        # optim_grads_params, in groups as HSDP when there are several instances
        # (core/distributed/fsdp/mcore_fsdp_adapter.py:346, outer group no_shard)
        zero=(0, 1, 2, 3), zero_hybrid=(1, 2, 3),
        # --cp-comm-type p2p | a2a | a2a+p2p (training/arguments.py --cp-comm-type)
        # context_parallel.py AttnFuncWithCPAndKVAllGather: K/V gathered forward and again
        # backward (it saves the rank's own), dK/dV reduce-scattered
        cp_kinds=("ring", "ulysses", "hybrid", "allgather"),
        cp_overlap=True, axes=("tp", "pp", "cp", "ep"), pipeline_engine="megatron",
        p2p_overlap="interleaved", dtypes=("bf16", "fp16", "fp32"), export="megatron",
        # transformer_config.py fp8_recipe: tensorwise | delayed | mxfp8 | blockwise; the
        # optimizer offload: --optimizer-cpu-offload (with --use-precision-aware-optimizer and
        # the distributed optimizer; a torch.optim.AdamW on the CPU, core/optimizer/__init__.py;
        # HybridDeviceOptimizer pipelines D2H, step and H2D with
        # --overlap-cpu-optimizer-d2h-h2d; --optimizer-offload-fraction keeps a share on GPU)
        fp8=("delayed", "tensorwise", "mxfp8", "blockwise"), fp8_framework="te",
        offloads=(Offload("optimizer", (1,), "torch-adamw", "pipelined",
                          "--optimizer-cpu-offload", fraction=True),),
        # bf16: --grad-reduce-in-bf16 or fp32 (validate_args sets accumulate_allreduce_grads_
        # in_fp32 for bf16 unless --grad-reduce-in-bf16); fp16: fp16 or
        # --accumulate-allreduce-grads-in-fp32; Megatron-FSDP: --megatron-fsdp-main-grads-dtype
        grad_dtypes=(("bf16", ("bf16", "fp32")), ("fp16", ("fp16", "fp32")),
                     ("fp32", ("fp32",))),
        # --pipeline-model-parallel-layout gives any layers per (virtual) stage
        # (training/arguments.py, core/transformer/pipeline_parallel_layer_layout.py)
        split="any",
        rules=(
            Rule(lambda v, train: (np.asarray(v["zero_group"]) > 0) & (np.asarray(v["ep"]) > 1)
                 & ((np.asarray(v["dp"]) * v["cp"] // v["ep"])
                    % np.maximum(np.asarray(v["dp"]) * v["cp"]
                                 // np.maximum(v["zero_group"], 1), 1) != 0),
                 "shards experts' ZeRO state over the expert data-parallel ranks dp·cp/ep: "
                 "with ep={ep} they must hold whole zero_group={zero_group} groups",
                 "megatron/core/parallel_state.py:1447 @d98e8a6"),
            Rule(lambda v, train: (np.asarray(v["zero"]) == 0) & any(
                     getattr(train, name, None) not in (None, "fp32") for name in
                     ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")),
                 "runs the precision-aware optimizer (moments or master weights below fp32) "
                 "with the distributed optimizer only, not zero={zero}",
                 "megatron/core/optimizer/optimizer_config.py, megatron-core 0.16.1"),
        )),
    Stack(
        "megatron-deepspeed", "Megatron-DeepSpeed (DeepSpeed's pipeline engine and ZeRO)",
        f"DeepSpeed 0.19.8; {_MDS}",
        "deepspeed/runtime/zero/config.py (overlap_comm defaults to stage == 3), "
        "deepspeed/runtime/pipe/schedule.py (TrainSchedule: 1F1B), Megatron-DeepSpeed "
        "megatron/arguments.py (--use-flash-attn-v2 off by default, --ds-sequence-parallel-size,"
        " --enable-zbh1-pipeline)",
        profile="megatron-te", kernels="fused", compile=(False,), tp_overlap=("none",),
        dp_overlap_zero=(3,), dp_overlap_settable=True, attention=("math", "fa2"),
        recompute=("none", "selective", "full"),
        # ZeRO 0-3 (deepspeed/runtime/zero/config.py); no shard groups: MiCS is gone from
        # 0.19 and ZeRO++'s hpZ (zero_hpz_partition_size) only keeps a secondary copy of
        # ZeRO-3 weights per group, the optimizer state stays sharded over all replicas
        zero=(0, 1, 2, 3), zero_hybrid=(),
        # --ds-sequence-parallel-size is DeepSpeed-Ulysses (deepspeed/sequence/layer.py)
        cp_kinds=("ulysses",), cp_overlap=False, axes=("tp", "pp", "cp"),
        pipeline_engine="deepspeed", p2p_overlap="never", dtypes=("bf16", "fp16", "fp32"),
        export="deepspeed",
        # ZeRO-Offload (zero_optimization.offload_optimizer, stages 1-3: DeepSpeedCPUAdam;
        # gradients copied to the host as their buckets reduce) and ZeRO-Infinity's parameter
        # offload (offload_param, stage 3 only); deepspeed/runtime/zero/offload_config.py
        offloads=(Offload("optimizer", (1, 2, 3), "deepspeed-cpu-adam", "backward",
                          "offload_optimizer"),
                  Offload("params", (3,), "deepspeed-cpu-adam", "backward",
                          "offload_param")),
        # data_types.grad_accum_dtype: the model dtype, or fp32 with ZeRO (rule below)
        grad_dtypes=(("bf16", ("bf16", "fp32")), ("fp16", ("fp16", "fp32")),
                     ("fp32", ("fp32",))),
        split="deepspeed",
        rules=(
            Rule(lambda v, train: (np.asarray(v["pp"]) > 1) & (np.asarray(v["zero"]) >= 2),
                 "runs ZeRO-{zero} without pipeline parallelism only (pp={pp}): its pipeline "
                 "engine asserts ZeRO < 2", "deepspeed/runtime/pipe/engine.py:76 @0.19.8"),
            Rule(lambda v, train: (np.asarray(v["cp"]) > 1)
                 & ((np.asarray(v["tp"]) > 1) | (np.asarray(v["pp"]) > 1)),
                 "runs its sequence parallelism (cp={cp}) without tensor and pipeline "
                 "parallelism only (tp={tp}, pp={pp})",
                 "Megatron-DeepSpeed megatron/core/parallel_state.py:146 @4efb479"),
            Rule(lambda v, train: _zb_h1(v) & (np.asarray(v["sp"]) > 0),
                 "runs ZB-H1 without sequence parallelism only",
                 "Megatron-DeepSpeed megatron/arguments.py:81 @4efb479"),
            Rule(lambda v, train: (np.asarray(v["zero"]) == 0) & (
                     train is not None and (train.grad_dtype or train.dtype) != train.dtype),
                 "without ZeRO accumulates gradients in the model dtype only",
                 "deepspeed/runtime/engine.py:2313 @0.19.8"),
        )),
    Stack(
        "torchtitan", "torchtitan", "torchtitan 0.3.0",
        "torchtitan/config/configs.py (CompileConfig.enable False, enable_async_tensor_parallel "
        "False and needs compile; fsdp_reshard_after_forward 'default'), "
        "distributed/activation_checkpoint.py (FullAC; SelectiveAC: save compute/comm op outputs "
        "except every second matmul), models/llama3 (attn_backend 'flex')",
        profile="torchtitan", kernels="eager", compile=(False, True),
        tp_overlap=("none", "async"), dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False,
        # a language model's attention is flex, flex_flash or varlen; SDPA is not one
        # (models/common/config_utils.py get_attention_config); its llama3 configs use flex
        attention=("flex",), recompute=("none", "full", "op-sac"),
        # FSDP2 on every run (models/llama3/parallelize.py apply_fsdp_to_decoder): replicate
        # only (ZeRO-0), reshard after forward "never" (ZeRO-2) or "always" (ZeRO-3), HSDP with
        # data_parallel_replicate_degree; no ZeRO-1 (nothing shards only optimizer states)
        zero=(0, 2, 3), zero_hybrid=(2, 3),
        # llama3's FlexAttention under CP all-gathers K/V (distributed/context_parallel/api.py
        # apply_cp_to_forward); ring attention needs an SDPA config none of its llama3 has
        cp_kinds=("allgather",), cp_overlap=True, cp_gather_kept=True,
        axes=("tp", "pp", "cp", "ep"), pipeline_engine="torchtitan", p2p_overlap="always",
        dtypes=("bf16", "fp32"), export="torchtitan",
        # FSDP's MixedPrecisionPolicy reduce_dtype: training.mixed_precision_reduce, which
        # accepts "float32" only (config/configs.py)
        grad_dtypes=(("bf16", ("fp32",)), ("fp32", ("fp32",))),
        split="torchtitan",
        rules=(
            Rule(lambda v, train: (np.asarray(v["ep"]) > 1) & (
                     (np.where(np.asarray(v["zero"]) > 0,
                               np.where(np.asarray(v["zero_group"]) > 0, v["zero_group"],
                                        np.asarray(v["dp"]) * v["cp"]), v["cp"])
                      * np.asarray(v["tp"])) % np.maximum(v["ep"], 1) != 0),
                 "borrows expert-parallel ranks from FSDP, CP and TP: ep={ep} must divide "
                 "dp_shard·cp·tp", "torchtitan/config/configs.py expert_parallel_degree "
                 "@0.3.0"),
        ),
        # its Llama 3 block counted eagerly, nn.RMSNorm as torch 2.13's fused CUDA kernel
        # (aten/src/ATen/native/layer_norm.cpp routes rms_norm to _fused_rms_norm)
        elementwise=TORCHTITAN_TRAFFIC, eager_kernels=TORCHTITAN_KERNELS,
        # components/quantization/float8.py (Float8LinearConverter recipe_name: rowwise |
        # rowwise_with_gw_hp) and mx.py (MXFP8LinearConverter); config/configs.py
        # training.enable_cpu_offload: FSDP2's CPUOffloadPolicy (parameters, gradients and
        # the optimizer, whose step then runs on the CPU: the default "fused" AdamW)
        fp8=("rowwise", "rowwise_with_gw_hp", "mxfp8"), fp8_framework="torchao",
        offloads=(Offload("params", (3,), "torch-adamw-fused", "none",
                          "--training.enable_cpu_offload"),)),
    Stack(
        "hf-sdpa", "Hugging Face transformers (SDPA attention) with DDP/FSDP",
        "transformers 5.24.0",
        "models/llama/modeling_llama.py, integrations/sdpa_attention.py; Trainer "
        "(gradient_checkpointing: full; torch_compile False)",
        profile="hf-sdpa", kernels="eager", compile=(False, True), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("fa2",),
        recompute=("none", "full"), zero=(0, 2, 3), zero_hybrid=(3,), cp_kinds=(),
        cp_overlap=False, axes=(), pipeline_engine=None, p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        elementwise=HF_TRAFFIC, eager_kernels=HF_KERNELS),
    Stack(
        "hf-eager", "Hugging Face transformers (eager attention) with DDP/FSDP",
        "transformers 5.24.0",
        "models/llama/modeling_llama.py eager_attention_forward (softmax materialised)",
        profile="hf-eager", kernels="eager", compile=(False, True), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("math",),
        recompute=("none", "full"), zero=(0, 2, 3), zero_hybrid=(3,), cp_kinds=(),
        cp_overlap=False, axes=(), pipeline_engine=None, p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        elementwise=HF_TRAFFIC, eager_kernels=HF_KERNELS),
    Stack(
        "pytorch-fsdp", "PyTorch FSDP training loops (llm-foundry/Composer, IBM fms-fsdp)",
        "torch 2.13",
        "torch.distributed.fsdp (FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD, backward and "
        "forward prefetch), eager decoder blocks with a FlashAttention-2 kernel (flash-attn or "
        "SDPA's flash backend) or flash-attn's Triton kernel (llm-foundry's attn_impl "
        "'triton'); no tensor, pipeline or context parallelism",
        profile="torchtitan", kernels="eager", compile=(False, True), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("fa2", "triton"),
        recompute=("none", "full"), zero=(0, 2, 3), zero_hybrid=(2, 3), cp_kinds=(),
        cp_overlap=False, axes=(), pipeline_engine=None, p2p_overlap="never",
        dtypes=("bf16", "fp16", "fp32"), export=None,
        # the same eager PyTorch ops as torchtitan's counted block, in the model's variant
        # (RoPE or learned positions, SwiGLU or GeLU)
        elementwise=TORCHTITAN_TRAFFIC, eager_kernels=TORCHTITAN_KERNELS),
    Stack(
        "shardwise", "shardwise runtime", "shardwise 0.1.0",
        "shardwise.runtime (blocking collectives on gloo/NCCL; bucketed gradient reducer)",
        profile="shardwise", kernels="eager", compile=(False,), tp_overlap=("none",),
        dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False, attention=("fa2", "math"),
        recompute=("none", "selective", "full"), zero=(0, 1, 2, 3), zero_hybrid=(0, 1, 2, 3),
        cp_kinds=("ring", "ulysses", "hybrid"), cp_overlap=False, axes=("tp", "pp", "cp", "ep"),
        pipeline_engine="shardwise", p2p_overlap="never", dtypes=("fp32", "bf16", "fp16", "fp64"),
        export=None),
)}

DEFAULT_STACK = "megatron-te"
"""What most large pretraining runs use (Megatron-LM, NeMo)."""


def stack_names() -> tuple[str, ...]:
    """The registered stacks' names, the default first."""
    return tuple(STACKS)


def get_stack(name: str) -> Stack:
    """The stack called `name` (or `name@version`, `parse_impl`)."""
    return STACKS[parse_impl(name)]


def parse_impl(text: str) -> str:
    """`name` or `name@version` → the stack name; the version must be the pinned one."""
    if not isinstance(text, str):
        raise ShardwiseError(f"stack must be a name, got {type(text).__name__}")
    name, _, version = text.partition("@")
    stack = STACKS.get(name)
    if stack is None:
        raise ShardwiseError(f"stack {name!r} unknown; valid: {', '.join(STACKS)}")
    if version and version != stack.label.split("@")[1]:
        raise ShardwiseError(f"stack {name} is modelled at {stack.version} only; "
                             f"use {stack.label} or {name}")
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
