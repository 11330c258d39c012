"""Pipeline simulator speed where the planner needs it: DeepSeek-V3 on 2,048 H800 (s=4096,
global batch 15,360), whose search ranks uneven pipelines by `simulated_bubble`.

Prints, on this machine: the median of `REPEATS` `simulated_bubble` calls of the search's first
simulated layout, repeated in one process; the search's calls in their order in a fresh process
(each new schedule generated and compiled once, as in a search); and the median wall time of
`PLAN_REPEATS` whole `plan(...)` calls, each in a fresh process (imports not counted), and
their CPU time (less disturbed by other load on the machine).
Run: `python benchmarks/bench_simulator.py` (about a minute).
"""

from __future__ import annotations

import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from shardwise.arch import get_model
from shardwise.estimate import step
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec

REPEATS = 20
PLAN_REPEATS = 3


def search() -> None:
    from shardwise.plan import plan

    plan(get_model("deepseek-v3"), Cluster.of(2048, "h800"),
         TrainSpec(seq_len=4096, global_batch=15360))


def search_calls() -> list[tuple[Any, ...]]:
    """The arguments of the search's `simulated_bubble` calls, in order."""
    import shardwise.plan.rank as rank

    calls: list[tuple[Any, ...]] = []

    def spy(*args: Any) -> float:
        calls.append(args)
        return step.simulated_bubble(*args)

    rank.simulated_bubble = spy  # type: ignore[assignment]
    try:
        search()
    finally:
        rank.simulated_bubble = step.simulated_bubble
    return calls


def seconds(call: Any, *args: Any) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def fresh(*args: str) -> Any:
    """What this script prints, as JSON, run in a fresh process with `args`."""
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def main() -> None:
    calls = search_calls()
    first = calls[0]
    print(f"{len(calls)} simulated_bubble calls in the search, "
          f"{len({(a[0].schedule, a[0].pp, a[1], a[0].chunks) for a in calls})} schedules; "
          f"the first: {first[0]}, m={first[1]}")
    times = [seconds(step.simulated_bubble, *first) for _ in range(REPEATS)]
    print(f"simulated_bubble, that layout again: median of {REPEATS} "
          f"{statistics.median(times) * 1e3:.3f} ms (min {min(times) * 1e3:.3f})")
    with tempfile.NamedTemporaryFile(suffix=".pkl") as file:
        pickle.dump(calls, file)
        file.flush()
        each = fresh("--calls", file.name)
    print(f"the search's calls in order, fresh process: {sum(each) * 1e3:.1f} ms, median "
          f"{statistics.median(each) * 1e3:.3f} ms, first {each[0] * 1e3:.2f} ms")
    walls, cpus = zip(*(fresh("--plan") for _ in range(PLAN_REPEATS)))
    print(f"plan(...), fresh process: median of {PLAN_REPEATS} {statistics.median(walls):.3f} s "
          f"wall ({', '.join(f'{w:.3f}' for w in walls)}), {statistics.median(cpus):.3f} s CPU")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--calls"]:
        with open(sys.argv[2], "rb") as stored:
            print(json.dumps([seconds(step.simulated_bubble, *args)
                              for args in pickle.load(stored)]))
    elif sys.argv[1:] == ["--plan"]:
        import shardwise.plan  # noqa: F401 - imported before the clock starts

        cpu = time.process_time()
        print(json.dumps([seconds(search), time.process_time() - cpu]))
    else:
        main()
