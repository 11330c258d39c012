"""`shardwise demo ulysses`: context parallelism by all-to-all over heads on real ranks.
DeepSpeed-Ulysses over `ranks` gloo processes (or under torchrun) against one device in fp64 —
the attention alone (output and the gradients of Q, K, V; causal and not, GQA and MHA) and a
small Llama-style model parallelised by `runtime.parallelize` (loss and every parameter's
gradient) — and the all-to-all bytes each rank sends against
`estimate.comm.ulysses_comm_bytes_per_layer`. With an even number of ranks ≥ 4 the hybrid runs
too: all-to-all inside pairs of ranks, ring attention across the pairs.

Each row: check, kind, case, ranks, max_diff (largest |parallel - one device| relative to the
largest reference entry, over outputs and gradients), bytes_measured / bytes_predicted (the
largest over ranks; attention rows), ok (max_diff ≤ 1e-12 and every rank's bytes equal the
prediction).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from shardwise.arch import get_model
from shardwise.demos.common import max_rel_diff
from shardwise.demos.context_parallel import reference_attention
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import cp_comm_bytes_per_layer, ulysses_comm_bytes_per_layer
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import launch

__all__ = ["run_ulysses_demo"]

TOL = 1e-12
BATCH, HEAD_DIM = 2, 8


def _layouts(ranks: int, kinds: tuple[str, ...]) -> list[Layout]:
    """Ulysses over every rank; the hybrid (pairs × a ring) with an even number ≥ 4."""
    out = [Layout(cp=ranks, cp_kind="ulysses")] if "ulysses" in kinds else []
    if "hybrid" in kinds and ranks >= 4 and ranks % 2 == 0:
        out.append(Layout(cp=ranks, cp_kind="hybrid", ulysses=2))
    return out


def _attention_row(mesh: Any, layout: Layout, seq_len: int, kv_heads: int, causal: bool
                   ) -> dict[str, Any]:
    """This rank's attention, against one device's on the whole sequence."""
    from shardwise.ops.attention import layout_positions
    from shardwise.runtime.context_parallel import ring_attention, shard_for_rank
    from shardwise.runtime.parallel_transformer import CP_LAYOUT
    from shardwise.runtime.ulysses import ulysses_attention

    cp, heads = mesh.axis("cp"), 2 * layout.cp
    gen = torch.Generator().manual_seed(kv_heads + 2 * causal)
    q, k, v, w = (torch.randn(BATCH, seq_len, n, HEAD_DIM, generator=gen, dtype=torch.float64)
                  for n in (heads, kv_heads, kv_heads, heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = reference_attention(q, k, v, causal)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard_for_rank(t.detach(), cp.size, cp.rank, CP_LAYOUT)

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, causal)  # the sequence arrives in position order

    held = layout_positions(seq_len, cp.size, CP_LAYOUT)  # (c, n)
    if layout.cp_kind == "ulysses":
        attend = partial(ulysses_attention, core=local, group=cp, positions=held)
    else:
        a2a, ring = mesh.axis("cp_a2a"), mesh.axis("cp_ring")
        groups = held.reshape(ring.size, a2a.size, -1)
        attend = partial(ulysses_attention, group=a2a, positions=groups[ring.rank],
                         core=partial(ring_attention, group=ring, causal=causal,
                                      positions=groups.flatten(1).sort(dim=1).values))
    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    with C.counting() as counter:
        out = attend(ql, kl, vl)
        (out * mine(w)).sum().backward()
    diff = max([max_rel_diff(out.detach(), mine(ref))]
               + [max_rel_diff(a.grad, mine(b)) for a, b in zip((ql, kl, vl), ref_grads)])
    return {"diff": diff, "bytes": counter.as_dict()}


def _model_row(mesh: Any, layout: Layout, seq_len: int) -> dict[str, Any]:
    """A 2-layer Llama-style model on this layout: the global loss and every gradient against
    one device's on the same batch."""
    from shardwise.runtime.model import Transformer
    from shardwise.runtime.parallelize import parallelize

    spec = _model_spec(layout.cp)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab, (BATCH, seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    one = Transformer(spec, seed=0)
    ref_loss = one.loss(inputs, targets)
    ref_loss.backward()
    parallel = parallelize(Transformer(spec, seed=0), mesh, layout, seq_len)
    loss = parallel.global_loss(parallel.forward_backward(inputs, targets))
    parallel.step(lambda: None)  # the gradients averaged over the cp ranks
    grads = dict(parallel.model.named_parameters())
    diff = max([abs(loss - ref_loss.item()) / abs(ref_loss.item())]
               + [max_rel_diff(grads[name].grad, p.grad) for name, p in one.named_parameters()])
    return {"diff": diff}


def _model_spec(ranks: int) -> Any:
    """`tiny` with 2 layers and 2·ranks query heads, `ranks` key/value heads of 8 dims."""
    return get_model("tiny").with_(name=f"tiny-ulysses{ranks}", n_layers=2,
                                   d_model=16 * ranks, n_heads=2 * ranks, n_kv_heads=ranks)


def _worker(ranks: int, seq_len: int, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    from shardwise.runtime.mesh import Mesh

    rows = []
    for layout in _layouts(ranks, kinds):
        mesh = Mesh.from_layout(layout)
        for causal in (True, False):
            for kv_heads in (layout.cp, 2 * layout.cp):  # GQA and plain multi-head
                rows.append(_attention_row(mesh, layout, seq_len, kv_heads, causal))
        rows.append(_model_row(mesh, layout, seq_len))
    return rows


def _predicted(layout: Layout, seq_len: int, kv_heads: int) -> dict[str, float]:
    """Bytes per rank, forward + backward, per (axis, op) (`estimate.comm`, fp64)."""
    c, u = layout.cp, layout.ulysses_degree
    q_dim, kv_dim = 2 * c * HEAD_DIM, kv_heads * HEAD_DIM
    a2a = ulysses_comm_bytes_per_layer(seq_len, BATCH, q_dim, kv_dim, c, u, 8)
    if u == c:
        return {"cp/all-to-all": a2a}
    return {"cp_a2a/all-to-all": a2a,
            "cp_ring/send": cp_comm_bytes_per_layer(seq_len, BATCH, kv_dim / u, c // u, 8)}


def run_ulysses_demo(ranks: int = 2, *, seq_len: int | None = None,
                     kinds: tuple[str, ...] = ("ulysses", "hybrid"),
                     timeout_s: float = 120) -> list[dict[str, Any]]:
    """`kinds` of Ulysses (the hybrid with an even number of ranks ≥ 4) on `ranks` processes
    against one device, fp64: attention outputs and gradients, a model's loss and gradients;
    bytes per rank against `estimate.comm`."""
    if ranks < 2:
        raise ShardwiseError(f"demo ulysses needs ≥ 2 ranks, got {ranks}")
    seq_len = seq_len or 8 * ranks  # 4 tokens per zigzag chunk
    per_rank = launch(_worker, ranks, ranks, seq_len, kinds, timeout_s=timeout_s)
    rows, i = [], 0
    for layout in _layouts(ranks, kinds):
        kind = layout.cp_kind + ("" if layout.cp_kind == "ulysses" else
                                 f" (a2a {layout.ulysses} × ring {layout.cp // layout.ulysses})")
        for causal in (True, False):
            for kv_heads in (layout.cp, 2 * layout.cp):
                results = [rank_rows[i] for rank_rows in per_rank]
                predicted = _predicted(layout, seq_len, kv_heads)
                measured = [r["bytes"] for r in results]
                diff = max(r["diff"] for r in results)
                rows.append({
                    "check": "attention", "kind": kind,
                    "case": f"{'GQA' if kv_heads < 2 * layout.cp else 'MHA'}"
                            f"{' causal' if causal else ''}",
                    "ranks": ranks, "max_diff": diff,
                    "bytes_measured": max(sum(m.values()) for m in measured),
                    "bytes_predicted": sum(predicted.values()),
                    "ok": diff <= TOL and all(m == predicted for m in measured)})
                i += 1
        diff = max(rank_rows[i]["diff"] for rank_rows in per_rank)
        rows.append({"check": "model loss and gradients", "kind": kind, "case": "2 layers",
                     "ranks": ranks, "max_diff": diff, "ok": diff <= TOL})
        i += 1
    return rows
