"""The runtime's kernels and modules against fp64: the attention core (flash and materialised
paths), the MoE layer and MLA, in fp32 and bf16.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from gpu_check.config import TOLERANCE, Context
from gpu_check.notebook import Notebook, _error_text, _rel
from shardwise.arch import get_model


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


