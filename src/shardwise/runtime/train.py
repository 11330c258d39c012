"""Train the runtime Transformer on any supported layout: the same loss curve as one device.

One step (every rank, `train_step`):

    1. data       this dp rank's rows of the step's global batch (`data.Batches`: a seeded
                  permutation of the corpus's windows; the position is the step number)
    2. fwd + bwd  `ParallelTransformer.forward_backward`: m = B/(dp·micro_batch) micro-batches,
                  through the pipeline schedule when pp > 1, gradients accumulated
    3. reduce     gradients summed/averaged over the mesh (see `runtime.parallelize`)
    4. clip       by the global norm over every unique parameter (Pascanu et al. 2013):
                  g ← g · min(1, c / (‖g‖ + 1e-6)), exactly `torch.nn.utils.clip_grad_norm_`
    5. AdamW      decoupled weight decay (Loshchilov & Hutter 2019) on this rank's parameters
                  (ZeRO: its flat shards; elementwise, so the same update as one device)
                  at the learning rate of the step: linear warm-up over `warmup` steps, then
                  cosine decay to `min_lr` at the last step
    6. hooks      `hook(state, record)` after the step, on every rank (logging, progress,
                  checkpoints: `TrainState` holds everything a resume needs)

Checkpoints (`runtime.checkpoint`): with `checkpoint_dir`, every `checkpoint_every` steps (or
"auto": Daly's interval from the measured write time, `runtime.saving`) and after the last
one, a sharded, layout-independent, atomically published checkpoint, its bytes and seconds in
the step's record; `resume`
loads the newest one into the freshly built state (on any layout) and goes on from its step,
the same trajectory as an uninterrupted run.

`run(config)` spawns the ranks locally (gloo on CPU) or, under `torchrun`, runs in place (NCCL
on GPUs): `torchrun --nproc-per-node 2 -m shardwise train --dp 2 …` runs `shardwise train` on
the ranks torchrun started (`python -m shardwise` is the one entry point).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.goodput import DEFAULT_MTBF_GPU_HOURS
from shardwise.layout import Layout, TrainSpec
from shardwise.runtime import checkpoint, hf, launch
from shardwise.runtime.data import BYTE_VOCAB, Batches, load_tokens
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.mixed_precision import MasterOptimizer
from shardwise.runtime.model import Transformer, configure_moe
from shardwise.runtime.parallel_transformer import ParallelTransformer
from shardwise.runtime.parallelize import parallelize, runtime_problems
from shardwise.runtime.saving import Checkpoints

__all__ = ["DTYPES", "StepRecord", "TrainConfig", "TrainState", "build", "plot_losses", "run",
           "train", "train_step"]

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

    def train_spec(self) -> TrainSpec:
        """The step model's view of this run: the shardwise stack (`stacks.STACKS`: its
        activation profile and the overlap it does — DP/ZeRO reductions behind backward, but
        TP collectives between its GEMMs, blocking pipeline receives and blocking
        ring-attention hops)."""
        return TrainSpec(seq_len=self.seq_len, global_batch=self.global_batch,
                         dtype=self.dtype, grad_dtype=self.grad_dtype,
                         flash_attention=self.flash, impl="shardwise")

    def problems(self) -> list[str]:
        out = []
        if self.steps < 0:  # 0: no step (load and save a checkpoint, say)
            out.append(f"steps must be ≥ 0, got {self.steps}")
        for name in ("seq_len", "global_batch"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            out.append(f"dtype {self.dtype!r} cannot train here; valid: {', '.join(DTYPES)}")
        elif self.grad_dtype not in (None, self.dtype) and not (
                self.dtype == "bf16" and self.grad_dtype == "fp32"):
            out.append(f"grad_dtype {self.grad_dtype} with dtype {self.dtype} is not supported "
                       "by the training runtime; use grad_dtype "
                       + (f"{self.dtype} or fp32" if self.dtype == "bf16" else self.dtype))
        if not 0 <= self.min_lr <= self.lr:
            out.append(f"need 0 ≤ min_lr ≤ lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.warmup < 0 or self.clip < 0 or self.weight_decay < 0:
            out.append("warmup, clip and weight_decay must be ≥ 0")
        auto = self.checkpoint_every == "auto"
        if (not auto and not (isinstance(self.checkpoint_every, int)
                              and self.checkpoint_every >= 0)) or self.checkpoint_keep < 1:
            out.append(f"need checkpoint_every ≥ 0 (or 'auto') and checkpoint_keep ≥ 1, got "
                       f"{self.checkpoint_every!r} and {self.checkpoint_keep}")
        if self.mtbf_gpu_hours is not None and not auto:
            out.append("mtbf_gpu_hours (--mtbf-gpu-hours) sets the automatic checkpoint "
                       "interval: use it with checkpoint_every 'auto'")
        elif self.mtbf_gpu_hours is not None and not (
                math.isfinite(self.mtbf_gpu_hours) and self.mtbf_gpu_hours > 0):
            out.append(f"mtbf_gpu_hours must be a finite number > 0, got "
                       f"{self.mtbf_gpu_hours!r}")
        if not self.checkpoint_dir and (self.resume or self.checkpoint_every):
            out.append("resume and checkpoint_every need a checkpoint directory "
                       "(checkpoint_dir, --checkpoint-dir)")
        out += self._moe_problems()
        if self.model.vocab < BYTE_VOCAB:
            out.append(f"the byte tokenizer needs a vocabulary ≥ {BYTE_VOCAB}; "
                       f"{self.model.name} has {self.model.vocab}")
        if out:
            return out
        return (self.layout.problems(self.model, train=self.train_spec())
                or runtime_problems(self.layout, self.model))

    def _moe_problems(self) -> list[str]:
        cf, coef = self.capacity_factor, self.aux_loss_coef
        if cf is None and not coef:
            return []
        if not self.model.is_moe:
            return ["capacity_factor and aux_loss_coef need a mixture-of-experts model; "
                    f"{self.model.name} is dense"]
        out = []
        if cf is not None and not cf > 0:
            out.append(f"capacity_factor must be > 0, got {cf}")
        if not coef >= 0:
            out.append(f"aux_loss_coef must be ≥ 0, got {coef}")
        return out

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
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


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


Hook = Callable[[TrainState, StepRecord], None]


# ---------------------------------------------------------------------------- the steps
def build(config: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """The training state on this rank (a process group must be up): the mesh, the model
    built from the seed and parallelised, AdamW over this rank's parameters, the data."""
    config.validate()
    mesh = mesh or Mesh.from_layout(config.layout)
    model = Transformer(config.model, flash=config.flash, dtype=DTYPES[config.dtype],
                        seed=config.seed)
    configure_moe(model, config.capacity_factor, config.aux_loss_coef)
    if config.hf_weights:  # the whole checkpoint on every rank; parallelize keeps a slice
        hf.load_hf_weights(model, config.hf_weights)
    parallel = parallelize(model, mesh, config.layout, config.seq_len, launch.device(),
                           DTYPES[config.grad_dtype] if config.grad_dtype else None)
    adamw = {"lr": config.lr, "betas": config.betas, "eps": config.eps,
             "weight_decay": config.weight_decay}
    # mixed precision: AdamW over fp32 masters of this rank's tensors (ZeRO: its shards)
    optimizer: torch.optim.Optimizer | MasterOptimizer = (
        MasterOptimizer(parallel.parameters(), **adamw) if config.mixed_precision else
        torch.optim.AdamW(parallel.parameters(), foreach=False, **adamw))
    batches = Batches(load_tokens(config.data), config.seq_len, config.global_batch,
                      config.seed)
    return TrainState(config, parallel, optimizer, batches)


