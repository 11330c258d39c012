"""Goodput: what failures, checkpoints and restarts cost a run (docs/concepts/goodput.md).

    M = H / N                       job MTBF: H GPU-hours between failures per GPU, N GPUs
    w = rank bytes / host link + node bytes / node bandwidth      checkpoint write
    δ = w (synchronous) or the host copy (asynchronous, durable L = w − δ later)
    τ = Daly (2006, eq. 37): √(2δM)·[1 + ⅓√(δ/2M) + ⅑·δ/2M] − δ      (Young 1974: √(2δM))
    T_w / T_s = (M/τ)·e^((R + L)/M)·(e^((τ + δ)/M) − 1),    goodput g = T_s / T_w

What each stack saves and who writes it (`CHECKPOINTS`), the split of the lost wall time into
checkpoints, restarts and lost work, and the sources: the concept page's "The model" section.
The simulated counterpart (component classes, policies, stragglers) is `goodput_sim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import (
    bytes_per_param_training,
    candidate_stages,
    placement_of,
    stage_param_counts,
)
from shardwise.hardware import LINKS, Accelerator, Cluster, Link
from shardwise.layout import Layout, Partition, TrainSpec
from shardwise.placement import expert_tp_degree

__all__ = ["CHECKPOINTS", "DEFAULT_CHECKPOINT_BANDWIDTH", "DEFAULT_MTBF_GPU_HOURS",
           "DEFAULT_RESTART_S", "MIN_GOODPUT", "RANK_BY", "CheckpointFormat", "Goodput",
           "Reliability",
           "checkpoint_bytes", "checkpoint_bytes_per_param", "checkpoint_format",
           "checkpoint_timing", "checkpoint_writes", "daly_interval", "estimate_goodput",
           "host_link", "interval_curve", "no_progress", "wall_per_useful", "young_interval"]

HOUR = 3600.0
# Llama 3 (Dubey et al. 2024, arXiv:2407.21783) §3.3.4: 419 unexpected interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs (466 with the 47 planned ones).
LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 16_384, 54, 419
DEFAULT_MTBF_GPU_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS  # 50,677
"""GPU-hours between job-interrupting failures per GPU: Llama 3's 16,384 GPUs × 54 days ÷ 419
unexpected interruptions (a failure every 3.09 h on 16,384 GPUs, 7.76 a day)."""
# Llama 3 §3.3.1: the Tectonic file system sustains 2 TB/s (7 TB/s peak), shared by the
# 2,048 eight-GPU servers of a 16,384-GPU job writing a checkpoint at once.
DEFAULT_CHECKPOINT_BANDWIDTH = 2e12 / (LLAMA3_GPUS / 8)
"""Bytes/s one node writes to storage: 2 TB/s ÷ 2,048 nodes = 0.98 GB/s."""
DEFAULT_RESTART_S = 600.0
"""Seconds from a failure to training again (detect, reschedule, reload): an assumption of 10
minutes. Llama 3's "more than 90 % effective training time" over 466 interruptions in 54 days
bounds everything one interruption costs, restart and lost work together, at 16.7 minutes."""
MIN_GOODPUT = 1e-6  # below it a job makes no useful progress: refused with one line
RANK_BY = ("step", "goodput")
"""What a plan can rank by (`plan.rank`, `PlanEntry.figure`): the step time, or the effective
step time, step ÷ goodput."""
# NVIDIA GH200 / GB200 datasheets: NVLink-C2C, 900 GB/s between CPU and GPU (both directions)
NVLINK_C2C = Link("nvlink-c2c", 450e9, 2e-6)
_HOST_LINKS = {"a100": LINKS["pcie4"], "gh200": NVLINK_C2C, "gb200": NVLINK_C2C}


def host_link(accelerator: Accelerator) -> Link:
    """The link a checkpoint's device→host copy crosses: PCIe 4 x16 on A100 boards, NVLink-C2C
    on Grace Hopper / Grace Blackwell, PCIe 5 x16 on the others (HGX H100/H200/B200, MI300X)."""
    name = accelerator.calibration_name.lower()
    return next((link for prefix, link in _HOST_LINKS.items() if name.startswith(prefix)),
                LINKS["pcie5"])


# ------------------------------------------------------------------------- what a stack saves
@dataclass(frozen=True)
class CheckpointFormat:
    """What a stack's checkpoint holds and which ranks write it.

    `model_copy_at`: the ZeRO stages at which it saves the weights in their training dtype
    beside the fp32 master copy (with fp32 weights there is no separate master and the weights
    are always saved). `writers`: "spread" — each replicated tensor is written once, by one of
    the ranks holding it, the writes balanced over them; "dp0" — each model-parallel group's
    data-parallel rank 0 writes the module, every rank its optimizer partition; "rank0" —
    global rank 0 gathers and writes everything. `async_option`: how the stack turns on
    asynchronous saving (None: it cannot).
    """

    title: str
    model_copy_at: tuple[int, ...]
    writers: str
    async_option: str | None
    source: str


CHECKPOINTS: dict[str, CheckpointFormat] = {
    "megatron-te": CheckpointFormat(
        "Megatron-LM distributed checkpoint (torch_dist)", (0, 1, 2, 3), "spread",
        "--async-save",
        "megatron-core 0.16.1 optimizer/distrib_optimizer.py _get_main_param_and_optimizer_"
        "states (fp32 main param, exp_avg, exp_avg_sq per parameter) beside the module's bf16 "
        "weights; dist_checkpointing/strategies/fully_parallel.py (each replicated shard "
        "written by one rank of the DP group, balanced; Megatron-LM "
        "CheckpointConfig.fully_parallel_save defaults on)"),
    "megatron-deepspeed": CheckpointFormat(
        "DeepSpeed checkpoint (module + ZeRO partitions)", (0, 1, 2), "dp0", None,
        "DeepSpeed 0.19.8 runtime/engine.py _configure_checkpointing (the module file "
        "mp_rank_*_model_states.pt from the data-parallel writer, rank 0; ZeRO partitions "
        "zero_pp_rank_*_optim_states.pt, fp32 master + moments, from every rank; ZeRO-3 saves "
        "no gathered 16-bit module); bf16 without ZeRO runs BF16_Optimizer, partitioned"),
    "torchtitan": CheckpointFormat(
        "torchtitan DCP checkpoint", (), "spread", "checkpoint.async_mode",
        "torchtitan 0.3.0 components/checkpointer/dcp.py (model: FSDP2's sharded fp32 "
        "parameters, bf16 only computes; optimizer exp_avg, exp_avg_sq, step); torch "
        "distributed/checkpoint/_dedup_save_plans.py (a replicated tensor is written by the "
        "rank with the least planned so far)"),
    "hf-sdpa": CheckpointFormat(
        "Hugging Face Trainer checkpoint", (), "rank0", None,
        "transformers 5.24.0 Trainer._save_checkpoint (the fp32 model and optimizer.pt from "
        "the process that should_save, rank 0; accelerate's FSDP default, fsdp_version 1 with "
        "FULL_STATE_DICT, gathers to rank 0)"),
    "shardwise": CheckpointFormat(
        "shardwise runtime checkpoint (DCP)", (0, 1, 2, 3), "spread", None,
        "shardwise.runtime.checkpoint (model.* in the run's dtype, optim.*.master fp32 under "
        "mixed precision, exp_avg, exp_avg_sq; DCP writes each replicated chunk once)"),
}
CHECKPOINTS["hf-eager"] = CHECKPOINTS["hf-sdpa"]
# the same DCP save and checkpoint.async_mode (components/checkpoint.py, torchtitan v0.1.0)
CHECKPOINTS["torchtitan@0.1.0"] = CHECKPOINTS["torchtitan"]
# GPT-NeoX saves through DeepSpeed's engine (megatron/checkpointing.py save_ds_checkpoint →
# model.save_checkpoint, gpt-neox ea7aefd)
CHECKPOINTS["gpt-neox"] = CHECKPOINTS["megatron-deepspeed"]
CHECKPOINTS["pytorch-fsdp"] = CheckpointFormat(
    "PyTorch FSDP sharded checkpoint (DCP)", (), "spread", None,
    "torch.distributed.checkpoint with FSDP's SHARDED_STATE_DICT (llm-foundry/Composer's "
    "and fms-fsdp's sharded checkpoints): the fp32 parameters and moments, each rank its shard")


def checkpoint_format(train: TrainSpec) -> CheckpointFormat:
    """The checkpoint format of `train`'s stack (`TrainSpec.impl`)."""
    try:
        return CHECKPOINTS[train.impl]
    except KeyError:
        raise ShardwiseError(f"no checkpoint format is modelled for stack {train.impl!r}; "
                             f"modelled: {', '.join(CHECKPOINTS)}") from None


