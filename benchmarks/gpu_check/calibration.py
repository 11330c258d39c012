"""Component calibration: GEMMs, attention kernels, flex attention, HBM bandwidth, and the
fit that writes the calibration file `load_calibration` reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpu_check.config import TOLERANCE, Context
from gpu_check.kernels import (
    SDPA_KERNELS,
    _causal_attention_fp64,
    _function_errors,
    _release,
    _sdpa,
)
from gpu_check.notebook import Notebook, _error_text, _plain, _rel, _seconds, check_item


def gemm_rank(ctx: Context, path: str) -> None:
    """bf16 `(M×K)·(K×N)` over `Sizes.gemm_shapes`: points as data/components.json holds them."""
    import torch

    note, device = Notebook(path), ctx.device()
    for m, n, k in ctx.sizes.gemm_shapes:
        key = f"{m}x{n}x{k}"
        try:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            seconds = _seconds(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), device,
                               ctx.sizes.timing_s)
        except RuntimeError as exc:
            note(key, {"error": _error_text(exc)})
            _release(device)
            continue
        note(key, {"accelerator": ctx.accelerator, "dtype": "bf16", "m": m, "n": n, "k": k,
                   "tflops": 2 * m * n * k / seconds / 1e12, "seconds": seconds})


def _attention_points(ctx: Context, note: Notebook, kernel: str, core: Callable[..., Any],
                      seqs: tuple[int, ...], dims: tuple[int, ...], heads_first: bool,
                      backward: bool) -> None:
    """Forward and backward of `core` (causal) over seqs × head dims at `attention_tokens`
    tokens and `attention_hidden` = heads × d: points in FlashAttention's convention (forward
    `4·s²·d·heads·batch`, halved when causal; backward 2.5×), as data/components.json."""
    s_ = ctx.sizes
    for d in dims:
        for seq in seqs:
            key = f"{kernel} d={d} s={seq}"
            batch, heads = max(1, s_.attention_tokens // seq), s_.attention_hidden // d
            shape = (batch, heads, seq, d) if heads_first else (batch, seq, heads, d)
            try:
                seconds = _attention_seconds(ctx, core, shape, backward)
            except RuntimeError as exc:  # no kernel for this shape or dtype; an OOM
                note(key, {"unavailable": _error_text(exc)})
                _release(ctx.device())
                continue
            flops = 4 * seq * seq * d * heads * batch / 2
            note(key, [{"accelerator": ctx.accelerator, "kernel": kernel, "pass": p,
                        "head_dim": d, "seq": seq, "causal": True, "batch": batch,
                        "tflops": flops * (2.5 if p == "bwd" else 1) / t / 1e12, "seconds": t}
                       for p, t in seconds.items()])


def _attention_seconds(ctx: Context, core: Callable[..., Any], shape: tuple[int, ...],
                       backward: bool) -> dict[str, float]:
    """{"fwd": s, "bwd": s} of `core` on bf16 q, k, v of `shape` (the backward alone: the
    gradients of one output, the graph kept)."""
    import torch

    device = ctx.device()
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    seconds = {"fwd": _seconds(lambda: core(q, k, v), device, ctx.sizes.timing_s)}
    if backward:
        out = core(q, k, v)
        grad = torch.randn_like(out)
        seconds["bwd"] = _seconds(lambda: torch.autograd.grad(out, (q, k, v), grad,
                                                              retain_graph=True),
                                  device, ctx.sizes.timing_s)
    return seconds


def attention_rank(ctx: Context, path: str) -> None:
    """SDPA's kernels (fa2, efficient, cudnn, math) and the runtime's attention core (its
    flash path: on CUDA `ops.attention.block_forward`, materialised in bf16)."""
    from shardwise.runtime.model import AttentionFunction

    note, s = Notebook(path), ctx.sizes
    for kernel in SDPA_KERNELS:
        _attention_points(ctx, note, kernel, _sdpa(kernel), s.attention_seqs,
                          s.attention_dims, heads_first=True, backward=True)
    _attention_points(ctx, note, "runtime",
                      lambda q, k, v: AttentionFunction.apply(q, k, v, True, True),
                      s.attention_seqs, s.attention_dims, heads_first=False, backward=True)


def flex_rank(ctx: Context, path: str) -> None:
    """FlexAttention (causal block mask) under `torch.compile`: its error against fp64, then
    its points. On the CPU (dry run): eager and forward only — torch 2.13 has no CPU backward,
    and compiling takes minutes there."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    note, device = Notebook(path), ctx.device()
    gpu = device.type == "cuda"
    attend = torch.compile(flex_attention, dynamic=False) if gpu else flex_attention
    masks: dict[int, Any] = {}

    def core(q: Any, k: Any, v: Any) -> Any:  # (b, heads, s, d)
        seq = q.shape[2]
        if seq not in masks:
            masks[seq] = create_block_mask(lambda b, h, i, j: i >= j, None, None, seq, seq,
                                           device=device)
        return attend(q, k, v, block_mask=masks[seq])

    gen = torch.Generator().manual_seed(0)
    mha = [torch.randn(2, ctx.sizes.kernel_seq, 8, 64, dtype=torch.float64, generator=gen)
           for _ in range(3)]
    heads_first = lambda t: t.transpose(1, 2)  # noqa: E731  (b, s, a, d) <-> (b, a, s, d)
    if gpu:
        start = time.perf_counter()
        errors = _function_errors(core, mha, torch.bfloat16, device, heads_first)
        note("flex bf16", errors | {"compile_and_run_s": time.perf_counter() - start})
        note.check("kernel flex bf16: worst of output and gradients", max(errors.values()),
                   TOLERANCE[("kernel", "bf16")],
                   ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    else:
        with torch.no_grad():
            q, k, v = (heads_first(t.to(torch.bfloat16)) for t in mha)
            error = _rel(heads_first(core(q, k, v)),
                         _causal_attention_fp64(*(t.to(torch.bfloat16).double() for t in mha)))
        note("flex bf16", {"out": error, "note": "eager, forward only (CPU)"})
        note.check("kernel flex bf16 (eager, forward): output", error,
                   TOLERANCE[("kernel", "bf16")])
    _attention_points(ctx, note, "flex", core, ctx.sizes.flex_seqs, ctx.sizes.flex_dims,
                      heads_first=True, backward=gpu)


def hbm_rank(ctx: Context, path: str) -> None:
    """Memory-bound kernels in bf16, bytes moved per call / seconds (`runtime.calibrate`'s
    conventions): copy (2 bytes moved per byte copied), add (2 reads + 1 write), the
    runtime's RMSNorm and softmax over rows (read + write)."""
    note = Notebook(path)
    for n in ctx.sizes.hbm_elements:
        try:
            for kernel, gbps in _hbm_points(ctx, n).items():
                note(f"{kernel} {2 * n}", {"accelerator": ctx.accelerator, "kernel": kernel,
                                           "bytes": 2 * n, "gbps": gbps})
        except RuntimeError as exc:
            note(f"{2 * n}", {"error": _error_text(exc)})
            _release(ctx.device())


def _hbm_points(ctx: Context, n: int) -> dict[str, float]:
    """GB/s of each memory-bound kernel on `n` bf16 elements (rows of 4096; 256 dry)."""
    import torch

    from shardwise.runtime.model import RMSNorm

    device, width = ctx.device(), 256 if ctx.dry_run else 4096
    x = torch.randn(n // width, width, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    norm = RMSNorm(width, dtype=torch.bfloat16).to(device)
    size = 2 * n  # bytes of one tensor
    calls = {"copy": (lambda: y.copy_(x), 2 * size),
             "add": (lambda: torch.add(x, y, out=y), 3 * size),
             "rmsnorm": (lambda: norm(x), 2 * size),
             "softmax": (lambda: torch.softmax(x, dim=-1), 2 * size)}
    with torch.no_grad():
        return {kernel: moved / _seconds(call, device, ctx.sizes.timing_s) / 1e9
                for kernel, (call, moved) in calls.items()}


SHIPPED = ("fa2", "efficient", "cudnn", "flex")
"""Kernels whose fit goes into the calibration file; math (memory-bound: the step model's
materialised path) and the runtime's core are fitted and reported only
(fit_components.NOT_SHIPPED)."""


def stand_in_rates(results: dict[str, dict[str, Any]], label: str) -> dict[str, dict[str, Any]]:
    """The dry run's CPU points standing in for accelerator `label`: every `tflops` scaled so
    the best GEMM runs at the preset's `matmul_efficiency` of `peak_bf16`, every `gbps` so the
    best copy runs at its `hbm_efficiency` of `hbm_bandwidth`. A CPU is ~10³× slower than the
    GPU it stands in for, so unscaled its fit sits at (or under, when the machine is loaded)
    the calibration file's 0.001 floor; scaled, the fit and the load run on in-range numbers
    with the shape of the CPU's curves."""
    from shardwise.calibration import default_calibration
    from shardwise.hardware import get_accelerator

    acc, preset = get_accelerator(label), default_calibration(label)
    points = [p for v in results.values() for x in v.values()
              for p in (x if isinstance(x, list) else [x]) if isinstance(p, dict)]
    best_gemm = max((p["tflops"] for p in results.get("gemm", {}).values() if "tflops" in p),
                    default=None)
    best_copy = max((p["gbps"] for p in points if "gbps" in p), default=None)
    scale = {"tflops": acc.peak_bf16 * preset.matmul_efficiency / 1e12 / best_gemm
             if best_gemm else 1.0,
             "gbps": acc.hbm_bandwidth * preset.hbm_efficiency / 1e9 / best_copy
             if best_copy else 1.0}

    def scaled(point: Any) -> Any:
        if isinstance(point, list):
            return [scaled(p) for p in point]
        if not isinstance(point, dict):
            return point
        return {k: v * scale[k] if k in scale and isinstance(v, (int, float)) else v
                for k, v in point.items()}

    return {name: {key: scaled(v) for key, v in group.items()}
            for name, group in results.items()}


def fit_calibration(results: dict[str, dict[str, Any]], label: str, out: Path,
                    environment: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fit this GPU's component constants with benchmarks/fit_components.py's fits, write
    `out` (a calibration file for accelerator `label`), load it back as `plan` would, and
    set its constants and residuals against the preset's. Returns (summary, checks)."""
    from fit_components import fit_attention_kernel, fit_gemm, fit_hbm

    from shardwise.calibration import Calibration, default_calibration, load_calibration
    from shardwise.calibration.components import residual_summary
    from shardwise.estimate.components import predict

    gemm = [p for p in results.get("gemm", {}).values() if "tflops" in p]
    attention = [p for v in (*results.get("attention", {}).values(),
                             *results.get("flex", {}).values())
                 if isinstance(v, list) for p in v]
    copies = [p for p in results.get("hbm", {}).values() if p.get("kernel") == "copy"]
    preset = default_calibration(label)
    constants: dict[str, Any] = {}
    summary: dict[str, Any] = {"accelerator": label, "fits": {}}
    if len(gemm) >= 5:
        g = fit_gemm(gemm)[label]
        constants |= {k: g[k] for k in ("matmul_efficiency", "matmul_half_dim")}
        summary["fits"]["gemm"] = g
    if copies:
        best = max(copies, key=lambda p: p["bytes"])  # the largest: furthest past the L2
        constants["hbm_efficiency"] = fit_hbm([best])[label]["hbm_efficiency"]
        summary["fits"]["hbm"] = {p["kernel"] + f" {p['bytes']}": p["gbps"]
                                  for p in results["hbm"].values() if "gbps" in p}
    kernels: dict[str, dict[str, Any]] = {}
    for kernel in sorted({p["kernel"] for p in attention}):
        rows = [p for p in attention if p["kernel"] == kernel]
        known = preset.attention_kernels.get(kernel, {})
        held: dict[str, float | None] = {}  # what the points cannot tell: the preset's
        if len({p["head_dim"] for p in rows}) < 2:
            held["half_dim"] = known.get("half_dim")
        if not {"fwd", "bwd"} <= {p["pass"] for p in rows}:
            held["backward_ratio"] = known.get("backward_ratio")
        how = [f"{name} from the preset" for name in held]
        if None in held.values():
            summary["fits"][f"attention {kernel}"] = {
                "not fitted": f"the points do not tell {', '.join(held)} and the preset has "
                              f"no {kernel} curve"}
            continue
        fit = fit_attention_kernel(rows, **held) | {"how": "; ".join(how) or "fitted"}
        summary["fits"][f"attention {kernel}"] = fit
        if kernel in SHIPPED:
            kernels[kernel] = {k: fit[k] for k in ("efficiency", "half_dim", "half_seq",
                                                   "backward_ratio")}
    if kernels:
        constants["attention"] = kernels
    device = (environment.get("devices") or [{"name": "CPU (dry run)"}])[0]["name"]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "_doc": [f"Measured by benchmarks/gpu_check.py on {device} ({when}, torch "
                 f"{environment.get('torch')}, CUDA {environment.get('cuda')}); fitted with "
                 "benchmarks/fit_components.py's fits. Use: shardwise plan --gpu "
                 f"{label} --calibration FILE (only the keys below replace the built-in ones).",
                 "attention kernels: fa2 = torch SDPA's FlashAttention-2, efficient = its "
                 "memory-efficient kernel, cudnn = its cuDNN fused attention, flex = "
                 "FlexAttention under torch.compile."],
        "accelerators": {label: constants},
        "sources": {label: f"benchmarks/gpu_check.py on {device}, {when}"},
        "measurements": {"gemm": gemm, "attention": attention,
                         "hbm": list(results.get("hbm", {}).values())},
    }
    out.write_text(json.dumps(_plain(data), indent=1) + "\n", encoding="utf-8")
    checks = []
    try:
        loaded: Calibration | None = load_calibration(label, out)
        checks.append(check_item("calibration file loads (load_calibration)", 0.0, 0.0,
                                 str(out.name)))
    except Exception as exc:  # a bad fit: say so, keep the points
        loaded = None
        checks.append(check_item("calibration file loads (load_calibration)", 1.0, 0.0,
                                 _error_text(exc)))
    summary["file"] = out.name
    summary["constants"] = {"measured": constants, "preset": {
        "matmul_efficiency": preset.matmul_efficiency,
        "matmul_half_dim": preset.matmul_half_dim, "hbm_efficiency": preset.hbm_efficiency,
        "attention": preset.attention_kernels}}
    if loaded is not None:  # each component's points: the preset's residuals and the fit's
        groups = {"gemm": ("gemm", gemm), "hbm": ("hbm", copies), **{
            f"attention {k}": ("attention", [p for p in attention if p["kernel"] == k])
            for k in kernels}}
        residuals: dict[str, Any] = {}
        for group, (component, rows) in groups.items():
            for name, cal in (("preset", preset), ("measured", loaded)) if rows else ():
                if component == "attention" and group.split()[1] not in cal.attention_kernels:
                    residuals[f"{group}: {name}"] = "no curve for this kernel"
                    continue
                value = "tflops" if component != "hbm" else "gbps"
                residuals[f"{group}: {name}"] = residual_summary(
                    [(p[value] - predict(component, p, cal)) / p[value] for p in rows])
        summary["residuals"] = residuals
    return summary, checks