def _update(state: TrainState, lr: float) -> float:
    """Clip by the global norm, then AdamW at `lr`; returns the norm before clipping."""
    norm = state.model.grad_norm()
    coef = min(1.0, state.config.clip / (norm + 1e-6)) if state.config.clip else 1.0
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    if isinstance(state.optimizer, MasterOptimizer):  # clipped in fp32, on the masters
        state.optimizer.step(coef)
        return norm
    if coef != 1.0:
        for p in state.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    state.optimizer.step()
    return norm


def train_step(state: TrainState) -> StepRecord:
    """One optimizer step on global batch `state.step`."""
    config, model = state.config, state.model
    start = time.perf_counter()
    dp = model.axis("dp")
    inputs, targets = state.batches.shard(state.step, dp.rank, dp.size)  # (B/dp, s) each
    device = model.positions.device
    model.zero_grad()
    local = model.forward_backward(inputs.to(device), targets.to(device))
    lr = config.lr_at(state.step)
    norm: list[float] = []
    model.step(lambda: norm.append(_update(state, lr)))
    loss = model.global_loss(local)
    record = StepRecord(state.step, loss, norm[0], lr, config.global_batch * config.seq_len,
                        time.perf_counter() - start)
    state.step += 1
    state.rng = torch.get_rng_state()
    state.records.append(record)
    return record


