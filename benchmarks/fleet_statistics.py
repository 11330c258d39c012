"""The failure simulation (`estimate.goodput_sim`) against published fleet statistics: each
source's stated rates and assumptions written as a failure model, simulated, and compared with
the figure it reports, within that figure's own precision (half a unit of its last digit).

Source: Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research
Clusters" (Meta RSC-1/RSC-2, arXiv:2410.21680, HPCA 2025): RSC-1's failure rate r_f = 6.50
failures per 1000 node-days (8 A100 GPUs a node), its failure model MTTF = 1 / (N_nodes·r_f),
the projected MTTF of 16,384- and 131,072-GPU jobs, and its ETTR study at 12,000 GPUs
(checkpoint write and restart overhead 5 min each, checkpoints at √(2·w·MTTF)): ETTR ≈ 0.9
needs r_f ≈ 1 per 1000 node-days, or a ≈ 10 s write at RSC-1's rate. Held out, never compared:
Llama 3's 54-day snapshot (Dubey et al. 2024 §3.3.4).

Run: `python benchmarks/fleet_statistics.py` (about ten seconds). It writes
`docs/generated/fleet_statistics.md` (`results.write_result`), which
docs/accuracy/fleet.md includes; tests/estimate/test_fleet_statistics.py runs every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from shardwise.estimate.goodput_sim import DAY, HOUR, FailureClass, Fleet, Policy, simulate

KOKOLIS = "Kokolis et al. 2025 (arXiv:2410.21680), Meta RSC-1"
GPUS_PER_NODE = 8
RSC1_RATE = 6.50  # failures per 1000 node-days, RSC-1


def node_fleet(gpus: int, per_1000_node_days: float) -> Fleet:
    """A job of `gpus` GPUs on 8-GPU nodes, each failing `per_1000_node_days` times per 1000
    node-days and stopping its node (the source's failure model)."""
    mtbf_hours = 1000 / per_1000_node_days * 24
    return Fleet(gpus, (FailureClass("node", mtbf_hours, gpus_each=GPUS_PER_NODE),))


def simulated_mttf_hours(fleet: Fleet, *, failures: int, seed: int = 0) -> float:
    """Hours between the job's failures, measured on simulated runs: total time on test ÷
    failures (the exponential's estimator; the last stretch of each run is censored).
    Checkpoints and restarts cost nothing here, so the runs only count failures."""
    mttf = fleet.job_mtbf_s
    per_run = 1000
    runs = max(failures // per_run, 1)
    policy = Policy("sync", interval_s=mttf / 100, stall_s=0.0, restart_s=0.0)
    out = simulate(per_run * mttf, fleet, policy, runs=runs, seed=seed)
    return float(out.wall_s.sum() / out.interruptions.sum() / HOUR)


def simulated_ettr(fleet: Fleet, *, write_s: float, restart_s: float, runs: int,
                   days: float = 30.0, seed: int = 0) -> float:
    """Mean goodput (the source's effective training time ratio) of `days` of useful work,
    synchronous checkpoints taking `write_s` every √(2·write·MTTF) (the source's interval),
    each failure costing `restart_s` and the work since the last checkpoint."""
    interval = math.sqrt(2 * write_s * fleet.job_mtbf_s)
    policy = Policy("sync", interval_s=interval, stall_s=write_s, restart_s=restart_s)
    return float(simulate(days * DAY, fleet, policy, runs=runs, seed=seed).goodput.mean())


@dataclass(frozen=True)
class Figure:
    """One published figure: what it is, where, its value as printed (its precision is half a
    unit of the last digit printed), the unit, and the rates and assumptions simulated."""

    name: str
    source: str
    published: str
    unit: str
    assumptions: str

    @property
    def decimals(self) -> int:
        """Digits printed after the point."""
        exponent = Decimal(self.published).as_tuple().exponent
        assert isinstance(exponent, int)
        return -exponent

    @property
    def half_unit(self) -> float:
        return 0.5 * 10.0 ** -self.decimals

    def simulate(self, scale: int = 1) -> float:
        """The simulated value (`scale` multiplies the Monte Carlo effort)."""
        return SIMULATIONS[self.name](scale)

    def within(self, simulated: float) -> bool:
        return abs(simulated - float(self.published)) <= self.half_unit


FIGURES = (
    Figure("MTTF of a 16,384-GPU job", KOKOLIS + ", failure model's projected MTTF", "1.8",
           "h", "2,048 nodes at r_f = 6.50 / 1000 node-days; a node failure stops the job"),
    Figure("MTTF of a 131,072-GPU job", KOKOLIS + ", failure model's projected MTTF",
           "0.23", "h", "16,384 nodes at r_f = 6.50 / 1000 node-days"),
    Figure("ETTR at 12,000 GPUs, r_f = 1 / 1000 node-days", KOKOLIS + ", ETTR estimate",
           "0.9", "", "1,500 nodes; 5-min checkpoint write and restart; checkpoints every "
           "√(2·w·MTTF)"),
    Figure("ETTR at 12,000 GPUs, 10 s checkpoint write", KOKOLIS + ", ETTR estimate", "0.9",
           "", "1,500 nodes at r_f = 6.50; 10 s write, 5-min restart; every √(2·w·MTTF)"),
)

SIMULATIONS = {
    "MTTF of a 16,384-GPU job":
        lambda k: simulated_mttf_hours(node_fleet(16_384, RSC1_RATE), failures=200_000 * k),
    "MTTF of a 131,072-GPU job":
        lambda k: simulated_mttf_hours(node_fleet(131_072, RSC1_RATE), failures=2_000_000 * k),
    "ETTR at 12,000 GPUs, r_f = 1 / 1000 node-days":
        lambda k: simulated_ettr(node_fleet(12_000, 1.0), write_s=300, restart_s=300,
                                 runs=100 * k),
    "ETTR at 12,000 GPUs, 10 s checkpoint write":
        lambda k: simulated_ettr(node_fleet(12_000, RSC1_RATE), write_s=10, restart_s=300,
                                 runs=100 * k),
}


def main() -> None:
    from results import markdown_table, write_result

    rows = []
    for figure in FIGURES:
        simulated = figure.simulate(scale=2)
        digits = figure.decimals + 2
        rows.append([figure.name, figure.source, figure.assumptions,
                     f"{figure.published} {figure.unit}".strip(),
                     f"{simulated:.{digits}f} {figure.unit}".strip(),
                     "yes" if figure.within(simulated) else "**no**"])
        print(rows[-1])
    table = markdown_table(["figure", "source", "stated rates and assumptions (the failure "
                            "model simulated)", "published", "simulated", "within precision?"],
                           rows, align="lllrrl")
    write_result("fleet_statistics", "Each row: the source's stated rates as a failure model "
                 "(`estimate.goodput_sim`), simulated; *within precision* means within half a "
                 f"unit of the last digit the source printed.\n\n{table}")


if __name__ == "__main__":
    main()
