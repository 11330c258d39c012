"""A memory budget per search: `plan`'s resident bytes are estimated before it runs
(`plan.search_size`, from the grid's first two levels, under a second) and a search over the
budget is refused in one line naming a `--fix`/`--max` that fits, instead of taking the
machine's memory (a timeout bounds time, not memory).

The CLI's budget is `CLI_BUDGET` (`plan --memory-budget`); the web app's is `WEB_BUDGET` for
the whole process, shared by its `PLAN_WORKERS` concurrent searches (`web_request_budget`);
more requests than workers wait for none: they get 503.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.units import gb

__all__ = ["CLI_BUDGET", "MIN_BUDGET", "WEB_BUDGET", "check_search", "parse_budget",
           "web_request_budget"]

CLI_BUDGET = 8e9  # bytes (GB = 10^9): a laptop's share; `plan --memory-budget` changes it
WEB_BUDGET = 1.5e9  # bytes the web app's process may hold (issue 47's acceptance figure)
MIN_BUDGET = 200e6  # the interpreter and its modules alone hold ~150 MB (`BASE_BYTES`)


def parse_budget(text: Any, option: str) -> float:
    """A budget option's bytes (`8GB`, `500MB`, a number of bytes) in [MIN_BUDGET, 1 PB]."""
    from shardwise.units import parse_size
    from shardwise.validate import finite

    return finite(parse_size(text), f"{option} {text} (bytes)", low=MIN_BUDGET, high=1e15)


def web_request_budget(workers: int, total: float | None = None) -> float:
    """Bytes one `/api/plan` search may hold (`search_size`'s estimate, its interpreter base
    included) so that `workers` of them at once stay under `total` (default:
    `$SHARDWISE_WEB_MEMORY`, a size such as 1.5GB, else `WEB_BUDGET`): `total / workers`.
    The base is counted per search, not once: two DeepSeek-V3 / 1,024-GPU searches (each
    estimated 0.73 GB) peaked at 1.40 GB RSS together (benchmarks/bench_web_memory.py)."""
    import os

    if total is None:
        text = os.environ.get("SHARDWISE_WEB_MEMORY")
        total = WEB_BUDGET if text is None else parse_budget(text, "SHARDWISE_WEB_MEMORY")
    return total / workers


def _fits(model: Any, cluster: Any, train: Any, space: Any, budget: float) -> bool:
    from shardwise.plan import search_size

    return search_size(model, cluster, train, space).bytes <= budget


def _suggestions(model: Any, cluster: Any) -> list[tuple[str, str]]:
    """(fix, max) constraints to try, smallest change first."""
    node = cluster.gpus_per_node
    out: list[tuple[str, str]] = [("", f"pp={p}") for p in (16, 8, 4)]
    if model.is_moe:
        out = [("", f"ep={node}"), *out, ("", f"ep={node},pp=8")]
    out += [(f"tp={node}", ""), (f"tp={node}", "pp=8"), (f"tp={node},pp=8", "")]
    return out


def check_search(model: Any, cluster: Any, train: Any, space: Any, budget: float | None,
                 fix_text: str | None = None, max_text: str | None = None,
                 option: str = "--memory-budget") -> None:
    """Refuse a search whose estimated peak (`plan.search_size`) is over `budget` bytes
    (None: no budget), naming the estimate and the first of a few `--fix`/`--max`
    constraints (`_suggestions`, each estimated too) that fits."""
    if budget is None:
        return
    from shardwise.plan import search_size
    from shardwise.plan.space import Constraint

    size = search_size(model, cluster, train, space)
    if size.bytes <= budget:
        return
    hint = "fix more axes (--fix tp=8,pp=8) or plan fewer GPUs"
    given = {item.split("=")[0].strip() for text in (fix_text, max_text) if text
             for item in text.split(",")}
    for fix, most in _suggestions(model, cluster):
        if given & {item.split("=")[0] for item in f"{fix},{most}".split(",") if item}:
            continue  # the user already constrains that axis
        fix_all = ",".join(x for x in (fix_text, fix) if x)
        max_all = ",".join(x for x in (max_text, most) if x)
        try:
            smaller = replace(space, constraint=Constraint.parse(fix_all or None,
                                                                 max_all or None))
            if _fits(model, cluster, train, smaller, budget):
                hint = " ".join(x for x in (f"--fix {fix_all}" if fix_all else "",
                                            f"--max {max_all}" if max_all else "") if x)
                hint = f"{hint} fits"
                break
        except ShardwiseError:  # a suggestion that contradicts the user's own constraint
            continue
    raise ShardwiseError(
        f"this search would hold about {gb(size.bytes)} ({size.cells:,} layouts in "
        f"memory) over the {gb(budget)} budget ({option}); {hint}")
