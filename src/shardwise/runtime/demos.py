"""The multi-process demonstrations behind `shardwise demo ring|ddp|zero|tp`.

Each `run_*_demo` spawns real ranks (gloo on CPU), runs the parallel code and an independent
reference in every rank — the single-process full-batch computation, PyTorch's
DistributedDataParallel, the single-device model — and returns rows for a table:

    {"check": str, "measured": float, "expected": float | str, "ok": bool}

`expected` is a number when the measurement should equal it (bytes predicted by SPEC §5 / §2)
and a string such as "≤ 1e-05" for a numerical difference. The demos always use gloo on CPU
processes (also on a GPU machine). Public API:

    run_ring_demo(ranks=4, sizes=(1000, 4099, 2**16 + 1), timeout_s=120) -> list[dict]
    run_ddp_demo(ranks=2, dtype="float32", micro_batches=2, bucket_cap_bytes=1024,
                 timeout_s=120) -> list[dict]
    run_zero_demo(ranks=2, dtype="float64", steps=3, timeout_s=120) -> list[dict]
    run_tp_demo(ranks=2, dtype="float64", timeout_s=120) -> list[dict]

The `_*_worker` functions run inside each rank and return plain numbers; the tests call them
directly in float64 with tight tolerances.

Run under torchrun as well: `torchrun --nproc-per-node 4 -m shardwise.runtime.demos ring`.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import dp_step_comm_bytes, ring_bytes_on_wire, tp_comm_bytes_per_layer
from shardwise.estimate.memory import StateBytes, zero_state_bytes
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.data_parallel import BucketedDataParallel, DDPConfig, all_reduce_gradients
from shardwise.runtime.launch import launch
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.model import Transformer
from shardwise.runtime.parallelize import ParallelTransformer, gather_shards, parallelize
from shardwise.runtime.tensor_parallel import allreduce_sequence_parallel_grads
from shardwise.runtime.zero import ZeroConfig, ZeroDataParallel

__all__ = ["run_ddp_demo", "run_ring_demo", "run_tp_demo", "run_zero_demo"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Relative tolerance for "equal to float reassociation" (SPEC §8: fp32 ≤ 1e-5, typically 1e-7).
_TOL = {"float32": 1e-5, "float64": 1e-12}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ShardwiseError(f"dtype {name!r} unknown; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _row(check: str, measured: float, expected: float | str, ok: bool | None = None
         ) -> dict[str, Any]:
    if ok is None:
        if isinstance(expected, str):  # "≤ tol"
            ok = measured <= float(expected.split()[-1])
        else:
            ok = measured == expected
    return {"check": check, "measured": measured, "expected": expected, "ok": bool(ok)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else diff


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


# ------------------------------------------------------------------------------- ring
def _ring_worker(sizes: list[int]) -> list[dict[str, float]]:
    """p2p ring all-reduce vs the backend's, per size (float64)."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in sizes:
        gen = torch.Generator().manual_seed(numel + 7919 * r)
        x = torch.randn(numel, dtype=torch.float64, generator=gen)
        ref = x.clone()
        dist.all_reduce(ref)
        with C.counting() as c:
            C.ring_all_reduce_p2p(x)
        out.append({"numel": numel, "diff": _rel(x, ref), "bytes": c.bytes(),
                    "predicted": ring_bytes_on_wire("all-reduce", numel * 8, n)})
    return out


def run_ring_demo(ranks: int = 4, sizes: tuple[int, ...] = (1000, 4099, 2**16 + 1),
                  timeout_s: float = 120) -> list[dict[str, Any]]:
    """Ring all-reduce from send/recv vs gloo's all_reduce; bytes sent vs `2(N-1)/N·S`."""
    results = launch(_ring_worker, ranks, list(sizes), timeout_s=timeout_s, backend="gloo")
    rows = []
    for i, numel in enumerate(sizes):
        worst = max(res[i]["diff"] for res in results)
        rows.append(_row(f"p2p ring vs backend all-reduce, {numel} float64 on {ranks} ranks "
                         "(max rel. diff)", worst, f"≤ {_TOL['float64']:g}"))
        sent = results[0][i]["bytes"]
        predicted = results[0][i]["predicted"]
        # N ∤ numel: chunks differ by one element, so bytes differ from the formula by < 1 chunk
        rows.append(_row(f"bytes sent by rank 0 for {numel * 8} bytes", sent, predicted,
                         abs(sent - predicted) <= 2 * 8 * (ranks - 1)))
    return rows


