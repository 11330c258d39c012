"""`Layout` — how one training step is spread over the cluster — and `TrainSpec` — what is
trained (sequence length, batch, dtypes, optimizer).

World size = `dp · tp · pp · cp`; expert parallelism reuses ranks of `dp × cp`, so `ep`
divides `dp · cp` and does not add ranks (SPEC notation). With expert tensor parallelism
(`etp`, Megatron's `--expert-tensor-parallel-size`; 0 means tp, its default) the MoE layers
lay the `tp·dp·cp` ranks of a stage out as `etp × ep × edp` instead (`shardwise.placement`):
`etp·ep` divides `tp·dp·cp`. Constraints: `layout_checks`; stage partitions: `partition`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.choices import (
    _FALSE,
    _TRUE,
    AXES,
    CP_KINDS,
    OPTIMIZERS,
    RECOMPUTE,
    RECOMPUTE_LIGHTEST_FIRST,
    ulysses_degree,
)
from shardwise.cuda_graph import cuda_graph_problems
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout_checks import layout_problems, memory_setting_problems
from shardwise.partition import (
    Balanced,
    Partition,
    accounted_partition,
    chunk_span,
    first_last_partition,
    is_pipeline_layout,
    layers_on_stage,
    parse_partition,
    parse_pipeline_layout,
    partition_problems,
    resolve_partition,
    stage_extremes,
    stage_partition,
    stage_totals,
    virtual_sizes,
)
from shardwise.schedules.actions import Placement
from shardwise.schedules.registry import DEFAULT_SCHEDULE, SCHEDULE_REGISTRY, SCHEDULES
from shardwise.stacks import DEFAULT_STACK, STACKS, Settings, Stack, get_stack, parse_impl, resolve
from shardwise.units import DTYPE_BYTES

__all__ = [
    "AXES",
    "CP_KINDS",
    "MOE_COMM",
    "MOE_DISPATCHERS",
    "MOE_OVERLAPS",
    "OPTIMIZERS",
    "RECOMPUTE",
    "RECOMPUTE_LIGHTEST_FIRST",
    "SCHEDULES",
    "Balanced",
    "Layout",
    "Partition",
    "TrainSpec",
    "accounted_partition",
    "check_specs",
    "chunk_span",
    "first_last_partition",
    "layers_on_stage",
    "parse_partition",
    "parse_pipeline_layout",
    "partition_problems",
    "resolve_partition",
    "stage_extremes",
    "stage_partition",
    "stage_totals",
    "ulysses_degree",
]



MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Token dispatchers (Megatron-Core 0.16.1 `--moe-token-dispatcher-type`; "flex" is DeepEP's
fused all-to-all, `--moe-flex-dispatcher-backend deepep`, and torchtitan 0.3.0's
`DeepEPTokenDispatcher`; "alltoall" also torchtitan's `AllToAllTokenDispatcher` and the
runtime's)."""
MOE_OVERLAPS = ("none", "shared", "1f1b")
"""Overlap of the expert-parallel collectives: none; "shared": the shared experts' forward
beside the dispatch and combine (`--moe-shared-expert-overlap`); "1f1b": one micro-batch's
forward beside another's backward (`--overlap-moe-expert-parallel-comm`, DualPipe's pairs)."""
MOE_COMM = {  # stack -> (dispatchers, overlaps) its code runs, at the pinned versions
    "megatron-te": (MOE_DISPATCHERS, MOE_OVERLAPS),  # transformer_config.py, 0.16.1
    "torchtitan": (("alltoall", "flex"), ("none",)),  # models/common/token_dispatcher.py, 0.3.0
}


