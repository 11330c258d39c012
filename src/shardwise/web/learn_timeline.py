"""`/api/learn/run-timeline`: the "A run's timeline" explainer's data. One seeded simulated
run (`estimate.goodput_sim.timeline`: its training windows, checkpoints, failures, restarts
and the work redone) under the chosen checkpoint policy, and every policy's goodput over many
runs (`estimate.goodput_sim.policies`). The page only scales and draws these numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel

from shardwise.estimate.goodput import DEFAULT_MTBF_GPU_HOURS
from shardwise.estimate.goodput_sim import (
    DAY,
    FailureClass,
    Fleet,
    policies,
    policy_options,
    timeline,
)

router = APIRouter(tags=["learn"])
POLICY_NAMES = ("synchronous", "asynchronous", "in-memory", "elastic")
RUNS = 200  # runs per policy for the goodput table


@dataclass(frozen=True)
class Checkpointing:
    """What `goodput_sim.policy_options` reads of a layout's `Goodput`: seconds to copy the
    state to host memory, to write it to storage, and to restart."""

    copy_s: float
    write_s: float
    restart_s: float
    async_checkpoint: bool = False


class Failure(BaseModel):
    """One failure of the drawn run."""

    t: float  # seconds from the start
    cls: str
    recovery: str  # "storage", "memory" or "elastic"
    lost_s: float  # work redone (rolled back to storage included)
    restart_s: float  # detection, waiting for spares and restart after it


class PolicyGoodput(BaseModel):
    """One policy's goodput over the simulated runs, and its checkpoint interval."""

    name: str
    mean: float  # goodput against a straggler-free run
    p10: float
    p90: float
    interval_s: float


class RunTimeline(BaseModel):
    """One run's events (seconds) and every policy's goodput distribution."""

    gpus: int
    job_mtbf_s: float
    policy: str
    seed: int
    work_s: float  # useful training, straggler-free
    wall_s: float
    goodput: float  # work_s / wall_s
    interruptions: int
    lost_s: float
    interval_s: float
    stall_s: float
    straggler_factor: float
    straggler_share: float  # of each training window spent waiting for the slowest rank
    work: list[list[float]]  # [start, end] windows of training
    checkpoints: list[float]  # when each checkpoint finished
    restarts: list[list[float]]
    lost: list[list[float]]  # [last durable checkpoint, failure]: redone
    failures: list[Failure]
    policies: list[PolicyGoodput]
    best: str


@router.get("/run-timeline", response_model=RunTimeline)
def run_timeline(
    gpus: int = Query(16384, ge=8, le=131_072, description="GPUs in the job"),
    mtbf_gpu_hours: float = Query(DEFAULT_MTBF_GPU_HOURS, ge=1000, le=1e7,
                                  description="GPU-hours between failures per GPU"),
    host_mtbf_hours: float = Query(0, ge=0, le=1e7, description="hours between failures of "
                                   "one 8-GPU host (0: hosts never fail)"),
    days: float = Query(2, ge=0.25, le=14, description="days of useful training"),
    write_s: float = Query(60, ge=1, le=3600, description="seconds to write a checkpoint"),
    copy_s: float = Query(5, ge=0.1, le=600, description="seconds to copy it to host memory"),
    restart_min: float = Query(10, ge=0, le=120, description="minutes to restart"),
    straggler: float = Query(1.05, ge=1, le=2, description="slowest rank's step ÷ nominal"),
    policy: Literal[POLICY_NAMES] = "synchronous",  # type: ignore[valid-type]
    seed: int = Query(0, ge=0, le=10**6, description="the simulated run drawn"),
) -> RunTimeline:
    """One seeded run of `days` of useful training on `gpus` GPUs under `policy`, and each
    policy's goodput over 200 runs."""
    classes = [FailureClass("gpu", mtbf_gpu_hours)]
    if host_mtbf_hours:
        classes.append(FailureClass("host", host_mtbf_hours, gpus_each=8))
    fleet = Fleet(gpus, tuple(classes))
    saving = Checkpointing(min(copy_s, write_s), write_s, restart_min * 60)
    options = policy_options(saving, replica_gpus=gpus // 8)
    run = timeline(days * DAY, fleet, options[policy], seed=seed, straggler=straggler)
    table = policies(saving, fleet, replica_gpus=gpus // 8, work_s=days * DAY, runs=RUNS,
                     seed=seed, straggler=straggler)
    rows = [PolicyGoodput(name=name, interval_s=row["interval_s"],
                          **{k: row["goodput_vs_ideal"][k] for k in ("mean", "p10", "p90")})
            for name, row in table["policies"].items()]
    failures = [Failure(cls=f.pop("class"), **f) for f in run.pop("failures")]
    run.pop("policy"), run.pop("elastic")
    return RunTimeline(gpus=gpus, job_mtbf_s=fleet.job_mtbf_s, policy=policy, seed=seed,
                       failures=failures, policies=rows, best=table["best"], **run)
