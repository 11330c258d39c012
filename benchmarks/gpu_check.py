"""One prepared run that checks shardwise's CUDA and NCCL path and calibrates the GPU (issue 38).

    PYTHONPATH=src python benchmarks/gpu_check.py OUT            # a GPU machine: ~4-5 min
    PYTHONPATH=src python benchmarks/gpu_check.py --dry-run OUT  # any CPU: tiny sizes, gloo

writes OUT/gpu_check.json (every section and step: measured, skipped and why, or failed with
the error and what it measured before), OUT/summary.md and OUT/calibration-<accelerator>.json
(the GPU's component constants, the format `shardwise.calibration.load_calibration` reads),
rewritten after every step. Each step runs in processes of its own (`runtime.launch.spawn`)
with its own timeout inside a global budget and writes its points as it measures them
(`Notebook`): a crash, a hang or the lease's end loses nothing measured before it.
docs/howto/gpu-check.md says what each figure means and derives the tolerances.

Steps, timeout / expected seconds on one H200 (`STEPS`; ~230 s expected, 450 s budget):

    environment  env 60/10
    runtime      reference 60/15 (CPU fp64), train 90/20, kernels 60/15
    memory       llama3-8b 90/30, hf-layers 60/20, tiny 60/15
    calibration  gemm 40/10, attention 90/25, hbm 20/5, flex 120/60, fit 20/3
    multi-gpu    (≥ 2 GPUs, else skipped) collectives 60/20, calibrate 120/40,
                 check-dp2 / -tp2 / -pp2 60/15 each
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from shardwise.arch import get_model

GLOBAL_BUDGET_S = 450.0  # one GPU: 7.5 minutes, inside the 8
DRY_BUDGET_S = 170.0  # a stop, not a target: 60–107 s measured on 2 cores at load 12–18
MIN_STEP_S = 8.0  # a step given less is skipped ("global budget spent")
SCHEMA = 1

# Tolerances (relative), from the unit roundoff u of the dtype (fp32 2^-24, bf16 2^-8); the
# docs page derives them. `train`: loss and gradient norm of every step against the fp64 run
# from the same initial weights. `kernels`: ‖x − x_ref‖/‖x_ref‖ of the output and of every
# gradient, against fp64 on the same (rounded) inputs and weights.
U = {"fp32": 2.0**-24, "bf16": 2.0**-8}
TOLERANCE = {
    ("loss", "fp32"): 2**6 * U["fp32"],  # 3.8e-6: ~u per op, no TF32 (a TF32 GEMM: ~1e-3)
    ("grad_norm", "fp32"): 2**8 * U["fp32"],  # 1.5e-5
    ("loss", "bf16"): U["bf16"] / 4,  # 9.8e-4: the mean of B·s tokens' roundings
    ("grad_norm", "bf16"): 4 * U["bf16"],  # 1.6e-2: ≤ 4 roundings on a gradient's path
    ("kernel", "fp32"): 2**10 * U["fp32"],  # 6.1e-5: √K·u for inner sums K ≤ 2^10, ×4
    ("kernel", "bf16"): 4 * U["bf16"],  # 1.6e-2: forward ~u, backward ≤ 4 roundings
    ("module", "fp32"): 2**10 * U["fp32"],  # a layer (MoE, MLA): as a kernel in fp32,
    ("module", "bf16"): 8 * U["bf16"],  # 3.1e-2: twice a kernel's chain of bf16 roundings
}
PROFILE_TARGET = 0.01  # saved bytes of transformers' layers against their profile (as on CPU)


# ------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """What each step runs: `GPU` on a device, `DRY` on a CPU (tiny, seconds)."""

    train_runs: tuple[tuple[str, str], ...]  # (model preset, dtype) of `train`
    train_steps: int
    train_seq: int
    kernel_seq: int
    moe_tokens: int
    layer_seq: int  # the Llama-3-8B layer
    layer_shape: tuple[int, int, int, int, int]  # (h, heads, kv heads, f, vocab)
    memory_models: tuple[str, ...]  # tiny models through check_layout
    gemm_shapes: tuple[tuple[int, int, int], ...]  # (m, n, k)
    attention_seqs: tuple[int, ...]
    attention_dims: tuple[int, ...]
    attention_tokens: int  # batch × seq of every attention point (FlashAttention's 16k)
    attention_hidden: int  # heads × head dim (FlashAttention's benchmarks: 2048)
    flex_seqs: tuple[int, ...]
    flex_dims: tuple[int, ...]
    hbm_elements: tuple[int, ...]
    collective_sizes: tuple[int, ...]  # bytes
    multi_layouts: tuple[str, ...]  # `shardwise check` layouts
    timing_s: float  # seconds per timed point (`runtime.calibrate._seconds`' budget)


def _gemm_shapes(cubes: tuple[int, ...], wide: int, thin: tuple[int, ...],
                 tokens: int, projections: tuple[tuple[int, int], ...]
                 ) -> tuple[tuple[int, int, int], ...]:
    """Cubes, thin × wide × wide (small per-rank matmuls) and a Transformer's projections
    `(tokens × k) · (k × n)` — what `fit_gemm`'s `e_max·Π d/(d + d½)` is fitted over."""
    shapes = [(d, d, d) for d in cubes] + [(m, wide, wide) for m in thin]
    shapes += [(tokens, n, k) for k, n in projections]
    return tuple(dict.fromkeys(shapes))


LLAMA3_8B = (4096, 32, 8, 14336, 128256)
GPU = Sizes(
    train_runs=(("tiny", "fp32"), ("tiny-moe", "fp32"), ("tiny-deepseek", "fp32"),
                ("tiny", "bf16")),
    train_steps=4, train_seq=64, kernel_seq=256, moe_tokens=256,
    layer_seq=4096, layer_shape=LLAMA3_8B,
    memory_models=("tiny", "tiny-moe", "tiny-deepseek"),
    gemm_shapes=_gemm_shapes((256, 512, 1024, 2048, 4096, 8192), 8192, (16, 64, 128, 512),
                             4096, ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096),
                                    (4096, 7168), (7168, 4096), (4096, 512))),
    attention_seqs=(512, 1024, 2048, 4096, 8192), attention_dims=(64, 128),
    attention_tokens=16384, attention_hidden=2048,
    flex_seqs=(1024, 4096), flex_dims=(64, 128),
    hbm_elements=(2**26, 2**28),
    collective_sizes=tuple(2**e for e in range(10, 31, 4)),  # 1 KiB … 1 GiB
    multi_layouts=("dp2", "tp2", "pp2"), timing_s=0.05)
