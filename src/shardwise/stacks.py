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

from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import ShardwiseError

__all__ = ["ATTENTION_KERNELS", "DEFAULT_STACK", "OFFLOADS", "STACKS", "TP_OVERLAPS", "Offload",
           "Settings", "Stack", "get_stack", "parse_impl", "stack_names"]

OFFLOADS = ("none", "optimizer", "params")
"""What lives in host memory: nothing; the optimizer state (fp32 master weights and moments,
with the optimizer step on the CPU); or every sharded state class (parameters, gradients,
optimizer), fetched per layer (ZeRO-3 / FSDP)."""

TP_OVERLAPS = ("none", "bulk", "async")
"""Tensor-parallel communication: exposed; pipelined with the adjacent GEMMs in chunks
(Transformer Engine userbuffers, Megatron `--tp-comm-overlap`; Wang et al. 2022); or
micro-pipelined all-gather-matmul / matmul-reduce-scatter (PyTorch async TP, torchtitan
`compile.enable_async_tensor_parallel`, which needs `torch.compile`)."""

ATTENTION_KERNELS = ("cudnn", "fa2", "fa3", "flex", "math")
"""Fused attention kernels (cuDNN fused attention, FlashAttention-2 (Dao 2023; PyTorch SDPA's
flash backend), FlashAttention-3 (Shah et al. 2024, Hopper), FlexAttention (PyTorch)) and the
materialised softmax (`math`: scores in HBM; `--no-flash`)."""

KERNEL_MODES = ("fused", "eager", "compiled")
"""How a layer's memory-bound work runs: hand-fused kernels (Transformer Engine, Megatron's
fused bias-GeLU/SwiGLU, bias-dropout-add, RoPE and softmax), one PyTorch kernel per aten op
(eager), or Inductor's fused kernels (`torch.compile`)."""


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
    # eager stacks: memory-bound bytes per token of one layer (bf16) as coefficients of
    # (h, q + kv, f), forward and backward, and the kernels a layer launches besides GEMMs and
    # attention — counted on the stack's own layer code (tests/estimate/test_stack_traffic.py)
    elementwise: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    eager_kernels: tuple[float, float] = (0.0, 0.0)
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
        if problems:
            raise ShardwiseError(f"stack {self.name}: " + "; ".join(problems))
        return self

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

    def layout_problems(self, layout: Any) -> list[str]:
        """What in `layout` this stack cannot run, one sentence each (issue 33: the search and
        a forced `--layout` only take what the stack runs)."""
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
        if layout.cp > 1 and getattr(layout, "cp_kind", "ring") not in self.cp_kinds:
            out.append(f"{self.name} has no {layout.cp_kind} context parallelism; valid: "
                       f"{', '.join(self.cp_kinds) or 'none'}")
        if layout.recompute not in self.recompute:
            out.append(f"{self.name} has no {layout.recompute} recompute; valid: "
                       f"{', '.join(self.recompute)}")
        return out


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
# Counted with a TorchDispatchMode over one decoder layer's forward and backward on CPU in bf16
# (tests/estimate/test_stack_traffic.py recounts them): bytes read + written per token by the
# ops that are neither GEMMs nor attention, fitted as (h, q + kv, f) coefficients over five
# shapes (within 1 %); kernels: those ops' count.
TORCHTITAN_TRAFFIC = ((29.1, 27.8, 9.93), (131.3, 27.4, 17.8))
TORCHTITAN_KERNELS = (17.0, 36.0)
HF_TRAFFIC = ((89.4, 19.5, 9.79), (224.9, 32.0, 17.97))
HF_KERNELS = (40.0, 57.0)
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
        zero=(0, 1, 2, 3), zero_hybrid=(1,), cp_kinds=("ring", "ulysses", "hybrid"),
        cp_overlap=True, axes=("tp", "pp", "cp", "ep"), pipeline_engine="megatron",
        p2p_overlap="interleaved", dtypes=("bf16", "fp16", "fp32"), export="megatron",
        # transformer_config.py fp8_recipe: tensorwise | delayed | mxfp8 | blockwise; the
        # optimizer offload: --optimizer-cpu-offload (with --use-precision-aware-optimizer and
        # the distributed optimizer; a torch.optim.AdamW on the CPU, core/optimizer/__init__.py;
        # HybridDeviceOptimizer pipelines D2H, step and H2D with
        # --overlap-cpu-optimizer-d2h-h2d; --optimizer-offload-fraction keeps a share on GPU)
        fp8=("delayed", "tensorwise", "mxfp8", "blockwise"), fp8_framework="te",
        offloads=(Offload("optimizer", (1,), "torch-adamw", "pipelined",
                          "--optimizer-cpu-offload", fraction=True),)),
    Stack(
        "megatron-deepspeed", "Megatron-DeepSpeed (DeepSpeed's pipeline engine and ZeRO)",
        "DeepSpeed 0.19.8; Megatron-DeepSpeed master",
        "deepspeed/runtime/zero/config.py (overlap_comm defaults to stage == 3), "
        "deepspeed/runtime/pipe/schedule.py (TrainSchedule: 1F1B), Megatron-DeepSpeed "
        "megatron/arguments.py (--use-flash-attn-v2 off by default, --ds-sequence-parallel-size)",
        profile="megatron-te", kernels="fused", compile=(False,), tp_overlap=("none",),
        dp_overlap_zero=(3,), dp_overlap_settable=True, attention=("math", "fa2"),
        recompute=("none", "selective", "full"), zero=(0, 1, 2, 3), zero_hybrid=(),
        cp_kinds=("ulysses",), cp_overlap=False, axes=("tp", "pp", "cp"),
        pipeline_engine="deepspeed", p2p_overlap="never", dtypes=("bf16", "fp16", "fp32"),
        export="deepspeed",
        # ZeRO-Offload (zero_optimization.offload_optimizer, stages 1-3: DeepSpeedCPUAdam;
        # gradients copied to the host as their buckets reduce) and ZeRO-Infinity's parameter
        # offload (offload_param, stage 3 only); deepspeed/runtime/zero/offload_config.py
        offloads=(Offload("optimizer", (1, 2, 3), "deepspeed-cpu-adam", "backward",
                          "offload_optimizer"),
                  Offload("params", (3,), "deepspeed-cpu-adam", "backward",
                          "offload_param"))),
    Stack(
        "torchtitan", "torchtitan", "torchtitan 0.3.0",
        "torchtitan/config/configs.py (CompileConfig.enable False, enable_async_tensor_parallel "
        "False and needs compile; fsdp_reshard_after_forward 'default'), "
        "distributed/activation_checkpoint.py (FullAC; SelectiveAC: save compute/comm op outputs "
        "except every second matmul), models/llama3 (attn_backend 'flex')",
        profile="torchtitan", kernels="eager", compile=(False, True),
        tp_overlap=("none", "async"), dp_overlap_zero=(0, 1, 2, 3), dp_overlap_settable=False,
        attention=("flex", "fa2", "cudnn"), recompute=("none", "full", "op-sac"),
        zero=(0, 2, 3), zero_hybrid=(2, 3), cp_kinds=("ring",), cp_overlap=True,
        axes=("tp", "pp", "cp", "ep"), pipeline_engine="torchtitan", p2p_overlap="always",
        dtypes=("bf16", "fp32"), export="torchtitan",
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
