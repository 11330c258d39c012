"""The multi-process demonstrations behind `shardwise demo ring|ddp|zero|tp`.

Each `run_*_demo` spawns real ranks (gloo on CPU), runs the parallel code and an independent
reference in every rank — the single-process full-batch computation, PyTorch's
DistributedDataParallel, the unsharded block — and returns rows for a table:

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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import dp_step_comm_bytes, ring_bytes_on_wire, tp_comm_bytes_per_layer
from shardwise.estimate.memory import StateBytes, zero_state_bytes
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.data_parallel import BucketedDataParallel, DDPConfig, all_reduce_gradients
from shardwise.runtime.launch import launch
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.tensor_parallel import (
    BlockConfig,
    ColumnParallelLinear,
    ParallelBlock,
    ReferenceBlock,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
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
_S, _B, _V = 8, 2, 64  # sequence, micro-batch, vocabulary of the TP demo


def _gather_seq(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]), dtype=x.dtype)
    with C.counting():
        C.all_gather(out, x.contiguous(), "tp")
    return out


def _tp_worker(sp: bool, dtype_name: str = "float64",
               cfg: BlockConfig | None = None) -> dict[str, Any]:
    """A sharded block vs the unsharded one: output, input gradient, weight gradients and
    bytes per layer; then a tiny LM (vocab-parallel embedding → block → column-parallel head
    → vocab-parallel cross-entropy) vs nn.Embedding / nn.Linear / F.cross_entropy."""
    dtype = _dtype(dtype_name)
    cfg = cfg or BlockConfig()
    r, t = dist.get_rank(), dist.get_world_size()
    Mesh.from_layout(Layout(tp=t, sp=sp))
    torch.manual_seed(0)
    ref = ReferenceBlock(cfg, dtype)
    block = ParallelBlock(cfg, "tp", sequence_parallel=sp, dtype=dtype).load_reference(ref)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(_S, _B, cfg.hidden, generator=gen).to(dtype)
    upstream = torch.randn(_S, _B, cfg.hidden, generator=gen).to(dtype)

    xr = x.clone().requires_grad_(True)
    out_ref = ref(xr)
    (out_ref * upstream).sum().backward()

    mine = (lambda z: z.chunk(t)[r]) if sp else (lambda z: z)
    xp = mine(x).clone().requires_grad_(True)
    with C.counting() as counter:
        out = block(xp)
        (out * mine(upstream)).sum().backward()
    layer_bytes = counter.bytes(axis="tp")
    ops = {row["op"] for row in counter.rows()}
    allreduce_sequence_parallel_grads(block)
    assert xp.grad is not None and xr.grad is not None
    out_full = _gather_seq(out.detach()) if sp else out.detach()
    gx_full = _gather_seq(xp.grad) if sp else xp.grad
    grads = block.gathered_grads()
    ref_grads = {"norm1": ref.norm1.weight.grad, "norm2": ref.norm2.weight.grad,
                 **{k: getattr(ref, k).weight.grad for k in
                    ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}}
    elt = torch.finfo(dtype).bits // 8

    # Vocabulary-parallel embedding and cross-entropy around the block.
    torch.manual_seed(1)
    emb_ref = nn.Embedding(_V, cfg.hidden, dtype=dtype)
    head_ref = nn.Linear(cfg.hidden, _V, bias=False, dtype=dtype)
    ids = torch.randint(0, _V, (_S, _B), generator=gen)
    targets = torch.randint(0, _V, (_S, _B), generator=gen)
    ref.zero_grad()
    logits_ref = head_ref(ref(emb_ref(ids)))
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, _V), targets.reshape(-1))
    loss_ref.backward()
    emb = VocabParallelEmbedding(_V, cfg.hidden, "tp", sequence_parallel=sp, dtype=dtype)
    head = ColumnParallelLinear(cfg.hidden, _V, "tp", sequence_parallel=sp, dtype=dtype)
    rows = slice(r * _V // t, (r + 1) * _V // t)
    with torch.no_grad():
        emb.weight.copy_(emb_ref.weight[rows])
        head.weight.copy_(head_ref.weight[rows])
    block.zero_grad()
    loss = vocab_parallel_cross_entropy(head(block(emb(ids))), targets, "tp").mean()
    loss.backward()
    return {
        "out": _rel(out_full, out_ref.detach()),
        "grad_x": _rel(gx_full, xr.grad),
        "grads": max(_rel(grads[k], v) for k, v in ref_grads.items()),
        "layer_bytes": layer_bytes,
        "ops": ops,
        "predicted_bytes": tp_comm_bytes_per_layer(_S, _B, cfg.hidden, t, dtype_bytes=elt,
                                                   sp=sp),
        "loss": abs(float(loss) - float(loss_ref)) / abs(float(loss_ref)),
        "emb_grad": _rel(emb.weight.grad, emb_ref.weight.grad[rows]),
        "head_grad": _rel(head.weight.grad, head_ref.weight.grad[rows]),
    }


def _tp_both(dtype_name: str) -> list[dict[str, Any]]:
    return [_tp_worker(False, dtype_name), _tp_worker(True, dtype_name)]


def run_tp_demo(ranks: int = 2, dtype: str = "float64",
                timeout_s: float = 120) -> list[dict[str, Any]]:
    """A Llama-style block (GQA + SwiGLU) and a tiny vocab-parallel LM, t = `ranks` ways,
    without and with sequence parallelism, vs the unsharded computation."""
    cfg = BlockConfig()
    sizes = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn,
             "sequence": _S, "vocabulary": _V}
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
            _row(f"{mode} t={ranks}: block output vs unsharded ({dtype}, max rel. diff)",
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
