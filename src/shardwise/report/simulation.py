"""`plan --failure-model FILE --simulate N`: the chosen layout's run simulated under a fleet's
failures, each checkpoint policy compared (`estimate.goodput_sim.policies`), and the slowest
rank's cost (`--stragglers`: a `shardwise train --json` run). With `--rank-by goodput` the
shown rows are re-ranked by their simulated mean effective step time (`simulated_ranking`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

import shardwise.validate as validate
from shardwise.estimate.goodput_sim import (
    Fleet,
    load_failure_model,
    measured_stragglers,
    planned_policy,
    policies,
    policy_options,
    simulate,
    stragglers_factor,
)

DEFAULT_RUNS = 200
DEFAULT_DAYS = 30.0  # the useful training simulated without a token budget


def simulation_payload(result: Any, failure_model: str, *, runs: int | None = None,
                       tokens: float | None = None, stragglers: str | None = None
                       ) -> dict[str, Any]:
    """The recommended layout (`result.recommended`) trained for `tokens` (else 30 days of
    useful work) under `failure_model`'s fleet, `runs` times per policy; the policy that gains
    most."""
    entry = result.recommended
    if entry.goodput is None:
        return {"error": "no goodput for this layout"}
    runs = validate.integer(DEFAULT_RUNS if runs is None else runs, "--simulate", low=10,
                            high=100_000)
    layout = entry.layout
    fleet, _ = load_failure_model(failure_model, layout.world_size)
    factor, measured = 1.0, None
    if stragglers:
        samples, ranks = measured_stragglers(stragglers)
        factor = stragglers_factor(samples, layout.world_size / ranks)
        measured = {"file": stragglers, "steps": int(samples.size), "ranks": ranks}
    work = entry.estimate.time_to_train(tokens) if tokens else DEFAULT_DAYS * 86400
    replica = layout.world_size // layout.dp
    out = policies(entry.goodput, fleet, replica_gpus=replica, work_s=work, runs=runs,
                   straggler=factor)
    if result.rank_by == "goodput":
        out["ranking"] = simulated_ranking(result.ranked, fleet, work_s=work, runs=runs,
                                           straggler=factor)
    return out | {"layout": layout.short(), "failure_model": failure_model,
                  "stragglers": measured, "tokens": tokens,
                  "sentence": simulation_sentence(out)}


def simulated_ranking(entries: Any, fleet: Fleet, *, work_s: float, runs: int,
                      straggler: float = 1.0, seed: int = 0) -> list[dict[str, Any]]:
    """The plan's shown rows (`PlanEntry`s with goodput) re-ranked by the simulated mean
    effective step time — step × straggler ÷ mean simulated goodput, each row's planned policy
    under `fleet` — with its p10–p90 over runs (step × straggler ÷ each run's goodput) and the
    closed form's figure and rank beside it."""
    rows = []
    for entry in entries:
        if entry.goodput is None:
            continue
        g = entry.goodput
        policy = policy_options(g, entry.layout.world_size // entry.layout.dp)[planned_policy(g)]
        out = simulate(work_s * straggler, fleet.with_gpus(entry.layout.world_size), policy,
                       runs=runs, seed=seed)
        step = g.step_s * straggler
        effective = step / out.goodput  # per run, seconds
        p10, p90 = np.quantile(effective, [0.1, 0.9])
        rows.append({"layout": entry.layout.short(), "closed_rank": entry.rank,
                     "step_s": g.step_s, "closed_effective_step_s": g.effective_step_s,
                     "goodput_mean": float(out.goodput.mean()),
                     "effective_step_s": step / float(out.goodput.mean()),
                     "p10": float(p10), "p90": float(p90),
                     "policy": planned_policy(g)})
    rows.sort(key=lambda row: row["effective_step_s"])
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return rows


def simulation_sentence(out: dict[str, Any]) -> str:
    """What the simulation recommends, in one sentence."""
    rows, best, planned = out["policies"], out["best"], out["planned"]
    mean = rows[best]["goodput_vs_ideal"]["mean"]
    if best == planned:
        return (f"Simulated over {out['runs']} runs, {planned} checkpoints are already the best "
                f"policy here ({mean:.1%} goodput).")
    interval = rows[best]["interval_s"]
    every = f"{interval:.0f} s" if interval < 120 else f"{interval / 60:.0f} min"
    return (f"Simulated over {out['runs']} runs: {best} checkpoints every "
            f"{every} would gain {out['gain'] * 100:+.1f} "
            f"points of goodput ({mean:.1%} against "
            f"{rows[planned]['goodput_vs_ideal']['mean']:.1%} {planned}).")


def render_simulation(out: dict[str, Any], console: Console) -> None:
    """The policies' goodput distributions, days and interruptions as a table."""
    table = Table(title=f"Goodput simulated ({out['runs']} runs per policy, job MTBF "
                        f"{out['job_mtbf_hours']:.2f} h"
                        + (f", slowest rank ×{out['straggler_factor']:.3f}"
                           if out["straggler_factor"] != 1 else "") + ")")
    for column in ("policy", "goodput mean", "p10 – p90", "days (median)",
                   "interruptions", "lost work h"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, row in out["policies"].items():
        g = row["goodput_vs_ideal"]
        mark = " (planned)" if name == out["planned"] else ""
        table.add_row(name + mark, f"{g['mean']:.1%}", f"{g['p10']:.1%} – {g['p90']:.1%}",
                      f"{row['days']['median']:.1f}", f"{row['interruptions']['median']:.0f}",
                      f"{row['lost_hours']['median']:.1f}")
    console.print(table)
    console.print(out["sentence"])
    if out.get("ranking"):
        render_ranking(out, console)


def render_ranking(out: dict[str, Any], console: Console) -> None:
    """The shown rows re-ranked by the simulated mean effective step time."""
    table = Table(title="Rows re-ranked by the simulated mean effective step time (step ÷ "
                        f"mean simulated goodput, {out['runs']} runs each, its planned "
                        "policy); the table above ranks by the closed form")
    for column in ("#", "layout", "effective step", "p10 – p90", "closed form (rank)"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for row in out["ranking"]:
        table.add_row(str(row["rank"]), row["layout"], f"{row['effective_step_s']:.3f} s",
                      f"{row['p10']:.3f} – {row['p90']:.3f} s",
                      f"{row['closed_effective_step_s']:.3f} s ({row['closed_rank']})")
    console.print(table)
