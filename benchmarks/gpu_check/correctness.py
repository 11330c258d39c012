"""The environment step and the runtime's training on CUDA: the fp64 CPU reference, the
`train` runs in fp32 and bf16, and their comparison against the reference.
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import replace
from importlib import metadata
from typing import Any

from gpu_check.config import TOLERANCE, Context, Sizes
from gpu_check.notebook import Notebook, _cores, check_item
from shardwise.arch import get_model


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


