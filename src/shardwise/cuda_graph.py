"""CUDA graphs of Megatron-Core's layers (`TrainSpec.cuda_graph`, `--cuda-graph-scope`): the
scopes megatron-core 0.16.1 captures with `--cuda-graph-impl transformer_engine`
(`transformer/enums.py` `CudaGraphScope`, the checks of `transformer_config.py`
`__post_init__`). A captured scope replays as one graph launch, so its kernels cost the host
nothing per micro-batch (`estimate.host`). The whole-iteration graph (`local` impl,
`full_iteration`) is not offered. Derivation: docs/concepts/step-time.md ("Compute").
"""

from __future__ import annotations

from typing import Any

__all__ = ["CUDA_GRAPH_SCOPES", "cuda_graph_layout_problems", "cuda_graph_problems"]

CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
"""attn: the attention block (norm, QKV, core, output projection, residual, pre-MLP norm);
mlp: dense layers' MLP; moe: a whole MoE layer (drop-and-pad only); moe_router: the router;
moe_preprocess: the dispatcher's preprocessing (with moe_router)."""


def cuda_graph_problems(train: Any) -> list[str]:
    """What megatron-core 0.16.1 refuses in `train.cuda_graph` (one sentence each)."""
    scopes = train.cuda_graph
    if not scopes:
        return []
    if not isinstance(scopes, tuple) or not all(isinstance(s, str) for s in scopes):
        return [f"cuda_graph must be scope names, got {scopes!r}"]
    if train.impl != "megatron-te":
        return [f"cuda_graph: {train.impl} captures no CUDA graphs (megatron-te's "
                "--cuda-graph-impl transformer_engine does)"]
    out = [f"cuda_graph scope {s!r} unknown; valid: {', '.join(CUDA_GRAPH_SCOPES)}"
           for s in scopes if s not in CUDA_GRAPH_SCOPES]
    if "moe" in scopes and "moe_router" in scopes:
        out.append("cuda_graph: moe and moe_router exclude each other (moe captures the router)")
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        out.append("cuda_graph: moe_preprocess needs moe_router")
    if "moe" in scopes and train.moe_capacity is None:
        out.append("cuda_graph: moe captures drop-and-pad MoE layers only; set moe_capacity")
    return out


def cuda_graph_layout_problems(layout: Any, model: Any, train: Any) -> list[str]:
    """The checks that need the model and layout: full recompute only under whole-iteration
    graphs; `mlp` needs a dense layer, the MoE scopes an MoE layer; selective recompute of
    the `moe` module is not graphed inside `moe_router`; with dropout, a graphed scope is not
    recomputed (core_attn in attn, mlp in mlp, moe in moe)."""
    scopes = train.cuda_graph
    if not scopes or cuda_graph_problems(train):
        return []
    out = []
    if layout.recompute == "full":
        out.append("cuda_graph: full recompute is graphed only as a whole-iteration graph "
                   "(megatron-core's local impl); use recompute=selective or none")
    if "mlp" in scopes and model.n_moe_layers == model.n_layers:
        out.append(f"cuda_graph: mlp captures dense layers' MLPs; {model.name} has none")
    if not model.is_moe and {"moe", "moe_router"} & set(scopes):
        out.append(f"cuda_graph: moe scopes need an MoE model; {model.name} is dense")
    modules = (train.recompute_modules or ("core_attn",)) if layout.recompute == "selective" \
        else ()
    if "moe" in modules and "moe_router" in scopes:
        out.append("cuda_graph: recomputing the moe module does not go with the moe_router "
                   "graph")
    for scope, module in (("attn", "core_attn"), ("mlp", "mlp"), ("moe", "moe")):
        if model.dropout and scope in scopes and module in modules:
            out.append(f"cuda_graph: with dropout the graphed {scope} scope cannot recompute "
                       f"{module}")
    return out
