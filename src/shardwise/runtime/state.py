"""What a training run is and holds: `TrainConfig` (what to train, on which layout, for how
long, with which optimizer settings), `TrainState` (everything a step reads and writes and a
checkpoint keeps) and `StepRecord` (one logged step). `runtime.train` runs them and
`runtime.checkpoint` saves and loads them; both import this module, neither the other's.

The optimizer schedule (`SCHEDULE_SETTINGS`: learning rate, its warm-up and cosine floor, the
step count the cosine spans, weight decay, clipping, AdamW's betas and ε) decides every update;
`schedule_changes` says which of them a new config changes for steps a checkpoint already took,
which a resume refuses unless `override` names them (`--override lr,warmup`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.layout import Layout, TrainSpec
from shardwise.runtime.data import BYTE_VOCAB
from shardwise.runtime.parallelize import runtime_problems

if TYPE_CHECKING:
    from shardwise.runtime.data import Batches
    from shardwise.runtime.mixed_precision import MasterOptimizer
    from shardwise.runtime.parallel_transformer import ParallelTransformer

__all__ = ["DTYPES", "SCHEDULE_SETTINGS", "StepRecord", "TrainConfig", "TrainState",
           "json_config", "lr_at", "schedule_changes"]

# the weights' dtype; "bf16" is mixed precision (`runtime.mixed_precision`: bf16 weights,
# bf16 or (grad_dtype "fp32") fp32 gradients, fp32 master weights and AdamW moments)
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """What to train, on which layout, for how long, with which optimizer settings."""

    model: ModelSpec
    layout: Layout = field(default_factory=Layout)
    steps: int = 20
    seq_len: int = 64
    global_batch: int = 8  # sequences per optimizer step
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 2  # steps of linear warm-up
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: float = 1.0  # max global gradient norm; 0: no clipping
    seed: int = 0  # model initialisation and data order
    data: str | None = None  # a text file; None: the built-in corpus
    dtype: str = "fp32"  # "fp32" | "fp64" | "bf16" (mixed precision, fp32 master)
    grad_dtype: str | None = None  # gradients (accumulated and reduced); None: dtype; "fp32"
    # with dtype "bf16": Megatron's fp32 main_grad (`mixed_precision.accumulate_in_fp32`)
    flash: bool = True
    log_path: str | None = None  # JSON lines, one per step (rank 0)
    progress: bool = False  # progress bar / lines on rank 0
    checkpoint_dir: str | None = None  # sharded checkpoints here (runtime.checkpoint)
    # steps between checkpoints; 0: only after the last step; "auto": Daly's interval from the
    # measured write time and `mtbf_gpu_hours` (`runtime.saving.Checkpoints`)
    checkpoint_every: int | str = 0
    mtbf_gpu_hours: float | None = None  # per GPU, with "auto" [default: the published one]
    checkpoint_keep: int = 2  # the newest checkpoints kept
    resume: bool = False  # start from the newest checkpoint in checkpoint_dir, if any
    # MoE: ⌈cf · T·k / E⌉ assignments per expert from the T tokens of one micro-batch on one
    # rank (None: no limit); α of every MoE layer's load-balancing loss added to the objective
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    hf_weights: str | None = None  # start from this Hugging Face checkpoint (runtime.hf)
    save_hf: str | None = None  # write the trained model here as config.json + safetensors
    # schedule settings (SCHEDULE_SETTINGS) a resume may change from the checkpoint's
    override: tuple[str, ...] = ()

    def train_spec(self) -> TrainSpec:
        """The step model's view of this run: the shardwise stack (`stacks.STACKS`: its
        activation profile and the overlap it does — DP/ZeRO reductions behind backward, but
        TP collectives between its GEMMs, blocking pipeline receives and blocking
        ring-attention hops)."""
        return TrainSpec(seq_len=self.seq_len, global_batch=self.global_batch,
                         dtype=self.dtype, grad_dtype=self.grad_dtype,
                         flash_attention=self.flash, impl="shardwise")

    def problems(self) -> list[str]:
        out = self._number_problems()
        if out:
            return out
        if self.dtype not in DTYPES:
            out.append(f"dtype {self.dtype!r} cannot train here; valid: {', '.join(DTYPES)}")
        elif self.grad_dtype not in (None, self.dtype) and not (
                self.dtype == "bf16" and self.grad_dtype == "fp32"):
            out.append(f"grad_dtype {self.grad_dtype} with dtype {self.dtype} is not supported "
                       "by the training runtime; use grad_dtype "
                       + (f"{self.dtype} or fp32" if self.dtype == "bf16" else self.dtype))
        if not self.min_lr <= self.lr:
            out.append(f"need 0 ≤ min_lr ≤ lr, got min_lr={self.min_lr}, lr={self.lr}")
        if not self.checkpoint_dir and (self.resume or self.checkpoint_every):
            out.append("resume and checkpoint_every need a checkpoint directory "
                       "(checkpoint_dir, --checkpoint-dir)")
        unknown = [name for name in self.override if name not in SCHEDULE_SETTINGS]
        if unknown:
            out.append(f"override names {', '.join(map(repr, unknown))}; a resume may change "
                       f"{', '.join(SCHEDULE_SETTINGS)}")
        out += self._moe_problems()
        if self.model.vocab < BYTE_VOCAB:
            out.append(f"the byte tokenizer needs a vocabulary ≥ {BYTE_VOCAB}; "
                       f"{self.model.name} has {self.model.vocab}")
        out += self.model.seq_problems(self.seq_len)
        if self.model.dropout:
            out.append(f"the training runtime has no dropout; {self.model.name} has it "
                       "(attention_dropout or hidden_dropout > 0 in its config)")
        if out:
            return out
        return (self.layout.problems(self.model, train=self.train_spec())
                or runtime_problems(self.layout, self.model, self.seq_len))

    def _number_problems(self) -> list[str]:
        """Every setting of the right type and finite, in range (`shardwise.validate`)."""
        out = []
        checks: list[tuple[str, Any, dict[str, Any]]] = [
            ("model", lambda v, n: validate.instance(v, ModelSpec, n), {}),
            ("layout", lambda v, n: validate.instance(v, Layout, n), {}),
            ("steps", validate.integer, {"low": 0, "high": validate.MAX_SEQUENCES}),
            ("seq_len", validate.positive_int, {"high": validate.MAX_SEQUENCES}),
            ("global_batch", validate.positive_int, {"high": validate.MAX_SEQUENCES}),
            ("warmup", validate.integer, {"low": 0, "high": validate.MAX_SEQUENCES}),
            ("checkpoint_keep", validate.positive_int, {"high": 2**20}),
            ("seed", validate.seed, {}),
            ("lr", validate.positive, {}),
            ("min_lr", validate.finite, {"low": 0}),
            ("weight_decay", validate.finite, {"low": 0}),
            ("clip", validate.finite, {"low": 0}),
            ("eps", validate.positive, {}),
            ("aux_loss_coef", validate.finite, {"low": 0}),
        ]
        for name, check, bounds in checks:
            try:
                check(getattr(self, name), name, **bounds)
            except ShardwiseError as exc:
                out.append(str(exc))
        if self.checkpoint_every != "auto":
            try:
                validate.integer(self.checkpoint_every, "checkpoint_every", low=0,
                                 high=validate.MAX_SEQUENCES)
            except ShardwiseError as exc:
                out.append(f"{exc} (or 'auto')")
        if self.mtbf_gpu_hours is not None:
            if self.checkpoint_every != "auto":
                out.append("mtbf_gpu_hours (--mtbf-gpu-hours) sets the automatic checkpoint "
                           "interval: use it with checkpoint_every 'auto'")
            else:
                try:
                    validate.positive(self.mtbf_gpu_hours, "mtbf_gpu_hours")
                except ShardwiseError as exc:
                    out.append(str(exc))
        betas = self.betas
        if not (isinstance(betas, tuple | list) and len(betas) == 2 and all(
                _number(b) and 0 <= b < 1 for b in betas)):
            out.append(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not isinstance(self.override, tuple | list) or not all(
                isinstance(n, str) for n in self.override):
            out.append(f"override must be a tuple of setting names, got {self.override!r}")
        return out

    def _moe_problems(self) -> list[str]:
        cf, coef = self.capacity_factor, self.aux_loss_coef
        if cf is None and not coef:
            return []
        if not self.model.is_moe:
            return ["capacity_factor and aux_loss_coef need a mixture-of-experts model; "
                    f"{self.model.name} is dense"]
        if cf is None:
            return []
        try:  # ⌈cf·T·k/E⌉ rows per expert: any cf ≥ E/k drops nothing
            validate.positive(cf, "capacity_factor", high=validate.MAX_FACTOR)
        except ShardwiseError as exc:
            return [str(exc)]
        return []

    @property
    def mixed_precision(self) -> bool:
        """bf16 weights with fp32 master weights and optimizer state."""
        return self.dtype == "bf16"

    def validate(self) -> TrainConfig:
        problems = self.problems()
        if problems:
            raise LayoutError(problems)
        return self

    def lr_at(self, step: int) -> float:
        """Linear warm-up to `lr` over `warmup` steps, then cosine decay to `min_lr`."""
        return lr_at(step, self.lr, self.min_lr, self.warmup, self.steps)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as logged: the global batch's mean loss, the gradient norm before
    clipping, the learning rate used, tokens processed, wall time (rank 0)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    # a checkpoint saved after this step (`runtime.saving.Checkpoints`): its tensors' bytes
    # (rank 0), the save's wall time, and with an automatic interval the steps to the next
    checkpoint_bytes: float | None = None
    checkpoint_seconds: float | None = None
    checkpoint_every: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """The record for a log line: the checkpoint fields only after a save."""
        return ({k: v for k, v in asdict(self).items() if v is not None}
                | {"tokens_per_s": self.tokens_per_s})


@dataclass
class TrainState:
    """Everything a step reads and writes, and a checkpoint would hold: the step (= the data
    position: step k reads global batch k), the model, the optimizer, the data, the RNG."""

    config: TrainConfig
    model: ParallelTransformer
    optimizer: torch.optim.Optimizer | MasterOptimizer
    batches: Batches
    step: int = 0
    rng: torch.Tensor = field(default_factory=torch.get_rng_state)
    records: list[StepRecord] = field(default_factory=list)

# The optimizer schedule (`TrainConfig` fields): together they decide every step's update.
SCHEDULE_SETTINGS = ("lr", "min_lr", "warmup", "steps", "weight_decay", "clip", "betas", "eps")


def schedule_changes(saved: dict[str, Any], config: TrainConfig, start: int) -> list[str]:
    """The schedule settings `config` changes from `saved` (a checkpoint's config, as JSON)
    for the `start` steps the checkpoint already took: weight decay, clipping, betas and ε
    whenever they differ; lr, min_lr, warmup and steps when `lr_at` differs at a step before
    `start` (more steps after a warm-up checkpoint changes nothing taken)."""
    new = json_config(config)
    fixed = [k for k in ("weight_decay", "clip", "betas", "eps") if saved.get(k) != new[k]]
    curve = ("lr", "min_lr", "warmup", "steps")
    differ = [k for k in curve if saved.get(k) != new[k]]
    if not differ:
        return fixed
    old = [saved.get(k) for k in curve]
    if not all(_number(v) for v in old):
        return fixed + differ  # an unreadable schedule: every difference counts
    taken = any(lr_at(k, *old) != config.lr_at(k) for k in range(start))
    return fixed + (differ if taken else [])


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def lr_at(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """The learning rate of step `step`: linear warm-up to `lr` over `warmup` steps, then
    cosine decay to `min_lr` at the last of `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def json_config(config: TrainConfig) -> dict[str, Any]:
    """`config` as `shardwise.json` stores it (tuples as lists)."""
    import json

    return dict(json.loads(json.dumps(asdict(config))))