def train(config: TrainConfig, hooks: Sequence[Hook] = (), state: TrainState | None = None
          ) -> TrainState:
    """Train on this rank until `config.steps`, from `state.step` (a given state), or from
    the newest checkpoint when `config.resume` (from step 0 when there is none yet)."""
    if state is None:
        checkpoint.check_start(config)
        state = build(config)
        if config.resume:
            checkpoint.load_checkpoint(state, str(config.checkpoint_dir))
    saving = ([Checkpoints(config.checkpoint_dir, config.checkpoint_every,
                           config.checkpoint_keep,
                           config.mtbf_gpu_hours or DEFAULT_MTBF_GPU_HOURS)]
              if config.checkpoint_dir else [])
    hooks = [*saving, *_rank0_hooks(config, state.step), *hooks]  # a save enters the record
    while state.step < config.steps:
        train_step(state)
        for hook in hooks:
            hook(state, state.records[-1])
    for hook in hooks:
        getattr(hook, "close", lambda: None)()
    if config.save_hf:
        hf.save_hf(state.model, config.save_hf)
    return state


# ---------------------------------------------------------------------- logging (rank 0)
class JsonLines:
    """Append each step's record to a JSON-lines file (one object per line).

    A run resumed at step `start` > 0 keeps the file's lines of earlier steps and drops the
    rest: the steps an interrupted run logged after its last checkpoint are trained again."""

    def __init__(self, path: str, start: int = 0):
        kept = []
        if start and Path(path).is_file():
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line)["step"] < start:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):  # a line torn by the interruption
                    continue
        self.file = Path(path).open("w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.file.writelines(line + "\n" for line in kept)

    def __call__(self, state: TrainState, record: StepRecord) -> None:
        self.file.write(json.dumps(record.as_dict()) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ProgressBar:
    """Loss, tokens/s and step time: a live bar on a terminal, else about 20 lines."""

    def __init__(self, config: TrainConfig):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.console = Console(stderr=True)
        self.total = config.steps
        self.every = max(1, config.steps // 20)
        self.progress = None
        if self.console.is_terminal:
            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), console=self.console)
            self.task = self.progress.add_task("train", total=config.steps, info="")
            self.progress.start()

    def __call__(self, state: TrainState, record: StepRecord) -> None:
        info = (f"loss {record.loss:.4f}  {record.tokens_per_s:,.0f} tok/s  "
                f"{record.seconds * 1e3:.0f} ms/step")
        if self.progress is not None:
            self.progress.update(self.task, completed=record.step + 1, info=info)
        elif record.step % self.every == 0 or record.step + 1 == self.total:
            self.console.print(f"step {record.step + 1}/{self.total}  {info}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _rank0_hooks(config: TrainConfig, start: int) -> list[Hook]:
    if launch.rank() != 0:
        return []
    hooks: list[Hook] = []
    if config.log_path:
        hooks.append(JsonLines(config.log_path, start))
    if config.progress:
        hooks.append(ProgressBar(config))
    return hooks


def plot_losses(records: Sequence[StepRecord], path: str, title: str) -> None:
    """A loss-curve PNG (matplotlib, `pip install 'shardwise[plot]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardwiseError("--plot needs matplotlib: pip install 'shardwise[plot]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.step + 1 for r in records], [r.loss for r in records], marker=".")
    ax.set(xlabel="step", ylabel="loss (mean cross-entropy, nats)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ launching
def _rank_main(config: TrainConfig, hooks: tuple[Hook, ...]) -> list[StepRecord] | None:
    state = train(config, hooks)
    return state.records if launch.rank() == 0 else None


def run(config: TrainConfig, *, hooks: Sequence[Hook] = (), timeout_s: float = 600
        ) -> list[StepRecord]:
    """Train on `config.layout.world_size` ranks (spawned here, or the torchrun world) and
    return rank 0's records. `hooks` run on every rank after every step (module-level
    functions: they travel to the ranks by name). A rank that fails or dies raises
    `launch.RankFailure` on the caller within `timeout_s`."""
    config.validate()
    Batches(load_tokens(config.data), config.seq_len, config.global_batch)  # enough text?
    layout, started = config.layout, os.environ.get("WORLD_SIZE")
    if "RANK" in os.environ and started is not None and int(started) != layout.world_size:
        raise ShardwiseError(
            f"the layout needs dp·tp·pp·cp = {layout.dp}·{layout.tp}·{layout.pp}·{layout.cp} = "
            f"{layout.world_size} ranks but torchrun started {started} (WORLD_SIZE)")
    owner = config.checkpoint_dir and os.environ.get("RANK", "0") == "0"  # one lock per run
    with checkpoint.DirectoryLock(config.checkpoint_dir) if owner else contextlib.nullcontext():
        checkpoint.check_start(config)  # a checkpoint directory this run can use?
        results = launch.launch(_rank_main, layout.world_size, config, tuple(hooks),
                                timeout_s=timeout_s)
    return results[0]
