"""Speed of the failure simulation (`estimate.goodput_sim`), and its agreement with Daly's
closed form where the closed form holds.

    a 16,384-GPU, 54-day run (Llama 3's scale; its per-GPU failure rate, 60 s synchronous
    checkpoints, 10-minute restarts) simulated 1,000 times            target < 10 s wall
    each checkpoint policy and a multi-class fleet with spares, the same run

Run: `python benchmarks/bench_goodput.py` (seconds). It writes
`docs/generated/bench_goodput.md` (`results.write_result`), which docs/accuracy includes.
"""

from __future__ import annotations

import time

from results import markdown_table, write_result

from shardwise.estimate.goodput import DEFAULT_MTBF_GPU_HOURS, wall_per_useful
from shardwise.estimate.goodput_sim import FailureClass, Fleet, Policy, simulate, single_class

GPUS, DAYS, RUNS = 16_384, 54, 1000


def timed(fleet: Fleet, policy: Policy, work: float) -> tuple[float, object]:
    start = time.perf_counter()
    out = simulate(work, fleet, policy, runs=RUNS, seed=0)
    return time.perf_counter() - start, out


def main() -> None:
    fleet = single_class(GPUS, DEFAULT_MTBF_GPU_HOURS)
    work = DAYS * 86400.0
    rows = []
    multi = Fleet(GPUS, (FailureClass("gpu", 2 * DEFAULT_MTBF_GPU_HOURS, repair_hours=72),
                         FailureClass("host", 8 * DEFAULT_MTBF_GPU_HOURS, 8, repair_hours=24),
                         FailureClass("switch", 20_000.0, 256, repair_hours=8)), spares=256)
    cases = [("synchronous (Daly's assumptions)", fleet, Policy("sync", stall_s=60.0)),
             ("asynchronous, 10 s stall, 60 s lag", fleet,
              Policy("async", stall_s=10.0, lag_s=60.0)),
             ("in-memory, storage every 10th", fleet, Policy("memory", stall_s=10.0)),
             ("elastic, 128-GPU replicas", fleet,
              Policy("sync", stall_s=60.0, elastic=True, replica_gpus=128)),
             ("GPU + host + switch classes, 256 spares", multi, Policy("sync", stall_s=60.0))]
    for name, f, policy in cases:
        seconds, out = timed(f, policy, work)
        g = out.summary["goodput"]
        closed = ""
        if f is fleet and policy.kind == "sync" and not policy.elastic:
            daly = 1 / float(wall_per_useful(out.interval_s, policy.stall_s, f.job_mtbf_s,
                                             policy.restart_s))
            closed = f"{daly:.4f}"
        rows.append([name, f"{seconds:.2f} s", f"{g['mean']:.4f}", closed,
                     f"{g['p10']:.4f} – {g['p90']:.4f}",
                     f"{out.summary['interruptions']['median']:.0f}",
                     f"{out.summary['days']['median']:.1f}"])
    table = markdown_table(["policy", f"{RUNS:,} runs", "goodput (mean)", "Daly's closed form",
                            "p10 – p90", "interruptions (median)", "days (median)"], rows)
    write_result("bench_goodput", f"A {GPUS:,}-GPU run of {DAYS} days of useful training, "
                 f"{RUNS:,} simulated runs per row (target: under 10 s each).\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