DRY = Sizes(  # MoE and MLA run in `kernels` (the CPU trains and checks them slowly)
    train_runs=(("tiny", "fp32"), ("tiny", "bf16")), train_steps=2, train_seq=32,
    kernel_seq=64, moe_tokens=64, layer_seq=128, layer_shape=(128, 4, 2, 256, 512),
    memory_models=("tiny",),
    gemm_shapes=_gemm_shapes((32, 64, 128), 128, (8, 16), 64, ((128, 64), (64, 128))),
    attention_seqs=(64, 128), attention_dims=(16, 32), attention_tokens=256,
    attention_hidden=64, flex_seqs=(64,), flex_dims=(16,), hbm_elements=(2**16, 2**18),
    collective_sizes=(2**10, 2**14), multi_layouts=("dp2",), timing_s=0.01)


@dataclass(frozen=True)
class Context:
    """What every step's ranks need (picklable): dry run or not, the sizes, the accelerator
    preset this GPU is fitted as, the folder of the steps' notebooks."""

    dry_run: bool
    sizes: Sizes
    accelerator: str | None  # None: a GPU no preset describes (the fit is skipped)
    scratch: str

    def device(self) -> Any:
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")


# ---------------------------------------------------------------------------- notebook
class Notebook:
    """What a step measured so far: one JSON line per item, appended as it is measured, in a
    file the orchestrator reads whether the step finished, raised, died or timed out."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, key: str, value: Any) -> Any:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "value": _plain(value)}) + "\n")
        return value

    def check(self, what: str, value: float | None, tolerance: float | None,
              note: str = "") -> None:
        """A figure against its tolerance (None: reported, no target)."""
        self("check", check_item(what, value, tolerance, note))

    @staticmethod
    def read(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(items by key, checks) of a notebook; a torn last line is dropped."""
        items: dict[str, Any] = {}
        checks: list[dict[str, Any]] = []
        if not Path(path).is_file():
            return items, checks
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry["key"] == "check":
                checks.append(entry["value"])
            else:
                items[entry["key"]] = entry["value"]
        return items, checks


def check_item(what: str, value: float | None, tolerance: float | None,
               note: str = "") -> dict[str, Any]:
    """{what, value, tolerance, ok, note}: ok is None without a tolerance or a value."""
    ok = None if tolerance is None or value is None else bool(value <= tolerance)
    return {"what": what, "value": value, "tolerance": tolerance, "ok": ok, "note": note}


def _plain(value: Any) -> Any:
    """JSON-ready: NumPy and torch scalars to floats, tuples to lists, non-finite to str."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _error_text(exc: BaseException) -> str:
    """The first line of an exception and its last frames (a rank's traceback included)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = text.splitlines()
    return "\n".join(lines[:1] + lines[-12:]) if len(lines) > 13 else text


# ------------------------------------------------------------------------------- timing
def _seconds(fn: Callable[[], Any], device: Any, budget: float) -> float:
    """Seconds per call: `runtime.calibrate`'s timer (median of blocks, synchronised on a
    GPU), the one `shardwise calibrate` uses."""
    from shardwise.runtime import calibrate

    return calibrate._seconds(fn, device, budget=budget, repeats=3)


def _sync(device: Any) -> None:
    """Wait for the device's queued work (`runtime.calibrate`'s)."""
    from shardwise.runtime import calibrate

    calibrate._sync(device)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _rel(x: Any, ref: Any) -> float:
    """‖x − ref‖ / ‖ref‖ in fp64 on the CPU."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm())


# ================================================================ environment (one rank)
def env_rank(ctx: Context, path: str) -> None:
    """Versions, GPUs, the SDPA kernels torch says it has, the fp32 matmul precision."""
    import torch

    note = Notebook(path)
    note("python", platform.python_version())
    note("torch", torch.__version__)
    note("cuda", torch.version.cuda)
    note("float32_matmul_precision", torch.get_float32_matmul_precision())
    note("allow_tf32_matmul", torch.backends.cuda.matmul.allow_tf32)
    note("allow_bf16_reduced_precision_reduction",
         torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    packages = {}
    for name in ("transformers", "triton", "torchtitan", "transformer_engine", "flash_attn"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    note("packages", packages)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    note("cpu_cores", _cores())
    note("gpus", gpus)
    if not gpus:
        return
    note("devices", [{"name": p.name, "capability": f"{p.major}.{p.minor}",
                      "memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count}
                     for p in (torch.cuda.get_device_properties(i) for i in range(gpus))])
    with contextlib.suppress(Exception):
        note("cudnn", torch.backends.cudnn.version())
    with contextlib.suppress(Exception):
        note("nccl", ".".join(map(str, torch.cuda.nccl.version())))
    free, total = torch.cuda.mem_get_info()
    note("memory_free_bytes", free)
    note("memory_total_bytes", total)
    sdpa = {}
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled",
                 "math_sdp_enabled", "is_flash_attention_available"):
        with contextlib.suppress(Exception):
            sdpa[name] = bool(getattr(torch.backends.cuda, name)())
    note("sdpa", sdpa)


# =================================================================== runtime (section 1)
def _train_config(ctx: Context, model: str, dtype: str) -> Any:
    from shardwise.layout import Layout
    from shardwise.runtime.train import TrainConfig

    s = ctx.sizes
    return TrainConfig(get_model(model), Layout(), steps=s.train_steps, seq_len=s.train_seq,
                       global_batch=8, dtype=dtype)


def _fp64_from_init(config: Any) -> list[list[float]]:
    """[loss, grad norm] per step of `config` trained in fp64 on this rank, from the initial
    weights `config`'s own run draws in its dtype (the seed's draw differs per dtype), upcast:
    the reference whose only difference from the run is the run's arithmetic."""
    import torch

    from shardwise.runtime.model import Transformer
    from shardwise.runtime.train import DTYPES, build, train_step

    state = build(replace(config, dtype="fp64"))
    start = Transformer(config.model, dtype=DTYPES[config.dtype], seed=config.seed)
    with torch.no_grad():
        for mine, theirs in zip(state.model.model.parameters(), start.parameters(),
                                strict=True):
            mine.copy_(theirs)
    return [[r.loss, r.grad_norm] for r in (train_step(state) for _ in range(config.steps))]


