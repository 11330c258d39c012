"""Train the runtime Transformer on any supported layout: the same loss curve as one device.

Checkpoints (`runtime.checkpoint`): with `checkpoint_dir`, every `checkpoint_every` steps (or
"auto": Daly's interval from the measured write time, `runtime.saving`) and after the last
one, a sharded, layout-independent, atomically published checkpoint, its bytes and seconds in
the step's record; `resume`
loads the newest one into the freshly built state (on any layout) and goes on from its step,
the same trajectory as an uninterrupted run.

`run(config)` spawns the ranks locally (gloo on CPU) or, under `torchrun`, runs in place (NCCL
on GPUs): `torchrun --nproc-per-node 2 -m shardwise train --dp 2 …` runs `shardwise train` on
the ranks torchrun started (`python -m shardwise` is the one entry point).

Design notes: docs/concepts/runtime.md#runtime-train.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import DEFAULT_MTBF_GPU_HOURS
from shardwise.runtime import checkpoint, hf, hf_target, launch
from shardwise.runtime.data import Batches, load_tokens
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.mixed_precision import MasterOptimizer
from shardwise.runtime.model import Transformer, configure_moe
from shardwise.runtime.parallelize import parallelize
from shardwise.runtime.saving import Checkpoints
from shardwise.runtime.state import DTYPES, StepRecord, TrainConfig, TrainState

__all__ = ["DTYPES", "StepRecord", "TrainConfig", "TrainState", "build", "plot_losses", "run",
           "train", "train_step"]

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
    the newest checkpoint when `config.resume` (from step 0 when there is none yet). A step
    whose loss or gradient norm is not finite stops the run on every rank (the values are
    global) before any hook logs or saves it."""
    if state is None:
        checkpoint.check_start(config)
        state = build(config)
        if config.resume:
            checkpoint.load_checkpoint(state, str(config.checkpoint_dir), report=_warn)
    saving = ([Checkpoints(config.checkpoint_dir, config.checkpoint_every,
                           config.checkpoint_keep,
                           config.mtbf_gpu_hours or DEFAULT_MTBF_GPU_HOURS)]
              if config.checkpoint_dir else [])
    hooks = [*saving, *_rank0_hooks(config, state.step), *hooks]  # a save enters the record
    while state.step < config.steps:
        record = train_step(state)
        if not (math.isfinite(record.loss) and math.isfinite(record.grad_norm)):
            kept = _kept(config)
            raise ShardwiseError(
                f"step {record.step}: the loss is {record.loss} and the gradient norm "
                f"{record.grad_norm}: training diverged (lower --lr, or check the data); "
                + (f"the last checkpoint {kept} is kept" if kept else "nothing was saved"))
        for hook in hooks:
            hook(state, state.records[-1])
    for hook in hooks:
        getattr(hook, "close", lambda: None)()
    if config.save_hf:
        _save_model(state, config)
    return state


def _kept(config: TrainConfig) -> Path | None:
    """The newest checkpoint of the run, if it saves any."""
    return checkpoint.latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _save_model(state: TrainState, config: TrainConfig) -> None:
    """`hf.save_hf` to `config.save_hf`; when that fails, to a new temporary directory (rank
    0's choice), and the one-line error says where the trained model is."""
    try:
        hf.save_hf(state.model, str(config.save_hf))
        return
    except ShardwiseError as exc:
        problem = str(exc)
    spare = launch.from_rank0(tempfile.mkdtemp(prefix="shardwise-model-")
                              if launch.rank() == 0 else None)
    try:
        hf.save_hf(state.model, spare)
    except ShardwiseError as exc:
        kept = _kept(config)
        raise ShardwiseError(f"{problem}; nor to {spare} ({exc}): "
                             + (f"the trained model is in checkpoint {kept}" if kept
                                else "the trained model is lost")) from None
    raise ShardwiseError(f"{problem}; the trained model was written to {spare} instead")


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
        if config.save_hf and os.environ.get("RANK", "0") == "0":  # a --save-hf folder too?
            hf_target.check_save_target(config.save_hf)
        results = launch.launch(_rank_main, layout.world_size, config, tuple(hooks),
                                timeout_s=timeout_s)
    return results[0]
