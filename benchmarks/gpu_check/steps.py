"""The steps (`STEPS`): each runs its function on fresh ranks with its own timeout
(`on_ranks`), checks what it measured (`then`) and records failures with what it kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_check.calibration import (
    attention_rank,
    fit_calibration,
    flex_rank,
    gemm_rank,
    hbm_rank,
    stand_in_rates,
)
from gpu_check.config import DRY, GPU, Context
from gpu_check.correctness import compare_train, env_rank, reference_rank, train_rank
from gpu_check.kernels import kernels_rank
from gpu_check.memory import (
    _layer_model,
    hf_checks,
    hf_layers_rank,
    layer_memory_rank,
    memory_checks,
    tiny_memory_rank,
)
from gpu_check.multigpu import _cli, collective_checks, collectives_rank
from gpu_check.notebook import Notebook, _error_text, _row_checks, check_item
from shardwise.arch import get_model


@dataclass(frozen=True)
class Step:
    """One step: `run(ctx, timeout, results)` returns (items, checks); `timeout_s` and
    `expect_s` on one H200 (the budget); `gpus`: the GPUs it needs (multi-GPU)."""

    section: str
    name: str
    run: Callable[[Context, float, dict[str, Any]], tuple[dict[str, Any], list[dict]]]
    timeout_s: float
    expect_s: float
    gpus: int = 0


class StepFailed(RuntimeError):
    """A step's ranks failed; `items` and `checks` are what its notebook holds."""

    def __init__(self, message: str, items: dict[str, Any], checks: list[dict[str, Any]]):
        super().__init__(message)
        self.items, self.checks = items, checks