def reference_rank(ctx: Context, path: str) -> None:
    """CPU: per `train` run, the fp64 reference and the same run on the CPU (gloo; not in a
    dry run, whose `train` step is that run)."""
    from shardwise.runtime.train import train

    note = Notebook(path)
    for model, dtype in ctx.sizes.train_runs:
        config = _train_config(ctx, model, dtype)
        note(f"{model} {dtype}: fp64", _fp64_from_init(config))
        if not ctx.dry_run:
            note(f"{model} {dtype}: cpu", [[r.loss, r.grad_norm]
                                           for r in train(config).records])


def train_rank(ctx: Context, path: str) -> None:
    """`runtime.train.train` of each run on this rank (NCCL on one GPU; gloo on the CPU)."""
    import torch

    from shardwise.runtime import launch
    from shardwise.runtime.train import train

    note = Notebook(path)
    note("device", str(launch.device()))
    for model, dtype in ctx.sizes.train_runs:
        records = train(_train_config(ctx, model, dtype)).records
        note(f"{model} {dtype}", [[r.loss, r.grad_norm] for r in records])
        note(f"{model} {dtype}: seconds per step", [r.seconds for r in records])
    if torch.cuda.is_available() and not ctx.dry_run:
        note("max_memory_allocated", torch.cuda.max_memory_allocated())


def compare_train(reference: dict[str, Any], runs: dict[str, Any],
                  sizes: Sizes) -> list[dict[str, Any]]:
    """Per run and step: the device's loss and gradient norm against the fp64 reference
    (checks), with the CPU's own run against it in the note (what the tolerance absorbs)."""
    checks = []
    for model, dtype in sizes.train_runs:
        key = f"{model} {dtype}"
        ref, cpu, mine = (reference.get(f"{key}: fp64"), reference.get(f"{key}: cpu"),
                          runs.get(key))
        if ref is None or mine is None:
            checks.append(check_item(f"train {key}", None, None,
                                     "no reference (runtime.reference failed)" if ref is None
                                     else "not run (runtime.train failed before it)"))
            continue
        for i, name in enumerate(("loss", "grad_norm")):
            errors = [abs(m[i] - r[i]) / abs(r[i]) for m, r in zip(mine, ref, strict=False)]
            on_cpu = [abs(c[i] - r[i]) / abs(r[i]) for c, r in zip(cpu or [], ref, strict=False)]
            checks.append(check_item(
                f"train {key}: {name}, worst step vs fp64", max(errors),
                TOLERANCE[(name, dtype)],
                f"per step {', '.join(f'{e:.1e}' for e in errors)}; the same run on the CPU: "
                + (", ".join(f"{e:.1e}" for e in on_cpu) or "-")))
    return checks


# ---------------------------------------------------------------------------- kernels
def _causal_attention_fp64(q: Any, k: Any, v: Any) -> Any:
    """softmax(QKᵀ/√d + causal mask)·V in fp64, written out: (b, s, a, d) with K, V at
    a_kv heads (each serves a/a_kv query heads) and V possibly narrower."""
    import torch

    group = q.shape[2] // k.shape[2]
    # (b, s, heads, d) -> (b, heads, s, d), kv heads repeated to all query heads
    qh = q.transpose(1, 2)
    kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = scores.shape[-1]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ vh).transpose(1, 2)


def _function_errors(fn: Callable[..., Any], inputs: list[Any], dtype: Any, device: Any,
                     layout: Callable[[Any], Any] = lambda t: t) -> dict[str, float]:
    """Forward + backward of `fn` in `dtype` on `device` against `_causal_attention_fp64` on
    the same rounded inputs: relative error of the output and each input's gradient.
    `layout` maps a (b, s, heads, d) tensor to `fn`'s layout (and back: it is a transpose)."""
    import torch

    rounded = [x.to(dtype) for x in inputs]
    ref_in = [r.double().requires_grad_() for r in rounded]
    ref = _causal_attention_fp64(*ref_in)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad = grad.to(dtype)
    ref.backward(grad.double())
    mine = [layout(r.to(device)).contiguous().requires_grad_() for r in rounded]
    out = fn(*mine)
    out.backward(layout(grad.to(device)))
    errors = {"out": _rel(layout(out), ref)}
    for name, m, r in zip("qkv", mine, ref_in, strict=True):
        errors[f"d{name}"] = _rel(layout(m.grad), r.grad)
    return errors


def _module_errors(make: Callable[[Any], Any], args: Callable[[Any, Any], tuple[Any, ...]],
                   state: dict[str, Any], dtype: Any, device: Any) -> dict[str, Any]:
    """Forward + backward of the runtime module `make(dtype)` on `device`, weights `state`
    rounded to `dtype`, against `make(fp64)` on the CPU with those rounded weights upcast, on
    the same rounded input (`args(x, dtype)` builds the call's arguments; x is the input
    whose gradient is compared): output, input gradient, every weight gradient (the worst
    named), and the MoE's per-expert rows (the routing) where the module has them."""
    import torch

    weights = {k: v for k, v in state.items() if not k.startswith("__")}

    def build(d: Any, where: Any) -> Any:
        module = make(d)  # the rounded weights, in `d` (fp64: upcast exactly)
        module.load_state_dict({k: v.to(dtype).to(d) for k, v in weights.items()})
        return module.to(where)

    x = state["__input__"].to(dtype)
    grad = state["__grad__"].to(dtype)
    results = []
    for d, where in ((torch.float64, torch.device("cpu")), (dtype, device)):
        module = build(d, where)
        inp = x.to(device=where, dtype=d).requires_grad_()
        out = module(*args(inp, d))
        out.backward(grad.to(device=where, dtype=d))
        results.append((module, inp, out))
    (ref_mod, ref_in, ref_out), (mod, inp, out) = results
    errors: dict[str, Any] = {"out": _rel(out, ref_out), "dx": _rel(inp.grad, ref_in.grad)}
    weights = {name: _rel(p.grad, dict(ref_mod.named_parameters())[name].grad)
               for name, p in mod.named_parameters() if p.grad is not None}
    worst = max(weights, key=lambda k: weights[k])
    errors |= {"dweights": weights[worst], "dweights_worst": worst}
    rows = getattr(mod, "expert_rows", None)
    if rows is not None:  # same routing: the same rows per expert
        errors["routing_mismatch_rows"] = int((rows.cpu() - ref_mod.expert_rows).abs().sum())
    return errors