def _per_param(train: TrainSpec, zero: Any) -> tuple[Any, float]:
    """(bytes per parameter of the weights saved beside the master, of the optimizer state:
    fp32 master + moments), for ZeRO stage(s) `zero`."""
    state = bytes_per_param_training(train.dtype, train.grad_dtype, train.optimizer)
    kept = np.isin(zero, checkpoint_format(train).model_copy_at) | (state.master == 0)
    return np.where(kept, state.weight, 0.0) + 0.0 * np.asarray(zero), state.optimizer


def checkpoint_bytes_per_param(train: TrainSpec, zero: int = 1) -> float:
    """Bytes per parameter of `train`'s stack's checkpoint (`CHECKPOINTS`): the fp32 master
    and the optimizer moments, plus the weights in their training dtype where the stack saves
    them too. bf16 Adam: 2 + 4 + 8 = 14 (Megatron, DeepSpeed below ZeRO-3, shardwise), 4 + 8 =
    12 (torchtitan, Hugging Face: the fp32 weights are the master)."""
    weights, optimizer = _per_param(train, zero)
    return float(weights) + optimizer


def checkpoint_bytes(model: ModelSpec, train: TrainSpec, zero: int = 1) -> float:
    """Bytes of one whole checkpoint, every replica written once: `P · checkpoint_bytes_per_
    param` (the stack's few non-parameter tensors — RNG, step counters — not counted)."""
    return model.count_params().total * checkpoint_bytes_per_param(train, zero)