def on_ranks(fn: Callable[[Context, str], None], world: int = 1, nccl: bool = False
             ) -> Callable[[Context, float, dict[str, Any]], tuple[dict[str, Any], list]]:
    """A step that runs `fn(ctx, notebook)` on `world` fresh ranks (`launch.spawn`; NCCL
    when `nccl` and not a dry run, else gloo) and returns its notebook."""

    def run(ctx: Context, timeout: float, results: dict[str, Any]
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        from shardwise.runtime import launch

        path = Path(ctx.scratch) / f"{fn.__name__}.jsonl"
        path.unlink(missing_ok=True)
        backend = "nccl" if nccl and not ctx.dry_run else "gloo"
        try:
            launch.spawn(fn, world, ctx, str(path), timeout_s=timeout, backend=backend)
        except Exception as exc:
            raise StepFailed(_error_text(exc), *Notebook.read(path)) from exc
        return Notebook.read(path)

    return run


def then(first: Callable[..., tuple[dict[str, Any], list]],
         checks: Callable[[dict[str, Any], Context, dict[str, Any]], list[dict[str, Any]]]
         ) -> Callable[..., tuple[dict[str, Any], list]]:
    """`first`, then `checks(items, ctx, results)` added to its checks (also on a failure,
    over what it measured); checks that cannot be drawn are one failed check, the items
    kept."""

    def checked(items: dict[str, Any], ctx: Context, results: dict[str, Any]
                ) -> list[dict[str, Any]]:
        try:
            return checks(items, ctx, results)
        except Exception as exc:  # a figure missing from a partial run, say
            return [check_item("the step's checks", math.inf, 0.0, _error_text(exc))]

    def run(ctx: Context, timeout: float, results: dict[str, Any]
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        try:
            items, found = first(ctx, timeout, results)
        except StepFailed as exc:
            exc.checks += checked(exc.items, ctx, results)
            raise
        return items, found + checked(items, ctx, results)

    return run


def _fit_step(ctx: Context, timeout: float, results: dict[str, Any]
              ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    measured = {name: results.get(f"calibration.{name}", {})
                for name in ("gemm", "attention", "hbm", "flex")}
    out = Path(results["__out__"]) / f"calibration-{ctx.accelerator}.json"
    if ctx.dry_run:
        measured = stand_in_rates(measured, ctx.accelerator)
    summary, checks = fit_calibration(measured, ctx.accelerator, out,
                                      results.get("environment.env", {}))
    if ctx.dry_run:
        summary["dry run"] = (f"CPU rates scaled to stand in for {ctx.accelerator} "
                              "(gpu_check.calibration.stand_in_rates)")
    return summary, checks


def _calibrate_step(ctx: Context, timeout: float, results: dict[str, Any]
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    backend, ranks = ("gloo", 2) if ctx.dry_run else ("nccl", results["__gpus__"])
    out = Path(results["__out__"]) / f"calibrate-{backend}.json"
    data = _cli(["calibrate", "--backend", backend, "--ranks", str(ranks), "--quick",
                 "--out", str(out)], timeout)
    return {"file": out.name, "constants": data["default"], "machine": data["machine"]}, []


def _check_step(layout: str) -> Callable[..., tuple[dict[str, Any], list]]:
    """`shardwise check --model tiny --<axis> 2 [--calibration FILE]` (its defaults: s=64,
    8 sequences, 2 steps), through the functions the command calls: `run_check` on ranks
    spawned here (NCCL on GPUs), then `with_prediction` from the calibration file."""

    def run(ctx: Context, timeout: float, results: dict[str, Any]
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        from shardwise.layout import Layout
        from shardwise.runtime.measure import run_check
        from shardwise.runtime.step_time import with_prediction
        from shardwise.runtime.train import TrainConfig

        config = TrainConfig(get_model("tiny"), Layout.parse(f"{layout[:2]}={layout[2:]}"),
                             steps=2, seq_len=64, global_batch=8)
        calibration = results.get("multi-gpu.calibrate", {}).get("file")
        path = str(Path(results["__out__"]) / calibration) if calibration else None
        rows = with_prediction(run_check(config, 2, timeout_s=timeout,
                                         reference=path is not None), config, path)
        return ({"calibration": calibration or "built-in"},
                _row_checks(f"check {layout}", [row.as_dict() for row in rows]))

    return run


def _skip_in_dry_run(reason: str, run: Callable[..., Any]) -> Callable[..., Any]:
    def maybe(ctx: Context, timeout: float, results: dict[str, Any]) -> Any:
        if ctx.dry_run:
            raise StepSkipped(reason)
        return run(ctx, timeout, results)

    return maybe


class StepSkipped(Exception):
    """The step does not run here; the message says why."""


def _train_compare(items: dict[str, Any], ctx: Context, results: dict[str, Any]
                   ) -> list[dict[str, Any]]:
    return compare_train(results.get("runtime.reference", {}), items, ctx.sizes)


def _needs_transformers(run: Callable[..., Any]) -> Callable[..., Any]:
    def maybe(ctx: Context, timeout: float, results: dict[str, Any]) -> Any:
        if not (results.get("environment.env", {}).get("packages") or {}).get("transformers"):
            raise StepSkipped("transformers is not installed")
        return run(ctx, timeout, results)

    return maybe


STEPS = (
    Step("environment", "env", on_ranks(env_rank), 60, 10),
    Step("runtime", "reference", on_ranks(reference_rank), 60, 15),
    Step("runtime", "train", then(on_ranks(train_rank, nccl=True), _train_compare), 90, 20),
    Step("runtime", "kernels", on_ranks(kernels_rank), 60, 15),
    Step("memory", "llama3-8b", then(
        on_ranks(layer_memory_rank, nccl=True),
        lambda items, ctx, results: memory_checks(items, _layer_model(ctx),
                                                  ctx.sizes.layer_seq, 1)), 90, 30),
    Step("memory", "hf-layers", _needs_transformers(then(
        on_ranks(hf_layers_rank),
        lambda items, ctx, results: hf_checks(items, _layer_model(ctx),
                                              ctx.sizes.layer_seq))), 60, 20),
    Step("memory", "tiny", then(
        on_ranks(tiny_memory_rank, nccl=True),
        lambda items, ctx, results: [c for model in ctx.sizes.memory_models
                                     for c in memory_checks(items, get_model(model), 64, 8)]),
         60, 15),
    Step("calibration", "gemm", on_ranks(gemm_rank), 40, 10),
    Step("calibration", "attention", on_ranks(attention_rank), 90, 25),
    Step("calibration", "hbm", on_ranks(hbm_rank), 20, 5),
    Step("calibration", "flex", on_ranks(flex_rank), 120, 60),
    Step("calibration", "fit", _fit_step, 20, 3),
    Step("multi-gpu", "collectives", then(
        lambda ctx, timeout, results: on_ranks(collectives_rank, results["__gpus__"] or 2,
                                               nccl=True)(ctx, timeout, results),
        lambda items, ctx, results: collective_checks(items, ctx.accelerator)), 60, 20, 2),
    Step("multi-gpu", "calibrate", _skip_in_dry_run(
        "dry run: `shardwise calibrate --quick` takes ~30 s on 2 CPU cores (its own tests "
        "cover it); the checks run without it", _calibrate_step), 120, 40, 2),
    *(Step("multi-gpu", f"check-{layout}", _skip_in_dry_run(
        "dry run: the same code path as check-dp2 (the runtime's tests run tp and pp on gloo)",
        _check_step(layout)) if layout not in DRY.multi_layouts else _check_step(layout),
        60, 15, 2) for layout in GPU.multi_layouts),
)


