"""Planner speed: layouts evaluated per second and the wall time of a full search.

For each scenario the full `plan()` runs `REPEATS` times (median reported): enumeration of the
whole grid with pruning, the vectorised step-time and memory evaluation of every valid layout,
ranking, the scalar re-evaluation of the top 10 (simulator included when small), the §7
baseline and the explanation's alternatives.

    grid        grid points of the search space (tp × pp × cp × ep × micro-batch × schedule ×
                ZeRO/hybrid group × sp × recompute)
    evaluated   valid layouts whose step time and per-stage memory were computed
    eval rate   evaluated / time of the vectorised evaluation: wall time (large grids run
                in row blocks on up to 4 threads) and CPU time (all threads)
    e2e rate    evaluated / wall time of the whole search

Run: `python benchmarks/bench_planner.py` (a few seconds). It writes its table to
`docs/generated/bench_planner.md` (`results.write_result`), which the Accuracy page includes.

The end-to-end rate (evaluated / whole search) is lower for the small searches, where the fixed
costs (top-10 scalar re-evaluation, the §7 baseline) dominate. For scale: Calculon reports
about 300 layouts per second.
"""

from __future__ import annotations

import statistics
import sys
import time

from results import markdown_table, write_result

from shardwise.arch import ModelSpec, get_model
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _flatten, _Rejections, evaluate_candidates, plan

REPEATS = 5

GPT_530B = ModelSpec("gpt-530b", 105, 20480, 128, 128, 4 * 20480, 51200, gated_mlp=False,
                     tie_embeddings=True, norm="layernorm", dropout=True,
                     learned_positions=2048, max_seq=2048)

SCENARIOS = [
    ("Llama-3-405B, 16,384 H100, s=8192", get_model("llama3-405b"), Cluster.of(16384, "h100"),
     TrainSpec(seq_len=8192, global_batch=2048)),
    ("GPT-530B, 2,520 A100, s=2048 (2021)", GPT_530B, Cluster.of(2520, "a100"),
     TrainSpec(seq_len=2048, global_batch=2520, dtype="fp16", flash_attention=False)),
    ("GPT-530B, 2,520 A100, + FlashAttn", GPT_530B, Cluster.of(2520, "a100"),
     TrainSpec(seq_len=2048, global_batch=2520, dtype="fp16")),
    ("Llama-3-8B, 64 H100 (CLI default)", get_model("llama3-8b"), Cluster.of(64, "h100"),
     TrainSpec(seq_len=8192, global_batch=512)),
]


def cpu_rate(model: ModelSpec, cluster: Cluster, train: TrainSpec) -> float:
    """Valid layouts per CPU-second of the vectorised evaluation (best of REPEATS)."""
    cand, _ = _enumerate(model, cluster, train, SearchSpace(), _Rejections())
    n = int(cand["_valid"].sum())
    best = float("inf")
    for _ in range(REPEATS):
        start = time.process_time()
        _flatten(cand, evaluate_candidates(model, cluster, train, cand,
                                           keys=("total", "memory")))
        best = min(best, time.process_time() - start)
    return n / best


def main() -> int:
    rows = []
    worst_search = 0.0
    for name, model, cluster, train in SCENARIOS:
        runs = [plan(model, cluster, train, top=10) for _ in range(REPEATS)]
        seconds = statistics.median(r.stats.seconds for r in runs)
        rate = statistics.median(r.stats.layouts_per_s for r in runs)
        stats = runs[0].stats
        worst_search = max(worst_search, seconds)
        rows.append([name, f"{stats.grid:,}", f"{stats.evaluated:,}", f"{stats.fits:,}",
                     f"{seconds:.3f} s", f"{rate / 1e6:.2f} M/s",
                     f"{cpu_rate(model, cluster, train) / 1e6:.2f} M/s",
                     f"{stats.evaluated / seconds / 1e6:.2f} M/s",
                     f"`{runs[0].best.layout.short()}`"])
    table = markdown_table(["scenario", "grid", "evaluated", "fits", "search", "eval rate",
                            "CPU rate", "e2e rate", "best layout"], rows, "lrrrrrrrl")
    verdict = "met" if worst_search < 1.0 else "MISSED"
    text = (f"{table}\n\nMedians of {REPEATS} full searches each. Slowest full search: "
            f"{worst_search:.3f} s (target < 1 s: {verdict}).")
    print(text)
    write_result("bench_planner", text)
    return 0 if worst_search < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