def checkpoint_writes(model: ModelSpec, gpus_per_node: int, train: TrainSpec, *, tp: Any,
                      pp: Any, dp: Any, cp: Any, ep: Any, zero: Any, chunks: Any,
                      etp: Any = 0, partition: Partition = (), schedule: Any = 1,
                      **_: Any) -> tuple[Any, Any]:
    """(bytes the busiest rank writes, bytes the busiest node writes) per checkpoint, for one
    layout or arrays of layouts (`Layout.codes()` names).

    A rank of pipeline stage `i` holds `D` dense and `E` expert parameters
    (`memory.stage_param_counts`). "spread": the stage's dense state is spread over its
    `dp·cp` replicas, the experts' over the `tp·dp·cp/(etp·ep)` ranks sharing them, so a rank
    writes `(D/(dp·cp) + E·etp·ep/(tp·dp·cp))·b`. "dp0": data-parallel rank 0 writes the module
    `(D + E)·b_w` and every rank its optimizer partition `(D + E)·b_o/(dp·cp)` (the whole
    optimizer from rank 0 when it is not partitioned: ZeRO-0 without bf16). "rank0": rank 0
    writes the whole checkpoint. A node holds `gpus_per_node` ranks (tp fastest,
    `placement`); under "dp0" `min(gpus_per_node, tp·cp)` of them are data-parallel rank 0.
    The busiest stage of `memory.candidate_stages` counts.
    """
    fmt = checkpoint_format(train)
    weights, optimizer = _per_param(train, zero)
    per_node = np.minimum(gpus_per_node, tp * pp * dp * cp)
    if fmt.writers == "rank0":
        whole = model.count_params().total * (weights + optimizer) + 0.0 * tp
        return whole, whole
    replicas = dp * cp
    rank, node = 0.0 * tp, 0.0 * tp
    for stage in candidate_stages(model, pp):
        dense, expert = stage_param_counts(model, tp=tp, pp=pp, ep=ep, chunks=chunks,
                                           stage=stage, partition=partition, etp=etp,
                                           placement=placement_of(schedule, partition))
        if fmt.writers == "spread":
            sharing = np.maximum(tp * replicas // (expert_tp_degree(etp, tp) * ep), 1)
            mine = (dense / replicas + expert / sharing) * (weights + optimizer)
            here = per_node * mine
        else:  # "dp0"
            held = dense + expert
            partitioned = (zero >= 1) | (train.dtype == "bf16")
            shard = np.where(partitioned, held * optimizer / replicas, 0.0)
            module = held * (weights + np.where(partitioned, 0.0, optimizer))
            mine = module + shard
            here = per_node * shard + np.minimum(per_node, tp * cp) * module
        rank, node = np.maximum(rank, mine), np.maximum(node, here)
    return rank, node


# ------------------------------------------------------------------------------ the inputs
@dataclass(frozen=True)
class Reliability:
    """The failure and checkpoint inputs: per-GPU MTBF (GPU-hours between job-interrupting
    failures), each node's write bandwidth to storage (bytes/s), the restart's cost (seconds:
    detect, reschedule, reload) and whether checkpoints are asynchronous (only the
    device→host copy stalls training). Defaults: `DEFAULT_*` (published fleet figures)."""

    mtbf_gpu_hours: float = DEFAULT_MTBF_GPU_HOURS
    checkpoint_bandwidth: float = DEFAULT_CHECKPOINT_BANDWIDTH
    restart_s: float = DEFAULT_RESTART_S
    async_checkpoint: bool = False

    def validate(self) -> Reliability:
        validate.finite(self.mtbf_gpu_hours, "mtbf_gpu_hours (GPU-hours)", low=0, low_open=True,
                        high=1e12)
        validate.finite(self.checkpoint_bandwidth, "checkpoint_bandwidth (bytes/s per node)",
                        low=0, low_open=True, high=1e15)
        validate.finite(self.restart_s, "restart_s (seconds)", low=0, high=1e8)
        if not isinstance(self.async_checkpoint, bool):
            raise ShardwiseError(f"async_checkpoint must be true or false, got "
                                 f"{self.async_checkpoint!r}")
        return self

    def check_stack(self, train: TrainSpec) -> None:
        """An asynchronous checkpoint needs a stack that has one (`CheckpointFormat`)."""
        if self.async_checkpoint and checkpoint_format(train).async_option is None:
            able = [f"{name} ({fmt.async_option})" for name, fmt in CHECKPOINTS.items()
                    if fmt.async_option]
            raise ShardwiseError(f"stack {train.impl} saves checkpoints synchronously only; "
                                 f"asynchronous checkpoints: {', '.join(able)}")

    def to_dict(self) -> dict[str, Any]:
        return {"mtbf_gpu_hours": self.mtbf_gpu_hours,
                "checkpoint_bandwidth": self.checkpoint_bandwidth, "restart_s": self.restart_s,
                "async_checkpoint": self.async_checkpoint}


# ---------------------------------------------------------------------------- the formulas
def young_interval(stall: Any, mtbf: Any) -> Any:
    """Young (1974): `τ = √(2·δ·M)` seconds of work between checkpoints."""
    return np.sqrt(2 * stall * mtbf)


def daly_interval(stall: Any, mtbf: Any) -> Any:
    """Daly (2006, eq. 37): `τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·δ/2M] − δ` for `δ < 2M`, else
    `M` (numbers or arrays). Daly's examples (δ = 5 min, R = 10 min): M = 24 h → 117 min,
    6 h → 57 min, 15 min → 9.1 min."""
    x = stall / (2 * mtbf)
    return np.where(x < 1, young_interval(stall, mtbf) * (1 + np.sqrt(x) / 3 + x / 9) - stall,
                    mtbf)


def wall_per_useful(interval: Any, stall: Any, mtbf: Any, restart: Any, lag: Any = 0.0
                    ) -> Any:
    """Daly's complete model: wall-clock seconds per second of useful work,
    `(M/τ)·e^((R+L)/M)·(e^((τ+δ)/M) − 1)`, evaluated in logarithms (no overflow: a job that
    cannot progress gives inf)."""
    x = (interval + stall) / mtbf
    log_growth = np.where(x < 30, np.log(np.expm1(np.minimum(x, 30))), x)  # ln(e^x − 1)
    with np.errstate(over="ignore"):
        return np.exp(np.log(mtbf / interval) + (restart + lag) / mtbf + log_growth)


def checkpoint_timing(model: ModelSpec, cluster: Cluster, train: TrainSpec,
                      reliability: Reliability, **layout: Any) -> dict[str, Any]:
    """Every figure of the goodput model for one layout or arrays of layouts (`layout`:
    `Layout.codes()` names and `partition`): rank and node bytes, copy, write, stall and lag
    seconds, job MTBF, Young's and Daly's intervals, the interval used, wall per useful
    second, goodput and the shares of wall time lost to checkpoints, restarts and lost work."""
    rank, node = checkpoint_writes(model, cluster.gpus_per_node, train, **layout)
    copy = rank / host_link(cluster.accelerator).bandwidth
    write = copy + node / reliability.checkpoint_bandwidth
    stall = copy if reliability.async_checkpoint else write
    lag = write - stall
    gpus = layout["tp"] * layout["pp"] * layout["dp"] * layout["cp"]
    mtbf = reliability.mtbf_gpu_hours * HOUR / gpus
    restart = reliability.restart_s
    interval = np.maximum(daly_interval(stall, mtbf), lag)
    ratio = wall_per_useful(interval, stall, mtbf, restart, lag)
    goodput = 1 / ratio
    # checkpoints take g·δ/τ of the wall time; the rest of the loss, what interruptions cost,
    # splits in proportion to the logs of the restart factor and the rework factor
    checkpoint = goodput * stall / interval
    restarts = restart / mtbf
    rework = np.maximum(np.log(ratio) - np.log1p(stall / interval) - restarts, 0.0)
    interrupted = 1 - goodput - checkpoint
    with np.errstate(invalid="ignore", divide="ignore"):
        part = np.where(restarts + rework > 0, restarts / (restarts + rework), 0.0)
    shares = {"checkpoint": checkpoint, "restart": interrupted * part,
              "lost work": interrupted * (1 - part)}
    return {"rank_bytes": rank, "node_bytes": node, "copy_s": copy, "write_s": write,
            "stall_s": stall, "lag_s": lag, "job_mtbf_s": mtbf, "restart_s": restart,
            "young_interval_s": young_interval(stall, mtbf),
            "daly_interval_s": daly_interval(stall, mtbf), "interval_s": interval,
            "wall_per_useful": ratio, "goodput": goodput, "shares": shares}


def interval_curve(stall: float, mtbf: float, restart: float, lag: float = 0.0,
                   points: int = 121) -> dict[str, Any]:
    """Wall seconds lost per useful second against the checkpoint interval τ (`points`
    log-spaced intervals from `δ/10`, at least `L`, to `M`): checkpoints `δ/τ`, restarts (the
    factor `e^(R/M)`), lost work (the rest: `(1 + δ/τ)·(rework factor − 1)`) and their total
    `T_w/T_s − 1`; the total's minimum on the grid, Young's and Daly's intervals and the total
    at Daly's: the "how often to checkpoint" explainer's curve."""
    for value, name in ((stall, "stall"), (mtbf, "mtbf")):
        validate.positive(value, name)
    validate.finite(restart, "restart", low=0)
    validate.finite(lag, "lag", low=0)
    low = max(stall / 10, lag, 1e-9)
    taus = np.geomspace(low, max(mtbf, 10 * low), points)
    ratio = wall_per_useful(taus, stall, mtbf, restart, lag)
    checkpoint = stall / taus  # per useful second: the factor 1 + δ/τ
    restarts = ratio * -np.expm1(-restart / mtbf)  # the factor e^(R/M)
    lost = ratio - 1 - checkpoint - restarts  # (1 + δ/τ)·(rework factor − 1)
    best = int(np.argmin(ratio))
    daly = float(np.maximum(daly_interval(stall, mtbf), lag))
    return {"interval_s": taus.tolist(), "checkpoint": checkpoint.tolist(),
            "restart": restarts.tolist(), "lost": lost.tolist(), "total": (ratio - 1).tolist(),
            "best_interval_s": float(taus[best]), "best_total": float(ratio[best] - 1),
            "young_interval_s": float(young_interval(stall, mtbf)), "daly_interval_s": daly,
            "daly_total": float(wall_per_useful(daly, stall, mtbf, restart, lag) - 1)}


# --------------------------------------------------------------------------- one layout
@dataclass(frozen=True)
class Goodput:
    """One layout's goodput (module docstring): seconds, bytes, fractions; `shares` of wall
    time lost to "checkpoint", "restart" and "lost work"."""

    stack: str
    gpus: int
    mtbf_gpu_hours: float
    job_mtbf_s: float
    checkpoint_bytes: float
    bytes_per_param: float
    rank_bytes: float
    node_bytes: float
    node_bandwidth: float
    host_link: str
    copy_s: float
    write_s: float
    stall_s: float
    lag_s: float
    restart_s: float
    young_interval_s: float
    daly_interval_s: float
    interval_s: float
    step_s: float
    goodput: float
    shares: dict[str, float]
    async_checkpoint: bool

    @property
    def every_steps(self) -> int:
        """The interval in whole optimizer steps (at least one)."""
        return max(1, round(self.interval_s / self.step_s))

    @property
    def interruptions_per_day(self) -> float:
        """Interruptions per day of wall-clock time: `86,400 / M`."""
        return 86400 / self.job_mtbf_s

    @property
    def lost_per_interruption_s(self) -> float:
        """Wall time each interruption costs (restart and lost work): `M·(1 − g·(1 + δ/τ))`,
        to first order `(τ + δ)/2 + L + R`."""
        return self.job_mtbf_s * (self.shares["restart"] + self.shares["lost work"])

    @property
    def effective_step_s(self) -> float:
        """Wall time per step, failures and checkpoints included: step ÷ goodput."""
        return self.step_s / self.goodput

    @property
    def dominant(self) -> str:
        """What costs the most wall time: "checkpoint", "restart" or "lost work"."""
        return max(self.shares, key=lambda k: self.shares[k])

    def budget(self, useful_s: float) -> dict[str, float]:
        """For `useful_s` seconds of failure-free training: wall seconds, days and expected
        interruptions (`T_w = T_s / goodput`, `T_w / M`)."""
        wall = useful_s / self.goodput
        return {"seconds": wall, "days": wall / 86400,
                "expected_interruptions": wall / self.job_mtbf_s}

    def to_dict(self) -> dict[str, Any]:
        return {"stack": self.stack, "gpus": self.gpus, "mtbf_gpu_hours": self.mtbf_gpu_hours,
                "job_mtbf_hours": self.job_mtbf_s / HOUR,
                "interruptions_per_day": self.interruptions_per_day,
                "checkpoint_bytes": self.checkpoint_bytes,
                "bytes_per_param": self.bytes_per_param,
                "checkpoint_rank_bytes": self.rank_bytes,
                "checkpoint_node_bytes": self.node_bytes,
                "checkpoint_bandwidth": self.node_bandwidth, "host_link": self.host_link,
                "checkpoint_copy_s": self.copy_s, "checkpoint_write_s": self.write_s,
                "checkpoint_stall_s": self.stall_s, "durability_lag_s": self.lag_s,
                "restart_s": self.restart_s, "young_interval_s": self.young_interval_s,
                "daly_interval_s": self.daly_interval_s,
                "checkpoint_interval_s": self.interval_s,
                "checkpoint_every_steps": self.every_steps, "step_s": self.step_s,
                "effective_step_s": self.effective_step_s, "goodput": self.goodput,
                "shares": dict(self.shares), "dominant": self.dominant,
                "lost_per_interruption_s": self.lost_per_interruption_s,
                "async_checkpoint": self.async_checkpoint}


def estimate_goodput(model: ModelSpec, cluster: Cluster, layout: Layout, train: TrainSpec,
                     step_s: float, reliability: Reliability | None = None) -> Goodput:
    """The goodput of `layout` (whose step takes `step_s` seconds) on `cluster`
    (`checkpoint_timing` for one layout). Raises `ShardwiseError` when failures come too fast
    for any progress (goodput under `MIN_GOODPUT`)."""
    rel = (reliability or Reliability()).validate()
    rel.check_stack(train)
    validate.positive(step_s, "step_s")
    t = checkpoint_timing(model, cluster, train, rel, **layout.codes(),
                          partition=layout.partition)
    if not t["goodput"] >= MIN_GOODPUT:
        raise ShardwiseError(no_progress(float(t["job_mtbf_s"]), layout.world_size, rel,
                                         float(t["stall_s"])))
    return Goodput(
        stack=train.impl, gpus=layout.world_size, mtbf_gpu_hours=rel.mtbf_gpu_hours,
        job_mtbf_s=float(t["job_mtbf_s"]), checkpoint_bytes=checkpoint_bytes(
            model, train, layout.zero),
        bytes_per_param=checkpoint_bytes_per_param(train, layout.zero),
        rank_bytes=float(t["rank_bytes"]), node_bytes=float(t["node_bytes"]),
        node_bandwidth=rel.checkpoint_bandwidth, host_link=host_link(cluster.accelerator).name,
        copy_s=float(t["copy_s"]), write_s=float(t["write_s"]), stall_s=float(t["stall_s"]),
        lag_s=float(t["lag_s"]), restart_s=rel.restart_s,
        young_interval_s=float(t["young_interval_s"]),
        daly_interval_s=float(t["daly_interval_s"]), interval_s=float(t["interval_s"]),
        step_s=step_s, goodput=float(t["goodput"]),
        shares={k: float(v) for k, v in t["shares"].items()},
        async_checkpoint=rel.async_checkpoint)


def no_progress(job_mtbf_s: float, gpus: int, reliability: Reliability, stall_s: float) -> str:
    """One line for a job whose failures leave no useful time."""
    return (f"with {reliability.mtbf_gpu_hours:g} GPU-hours between failures per GPU, "
            f"{gpus:,} GPUs fail every {job_mtbf_s:.3g} s, against a {stall_s:.3g} s "
            f"checkpoint and a {reliability.restart_s:g} s restart: the job makes no "
            "progress; give a larger --mtbf-gpu-hours or fewer GPUs")