# -------------------------------------------------------------------------------- DDP
def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 8)).to(dtype)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(-1).mean()


def _ddp_worker(dtype_name: str, micro_batches: int, bucket_cap_bytes: int,
                per_rank_batch: int = 4) -> dict[str, Any]:
    """Gradients of one accumulation step: manual / bucketed / PyTorch DDP vs full batch."""
    dtype = _dtype(dtype_name)
    r, n = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(dp=n))
    model = _mlp(dtype)
    gen = torch.Generator().manual_seed(1)
    batch = per_rank_batch * n
    x = torch.randn(batch, 16, generator=gen).to(dtype)
    y = torch.randn(batch, 8, generator=gen).to(dtype)
    xs, ys = x.chunk(n)[r], y.chunk(n)[r]  # this rank's shard of the global batch
    mx, my = xs.chunk(micro_batches), ys.chunk(micro_batches)

    full = copy.deepcopy(model)  # single-process reference on the whole batch
    _mse(full, x, y).backward()
    g_full = _flat_grads(full)

    manual = copy.deepcopy(model)
    for a, b in zip(mx, my):
        (_mse(manual, a, b) / micro_batches).backward()
    all_reduce_gradients(manual)

    bucketed = BucketedDataParallel(copy.deepcopy(model), "dp", DDPConfig(bucket_cap_bytes))
    with C.counting() as counter:
        for i, (a, b) in enumerate(zip(mx, my)):
            if i < micro_batches - 1:
                with bucketed.no_sync():
                    (_mse(bucketed, a, b) / micro_batches).backward()
            else:
                (_mse(bucketed, a, b) / micro_batches).backward()

    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    for i, (a, b) in enumerate(zip(mx, my)):
        if i < micro_batches - 1:
            with ddp.no_sync():
                (_mse(ddp, a, b) / micro_batches).backward()
        else:
            (_mse(ddp, a, b) / micro_batches).backward()

    g_bucketed = _flat_grads(bucketed.module)
    g_ddp = _flat_grads(ddp.module)
    n_params = sum(p.numel() for p in model.parameters())
    elt = torch.finfo(dtype).bits // 8
    return {
        "manual_vs_full": _rel(_flat_grads(manual), g_full),
        "bucketed_vs_full": _rel(g_bucketed, g_full),
        "ddp_vs_full": _rel(g_ddp, g_full),
        "bucketed_vs_ddp": _rel(g_bucketed, g_ddp),
        "grads": g_bucketed,
        "buckets": len(bucketed.buckets),
        "bytes": counter.bytes(axis="dp"),
        "calls": counter.calls(axis="dp"),
        "predicted": dp_step_comm_bytes(n_params, n, 0, grad_bytes=elt),
    }


