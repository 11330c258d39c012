"""`Layout` — how one training step is spread over the cluster — and `TrainSpec` — what is
trained (sequence length, batch, dtypes, optimizer).

World size = `dp · tp · pp · cp`; expert parallelism reuses ranks of `dp × cp`, so `ep`
divides `dp · cp` and does not add ranks (SPEC notation). With expert tensor parallelism
(`etp`, Megatron's `--expert-tensor-parallel-size`; 0 means tp, its default) the MoE layers
lay the `tp·dp·cp` ranks of a stage out as `etp × ep × edp` instead (`shardwise.placement`):
`etp·ep` divides `tp·dp·cp`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.hardware import Cluster
from shardwise.schedules.actions import Placement, virtual_stage
from shardwise.schedules.registry import DEFAULT_SCHEDULE, SCHEDULE_REGISTRY, SCHEDULES
from shardwise.stacks import DEFAULT_STACK, STACKS, Settings, Stack, get_stack, parse_impl, resolve
from shardwise.units import DTYPE_BYTES

AXES: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
"""The parallel axes, spelled the same everywhere: `Layout` fields, CLI options (`--tp`), layout
text (`tp=8`), JSON keys, the planner's arrays and the runtime mesh's axis names."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
RECOMPUTE = ("none", "selective", "full", "op-sac")
RECOMPUTE_LIGHTEST_FIRST = ("none", "selective", "op-sac", "full")
"""Recompute policies by how much they recompute (and save), least first."""
CP_KINDS = ("ring", "ulysses", "hybrid", "allgather")
"""How context parallelism splits attention (`Layout.cp_kind`; docs/concepts/context-parallel.md):
ring attention (K/V blocks around the cp group), DeepSpeed-Ulysses (all-to-all over heads),
their hybrid (Ulysses inside groups of `Layout.ulysses` ranks, a ring across the groups), or
K and V all-gathered before the attention (torchtitan's FlexAttention CP)."""
OPTIMIZERS = ("adam", "sgd-momentum", "sgd", "adam-8bit", "adafactor")


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

    def __post_init__(self) -> None:
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

    def validate(self) -> TrainSpec:
        problems = []
        for name, check in (("expert_load", validate.positive), ("experts_active",
                                                                  validate.fraction)):
            try:
                check(getattr(self, name), name)
            except ShardwiseError as exc:
                problems.append(str(exc))
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
            problems += _moe_comm_problems(self)
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

    def codes(self) -> dict[str, Any]:
        """The fields as integers, as the array-generic models take them: `schedule` as its
        registry code, `recompute` as its index in `RECOMPUTE`, `cp_kind` in `CP_KINDS`, `sp`
        as 0/1; without the stage `partition` (one layout's, passed on its own as
        `partition=`)."""
        return {**{k: v for k, v in asdict(self).items() if k != "partition"},
                "sp": int(self.sp), "cp_kind": CP_KINDS.index(self.cp_kind),
                "schedule": SCHEDULE_REGISTRY[self.schedule].code,
                "recompute": RECOMPUTE.index(self.recompute)}

    @classmethod
    def parse(cls, text: str, **defaults: object) -> Layout:
        """`tp=8,pp=16,zero=1,schedule=interleaved,chunks=2,sp=1` → Layout; an explicit stage
        partition as `partition=7:8:…:7` (layers per stage, first to last)."""
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
        for item in filter(None, (part.strip() for part in text.split(","))):
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
            if key == "partition":
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
        return values

    def stage_partition(self, n_layers: int) -> tuple[int, ...]:
        """Layers on each pipeline stage (per chunk when interleaved): `stage_partition`."""
        return stage_partition(n_layers, self.pp, self.chunks, self.partition)

    def stage_sizes(self, n_layers: int) -> tuple[int, ...]:
        """Layers of each of the `pp·chunks` virtual stages, in model order: a partition of
        virtual stages as given; else virtual stage `c·p + i` is chunk `c` of stage `i`, each
        chunk of stage `i` holding `1/chunks` of its layers."""
        if self.virtual_stages:
            return self.partition
        return self.stage_partition(n_layers) * self.chunks

    @property
    def virtual_stages(self) -> bool:
        """The partition counts each virtual stage (`pp·chunks` of them, interleaved)."""
        return bool(self.partition) and len(self.partition) != self.pp

    @property
    def placement(self) -> Placement:
        """Which virtual stage each chunk runs: "loop" or "v" (the schedule's)."""
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
        not a `ModelSpec`, `Cluster`, `TrainSpec` raise `ShardwiseError`)."""
        check_specs(model=model, cluster=cluster, train=train, optional=("cluster", "train"))
        out: list[str] = []
        for axis in (*AXES, "chunks", "micro_batch"):
            try:
                validate.degree(getattr(self, axis), axis)
            except ShardwiseError as exc:
                out.append(str(exc))
        try:
            validate.integer(self.zero_group, "zero_group", low=0, high=validate.MAX_DEGREE)
        except ShardwiseError as exc:
            out.append(str(exc))
        for name, allowed in (("schedule", SCHEDULES), ("recompute", RECOMPUTE)):
            if not isinstance(getattr(self, name), str):
                out.append(f"{name} must be one of {', '.join(allowed)}, got "
                           f"{getattr(self, name)!r}")
        if not isinstance(self.sp, bool | int):
            out.append(f"sp must be true or false, got {self.sp!r}")
        if out:
            return out
        t = self.tp
        if model.n_heads % t:
            out.append(f"tp={t} does not divide n_heads={model.n_heads}")
        if model.n_kv_heads % t and t % model.n_kv_heads:
            out.append(
                f"tp={t} neither divides n_kv_heads={model.n_kv_heads} nor is a multiple of it "
                "(for replicated kv heads)"
            )
        if model.d_ff % t:
            out.append(f"tp={t} does not divide d_ff={model.d_ff}")
        if self.etp < 0:
            out.append(f"etp must be ≥ 0 (0: the same as tp), got {self.etp}")
            return out
        et = self.expert_tp
        if model.is_moe and model.expert_d_ff % et:
            name = "etp" if self.etp else "tp"
            out.append(f"{name}={et} does not divide the expert d_ff={model.expert_d_ff}")
        if model.n_shared_experts and et != t and model.expert_d_ff % t:
            out.append(f"tp={t} does not divide the shared experts' d_ff={model.expert_d_ff}")
        if self.etp and not model.is_moe:
            out.append(f"etp={self.etp} needs a mixture-of-experts model; {model.name} is dense")
        out.extend(partition_problems(model.n_layers, self.pp, self.chunks, self.partition))
        info = SCHEDULE_REGISTRY.get(self.schedule)
        if info is None:
            out.append(f"schedule {self.schedule!r} unknown; valid: {', '.join(SCHEDULES)}")
        elif info.chunked:
            if (problem := info.chunk_problem(self.chunks)) is not None:
                out.append(problem)
            if self.pp < 2:
                out.append(f"the {info.name} schedule needs pp ≥ 2")
        elif self.chunks != 1:
            chunked = "|".join(s.name for s in SCHEDULE_REGISTRY.values() if s.chunked)
            out.append(f"chunks={self.chunks} needs schedule={chunked}")
        out.extend(self._cp_problems(model))
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute {self.recompute!r} unknown; valid: {', '.join(RECOMPUTE)}")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.zero_group and (self.dp * self.cp) % self.zero_group:
            out.append(f"zero_group={self.zero_group} does not divide dp·cp={self.dp * self.cp}")
        if self.ep > 1 and not model.is_moe:
            out.append(f"ep={self.ep} needs a mixture-of-experts model; {model.name} is dense")
        if model.is_moe and model.n_experts % self.ep:
            out.append(f"ep={self.ep} does not divide n_experts={model.n_experts}")
        if et == t and (self.dp * self.cp) % self.ep:
            out.append(f"ep={self.ep} must divide dp·cp={self.dp * self.cp} (experts reuse "
                       "data/context-parallel ranks)")
        elif (t * self.dp * self.cp) % (et * self.ep):
            out.append(f"etp·ep={et}·{self.ep} must divide tp·dp·cp={t * self.dp * self.cp} "
                       "(the expert layers' ranks of a pipeline stage)")
        if cluster is not None and self.world_size != cluster.n_gpus:
            out.append(
                f"dp·tp·pp·cp = {self.dp}·{self.tp}·{self.pp}·{self.cp} = {self.world_size} "
                f"ranks, but the cluster has {cluster.n_gpus} GPUs"
            )
        if train is not None:
            out.extend(self._train_problems(train, model))
        return out

    def _cp_problems(self, model: ModelSpec) -> list[str]:
        """The context-parallel kind's constraints. An all-to-all over heads gives each of its
        `u` ranks `1/u` of a tensor-parallel rank's query heads and of its key/value heads, so
        `u` divides both (Transformer Engine's `AttnFuncWithCPAndQKVOA2A`, cp_comm_type "a2a",
        asserts `num_heads % cp_size == 0` for Q and for K/V; TE 2.20.0.dev0,
        attention/dot_product_attention/context_parallel.py). DeepSpeed 0.19.8 also runs
        fewer key/value heads than ranks apart unevenly when a_kv ≥ u (`uneven_heads_all2all`,
        deepspeed/sequence/layer.py); shardwise models the even split only."""
        if self.cp_kind not in CP_KINDS:
            return [f"cp_kind {self.cp_kind!r} unknown; valid: {', '.join(CP_KINDS)}"]
        c, u = self.cp, self.ulysses
        if self.cp_kind != "hybrid" and u:
            return [f"ulysses={u} applies to cp_kind=hybrid only (the all-to-all degree inside "
                    "each cp group)"]
        if self.cp_kind == "hybrid" and (not 1 < u < c or c % u):
            return [f"cp_kind=hybrid needs ulysses=u with 1 < u < cp={c} and u dividing cp "
                    f"(all-to-all inside groups of u ranks, ring across cp/u), got ulysses={u}"]
        return self._head_problems(model)

    def _head_problems(self, model: ModelSpec) -> list[str]:
        """`Layout.ulysses_degree` divides the query and the key/value heads of a tp rank."""
        u, t = self.ulysses_degree, self.tp
        if u == 1:
            return []
        out = []
        q_heads, kv_heads = model.n_heads // t, max(model.n_kv_heads // t, 1)
        for what, heads in (("query heads", q_heads), ("key/value heads", kv_heads)):
            if heads % u:
                out.append(f"the Ulysses all-to-all over {u} ranks splits each tensor-parallel "
                           f"rank's {heads} {what} (n_heads={model.n_heads}, n_kv_heads="
                           f"{model.n_kv_heads}, tp={t}): {u} must divide {heads}")
        return out

    def _train_problems(self, train: TrainSpec, model: ModelSpec) -> list[str]:
        split_ok = not partition_problems(model.n_layers, self.pp, self.chunks, self.partition)
        out = (train.stack.layout_problems(self, model.n_layers if split_ok else None, train)
               if train.impl in STACKS else [])
        if train.impl in STACKS and train.offload in train.stack.offload_kinds():
            support = train.stack.offload_support(train.offload)
            if support is not None and self.zero not in support.zero:
                out.append(f"{train.stack.name} offloads the {train.offload} with ZeRO "
                           f"{', '.join(map(str, support.zero))} only ({support.flag}), "
                           f"not zero={self.zero}")
        # Zigzag causal balancing splits the sequence into 2·cp chunks.
        if self.cp > 1 and train.seq_len % (2 * self.cp):
            out.append(f"2·cp={2 * self.cp} does not divide seq_len={train.seq_len}")
        if self.sp and train.seq_len % (self.tp * self.cp):
            out.append(f"tp·cp={self.tp * self.cp} does not divide seq_len={train.seq_len} "
                       "(sequence parallel)")
        if train.global_batch is not None:
            per_step = self.dp * self.micro_batch
            if train.global_batch % per_step:
                out.append(
                    f"global batch {train.global_batch} is not a multiple of dp·micro_batch="
                    f"{self.dp}·{self.micro_batch}"
                )
            elif self.schedule in SCHEDULE_REGISTRY and self.pp > 1 and (
                    problem := SCHEDULE_REGISTRY[self.schedule].microbatch_problem(
                        self.pp, self.microbatches(train))) is not None:
                out.append(problem)
        return out

    def validate(self, model: ModelSpec, cluster: Cluster | None = None,
                 train: TrainSpec | None = None) -> Layout:
        """Raise `LayoutError` listing every violated constraint; return self when valid."""
        problems = self.problems(model, cluster, train)
        if problems:
            raise LayoutError(problems)
        return self


# ----------------------------------------------------------------------- stage partition
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
        partition = parse_partition(partition)
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


def partition_problems(n_layers: int, pp: int, chunks: int, partition: tuple[int, ...]
                       ) -> list[str]:
    """What is wrong with `partition` (or with the default one when it is empty): `pp` stage
    counts or, interleaved, `pp·chunks` virtual-stage counts (torchtitan's split; Megatron's
    `--pipeline-model-parallel-layout`). With `pp` counts and interleaving every stage's layers
    are a multiple of `chunks`, as megatron-core requires of
    `num_layers_in_first/last_pipeline_stage` and of the middle stages
    (`TransformerConfig.__post_init__`)."""
    if partition:
        out = []
        virtual = chunks > 1 and len(partition) == pp * chunks
        if len(partition) != pp and not virtual:
            out.append(f"partition has {len(partition)} stages but pp={pp}"
                       + (f" (or pp·chunks={pp * chunks} virtual stages)" if chunks > 1 else ""))
        if sum(partition) != n_layers:
            out.append(f"partition sums to {sum(partition)} layers but n_layers={n_layers}")
        if min(partition, default=1) < 1:
            out.append(f"every pipeline stage needs ≥ 1 layer, got partition "
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
    first stage)."""
    return tuple(int(n) for n in
                 (layers_on_stage(n_layers, pp, chunks, stage, partition) for stage in range(pp)))