def _moe_state(spec: Any, tokens: int) -> dict[str, Any]:
    """Weights of the runtime's `MoE` layer for `spec` (router std 1/√h, experts 1/√fan-in)
    and `tokens` input rows whose top-k choice is stable: unchanged under 8 random relative
    perturbations of their router scores by up to 2^-5 (8× bf16's u), far beyond what the
    dtype's rounding moves them — so every dtype must route them alike."""
    import torch

    from shardwise.runtime.model import MoE

    gen = torch.Generator().manual_seed(0)
    moe = MoE(spec, torch.float64)
    state = {}
    for name, p in moe.named_parameters():
        fan_in = spec.d_model if name in ("router", "w_gate", "w_up", "shared_gate",
                                          "shared_up") else spec.expert_d_ff
        state[name] = torch.randn(p.shape, dtype=torch.float64, generator=gen) / math.sqrt(fan_in)
    state |= {k: v for k, v in moe.state_dict().items() if k not in state}  # buffers
    moe.load_state_dict(state)
    rule = moe.rule()
    candidates = torch.randn(16 * tokens, spec.d_model, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        probs = rule.probs(candidates, moe.router)
        chosen = rule.choose(probs)[0].sort(-1).values
        stable = torch.ones(len(candidates), dtype=torch.bool)
        for _ in range(8):
            noise = 1 + 2.0**-5 * (2 * torch.rand(probs.shape, generator=gen,
                                                  dtype=torch.float64) - 1)
            stable &= (rule.choose(probs * noise)[0].sort(-1).values == chosen).all(-1)
    kept = candidates[stable][:tokens]
    if len(kept) < tokens:
        raise RuntimeError(f"only {len(kept)} of {tokens} stable tokens for the MoE check")
    state["__input__"] = kept.reshape(1, tokens, spec.d_model)  # (T, h) -> (1, T, h)
    state["__grad__"] = torch.randn(1, tokens, spec.d_model, dtype=torch.float64, generator=gen)
    return state


def _mla_state(spec: Any, seq: int) -> dict[str, Any]:
    """Weights of the runtime's `LatentAttention` for `spec` (std 1/√fan-in; norms 1), an
    input (1, seq, h) and an output gradient."""
    import torch

    from shardwise.runtime.model import LatentAttention

    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, p in LatentAttention(spec, True, torch.float64).named_parameters():
        state[name] = (torch.ones_like(p) if p.dim() == 1 else
                       torch.randn(p.shape, dtype=torch.float64, generator=gen)
                       / math.sqrt(p.shape[1]))
    state["__input__"] = torch.randn(1, seq, spec.d_model, dtype=torch.float64, generator=gen)
    state["__grad__"] = torch.randn(1, seq, spec.d_model, dtype=torch.float64, generator=gen)
    return state


SDPA_KERNELS = {"fa2": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
"""Calibration kernel name → `torch.nn.attention.SDPBackend` member (fa2: torch's bundled
FlashAttention-2)."""


def _sdpa(kernel: str) -> Callable[..., Any]:
    """Causal SDPA on (b, heads, s, d) forced onto one backend (raises if it cannot run)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_KERNELS[kernel])

    def run(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def kernels_rank(ctx: Context, path: str) -> None:
    """Each kernel the runtime (and the calibration) uses, forward + backward in fp32 and
    bf16 on the device, against fp64: relative errors, checked against `TOLERANCE`."""
    import torch

    from shardwise.runtime.model import AttentionFunction, LatentAttention, MoE, rotary_tables

    note, device = Notebook(path), ctx.device()
    s = ctx.sizes.kernel_seq
    gen = torch.Generator().manual_seed(0)
    # the runtime's GQA core: b=2, 8 query heads, 2 kv heads, d=64
    gqa = [torch.randn(2, s, heads, 64, dtype=torch.float64, generator=gen)
           for heads in (8, 2, 2)]
    mha = [torch.randn(2, s, 8, 64, dtype=torch.float64, generator=gen) for _ in range(3)]
    heads_first = lambda t: t.transpose(1, 2)  # noqa: E731  (b, s, a, d) <-> (b, a, s, d)
    # name -> (errors in a dtype, tolerance kind, optional: may be missing on this device)
    cases: dict[str, tuple[Callable[[Any], dict[str, Any]], str, bool]] = {
        "attention core, flash path": (lambda dt: _function_errors(
            lambda q, k, v: AttentionFunction.apply(q, k, v, True, True), gqa, dt, device),
            "kernel", False),
        "attention core, materialised": (lambda dt: _function_errors(
            lambda q, k, v: AttentionFunction.apply(q, k, v, True, False), gqa, dt, device),
            "kernel", False),
        **{f"sdpa {kernel}": ((lambda dt, kernel=kernel: _function_errors(
            _sdpa(kernel), mha, dt, device, heads_first)), "kernel", True)
           for kernel in SDPA_KERNELS},
    }
    for model in ("tiny-moe", "tiny-deepseek"):
        spec = get_model(model)
        state = _moe_state(spec, ctx.sizes.moe_tokens)
        cases[f"MoE layer ({model})"] = ((lambda dt, spec=spec, state=state: _module_errors(
            lambda d: MoE(spec, d), lambda x, d: (x,), state, dt, device)), "module", False)
    spec = get_model("tiny-deepseek")
    positions = torch.arange(s)
    mla = _mla_state(spec, s)

    def mla_args(x: Any, d: Any) -> tuple[Any, ...]:
        cos, sin = rotary_tables(positions, spec.rope_dim, spec.rope_theta, d,
                                 spec.rope_scaling)
        return x, cos.to(x.device), sin.to(x.device)

    for flash in (True, False):
        cases[f"MLA ({'flash path' if flash else 'materialised'}, tiny-deepseek)"] = (
            (lambda dt, flash=flash: _module_errors(
                lambda d: LatentAttention(spec, flash, d), mla_args, mla, dt, device)),
            "module", False)
    for name, (run, kind, optional) in cases.items():
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            key = f"{name} {dtype_name}"
            try:
                errors = run(dtype)
            except Exception as exc:  # recorded; the other kernels go on
                _release(device)
                if optional:  # an SDPA backend without this dtype, device or shape
                    note(key, {"unavailable": _error_text(exc)})
                else:
                    note(key, {"error": _error_text(exc)})
                    note.check(f"{kind} {key}: runs", math.inf, 0.0, _error_text(exc))
                continue
            note(key, errors)
            worst = max(v for k, v in errors.items() if k in ("out", "dq", "dk", "dv", "dx",
                                                              "dweights"))
            note.check(f"{kind} {key}: worst of output and gradients", worst,
                       TOLERANCE[(kind, dtype_name)],
                       ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in errors.items()))
            if "routing_mismatch_rows" in errors:
                note.check(f"{kind} {key}: rows routed differently from fp64",
                           errors["routing_mismatch_rows"], 0,
                           "tokens chosen stable under 2^-5 perturbations of their scores")


def _release(device: Any) -> None:
    """After an error (an OOM, say): free the allocator's cache so the next point can run."""
    import torch

    if device.type == "cuda":
        with contextlib.suppress(Exception):  # a broken context raises here too
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# ==================================================================== memory (section 2)
def _memory_stats(device: Any) -> dict[str, Any]:
    """The allocator's figures: peak allocated and reserved (what `nvidia-smi` shows less the
    CUDA context), now, allocation retries and OOMs."""
    import torch

    if device.type != "cuda":
        return {"note": "no GPU: the CPU allocator reports nothing"}
    stats = torch.cuda.memory_stats(device)
    keys = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "allocated_bytes.all.current",
            "reserved_bytes.all.current", "num_alloc_retries", "num_ooms")
    out = {k: stats.get(k) for k in keys}
    free, total = torch.cuda.mem_get_info(device)
    out["device_used_bytes"] = total - free  # as nvidia-smi counts it: context included
    return out


def _layer_model(ctx: Context) -> Any:
    """Llama-3-8B cut to 2 layers (dry run: its shape scaled down)."""

    h, a, kv, f, vocab = ctx.sizes.layer_shape
    return replace(get_model("llama3-8b"), name="llama3-8b-2layers", n_layers=2, d_model=h,
                   n_heads=a, n_kv_heads=kv, d_ff=f, vocab=vocab)


def _check_memory(ctx: Context, note: Notebook, spec: Any, seq: int, batch: int) -> None:
    """`check_layout` of `spec` in bf16 on this rank (as `shardwise check` runs it) and the
    allocator's statistics after it."""
    from shardwise.layout import Layout
    from shardwise.runtime import launch
    from shardwise.runtime.measure import check_layout
    from shardwise.runtime.train import TrainConfig

    config = TrainConfig(spec, Layout(), steps=2, seq_len=seq, global_batch=batch,
                         dtype="bf16")
    rows = check_layout(config, steps=2)
    note(f"{spec.name}: rows", [row.as_dict() for row in rows])
    note(f"{spec.name}: memory_stats", _memory_stats(launch.device()))


def layer_memory_rank(ctx: Context, path: str) -> None:
    """The Llama-3-8B layers through `check_layout` (NCCL on one GPU)."""
    import torch

    if not ctx.dry_run:  # the 1.5B-parameter model is drawn on the CPU
        torch.set_num_threads(_cores())
    _check_memory(ctx, Notebook(path), _layer_model(ctx), ctx.sizes.layer_seq, 1)


def tiny_memory_rank(ctx: Context, path: str) -> None:
    """tiny, tiny-moe, tiny-deepseek through `check_layout` (`shardwise check`'s defaults)."""

    note = Notebook(path)
    for model in ctx.sizes.memory_models:
        _check_memory(ctx, note, get_model(model), 64, 8)


def hf_layers_rank(ctx: Context, path: str) -> None:
    """transformers' `LlamaForCausalLM` with the layer model's shapes (2 layers), bf16, one
    forward + backward of the loss per attention implementation (`_hf_step`)."""
    import transformers

    note = Notebook(path)
    note("transformers", transformers.__version__)
    for attention in ("sdpa", "eager"):
        note(attention, _hf_step(ctx, attention))
        _release(ctx.device())


def _hf_step(ctx: Context, attention: str) -> dict[str, Any]:
    """Bytes each layer saves (`runtime.measure.saved_bytes_per_layer`), allocated by the
    forward, and the forward + backward peak above the weights (GPU)."""
    import torch
    import transformers

    from shardwise.runtime.measure import saved_bytes_per_layer

    device, spec, seq = ctx.device(), _layer_model(ctx), ctx.sizes.layer_seq
    config = transformers.LlamaConfig(
        hidden_size=spec.d_model, num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads, intermediate_size=spec.d_ff, num_hidden_layers=2,
        vocab_size=spec.vocab, max_position_embeddings=max(seq, 4096),
        attn_implementation=attention)
    torch.manual_seed(0)
    with device:  # drawn where it runs (1.5B parameters: seconds on a GPU)
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).train()
    _release(device)  # the fp32 draw's blocks
    ids = torch.randint(0, spec.vocab, (1, seq), device=device)
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if gpu else 0
    outputs: list[Any] = []
    saved = saved_bytes_per_layer(model, list(model.model.layers),
                                  lambda: outputs.append(model(input_ids=ids, labels=ids)))
    after = torch.cuda.memory_allocated() if gpu else 0
    outputs[0].loss.backward()
    result = {"saved_per_layer": saved, "weights_bytes": sum(
        p.numel() * p.element_size() for p in model.parameters())}
    if gpu:
        result |= {"allocated_by_forward": after - before,
                   "peak_above_weights": torch.cuda.max_memory_allocated() - before,
                   "memory_stats": _memory_stats(device)}
    return result