def run_ddp_demo(ranks: int = 2, dtype: str = "float32", micro_batches: int = 2,
                 bucket_cap_bytes: int = 1024, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Manual and bucketed (hook-overlapped, accumulating) DDP vs PyTorch DDP vs full batch."""
    res = launch(_ddp_worker, ranks, dtype, micro_batches, bucket_cap_bytes,
                 timeout_s=timeout_s, backend="gloo")
    tol = f"≤ {_TOL[dtype]:g}"
    agree = max(float((o["grads"] - res[0]["grads"]).abs().max()) for o in res)
    return [
        _row(f"manual all-reduce vs full batch ({dtype}, max rel. diff)",
             max(o["manual_vs_full"] for o in res), tol),
        _row(f"PyTorch DDP vs full batch ({dtype})", max(o["ddp_vs_full"] for o in res), tol),
        _row(f"bucketed hooks, {res[0]['buckets']} buckets, {micro_batches} micro-batches, vs "
             "full batch", max(o["bucketed_vs_full"] for o in res), tol),
        _row("bucketed vs PyTorch DDP", max(o["bucketed_vs_ddp"] for o in res), tol),
        _row(f"rank agreement over {ranks} ranks (max abs diff)", agree, "≤ 0"),
        _row("bytes sent per rank per step (measured vs dp_step_comm_bytes)", res[0]["bytes"],
             res[0]["predicted"]),
    ]


# ------------------------------------------------------------------------------- ZeRO
def _zero_mlp(dtype: torch.dtype, n: int) -> nn.Module:
    """Three units of 16·w, w·w and w·8 parameters with w = 4N: every unit splits evenly over
    N ranks, so no padding blurs the comparison with SPEC §2."""
    torch.manual_seed(0)
    w = 4 * n
    return nn.Sequential(nn.Linear(16, w, bias=False), nn.Tanh(), nn.Linear(w, w, bias=False),
                         nn.Tanh(), nn.Linear(w, 8, bias=False)).to(dtype)


def _zero_worker(stage: int, dtype_name: str = "float64", steps: int = 3,
                 lr: float = 1e-2) -> dict[str, Any]:
    """Train `steps` Adam steps with ZeRO-`stage`, PyTorch DDP and full batch; compare."""
    dtype = _dtype(dtype_name)
    r, n = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(dp=n, zero=stage))
    model = _zero_mlp(dtype, n)
    full = copy.deepcopy(model)
    opt_full = torch.optim.Adam(full.parameters(), lr=lr, foreach=False)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt_ddp = torch.optim.Adam(ddp.parameters(), lr=lr, foreach=False)
    zero = ZeroDataParallel(copy.deepcopy(model), ZeroConfig(stage=stage, lr=lr), "dp")
    per_step: list[float] = []
    state: dict[str, int] = {}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4 * n, 16, generator=gen).to(dtype)
        y = torch.randn(4 * n, 8, generator=gen).to(dtype)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]
        opt_full.zero_grad()
        _mse(full, x, y).backward()
        opt_full.step()
        opt_ddp.zero_grad()
        _mse(ddp, xs, ys).backward()
        opt_ddp.step()
        zero.events.clear()
        with C.counting() as counter:
            _mse(zero, xs, ys).backward()
            state = zero.state_bytes()  # grads in their persistent form, moments exist
            zero.step()
        zero.zero_grad()
        per_step.append(counter.bytes(axis="dp"))
    params = zero.full_parameters()
    vs_ddp = max(_rel(params[k], v.detach()) for k, v in ddp.module.named_parameters())
    vs_full = max(_rel(params[k], v.detach()) for k, v in full.named_parameters())
    bitwise = all(torch.equal(params[k], v.detach()) for k, v in ddp.module.named_parameters())
    elt = torch.finfo(dtype).bits // 8
    p = zero.n_params
    return {"vs_ddp": vs_ddp, "vs_full": vs_full, "bit_identical_to_ddp": bitwise,
            "state": state, "n_params": p,
            # SPEC §2 with fp64 weights and grads, Adam's two moments, no master copy.
            "predicted_state": dict(zip(("weights", "grads", "optimizer"), zero_state_bytes(
                p, n, stage, StateBytes(elt, elt, 0, 2 * elt)))),
            "bytes_per_step": per_step,
            "predicted_bytes": dp_step_comm_bytes(p, n, stage, grad_bytes=elt,
                                                  weight_bytes=elt),
            "events": list(zero.events)}


def _zero_all_stages(dtype_name: str, steps: int) -> list[dict[str, Any]]:
    return [_zero_worker(stage, dtype_name, steps) for stage in range(4)]


def run_zero_demo(ranks: int = 2, dtype: str = "float64", steps: int = 3,
                  timeout_s: float = 120) -> list[dict[str, Any]]:
    """ZeRO-0..3: parameters after `steps` Adam steps vs DDP; state and traffic vs SPEC §2."""
    res = launch(_zero_all_stages, ranks, dtype, steps, timeout_s=timeout_s, backend="gloo")
    rows = []
    for stage in range(4):
        o = res[0][stage]
        rows.append(_row(f"ZeRO-{stage}: params after {steps} Adam steps vs PyTorch DDP "
                         f"({dtype}, max rel. diff)",
                         max(r[stage]["vs_ddp"] for r in res), f"≤ {_TOL[dtype]:g}"))
        measured = sum(o["state"].values())
        rows.append(_row(f"ZeRO-{stage}: state bytes per rank (w + g + Adam moments)",
                         measured, sum(o["predicted_state"].values())))
        rows.append(_row(f"ZeRO-{stage}: bytes sent per rank per step",
                         o["bytes_per_step"][-1], o["predicted_bytes"]))
    return rows


# --------------------------------------------------------------------------------- TP
_S, _B = 8, 2  # sequence and micro-batch of the TP demo
# One Llama-style layer: GQA (8 query heads over 4 kv heads) and SwiGLU; t ∈ {1, 2, 4} divides
# the heads, the kv heads, d_ff, the sequence and the vocabulary.
_TP_MODEL = ModelSpec("tp-demo", n_layers=1, d_model=32, n_heads=8, n_kv_heads=4, d_ff=64,
                      vocab=64, max_seq=_S)

# reference(model) -> (lm, block): an unsharded computation with the single-device weights of
# `model`: `lm.loss(ids, targets)` the mean loss, `block(x)` its first block on (b, s, h), both
# with the model's parameter names (see `_single_device_reference`).
TPReference = Callable[[Transformer], tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]


def _tp_model(dtype: torch.dtype) -> Transformer:
    """The single-device demo model, identical on every rank, with O(1) weights (the model's
    std-0.02 initialisation would leave the block close to its residual) and non-trivial norm
    weights, so the checks see every layer."""
    model = Transformer(_TP_MODEL, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # (out, in) linears, (V, h) embedding: std 1/√(last dim)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)  # norms: U(0.5, 1.5)
    return model


def _tp_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The block's input and upstream gradient (b, s, h); the LM's ids and targets (b, s)."""
    gen = torch.Generator().manual_seed(5)
    h, v = _TP_MODEL.d_model, _TP_MODEL.vocab
    return {"x": torch.randn(_B, _S, h, generator=gen).to(dtype),
            "upstream": torch.randn(_B, _S, h, generator=gen).to(dtype),
            "ids": torch.randint(0, v, (_B, _S), generator=gen),
            "targets": torch.randint(0, v, (_B, _S), generator=gen)}


def _gathered_grads(par: ParallelTransformer) -> dict[str, torch.Tensor]:
    """Every gradient at its single-device size (tp shards all-gathered; not counted)."""
    tp, out = par.axis("tp"), {}
    with C.counting():
        for name, p in par.model.named_parameters():
            if p.grad is not None:
                dim = par.shards[name].tp_dim
                out[name] = p.grad if dim is None else gather_shards(p.grad, dim, tp)
    return out


def _tp_parallel(sp: bool, dtype: torch.dtype) -> dict[str, Any]:
    """The demo model split over all ranks by `parallelize` (Megatron TP, + SP): its block's
    output, input gradient and gathered weight gradients for `upstream`, the tp bytes and ops
    of that forward and backward; then the LM's mean loss and gathered gradients."""
    t = dist.get_world_size()
    layout = Layout(tp=t, sp=sp)
    par = parallelize(_tp_model(dtype), Mesh.from_layout(layout), layout, seq_len=_S)
    tp, data = par.axis("tp"), _tp_inputs(dtype)

    def mine(z: torch.Tensor) -> torch.Tensor:  # SP: this rank's sequence slice (b, s/t, h)
        return z.chunk(t, dim=1)[tp.rank] if sp else z

    def full(z: torch.Tensor) -> torch.Tensor:
        if not sp:
            return z
        with C.counting():
            return gather_shards(z, 1, tp)

    x = mine(data["x"]).clone().requires_grad_(True)
    with C.counting() as counter:
        out = par.model.run_blocks(x, range(1), par.positions)
        (out * mine(data["upstream"])).sum().backward()
    allreduce_sequence_parallel_grads(par.model, tp)
    assert x.grad is not None
    result = {"out": full(out.detach()), "grad_x": full(x.grad), "grads": _gathered_grads(par),
              "layer_bytes": counter.bytes(axis="tp"), "ops": {r["op"] for r in counter.rows()}}
    par.zero_grad()
    loss = par.model.loss(data["ids"], data["targets"], par.positions)
    loss.backward()
    allreduce_sequence_parallel_grads(par.model, tp)
    return {**result, "loss": loss.item(), "lm_grads": _gathered_grads(par)}


def _single_device_reference(model: Transformer
                             ) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The unsharded single-device `model` itself."""
    return model, lambda x: model.run_blocks(x, range(1), torch.arange(x.shape[1]))


def _tp_unsharded(reference: TPReference, dtype: torch.dtype) -> dict[str, Any]:
    """`_tp_parallel`'s computations by `reference`, unsharded."""
    lm, block = reference(_tp_model(dtype))
    data = _tp_inputs(dtype)
    x = data["x"].clone().requires_grad_(True)
    out = block(x)
    (out * data["upstream"]).sum().backward()
    grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    loss = lm.loss(data["ids"], data["targets"])
    loss.backward()
    return {"out": out.detach(), "grad_x": x.grad, "grads": grads, "loss": loss.item(),
            "lm_grads": {n: p.grad for n, p in lm.named_parameters()}}


def _tp_worker(sp: bool, dtype_name: str = "float64",
               reference: TPReference = _single_device_reference) -> dict[str, Any]:
    """A sharded block vs `reference`: output, input gradient, weight gradients and bytes per
    layer; then the whole LM (vocab-parallel embedding → block → norm → column-parallel head
    → vocab-parallel cross-entropy): loss and embedding / head gradients."""
    dtype = _dtype(dtype_name)
    par = _tp_parallel(sp, dtype)
    ref = _tp_unsharded(reference, dtype)
    if set(par["grads"]) != set(ref["grads"]):
        raise ShardwiseError(f"gradients of {sorted(par['grads'])} vs {sorted(ref['grads'])}")
    t, elt = dist.get_world_size(), torch.finfo(dtype).bits // 8
    return {
        "out": _rel(par["out"], ref["out"]),
        "grad_x": _rel(par["grad_x"], ref["grad_x"]),
        "grads": max(_rel(par["grads"][k], v) for k, v in ref["grads"].items()),
        "layer_bytes": par["layer_bytes"],
        "ops": par["ops"],
        # SP as implemented re-gathers the QKV and gate/up input in backward (Megatron)
        "predicted_bytes": tp_comm_bytes_per_layer(_S, _B, _TP_MODEL.d_model, t,
                                                   dtype_bytes=elt, sp=sp, regather=True),
        "loss": abs(par["loss"] - ref["loss"]) / abs(ref["loss"]),
        "emb_grad": _rel(par["lm_grads"]["embedding.weight"],
                         ref["lm_grads"]["embedding.weight"]),
        "head_grad": _rel(par["lm_grads"]["head.weight"], ref["lm_grads"]["head.weight"]),
    }


def _tp_both(dtype_name: str, reference: TPReference = _single_device_reference
             ) -> list[dict[str, Any]]:
    return [_tp_worker(False, dtype_name, reference), _tp_worker(True, dtype_name, reference)]


def run_tp_demo(ranks: int = 2, dtype: str = "float64",
                timeout_s: float = 120) -> list[dict[str, Any]]:
    """The runtime's Llama-style block (GQA + SwiGLU) and a one-layer vocab-parallel LM, split
    t = `ranks` ways by `parallelize` without and with sequence parallelism, vs the same model
    on one device."""
    m = _TP_MODEL
    sizes = {"n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "d_ff": m.d_ff,
             "sequence": _S, "vocabulary": m.vocab}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % ranks]
    if bad:
        raise ShardwiseError(f"the tp demo splits {', '.join(bad)} {ranks} ways; use ranks "
                             "1, 2 or 4")
    res = launch(_tp_both, ranks, dtype, timeout_s=timeout_s, backend="gloo")
    tol = f"≤ {_TOL[dtype]:g}"
    rows = []
    for i, mode in enumerate(("tp", "tp+sp")):
        def worst(key: str, i: int = i) -> float:
            return max(o[i][key] for o in res)
        rows += [
            _row(f"{mode} t={ranks}: block output vs single-device ({dtype}, max rel. diff)",
                 worst("out"), tol),
            _row(f"{mode}: input gradient", worst("grad_x"), tol),
            _row(f"{mode}: weight gradients (gathered)", worst("grads"), tol),
            _row(f"{mode}: bytes per layer per rank vs tp_comm_bytes_per_layer",
                 res[0][i]["layer_bytes"], res[0][i]["predicted_bytes"]),
            _row(f"{mode}: vocab-parallel LM loss", worst("loss"), tol),
            _row(f"{mode}: embedding / head gradients",
                 max(worst("emb_grad"), worst("head_grad")), tol),
        ]
    return rows


DEMOS = {"ring": run_ring_demo, "ddp": run_ddp_demo, "zero": run_zero_demo, "tp": run_tp_demo}


def main(argv: list[str] | None = None) -> int:
    """`python -m shardwise.runtime.demos NAME [RANKS]` (also under torchrun)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in DEMOS:
        print(f"usage: python -m shardwise.runtime.demos {{{'|'.join(DEMOS)}}} [ranks]")
        return 2
    import os
    ranks = int(args[1]) if len(args) > 1 else int(os.environ.get("WORLD_SIZE", 2))
    rows = DEMOS[args[0]](ranks=ranks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for row in rows:
            print(f"{'ok ' if row['ok'] else 'FAIL'}  {row['check']}: {row['measured']:.6g} "
                  f"(expected {row['expected']})")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