def stage_totals(pp: int, chunks: int, partition: tuple[int, ...],
                 placement: Placement = "loop") -> tuple[int, ...]:
    """Layers on each stage over all its chunks, of one layout's explicit `partition` (per
    stage, or per virtual stage in model order, laid out by `placement`)."""
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
    """(first layer, layers) of virtual chunk `chunk` on pipeline `stage`: even stages hold
    `[(c·p + stage)·n, … + n)`, `n = L/(p·v)`; uneven ones are contiguous in virtual-stage
    order, chunk `c` of stage `i` holding `partition[i]/v` layers from
    `c·L/v + Σ_{j<i} partition[j]/v` (megatron-core's `get_transformer_layer_offset` with
    first/last-stage layers and a virtual pipeline), or with `pp·v` counts (`virtual_stages`)
    the count of the virtual stage it runs (`schedules.actions.virtual_stage` in `placement`);
    a `Balanced` one (chunks = 1; the default is `Balanced.default`) spreads `L + a + z` units
    as evenly as possible, the extras on the stages after the first, then the first stage `a`
    layers short and the last `z`. Array-generic in `pp`, `chunks`, `stage` and the `Balanced`
    counts."""
    if isinstance(partition, tuple) and partition and len(partition) != pp:
        sizes = np.asarray(partition, dtype=np.int64)  # per virtual stage, in model order
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        vs = virtual_stage(stage, int(chunk), int(pp), placement)
        return starts[vs], sizes[vs]
    if isinstance(partition, tuple) and partition:
        sizes = np.asarray(partition, dtype=np.int64) // chunks
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return chunk * (n_layers // chunks) + starts[stage], sizes[stage]
    if not any(np.ndim(x) for x in (pp, chunks, stage, chunk)) and not (
            isinstance(partition, Balanced) and np.ndim(partition.first_less)
            + np.ndim(partition.last_less)):
        return _chunk_span_of_one(n_layers, int(pp), int(chunks), int(stage), int(chunk),
                                  partition)
    per = n_layers // (pp * chunks)
    divides = n_layers % (pp * chunks) == 0
    ends = partition if isinstance(partition, Balanced) else Balanced.default(n_layers, pp, chunks)
    a, z = ends.first_less, ends.last_less
    even = divides & (a == 0) & (z == 0)
    q, r = np.divmod(n_layers + a + z, pp)  # L + a + z units: embedding a layers, head z
    first, last = stage == 0, stage == pp - 1
    count = q + ((stage >= 1) & (stage <= r)) - a * first - z * last
    start = stage * q + np.clip(np.minimum(stage - 1, r), 0, None) - a * (stage > 0)
    if not np.ndim(even) and even:
        return (chunk * pp + stage) * per, per
    return (np.where(even, (chunk * pp + stage) * per, start),
            np.where(even, per, count))


def _chunk_span_of_one(n_layers: int, pp: int, chunks: int, stage: int, chunk: int,
                       partition: Partition) -> tuple[int, int]:
    """`chunk_span` of one layout in plain integers (the simulator asks it per stage);
    `partition` a `Balanced` one or () (an explicit one never reaches here)."""
    per, rest = divmod(n_layers, pp * chunks)
    if isinstance(partition, Balanced):
        a, z = int(partition.first_less), int(partition.last_less)
    else:
        a = z = int(rest != 0)
    if rest == 0 and a == z == 0:
        return (chunk * pp + stage) * per, per
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


def ulysses_degree(cp: Any, cp_kind: Any, ulysses: Any) -> Any:
    """Ranks each all-to-all over heads spans, for layouts as numbers or arrays (`cp_kind` as
    its code in `CP_KINDS`): 1 for ring attention and the all-gather, `cp` for Ulysses,
    `ulysses` for the hybrid."""
    return np.where(cp_kind == 1, cp, np.where(cp_kind == 2, np.maximum(ulysses, 1), 1))
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
