"""`shardwise demo tp`: Megatron tensor parallelism (+ sequence parallelism) on real ranks.

The runtime's Llama-style block (GQA + SwiGLU) and a one-layer vocab-parallel LM, split by
`runtime.parallelize`, vs the same model on one device: outputs, gradients and loss; bytes per
layer vs `estimate.comm.tp_comm_bytes_per_layer`. `tp_rank` / `tp_rank_both` run inside each
rank (the tests pass their own `TPReference`); `run_tp_demo` returns rows as
`demos.common.check_row`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.demos.common import TOL, check_row, dtype_of, max_rel_diff
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm import tp_comm_bytes_per_layer
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import launch
from shardwise.runtime.mesh import Mesh
from shardwise.runtime.model import Transformer
from shardwise.runtime.parallel_transformer import ParallelTransformer, gather_shards
from shardwise.runtime.parallelize import parallelize
from shardwise.runtime.tensor_parallel import allreduce_sequence_parallel_grads

__all__ = ["TPReference", "run_tp_demo", "single_device_reference", "tp_rank", "tp_rank_both"]

_S, _B = 8, 2  # sequence and micro-batch of the TP demo
# One Llama-style layer: GQA (8 query heads over 4 kv heads) and SwiGLU; t ∈ {1, 2, 4} divides
# the heads, the kv heads, d_ff, the sequence and the vocabulary.
_TP_MODEL = ModelSpec("tp-demo", n_layers=1, d_model=32, n_heads=8, n_kv_heads=4, d_ff=64,
                      vocab=64, max_seq=_S)

# reference(model) -> (lm, block): an unsharded computation with the single-device weights of
# `model`: `lm.loss(ids, targets)` the mean loss, `block(x)` its first block on (b, s, h), both
# with the model's parameter names (see `single_device_reference`).
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


def single_device_reference(model: Transformer
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


def tp_rank(sp: bool, dtype_name: str = "float64",
               reference: TPReference = single_device_reference) -> dict[str, Any]:
    """A sharded block vs `reference`: output, input gradient, weight gradients and bytes per
    layer; then the whole LM (vocab-parallel embedding → block → norm → column-parallel head
    → vocab-parallel cross-entropy): loss and embedding / head gradients."""
    dtype = dtype_of(dtype_name)
    par = _tp_parallel(sp, dtype)
    ref = _tp_unsharded(reference, dtype)
    if set(par["grads"]) != set(ref["grads"]):
        raise ShardwiseError(f"gradients of {sorted(par['grads'])} vs {sorted(ref['grads'])}")
    t, elt = dist.get_world_size(), torch.finfo(dtype).bits // 8
    return {
        "out": max_rel_diff(par["out"], ref["out"]),
        "grad_x": max_rel_diff(par["grad_x"], ref["grad_x"]),
        "grads": max(max_rel_diff(par["grads"][k], v) for k, v in ref["grads"].items()),
        "layer_bytes": par["layer_bytes"],
        "ops": par["ops"],
        # SP as implemented re-gathers the QKV and gate/up input in backward (Megatron)
        "predicted_bytes": tp_comm_bytes_per_layer(_S, _B, _TP_MODEL.d_model, t,
                                                   dtype_bytes=elt, sp=sp, regather=True),
        "loss": abs(par["loss"] - ref["loss"]) / abs(ref["loss"]),
        "emb_grad": max_rel_diff(par["lm_grads"]["embedding.weight"],
                                 ref["lm_grads"]["embedding.weight"]),
        "head_grad": max_rel_diff(par["lm_grads"]["head.weight"], ref["lm_grads"]["head.weight"]),
    }


def tp_rank_both(dtype_name: str, reference: TPReference = single_device_reference
             ) -> list[dict[str, Any]]:
    """`tp_rank` without, then with sequence parallelism: the rows of both."""
    return [tp_rank(False, dtype_name, reference), tp_rank(True, dtype_name, reference)]


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
    res = launch(tp_rank_both, ranks, dtype, timeout_s=timeout_s, backend="gloo")
    tol = f"≤ {TOL[dtype]:g}"
    rows = []
    for i, mode in enumerate(("tp", "tp+sp")):
        def worst(key: str, i: int = i) -> float:
            return max(o[i][key] for o in res)
        rows += [
            check_row(f"{mode} t={ranks}: block output vs single-device ({dtype}, max rel. diff)",
                      worst("out"), tol),
            check_row(f"{mode}: input gradient", worst("grad_x"), tol),
            check_row(f"{mode}: weight gradients (gathered)", worst("grads"), tol),
            check_row(f"{mode}: bytes per layer per rank vs tp_comm_bytes_per_layer",
                      res[0][i]["layer_bytes"], res[0][i]["predicted_bytes"]),
            check_row(f"{mode}: vocab-parallel LM loss", worst("loss"), tol),
            check_row(f"{mode}: embedding / head gradients",
                      max(worst("emb_grad"), worst("head_grad")), tol),
        ]
    return rows
