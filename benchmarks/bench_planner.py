"""Planner speed: layouts evaluated per second and the wall time of a full search.

Each scenario runs the whole `plan()` `REPEATS` times (median): enumeration with pruning, the
vectorised evaluation of every valid layout, ranking, the scalar re-evaluation of the top 10,
the §7 baseline and the explanation. Columns: grid points, layouts evaluated, evaluation rate
(wall and CPU: large grids run in row blocks on up to 4 threads), end-to-end rate. MoE searches
(second table) prune (`shardwise.plan.prune`); each runs `MOE_REPEATS` times in a process of
its own reporting its peak resident memory; `timed` counts the step times evaluated. Targets:
dense < 1 s, MoE < 2 s and < 1.5 GB resident on a quiet 2-core machine (Calculon reports about
300 layouts/s). Run: `python benchmarks/bench_planner.py` (minutes); writes
`docs/generated/bench_planner.md`.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

from results import markdown_table, write_result

from shardwise.arch import ModelSpec, get_model
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, _enumerate, _flatten, _Rejections, evaluate_candidates, plan
from shardwise.plan.prune import PRUNE_ABOVE

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

MOE_REPEATS = 3
# (scenario, preset, GPUs, accelerator, sequence length, global batch in sequences)
MOE_SCENARIOS = [
    ("DeepSeek-V3, 2,048 H800, s=4096", "deepseek-v3", 2048, "h800", 4096, 15360),
    ("Qwen3-235B-A22B, 256 H100, s=4096", "qwen3-235b-a22b", 256, "h100", 4096, 1024),
    ("Mixtral-8x22B, 1,024 H100, s=4096", "mixtral-8x22b", 1024, "h100", 4096, 1024),
    # the largest MoE search of the presets on 16,384 GPUs (2026-12-05: most cells and step
    # times of kimi-k2, qwen3, llama4, gpt-oss, deepseek, mixtral and glm at a 16,384 batch)
    ("Llama-4-Maverick, 16,384 H100, s=4096", "llama4-maverick", 16384, "h100", 4096, 16384),
]


def moe_search(index: int) -> dict[str, object]:
    """One MoE scenario's searches in this process: median wall time, CPU time, the
    search's counts and this process's peak resident memory."""
    _, name, gpus, gpu, seq, batch = MOE_SCENARIOS[index]
    model, cluster = get_model(name), Cluster.of(gpus, gpu)
    train = TrainSpec(seq_len=seq, global_batch=batch)
    walls, cpus, runs = [], [], []
    for _ in range(MOE_REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        runs.append(plan(model, cluster, train, top=10))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    stats = runs[0].stats
    return {"seconds": statistics.median(walls), "cpu": statistics.median(cpus),
            "grid": stats.grid, "evaluated": stats.evaluated, "fits": stats.fits,
            "timed": stats.timed, "best": runs[0].best.layout.short(),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def moe_table() -> tuple[str, float, float]:
    """The MoE rows, each measured in a fresh process; (table, slowest s, largest bytes)."""
    rows, slowest, largest = [], 0.0, 0.0
    for index, (scenario, *_) in enumerate(MOE_SCENARIOS):
        out = subprocess.run([sys.executable, __file__, "--moe", str(index)], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        slowest, largest = max(slowest, r["seconds"]), max(largest, r["rss"])
        rows.append([scenario, f"{r['grid']:,}", f"{r['evaluated']:,}", f"{r['timed']:,}",
                     f"{r['fits']:,}", f"{r['seconds']:.2f} s", f"{r['cpu']:.2f} s",
                     f"{r['rss'] / 1e9:.2f} GB", f"`{r['best']}`"])
    table = markdown_table(["MoE scenario", "grid", "valid", "timed", "fits", "search",
                            "CPU", "peak RSS", "best layout"], rows, "lrrrrrrrl")
    return table, slowest, largest


# grids around `plan.prune.PRUNE_ABOVE`, smallest first: (scenario, model, cluster, train)
THRESHOLD_SCENARIOS = [
    *((f"{name}, {gpus} H100", get_model(preset), Cluster.of(gpus, "h100"),
       TrainSpec(seq_len=seq, global_batch=batch))
      for name, preset, gpus, seq, batch in (
          ("Llama-3-8B", "llama3-8b", 8, 4096, 64), ("Llama-3-8B", "llama3-8b", 16, 4096, 128),
          ("Llama-3-8B", "llama3-8b", 32, 4096, 256),
          ("Mixtral-8x7B", "mixtral-8x7b", 16, 4096, 64),
          ("Llama-3-8B", "llama3-8b", 64, 8192, 512),
          ("Llama-3-70B", "llama3-70b", 64, 4096, 256))),
    SCENARIOS[2],  # GPT-530B + FlashAttention: 209 K
    SCENARIOS[0],  # Llama-3-405B: 369 K
    ("Llama-3-70B, 512 H100", get_model("llama3-70b"), Cluster.of(512, "h100"),
     TrainSpec(seq_len=8192, global_batch=1024)),
]


def threshold_table() -> str:
    """Each grid searched pruned and with every step time (`prune_above` 0 and above any
    grid), alternately, `REPEATS` times each: the medians, and which is faster."""
    rows = []
    for scenario, model, cluster, train in THRESHOLD_SCENARIOS:
        walls: dict[int, list[float]] = {0: [], 10**15: []}
        for _ in range(REPEATS):
            for prune_above, times in walls.items():
                start = time.perf_counter()
                result = plan(model, cluster, train, top=10, prune_above=prune_above)
                times.append(time.perf_counter() - start)
        pruned, every = (statistics.median(walls[k]) for k in (0, 10**15))
        rows.append([scenario, f"{result.stats.evaluated:,}", f"{pruned:.3f} s",
                     f"{every:.3f} s", "pruned" if pruned < every else "every"])
    return markdown_table(["grid", "valid", "pruned", "every step time", "faster"], rows,
                          "lrrrl")


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
    moe, slowest, largest = moe_table()
    moe_verdict = "met" if slowest < 2.0 and largest < 1.5e9 else "MISSED"
    text = (f"{table}\n\nMedians of {REPEATS} full searches each. Slowest full search: "
            f"{worst_search:.3f} s (target < 1 s: {verdict}).\n\n{moe}\n\n"
            f"Medians of {MOE_REPEATS} searches each, each scenario in a process of its own "
            f"(peak RSS: that process's). Slowest MoE search {slowest:.2f} s, largest "
            f"{largest / 1e9:.2f} GB (targets < 2 s and < 1.5 GB: {moe_verdict}); `timed`: "
            f"step times evaluated (`plan.prune`), `valid`: layouts whose memory was.\n\n"
            f"{threshold_table()}\n\nThe pruned search against the one that times every "
            f"layout, medians of {REPEATS} each, alternated: `plan` prunes above "
            f"`PRUNE_ABOVE` = {PRUNE_ABOVE:,} valid layouts.")
    print(text)
    write_result("bench_planner", text)
    return 0 if worst_search < 1.0 else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--moe":
        print(json.dumps(moe_search(int(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