def memory_checks(items: dict[str, Any], spec: Any, seq: int, batch: int
                  ) -> list[dict[str, Any]]:
    """The rows of a `check_layout` of `batch` sequences (targets as `shardwise check`), the
    measured bytes saved per layer and micro-batch (of 1 sequence, `Layout`'s default)
    against every activation profile (reported: the runtime saves `shardwise`'s), and the
    allocator's reserved peak against its allocated one and the modelled peak."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.estimate.profiles import profile_names, saved_tensors
    from shardwise.layout import Layout, TrainSpec

    rows = items.get(f"{spec.name}: rows") or []
    checks = _row_checks(spec.name, rows)
    layers: dict[int, float] = {}  # a MoE layer's rows: "layer k attention", "layer k MoE"
    for row in rows:
        if row["item"] == "activations" and row["what"].startswith("layer "):
            k = int(row["what"].split()[1])
            layers[k] = layers.get(k, 0.0) + row["measured"]
    for k, measured in layers.items():
        for impl in profile_names():
            predicted = sum(saved_tensors(impl, spec, seq, 1, flash=True, dtype_bytes_=2,
                                          moe=spec.is_moe_layer(k)).values())
            checks.append(check_item(f"{spec.name}: layer {k} saved vs the {impl} profile",
                                     abs(measured / predicted - 1), None,
                                     f"measured {measured:.0f} B (the runtime), profile "
                                     f"{predicted:.0f} B"))
    stats = items.get(f"{spec.name}: memory_stats") or {}
    if stats.get("reserved_bytes.all.peak"):
        peak, reserved = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
        stage = training_memory_per_gpu(spec, Layout(), TrainSpec(
            seq_len=seq, global_batch=batch, dtype="bf16", impl="shardwise"))[0]
        terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in
                          (*stage.as_dict().items(), *stage.transients) if v)
        checks.append(check_item(f"{spec.name}: peak reserved / peak allocated − 1",
                                 reserved / peak - 1, None,
                                 f"allocated {peak / 2**30:.2f} GiB, reserved "
                                 f"{reserved / 2**30:.2f} GiB (the allocator's cache and "
                                 f"fragmentation: what nvidia-smi adds)"))
        checks.append(check_item(f"{spec.name}: peak reserved vs the modelled peak",
                                 abs(reserved / stage.peak - 1), None,
                                 f"reserved {reserved / 2**30:.2f} GiB, modelled peak "
                                 f"{stage.peak / 2**30:.2f} GiB (peak term {stage.peak_term}, "
                                 f"transient {stage.peak_transient or 'none'}; GiB: {terms})"))
    return checks


def hf_checks(items: dict[str, Any], spec: Any, seq: int) -> list[dict[str, Any]]:
    """transformers' second layer against its profile (target 1 %, as measured on CPU by
    tests/estimate/test_profiles_measured.py), and the peak against the modelled one."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.estimate.profiles import saved_tensors
    from shardwise.layout import Layout, TrainSpec

    checks = []
    for attention, impl in (("sdpa", "hf-sdpa"), ("eager", "hf-eager")):
        got = items.get(attention)
        if not got:
            continue
        predicted = sum(saved_tensors(impl, spec, seq, 1, dtype_bytes_=2).values())
        measured = got["saved_per_layer"][1]  # layer 0 also holds the shared RoPE tables
        checks.append(check_item(f"transformers {attention}: layer 1 saved vs {impl}",
                                 abs(measured / predicted - 1), PROFILE_TARGET,
                                 f"measured {measured:.0f} B, profile {predicted:.0f} B"))
        if "peak_above_weights" in got:
            stage = training_memory_per_gpu(spec, Layout(), TrainSpec(
                seq_len=seq, global_batch=1, dtype="bf16", impl=impl))[0]
            held = stage.activations + stage.logits
            checks.append(check_item(
                f"transformers {attention}: allocated by the forward vs modelled",
                abs(got["allocated_by_forward"] / held - 1), None,
                f"measured {got['allocated_by_forward'] / 2**30:.2f} GiB; modelled "
                f"{held / 2**30:.2f} GiB = the {impl} profile's activations of 2 layers, the "
                "final norm's input and the fp32 logits (estimate/memory.py)"))
            modelled = (stage.grads + stage.activations + stage.logits
                        + max(v for k, v in stage.transients if k != "optimizer step"))
            checks.append(check_item(
                f"transformers {attention}: forward + backward peak above the weights vs "
                "modelled", abs(got["peak_above_weights"] / modelled - 1), None,
                f"measured {got['peak_above_weights'] / 2**30:.2f} GiB; modelled "
                f"{modelled / 2**30:.2f} GiB = grads + activations + logits + the largest "
                f"transient (estimate/memory.py; peak term {stage.peak_transient})"))
    return checks