def _moe_comm_problems(train: TrainSpec) -> list[str]:
    """What is wrong with `train`'s expert-parallel communication settings for its stack."""
    out: list[str] = []
    dispatchers, overlaps = MOE_COMM.get(train.impl, (("alltoall",), ("none",)))
    if train.moe_dispatcher is not None and train.moe_dispatcher not in dispatchers:
        out.append(f"moe_dispatcher {train.moe_dispatcher!r}: {train.impl} runs "
                   f"{', '.join(dispatchers)}")
    if train.moe_overlap not in overlaps:
        out.append(f"moe_overlap {train.moe_overlap!r}: {train.impl} runs {', '.join(overlaps)}")
    dispatcher = train.moe_dispatcher or dispatchers[0]
    if train.moe_overlap == "shared" and dispatcher != "alltoall":
        out.append("moe_overlap shared needs the alltoall dispatcher (Megatron-Core "
                   "transformer_config.py: moe_shared_expert_overlap only works with alltoall)")
    if train.moe_overlap == "1f1b" and dispatcher == "allgather":
        out.append("moe_overlap 1f1b needs the alltoall or flex dispatcher")
    if train.moe_dispatch_fp8 and dispatcher != "flex":
        out.append("moe_dispatch_fp8 needs the flex (DeepEP) dispatcher, whose kernels take an "
                   "FP8 payload with its scales")
    if train.moe_capacity is not None and not (isinstance(train.moe_capacity, (int, float))
                                               and train.moe_capacity >= 1):
        out.append(f"moe_capacity must be a factor ≥ 1 or None (dropless), got "
                   f"{train.moe_capacity!r}")
    if train.comm_sms is not None and not (isinstance(train.comm_sms, int)
                                           and 1 <= train.comm_sms <= 64):
        out.append(f"comm_sms must be an integer in 1..64 or None, got {train.comm_sms!r}")
    return out