# =============================================================== calibration (section 3)
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


# ================================================================ multi-GPU (section 4)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def collectives_rank(ctx: Context, path: str) -> None:
    """Each collective over the world against message size through `runtime.collectives`
    (what training calls): the slowest rank's mean call, every rank making the same calls."""
    import torch.distributed as dist

    world = dist.get_world_size()
    note = Notebook(path) if dist.get_rank() == 0 else None
    for op in COLLECTIVES:
        for size in ctx.sizes.collective_sizes:
            n = size // 4 // world * world  # fp32 elements, divisible by the ranks
            seconds = _collective_seconds(op, n, 20 if size < 2**24 else 5)
            if note is not None:
                note(f"{op} {4 * n}", {"op": op, "ranks": world, "bytes": 4 * n,
                                       "seconds": seconds})


def _collective_seconds(op: str, n: int, calls: int) -> float:
    """The mean of `calls` back-to-back calls of `op` on `n` fp32 elements over the world,
    after one untimed call and a barrier; the slowest rank's."""
    import torch
    import torch.distributed as dist

    from shardwise.runtime import collectives as C
    from shardwise.runtime import launch

    device, world = launch.device(), dist.get_world_size()
    full = torch.ones(n, device=device)
    part = torch.ones(n // world, device=device)
    out = torch.empty_like(full)
    call = {"all-reduce": lambda: C.all_reduce(full),
            "reduce-scatter": lambda: C.reduce_scatter(part, full),
            "all-gather": lambda: C.all_gather(full, part),
            "all-to-all": lambda: C.all_to_all_single(out, full)}[op]
    call()
    C.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    _sync(device)
    mean = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64,
                        device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean)