@dataclass(frozen=True)
class TrainSpec:
    """The training target: sequence length, global batch (sequences), dtypes, optimizer, and
    whose code trains it (`impl`: the activation profile, `estimate.profiles`)."""

    seq_len: int = 4096
    global_batch: int | None = None  # sequences per optimizer step; None: one micro-batch per pp stage
    dtype: str = "bf16"  # weights and activations
    grad_dtype: str | None = None  # None: the stack's first for dtype (`Stack.grad_dtypes`), else dtype
    optimizer: str = "adam"
    flash_attention: bool = True
    impl: str = DEFAULT_STACK  # the training stack (`shardwise.stacks`): name or name@version
    # The stack's time behaviours (`stacks.resolve`); None: that stack's default, named as
    # assumed in the explanation and `--json`.
    compile: bool | None = None  # torch.compile (stacks that have the choice)
    tp_overlap: str | None = None  # "none" | "bulk" | "async" (`stacks.TP_OVERLAPS`)
    dp_overlap: bool | None = None  # DP/ZeRO traffic behind backward/forward
    attention: str | None = None  # fused attention kernel (`stacks.ATTENTION_KERNELS`)
    # Memory as trained (Megatron-Core 0.16.1, `shardwise.choices`): the modules selective
    # recompute re-runs (--recompute-modules; None: core_attn, Megatron's default), the
    # precision-aware optimizer's moments and master weights (--exp-avg-dtype,
    # --exp-avg-sq-dtype, --main-params-dtype; None: fp32), the SwiGLU input kept in FP8
    # (--activation-func-fp8-input-store) and the multi-token prediction modules trained
    # (--mtp-num-layers)
    recompute_modules: tuple[str, ...] | None = None
    # With `Layout.recompute="full"`: the share of the layers fully recomputed, the others
    # keeping every activation (block-level selective checkpointing: torchtitan's
    # `selective_ac_option="n"` checkpoints every n-th block, fms-fsdp's
    # `selective_checkpointing=p` a share p; Megatron's `--recompute-method block
    # --recompute-num-layers N`, N of each stage chunk's layers). 1: every layer.
    recompute_share: float = 1.0
    exp_avg_dtype: str | None = None
    exp_avg_sq_dtype: str | None = None
    main_params_dtype: str | None = None
    act_fp8_store: bool = False
    mtp_layers: int | None = None  # None: the model's (`ModelSpec.mtp_layers`)
    offload_modules: tuple[str, ...] = ()  # --fine-grained-activation-offloading
    # MoE routing as the step's critical path sees it (`estimate.compute.layer_cost`): on the
    # busiest expert-parallel rank of each MoE call (ep ranks meet at every call, so each
    # waits for that one), the rows its experts run ÷ the balanced share T·k, and the share
    # of its experts that receive any row (an expert without rows launches nothing). 1 and 1:
    # balanced routing (SPEC §5), what the planner assumes; `shardwise check` passes the
    # routing its run drew.
    expert_load: float = 1.0
    experts_active: float = 1.0
    # FP8 training (`shardwise.fp8`): the stack's recipe name (None: bf16 GEMMs); host offload
    # (`stacks.OFFLOADS`) and, for stacks that can keep a share on the GPU (Megatron's
    # --optimizer-offload-fraction), the share of the optimizer state that moves
    fp8: str | None = None
    offload: str = "none"
    offload_fraction: float = 1.0
    # ---- expert-parallel communication as the stack runs it (`estimate.expert`; issue 43,
    # added by moetime): the token dispatcher (None: the stack's first, `MOE_COMM`), the
    # overlap of its collectives (`MOE_OVERLAPS`), FP8 dispatch with BF16 combine (DeepSeek-V3
    # §3.3.2; DeepEP), the capacity factor (None: dropless; else padded to capacity, every
    # rank sends factor·T·k rows) and the SMs the overlapped communication kernels take
    # (None: `estimate.expert.COMM_SMS`, 20). Checked by `_moe_comm_problems`.
    moe_dispatcher: str | None = None
    moe_overlap: str = "none"
    moe_dispatch_fp8: bool = False
    moe_capacity: float | None = None
    comm_sms: int | None = None
    # megatron-te's CUDA-graphed scopes (`shardwise.cuda_graph`; empty: none)
    cuda_graph: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.offload_modules, list | str):
            offloaded = self.offload_modules
            object.__setattr__(self, "offload_modules", tuple(
                offloaded.replace(",", " ").split() if isinstance(offloaded, str)
                else offloaded))
        if isinstance(self.cuda_graph, list | str):
            graphs = self.cuda_graph
            object.__setattr__(self, "cuda_graph", tuple(
                graphs.replace(",", " ").split() if isinstance(graphs, str) else graphs))
        if isinstance(self.recompute_modules, list | str):
            modules = self.recompute_modules
            object.__setattr__(self, "recompute_modules", tuple(
                modules.replace(",", " ").split() if isinstance(modules, str) else modules))
        if isinstance(self.impl, str) and "@" in self.impl:
            object.__setattr__(self, "impl", parse_impl(self.impl))
        if (self.dtype == "fp8" and self.fp8 is None and isinstance(self.impl, str)
                and self.impl in STACKS and STACKS[self.impl].fp8):
            # --dtype fp8 reads as FP8 training is done: bf16 weights, the stack's default
            # recipe for the GEMMs (Megatron-LM's --fp8-recipe default, torchao's rowwise…)
            object.__setattr__(self, "dtype", "bf16")
            object.__setattr__(self, "fp8", STACKS[self.impl].fp8[0])
        if (self.grad_dtype is None and isinstance(self.impl, str) and self.impl in STACKS
                and isinstance(self.dtype, str)):  # torchtitan: fp32 reductions
            choices = STACKS[self.impl].grad_choices(self.dtype)
            if choices and choices[0] != self.dtype:
                object.__setattr__(self, "grad_dtype", choices[0])

    @property
    def stack(self) -> Stack:
        """The training stack (`TrainSpec.impl`)."""
        return get_stack(self.impl)

    @property
    def profile(self) -> str:
        """The stack's activation profile (`estimate.profiles`)."""
        return self.stack.profile

    def settings(self) -> Settings:
        """The stack's behaviours for this run, defaults filled in (`stacks.resolve`)."""
        return resolve(self.impl, compile=self.compile, tp_overlap=self.tp_overlap,
                       dp_overlap=self.dp_overlap, attention=self.attention,
                       flash=self.flash_attention)

    def _fp8_offload_problems(self) -> list[str]:
        out = []
        if self.fp8 is not None:
            try:
                self.stack.fp8_recipe(self.fp8)
                if self.dtype != "bf16":
                    out.append(f"FP8 recipes run beside bf16 weights and activations; use "
                               f"--dtype bf16 with --fp8 {self.fp8}, not {self.dtype}")
            except ShardwiseError as exc:
                out.append(str(exc))
        try:
            support = self.stack.offload_support(self.offload)
            validate.fraction(self.offload_fraction, "offload_fraction")
            if self.offload_fraction < 1 and not (support and support.fraction):
                out.append(f"offload_fraction {self.offload_fraction:g} needs an optimizer "
                           "offload that can keep a share on the GPU (megatron-te's "
                           "--optimizer-offload-fraction)")
        except ShardwiseError as exc:
            out.append(str(exc))
        return out

    @property
    def routed_load(self) -> float:
        """The busiest expert-parallel rank's routed rows ÷ the balanced share `T·k`: the
        capacity factor when experts are padded to capacity (Megatron
        `--moe-pad-expert-input-to-capacity`, `moe_utils.get_capacity`), else `expert_load`."""
        return float(self.moe_capacity) if self.moe_capacity is not None else self.expert_load

    def validate(self) -> TrainSpec:
        problems = []
        for name, check in (("expert_load", validate.positive), ("experts_active",
                                                                  validate.fraction)):
            try:
                check(getattr(self, name), name)
            except ShardwiseError as exc:
                problems.append(str(exc))
        if (isinstance(self.expert_load, int | float) and not isinstance(self.expert_load, bool)
                and self.expert_load < 1 - 1e-9):  # the busiest rank holds ≥ the mean
            problems.append(f"expert_load must be ≥ 1 (the busiest expert-parallel rank's rows "
                            f"÷ the balanced share; 1: balanced), got {self.expert_load!r}")
        for name in ("seq_len", "global_batch"):  # integers ≥ 1 (a batch may be None)
            value = getattr(self, name)
            if value is not None or name == "seq_len":
                try:
                    validate.integer(value, name, low=1, high=validate.MAX_SEQUENCES)
                except ShardwiseError as exc:
                    problems.append(str(exc))
        for name in ("dtype", "grad_dtype", "optimizer", "impl"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "grad_dtype" and value is None):
                raise ShardwiseError(f"{name} must be a string, got {value!r}")
        for name, kind in (("compile", bool), ("dp_overlap", bool), ("tp_overlap", str),
                           ("attention", str), ("fp8", str)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ShardwiseError(f"{name} must be {'true or false' if kind is bool else 'a string'}"
                                     f" or None, got {value!r}")
        for name in ("dtype", "grad_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_BYTES:
                problems.append(f"{name} {value!r} unknown; valid: {', '.join(DTYPE_BYTES)}")
        if self.dtype == "fp8":  # left by __post_init__: a stack without FP8, or --fp8 too
            problems.append(f"dtype fp8: FP8 training keeps bf16 weights and runs the linear "
                            f"layers' GEMMs in FP8, which {self.impl} does not; use --dtype "
                            f"bf16 --fp8 RECIPE on megatron-te (delayed, tensorwise, mxfp8, "
                            f"blockwise) or torchtitan (rowwise, rowwise_with_gw_hp, mxfp8)"
                            if self.fp8 is None else
                            f"dtype fp8 with --fp8 {self.fp8}: use --dtype bf16 --fp8 {self.fp8}")
        grad = self.grad_dtype
        if (grad in DTYPE_BYTES and self.dtype in DTYPE_BYTES
                and DTYPE_BYTES[grad] < DTYPE_BYTES[self.dtype]):
            problems.append(f"grad_dtype {grad} is narrower than dtype {self.dtype}: gradients "
                            f"are kept in the weights' dtype or wider (fp32 main grads); use "
                            f"grad_dtype {self.dtype} or fp32")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer {self.optimizer!r} unknown; valid: {', '.join(OPTIMIZERS)}")
        if self.impl not in STACKS:
            problems.append(f"stack {self.impl!r} unknown; valid: {', '.join(STACKS)}")
        else:
            try:
                self.settings()
            except ShardwiseError as exc:
                problems.append(str(exc))
            if (self.dtype in DTYPE_BYTES and self.dtype != "fp8"
                    and self.dtype not in self.stack.dtypes):
                problems.append(f"{self.stack.name} does not train in {self.dtype}; valid: "
                                f"{', '.join(self.stack.dtypes)}")
            problems += self._fp8_offload_problems()
            problems += _moe_comm_problems(self) + cuda_graph_problems(self)
            problems += memory_setting_problems(self)
            grads = self.stack.grad_choices(self.dtype)
            if grads and (self.grad_dtype or self.dtype) not in grads:
                problems.append(f"{self.stack.name} reduces {self.dtype} gradients in "
                                f"{' or '.join(grads)}, not {self.grad_dtype}; valid "
                                f"--grad-dtype: {', '.join(grads)}")
        if problems:
            raise ShardwiseError("; ".join(problems))
        return self


@dataclass(frozen=True)
class Layout:
    """Parallel degrees and the per-rank choices that go with them."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_kind: str = "ring"  # one of CP_KINDS
    ulysses: int = 0  # hybrid: the all-to-all degree inside each cp group (ring across cp/ulysses)
    zero: int = 0  # ZeRO stage 0..3 over the data-parallel ranks
    zero_group: int = 0  # hybrid shard: shard over groups of this many dp·cp ranks (0: all)
    sp: bool = False  # Megatron sequence parallelism (with tp > 1)
    schedule: str = DEFAULT_SCHEDULE
    chunks: int = 1  # virtual pipeline chunks per stage (interleaved 1F1B)
    recompute: str = "none"
    micro_batch: int = 1
    # layers per pipeline stage, first to last; () = even when pp·chunks divides n_layers,
    # else the balanced default (`stage_partition`)
    partition: tuple[int, ...] = ()
    # expert tensor parallel: the routed experts' weights split over etp ranks instead of tp
    # (0: tp, Megatron-Core's default for expert_tensor_parallel_size)
    etp: int = 0

    def __post_init__(self) -> None:
        counts = self.partition
        if not isinstance(counts, tuple | list | np.ndarray) or not all(
                isinstance(n, int | np.integer | float | np.floating) and not isinstance(n, bool)
                and float(n).is_integer() for n in counts):
            raise ShardwiseError(f"partition must be whole layer counts per stage, got "
                                 f"{counts!r}"[:200])
        object.__setattr__(self, "partition", tuple(int(n) for n in counts))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """The degree the routed experts' weights are split over: `etp`, or tp when 0."""
        return self.etp or self.tp

    @property
    def zero_degree(self) -> int:
        """Ranks a ZeRO shard spans: the dp×cp replicas, or the hybrid shard group."""
        return self.zero_group or self.dp * self.cp

    @property
    def ulysses_degree(self) -> int:
        """Ranks each all-to-all over heads spans: 1 (ring), cp (Ulysses), `ulysses` (hybrid)."""
        self.check_names()
        return int(ulysses_degree(self.cp, CP_KINDS.index(self.cp_kind), self.ulysses))

    def microbatches(self, train: TrainSpec) -> int:
        """Micro-batches per step `m = global_batch / (dp · micro_batch)`; with no global batch
        one per pipeline stage (the smallest `m` that fills 1F1B's steady state)."""
        if train.global_batch is None:
            return self.pp
        return max(1, train.global_batch // (self.dp * self.micro_batch))

    def short(self) -> str:
        """`dp8 tp8 pp16 z1 sp 1f1b mb1 sel`-style one-liner (degree-1 axes omitted)."""
        parts = [f"{axis}{getattr(self, axis)}" for axis in AXES
                 if getattr(self, axis) > 1] or ["single"]
        if self.etp and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        if self.cp > 1 and self.cp_kind != "ring":
            parts.insert(parts.index(f"cp{self.cp}") + 1, self.cp_kind if self.cp_kind !=
                         "hybrid" else f"a2a{self.ulysses}×ring{self.cp // max(self.ulysses, 1)}")
        if self.zero:
            parts.append(f"zero{self.zero}" + (f"/{self.zero_group}" if self.zero_group else ""))
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule + (f"×{self.chunks}" if self.chunks > 1 else ""))
        parts.append(f"mb{self.micro_batch}")
        if self.recompute != "none":
            parts.append(self.recompute)
        if self.partition:
            parts.append("layers " + "/".join(map(str, self.partition)))
        return " ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def check_names(self) -> None:
        """`schedule`, `cp_kind` and `recompute` are names their tables hold; else one
        `ShardwiseError` naming the valid ones (not a `KeyError` from a lookup)."""
        for name, valid in (("schedule", SCHEDULES), ("cp_kind", CP_KINDS),
                            ("recompute", RECOMPUTE)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in valid:
                raise ShardwiseError(f"{name} {value!r} unknown; valid: "
                                     f"{', '.join(valid)}"[:300])

    def codes(self) -> dict[str, Any]:
        """The fields as integers, as the array-generic models take them: `schedule` as its
        registry code, `recompute` as its index in `RECOMPUTE`, `cp_kind` in `CP_KINDS`, `sp`
        as 0/1; without the stage `partition` (one layout's, passed on its own as
        `partition=`)."""
        self.check_names()
        return {**{k: v for k, v in asdict(self).items() if k != "partition"},
                "sp": int(self.sp), "cp_kind": CP_KINDS.index(self.cp_kind),
                "schedule": SCHEDULE_REGISTRY[self.schedule].code,
                "recompute": RECOMPUTE.index(self.recompute)}

    @classmethod
    def parse(cls, text: str, **defaults: object) -> Layout:
        """`tp=8,pp=16,zero=1,schedule=interleaved,chunks=2,sp=1` → Layout; an explicit stage
        partition as `partition=7:8:…:7` (layers per stage, first to last) or Megatron's
        layout string, `partition=Et|(tt|)*30L` (`partition.parse_pipeline_layout`; its
        virtual stages set `chunks` and the interleaved schedule when not given)."""
        return cls(**(defaults | cls.parse_fields(text)))  # type: ignore[arg-type]

    @classmethod
    def parse_fields(cls, text: str) -> dict[str, object]:
        """The fields `text` names (the syntax of `parse`), typed: {"tp": 8, "sp": True, …};
        each key at most once."""
        validate.instance(text, str, "layout text")
        types = {f.name: f.type for f in fields(cls)}
        aliases = {"mbs": "micro_batch", "mb": "micro_batch", "v": "chunks"}
        values: dict[str, object] = {}
        given: set[str] = set()
        staged: tuple[int, ...] = ()  # a Megatron layout's virtual stages
        items: list[str] = []
        for part in filter(None, (part.strip() for part in text.split(","))):
            if "=" not in part and items and items[-1].startswith("partition="):
                # layer counts `7,8,8,7`, or a Megatron layout's cosmetic comma ("…*29,m|L",
                # which its parser drops)
                items[-1] += "," + part
            else:
                items.append(part)
        for item in items:
            key, sep, raw = item.partition("=")
            key = aliases.get(key.strip(), key.strip())
            if not sep or key not in types:
                raise ShardwiseError(
                    f"cannot read layout item {item!r}; write key=value with key in "
                    f"{', '.join(types)}"
                )
            if key in given:
                raise ShardwiseError(f"layout {text!r} sets {key} twice; give each key once")
            given.add(key)
            raw = raw.strip()
            kind = types[key]
            if key == "partition" and is_pipeline_layout(raw):  # Megatron's layout string
                values[key] = staged = parse_pipeline_layout(raw)
            elif key == "partition":
                values[key] = parse_partition(raw.replace(":", ","))
            elif kind in ("bool", bool):
                if raw.lower() not in _TRUE + _FALSE:
                    raise ShardwiseError(f"layout {key}={raw!r} must be one of "
                                         f"{', '.join(_TRUE + _FALSE)}")
                values[key] = raw.lower() in _TRUE
            elif kind in ("int", int):
                try:
                    values[key] = int(raw)
                except ValueError:
                    raise ShardwiseError(f"layout {key}={raw!r} must be an integer") from None
            else:
                values[key] = raw
        if staged and isinstance(values.get("pp"), int) and (
                "chunks" not in values and len(staged) > values["pp"]  # type: ignore[operator]
                and len(staged) % values["pp"] == 0):  # type: ignore[operator]
            values["chunks"] = len(staged) // values["pp"]  # type: ignore[operator]
            values.setdefault("schedule", "interleaved")
        return values

    def stage_partition(self, n_layers: int) -> tuple[int, ...]:
        """Layers on each pipeline stage (per chunk when interleaved): `stage_partition`."""
        return stage_partition(n_layers, self.pp, self.chunks, self.partition)

    def stage_sizes(self, n_layers: int) -> tuple[int, ...]:
        """Layers of each of the `pp·chunks` virtual stages, in model order: a partition of
        virtual stages as given, `pp` counts each chunk of stage `i` holding `1/chunks` of its
        layers on the virtual stage the schedule's placement gives it (`virtual_sizes`);
        else the even or balanced split, virtual stage `c·p + i` chunk `c` of stage `i`."""
        if self.partition:  # `pp` counts laid out by the schedule's placement
            return virtual_sizes(self.pp, self.chunks, self.partition, self.placement)
        return self.stage_partition(n_layers) * self.chunks

    @property
    def virtual_stages(self) -> bool:
        """The partition counts each virtual stage (`pp·chunks` of them, interleaved)."""
        return bool(self.partition) and len(self.partition) != self.pp

    @property
    def placement(self) -> Placement:
        """Which virtual stage each chunk runs: "loop" or "v" (the schedule's)."""
        self.check_names()
        return SCHEDULE_REGISTRY[self.schedule].placement

    def stage_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers on each stage over all its chunks, first to last."""
        if self.partition:
            return stage_totals(self.pp, self.chunks, self.partition, self.placement)
        return tuple(n * self.chunks for n in self.stage_partition(n_layers))

    def with_(self, **changes: object) -> Layout:
        return replace(self, **changes)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------- validation
    def problems(self, model: ModelSpec, cluster: Cluster | None = None,
                 train: TrainSpec | None = None) -> list[str]:
        """Every constraint this layout violates, one clear sentence each (arguments that are
        not a `ModelSpec`, `Cluster`, `TrainSpec` raise `ShardwiseError`;
        `layout_checks.layout_problems`)."""
        check_specs(model=model, cluster=cluster, train=train, optional=("cluster", "train"))
        return layout_problems(self, model, cluster, train)

    def validate(self, model: ModelSpec, cluster: Cluster | None = None,
                 train: TrainSpec | None = None) -> Layout:
        """Raise `LayoutError` listing every violated constraint; return self when valid."""
        problems = self.problems(model, cluster, train)
        if problems:
            raise LayoutError(problems)
        return self


_ABSENT: Any = object()


def check_specs(*, model: Any = _ABSENT, layout: Any = _ABSENT, cluster: Any = _ABSENT,
                train: Any = _ABSENT, optional: tuple[str, ...] = ()) -> None:
    """The specs a public estimate takes are what their names say (`ModelSpec`, `Layout`,
    `Cluster`, `TrainSpec`; those named in `optional` may be None): `ShardwiseError` naming
    the first that is not, instead of an `AttributeError` from deep inside."""
    for value, kind, name, hint in ((model, ModelSpec, "model", " (shardwise.get_model)"),
                                    (layout, Layout, "layout", " (Layout(tp=…) or "
                                                               "Layout.parse('tp=8'))"),
                                    (cluster, Cluster, "cluster", " (Cluster.of(gpus, gpu))"),
                                    (train, TrainSpec, "train", " (TrainSpec(seq_len=…))")):
        if value is not _ABSENT and not (value is None and name in optional):
            validate.instance(value, kind, name, hint)