def collective_checks(items: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Bus bandwidth (nccl-tests' convention) against the step model's ring on the preset's
    calibrated intra-node link (reported)."""
    from shardwise.calibration import default_calibration
    from shardwise.estimate.comm import bus_bandwidth, collective_time
    from shardwise.hardware import get_accelerator, get_link

    link = default_calibration(label).link(get_link(get_accelerator(label).intra))
    checks = []
    for p in items.values():
        predicted = collective_time(p["op"], p["bytes"], p["ranks"], link)
        measured = bus_bandwidth(p["op"], p["bytes"], p["ranks"], p["seconds"])
        checks.append(check_item(
            f"{p['op']} {p['ranks']} ranks {p['bytes']} B: busbw / model − 1",
            measured / bus_bandwidth(p["op"], p["bytes"], p["ranks"], predicted) - 1, None,
            f"measured {measured / 1e9:.2f} GB/s; model {link.name} ring"))
    return checks


def _cli(args: list[str], timeout: float) -> dict[str, Any]:
    """`python -m shardwise ARGS --json` (what a user runs) within `timeout`: its JSON."""
    done = subprocess.run([sys.executable, "-m", "shardwise", *args, "--json"],
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode not in (0, 1):  # 1: `check` with rows that miss their target
        raise RuntimeError(f"shardwise {' '.join(args)}: exit {done.returncode}: "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


# ========================================================================= the steps
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
    return fit_calibration(measured, ctx.accelerator, out, results.get("environment.env", {}))


def _calibrate_step(ctx: Context, timeout: float, results: dict[str, Any]
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    backend, ranks = ("gloo", 2) if ctx.dry_run else ("nccl", results["__gpus__"])
    out = Path(results["__out__"]) / f"calibrate-{backend}.json"
    data = _cli(["calibrate", "--backend", backend, "--ranks", str(ranks), "--quick",
                 "--out", str(out)], timeout)
    return {"file": out.name, "constants": data["default"], "machine": data["machine"]}, []


def _row_checks(prefix: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`shardwise check`'s rows (`CheckRow.as_dict`) as checks with the rows' own targets
    (exact: float rounding, 1 %; "-": reported)."""
    checks = []
    for row in rows:
        target = {"exact": 1e-12, "1%": 0.01}.get(row["target"])
        error = None if row["error"] is None else abs(row["error"])
        checks.append(check_item(f"{prefix}: {row['item']} {row['what']}", error, target,
                                 f"predicted {row['predicted']}, measured {row['measured']}; "
                                 f"{row['note']}"))
    return checks


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


# ========================================================================= the report
@dataclass
class Report:
    """gpu_check.json and summary.md in `out`, rewritten after every step."""

    out: Path
    data: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        """Both files, each replaced whole (a reader never sees half of one); a summary that
        cannot be drawn says why instead of stopping the run."""
        try:
            summary = summary_markdown(self.data)
        except Exception as exc:  # the JSON holds everything: never lose the run to a table
            summary = (f"# gpu_check\n\nThe summary failed ({_error_text(exc)}); "
                       "see gpu_check.json.\n")
        for name, text in (("gpu_check.json", json.dumps(_plain(self.data), indent=1,
                                                         default=str) + "\n"),
                           ("summary.md", summary)):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(self.out / name)

    def step(self, step: Step, entry: dict[str, Any]) -> None:
        section = self.data["sections"][step.section]
        section["steps"][step.name] = entry
        statuses = {e["status"] for e in section["steps"].values()}
        section["status"] = ("skipped" if statuses == {"skipped"} else
                             "failed" if statuses == {"failed"} else
                             "partial" if "failed" in statuses else "measured")
        section["wall_s"] = sum(e.get("wall_s", 0.0) for e in section["steps"].values())
        checks = [c for s in self.data["sections"].values() for e in s["steps"].values()
                  for c in e.get("checks", [])]
        self.data["checks"] = {"passed": sum(c["ok"] is True for c in checks),
                               "failed": sum(c["ok"] is False for c in checks),
                               "reported": sum(c["ok"] is None for c in checks)}
        self.write()


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float) else str(value)


MEMORY_FIGURES = ("max_memory_allocated", "reserved", "peak above", "allocated by the forward",
                  "layer 1 saved vs")  # the memory checks the summary lists


def summary_markdown(data: dict[str, Any]) -> str:
    """The short summary: the run, each step's status and time, failed checks, the
    calibration against the preset."""
    env = data.get("environment") or {}
    device = (env.get("devices") or [{"name": "no GPU (dry run)" if data["dry_run"]
                                      else "no GPU"}])[0]["name"]
    lines = [f"# gpu_check {'(dry run) ' if data['dry_run'] else ''}— {device}", "",
             f"Started {data['started']}, {data.get('wall_s', 0):.0f} s of a "
             f"{data['budget_s']:.0f} s budget; torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, NCCL {env.get('nccl')}, {env.get('gpus', 0)} GPU(s). "
             f"Checks: {data.get('checks', {}).get('passed', 0)} passed, "
             f"{data.get('checks', {}).get('failed', 0)} failed, "
             f"{data.get('checks', {}).get('reported', 0)} reported.", "",
             "| section | step | status | seconds (budget) | note |", "|---|---|---|---:|---|"]
    for section, s in data["sections"].items():
        for name, e in s["steps"].items():
            note = (e.get("reason") or e.get("error") or "").splitlines()
            lines.append(f"| {section} | {name} | {e['status']} | {e.get('wall_s', 0):.1f} "
                         f"({e['timeout_s']:.0f}) | {(note[0] if note else '')[:160]} |")
    failed = [(name, c) for s in data["sections"].values() for name, e in s["steps"].items()
              for c in e.get("checks", []) if c["ok"] is False]
    if failed:
        lines += ["", "## Checks that failed", "", "| step | check | value | tolerance |",
                  "|---|---|---:|---:|"]
        lines += [f"| {name} | {c['what']} | {_cell(c['value'])} | {_cell(c['tolerance'])} |"
                  for name, c in failed]
    for title, section, keep in (
            ("Runtime against fp64", "runtime", lambda c: c["ok"] is not None),
            ("Memory", "memory", lambda c: any(key in c["what"] for key in MEMORY_FIGURES)),
            ("Multi-GPU step time", "multi-gpu", lambda c: "step time" in c["what"])):
        steps = data["sections"].get(section, {}).get("steps", {})
        rows = [(name, c) for name, e in steps.items() for c in e.get("checks", []) if keep(c)]
        if rows:
            lines += ["", f"## {title}", "", "| step | figure | value | tolerance | note |",
                      "|---|---|---:|---:|---|"]
            lines += [f"| {name} | {c['what']} | {_cell(c['value'])} | "
                      f"{_cell(c['tolerance']) if c['tolerance'] is not None else '-'} | "
                      f"{c['note'][:200]} |" for name, c in rows]
    fit = data["sections"].get("calibration", {}).get("steps", {}).get("fit", {})
    consts = (fit.get("items") or {}).get("constants")
    if consts:
        lines += ["", f"## Calibration ({fit['items']['file']}) against the preset", "",
                  "| constant | preset | measured |", "|---|---:|---:|"]
        for key in ("matmul_efficiency", "matmul_half_dim", "hbm_efficiency"):
            if key in consts["measured"]:
                lines.append(f"| {key} | {consts['preset'][key]} | {consts['measured'][key]} |")
        for kernel, params in consts["measured"].get("attention", {}).items():
            old = consts["preset"]["attention"].get(kernel, {})
            lines.append(f"| attention {kernel} (e, d½, s½, r_b) | "
                         f"{', '.join(str(old.get(k, '-')) for k in params)} | "
                         f"{', '.join(str(v) for v in params.values())} |")
    return "\n".join(lines) + "\n"


def accelerator_label(name: str, memory_bytes: int) -> str | None:
    """The hardware preset a CUDA device name stands for (None: none known)."""
    n = name.lower()
    for key, label in (("gh200", "gh200"), ("h200", "h200"), ("h100 pcie", "h100-pcie"),
                       ("h100 nvl", "h100-nvl"), ("h100", "h100-sxm"), ("b200", "b200")):
        if key in n:
            return label
    if "a100" in n:
        return "a100-80gb" if memory_bytes > 50 * 2**30 else "a100-40gb"
    return None


# What every step's ranks import: loaded once by the server they fork from (`launch.spawn`'s
# forkserver), not once per step (seconds each on a small machine).
PRELOAD = ("torch", "torch.distributed", "shardwise.runtime.collectives",
           "shardwise.runtime.train", "shardwise.runtime.measure")


def _warm_forkserver() -> None:
    """Start the forkserver `launch.spawn` forks its ranks from with `PRELOAD` imported (it
    starts once per process; `launch` then finds it running)."""
    import multiprocessing.forkserver

    import torch.multiprocessing

    if "forkserver" in torch.multiprocessing.get_all_start_methods():
        torch.multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()


def run(out: Path, dry_run: bool, budget: float, accelerator: str | None,
        only: tuple[str, ...]) -> dict[str, Any]:
    """Every step in order within `budget` seconds; the report after each."""
    start = time.monotonic()
    sizes = DRY if dry_run else GPU
    report = Report(out, {
        "schema": SCHEMA, "dry_run": dry_run, "command": " ".join(sys.argv),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "budget_s": budget, "tolerances": {f"{what} {dtype}": tol for (what, dtype), tol
                                           in TOLERANCE.items()},
        "environment": {}, "checks": {},
        "sections": {step.section: {"status": "pending", "steps": {}} for step in STEPS}})
    report.write()
    scratch = tempfile.mkdtemp(prefix="gpu_check-")
    results: dict[str, Any] = {"__out__": str(out), "__gpus__": 0}
    ctx = Context(dry_run, sizes, accelerator or ("h200" if dry_run else None), scratch)
    for step in STEPS:
        key = f"{step.section}.{step.name}"
        entry: dict[str, Any] = {"timeout_s": step.timeout_s, "expect_s": step.expect_s}
        left = budget - (time.monotonic() - start)
        timeout = min(step.timeout_s if not dry_run else 60.0, left)
        reason = None
        if only and step.section not in only and key not in only and step.name != "env":
            reason = f"not asked for (--only {','.join(only)})"
        elif step.gpus and results["__gpus__"] < step.gpus and not dry_run:
            reason = (f"needs {step.gpus} GPUs, this machine has {results['__gpus__']}: "
                      "NCCL collectives and the dp/tp/pp checks need two")
        elif timeout < MIN_STEP_S:
            reason = f"global budget spent ({left:.0f} s of {budget:.0f} s left)"
        elif key == "calibration.fit" and ctx.accelerator is None:
            reason = "unknown accelerator: pass --accelerator PRESET"
        if reason:
            report.step(step, entry | {"status": "skipped", "reason": reason})
            continue
        began = time.monotonic()
        if key == "environment.env":
            with contextlib.suppress(Exception):  # else `launch` starts its own
                _warm_forkserver()
        print(f"[{began - start:6.1f} s] {key} (timeout {timeout:.0f} s)", flush=True)
        try:
            items, checks = step.run(ctx, timeout, results)
            entry |= {"status": "measured", "items": items, "checks": checks}
        except StepSkipped as exc:
            entry |= {"status": "skipped", "reason": str(exc)}
        except StepFailed as exc:
            entry |= {"status": "failed", "error": str(exc), "items": exc.items,
                      "checks": exc.checks}
        except Exception as exc:  # any error is recorded; the run goes on
            entry |= {"status": "failed", "error": _error_text(exc) + "\n"
                      + "".join(traceback.format_tb(exc.__traceback__)[-3:])}
        entry["wall_s"] = time.monotonic() - began
        results[key] = entry.get("items", {})
        if key == "environment.env":
            env = entry.get("items", {})
            results["__gpus__"] = env.get("gpus", 0)
            report.data["environment"] = env
            if env.get("devices") and accelerator is None:
                ctx = replace(ctx, accelerator=accelerator_label(
                    env["devices"][0]["name"], env["devices"][0]["memory_bytes"]))
            if not dry_run and not env.get("gpus"):
                report.data["note"] = "no GPU found: every GPU step fails; use --dry-run on a CPU"
            report.data["accelerator"] = ctx.accelerator
        report.data["wall_s"] = time.monotonic() - start
        report.step(step, entry)
    report.data["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    report.data["wall_s"] = time.monotonic() - start
    report.write()
    shutil.rmtree(scratch, ignore_errors=True)  # every notebook is in the JSON
    return report.data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.json, summary.md and the "
                                               "calibration file (created)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU at tiny sizes (gloo, no CUDA)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {GLOBAL_BUDGET_S:.0f}; "
                             f"dry run {DRY_BUDGET_S:.0f})")
    parser.add_argument("--accelerator", default=None,
                        help="the hardware preset this GPU is (default: from its name)")
    parser.add_argument("--only", default="",
                        help="comma-separated sections or section.step to run (env always)")
    args = parser.parse_args()
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        print(f"gpu_check: cannot write to {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    if args.accelerator is not None:
        from shardwise.hardware import ACCELERATORS

        if args.accelerator not in ACCELERATORS:
            print(f"gpu_check: unknown accelerator {args.accelerator!r}; valid: "
                  f"{', '.join(ACCELERATORS)}", file=sys.stderr)
            return 2
    budget = (args.budget if args.budget is not None
              else DRY_BUDGET_S if args.dry_run else GLOBAL_BUDGET_S)
    if not budget > 0:
        print(f"gpu_check: --budget must be > 0 seconds, got {args.budget}", file=sys.stderr)
        return 2
    only = tuple(s for s in args.only.split(",") if s)
    data = run(args.out, args.dry_run, budget, args.accelerator, only)
    counts = data["checks"]
    print(f"wrote {args.out / 'gpu_check.json'} and summary.md in {data['wall_s']:.0f} s: "
          f"{counts.get('passed', 0)} checks passed, {counts.get('failed', 0)} failed, "
          f"{counts.get('reported', 0)} reported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
