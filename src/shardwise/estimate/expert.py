"""Expert-parallel communication of the MoE layers, per rank and micro-batch, as the stacks'
token dispatchers run it (Megatron-Core 0.16.1 `transformer/moe/token_dispatcher.py`,
`fused_a2a.py`; torchtitan 0.3.0 `models/common/token_dispatcher.py`, `moe_sharding.py`):
what each rank sends over NVLink and the inter-node link per dispatcher (`ep_volumes`), the
nodes a token reaches under node-limited routing (`nodes_reached`, DeepSeek-V3 §3.2.2), and the
exposed time after overlap (`ep_time`), overlap charged with the SMs its kernels take:

    paired(C, W) = C  if C·(S-σ)/S ≥ W  else  W + C·σ/S        (σ of S SMs communicate)

Array-polymorphic like `step.step_terms`, which calls `ep_time`. Derivation and sources:
docs/concepts/communication.md ("Expert parallelism as the dispatchers run it").
"""

from __future__ import annotations

from math import exp, lgamma
from typing import Any

import numpy as np

from shardwise.arch import ModelSpec
from shardwise.estimate.kernels import ComputeContext, linear
from shardwise.estimate.links import Links, group_collective_time
from shardwise.hardware import Accelerator, generation
from shardwise.layout import MOE_DISPATCHERS, TrainSpec
from shardwise.placement import expert_tp_degree

__all__ = ["COMM_SMS", "SMS", "SMS_BY_ACCELERATOR", "ep_time", "ep_volumes", "gpus_reached",
           "nodes_reached", "paired", "sm_count"]

COMM_SMS = 20
"""SMs the overlapped expert-parallel kernels take: DeepSeek-V3 technical report §3.2.2 (20
of the H800's 132 SMs suffice for IB + NVLink all-to-all), Megatron-Core 0.16.1
`TransformerConfig.moe_deepep_num_sms = 20` (DeepEP's default in Megatron)."""

SMS = {"hopper": 132, "blackwell": 148, "ampere": 108, "cdna3": 304, "cdna4": 256}
"""Streaming multiprocessors (compute units) per GPU by generation: H100/H800/H200 SXM 132
(NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022), B200 148 (NVIDIA Blackwell
architecture technical brief), A100 108 (NVIDIA A100 whitepaper), MI300X 304 CUs (AMD CDNA 3
white paper), MI355X 256 CUs (AMD CDNA 4 white paper)."""

SMS_BY_ACCELERATOR = {"h100-pcie": 114, "h20": 78}
"""Parts of a generation with fewer SMs than its flagship: H100 PCIe 114 of GH100's 144 (NVIDIA
H100 Tensor Core GPU Architecture whitepaper, 2022: SXM5 132, PCIe 114); H20 78 (NVIDIA
publishes none: its Geekbench 6 listing, as reported by Wccftech, 2024). Every other part takes
its generation's count (`SMS`)."""

FP8_DISPATCH_BYTES = 1 + 4 / 128
"""Bytes per element of an FP8 dispatch: e4m3 values and one fp32 scale per 1×128 tile
(DeepSeek-V3 §3.3.2: activations quantised before the dispatch, combine in BF16; DeepEP's
`Buffer.dispatch` takes the (fp8, scales) pair)."""


def _missed(total: float, per: float, draws: float) -> float:
    """Chance that `draws` distinct items drawn from `total` miss a set of `per` of them:
    `C(total - per, draws) / C(total, draws)` (through log-gamma: non-integer counts)."""
    if per >= total or draws > total - per:
        return 0.0
    return exp(lgamma(total - per + 1) + lgamma(total - draws + 1)
               - lgamma(total - per - draws + 1) - lgamma(total + 1))


def _reached(model: ModelSpec, units: Any) -> Any:
    """Expected distinct units (nodes or GPUs) of an EP group's `units` — the experts laid
    out over them in order — one token's `top_k` distinct routed experts lie on (random
    balanced routing; see `nodes_reached`)."""
    e, k, groups, chosen = model.n_experts, model.top_k, model.expert_groups, model.topk_groups
    n = np.maximum(np.asarray(units, dtype=float), 1.0)
    size = e / groups  # experts per group

    def one(u: float) -> float:
        if groups <= 1 or chosen >= groups:
            return u * (1 - _missed(e, e / u, k))
        if u <= groups:
            return u * (1 - _missed(groups, max(groups / u, 1.0), chosen))
        return chosen * (u / groups) * (1 - _missed(size, e / u, k / chosen))

    values, where = np.unique(n, return_inverse=True)  # the planner's arrays: few distinct
    return np.array([one(float(u)) for u in values])[where].reshape(n.shape)


def nodes_reached(model: ModelSpec, nodes: Any) -> Any:
    """Expected distinct nodes one token's `top_k` routed experts lie on, the experts of an
    EP group spread over `nodes` nodes in order (Megatron's expert placement), random
    balanced routing:

    * no node limit (one group, or `topk_groups ≥ expert_groups`): `N·(1 - C(E-E/N, k)/C(E, k))`
      (top-k picks k distinct experts);
    * node-limited (`moe_router_num_groups` / `n_group` groups, `topk_groups` = M chosen by
      the sum of each group's top `k/M` scores: every chosen group receives experts;
      Megatron-Core 0.16.1 `moe_utils.group_limited_topk`, DeepSeek-V3 §3.2.2), groups no
      larger than a node (`r = G/N` groups per node): `N·(1 - C(G-r, M)/C(G, M))`; groups
      spanning `q = N/G` nodes, `k/M` distinct experts in each chosen group:
      `M·q·(1 - C(E/G - E/N, k/M)/C(E/G, k/M))`.
    """
    return _reached(model, nodes)


def gpus_reached(model: ModelSpec, nodes: Any, per_node: Any) -> Any:
    """Expected distinct GPUs of an EP group (`per_node` members on each of `nodes` nodes,
    one expert shard set each) a token's routed experts lie on: `nodes_reached`'s rule with
    GPUs for nodes."""
    return _reached(model, np.asarray(nodes) * np.maximum(per_node, 1))


def ep_volumes(model: ModelSpec, train: TrainSpec, *, tokens: Any, e: Any, et: Any,
               ep_in_node: Any, act_bytes: float) -> dict[str, Any]:
    """Per rank, one MoE layer's forward: the bytes each step of the dispatcher moves.
    `tokens` is this rank's (sequence-sharded under SP: Megatron requires SP with TP for
    MoE training, `moe_layer.py`; torchtitan shards the routed experts' input over TP when EP
    is on, `moe_sharding.py`), `et` the expert-TP degree. Keys: "rows" (routed copies this
    rank sends, busiest rank: × `expert_load`, or × the capacity factor when padded),
    "dispatch"/"combine" (all-to-all payload, bytes), "gather" (the expert-TP all-gather's
    output; reduce-scatter in combine), "inter"/"intra" (with the flex dispatcher: DeepEP's
    elements over IB and NVLink per pass), "dispatch_bytes" (per element: FP8 with its scales, or the activation dtype).
    """
    k, h = model.top_k, model.d_model
    rows = tokens * k * train.routed_load
    dispatch_b = FP8_DISPATCH_BYTES if train.moe_dispatch_fp8 else act_bytes
    # Megatron's alltoall dispatcher sends each copy's routing probability beside it
    # (`token_dispatch`: `global_probs = all_to_all(...)`, the router's dtype); torchtitan
    # keeps the scores local and applies them after the combine
    probs = act_bytes if train.impl == "megatron-te" else 0.0
    out: dict[str, Any] = {"rows": rows, "dispatch": rows * (h * dispatch_b + probs),
                           "combine": rows * h * act_bytes,
                           "gather": et * rows * h * act_bytes, "dispatch_bytes": dispatch_b}
    if train.moe_dispatcher != "flex":
        return out
    nodes = np.maximum(e / np.maximum(ep_in_node, 1), 1)
    # DeepEP (flex): one RDMA copy per remote node reached, then one NVLink copy per GPU
    # reached (the routing map replicated over the expert-TP ranks: Megatron's
    # `MoEFlexTokenDispatcher._initialize_metadata`), balanced over the group
    remote = nodes_reached(model, nodes) * (nodes - 1) / nodes
    local = gpus_reached(model, nodes, ep_in_node) * et * (1 - 1 / (nodes * ep_in_node * et))
    out["inter"] = tokens * train.routed_load * remote * h  # elements per pass
    out["intra"] = tokens * train.routed_load * local * h
    return out


def sm_count(accelerator: Accelerator) -> int:
    """Streaming multiprocessors of `accelerator`: its own count (`SMS_BY_ACCELERATOR`), else
    its generation's (`SMS`), else 132."""
    own = SMS_BY_ACCELERATOR.get(accelerator.name)
    return own if own is not None else SMS.get(generation(accelerator.name), 132)


def paired(comm: Any, work: Any, sms: float, busy: float) -> Any:
    """Wall time of `work` seconds of compute beside `comm` seconds of communication whose
    kernels hold `busy` of the `sms` SMs: the compute runs at `(S-σ)/S` while the
    communication is in flight (DeepSeek-V3 §3.2.2 reserves 20 of 132 SMs for it)."""
    slow = (sms - busy) / sms
    return np.where(comm * slow >= work, comm, work + comm * busy / sms)


def ep_time(ctx: ComputeContext, links: Links, train: TrainSpec, *, t: Any, c: Any, b: Any,
            sp: Any, e: Any, etp: Any, full: Any, n_moe: Any, ep_in_node: Any, m: Any,
            work_f: Any, work_b: Any) -> tuple[Any, Any]:
    """Exposed expert-parallel (and expert-TP) time of one micro-batch's forward and backward
    over `n_moe` MoE layers on the critical stage, per rank: the dispatcher's collectives on
    the calibrated links (`ep_volumes`), backward the same again (the gradients take the
    reverse path; full recompute replays the forward's), then the overlap
    (`TrainSpec.moe_overlap`): "shared" hides each dispatch and combine behind the shared
    experts' GEMMs of the same pass (Megatron's `--moe-shared-expert-overlap`, on a side
    stream, `shared_experts.py`); "1f1b" pairs one micro-batch's forward with another's backward (Megatron's
    `--overlap-moe-expert-parallel-comm`, `pipeline_parallel/combined_1f1b.py`; DualPipe's
    chunk pairs), each pass's communication beside the other's compute `work_f`/`work_b`,
    the first micro-batch unpaired. Overlapped time costs `paired`'s SM share, never 0."""
    model, ab = ctx.model, ctx.act_bytes
    gpn = links.gpus_per_node
    et = expert_tp_degree(etp, t)
    # each rank routes its sequence shard: Megatron under SP (required with TP for MoE
    # training, `moe_layer.py`), torchtitan whenever EP is on (`moe_sharding.py`)
    shard = (np.where(sp == 1, t, 1) if train.impl == "megatron-te" else
             np.where(e > 1, t, 1) if train.impl == "torchtitan" else 1)
    tokens = ctx.seq_len / c * b / shard
    vol = ep_volumes(model, train, tokens=tokens, e=e, et=et, ep_in_node=ep_in_node,
                     act_bytes=ab)
    dispatcher = train.moe_dispatcher or MOE_DISPATCHERS[0]
    group_in = np.minimum(et * e, gpn)  # the tp_ep group: etp·ep consecutive ranks
    et_in = np.minimum(et, gpn)
    counts = 8.0 * model.n_experts
    if dispatcher == "allgather":
        # all-gather over tp_ep of the tokens, probs and routing map (E each), reduce-scatter
        # back (`MoEAllGatherTokenDispatcher`): every rank sees all etp·ep ranks' tokens
        per_rank = tokens * (model.d_model * ab + model.n_experts * (ab + 1))
        n = et * e
        fwd = (group_collective_time("all-gather", n * per_rank, n, group_in, links)
               + group_collective_time("reduce-scatter", n * tokens * model.d_model * ab, n,
                                       group_in, links))
        fwd = np.where(n > 1, fwd, 0.0)
        bwd_one = fwd
    elif dispatcher == "flex":
        # DeepEP: IB and NVLink concurrently (NVLink forwards what RDMA delivers), one
        # latency; the layout exchange `get_dispatch_layout` is local
        d_inter, c_inter = vol["dispatch_bytes"], ab
        nodes = e / np.maximum(ep_in_node, 1)
        lat = np.where(nodes > 1, links.inter_lat, links.intra_lat)

        def one(per_elem: float) -> Any:
            return lat + np.maximum(vol["inter"] * per_elem / links.inter_bw,
                                    vol["intra"] * per_elem / links.intra_bw)
        fwd = np.where(et * e > 1, one(d_inter) + one(c_inter), 0.0)
        bwd_one = fwd
    else:  # alltoall: NCCL all-to-all of every routed copy over ep, all-gather over etp
        a2a_d = group_collective_time("all-to-all", vol["dispatch"], e, ep_in_node, links)
        a2a_c = group_collective_time("all-to-all", vol["combine"], e, ep_in_node, links)
        # Megatron's expert-TP gather after the all-to-all and reduce-scatter before it
        # (torchtitan 0.3.0 shards routed experts over EP only: `expert_param_placement_sparse`)
        megatron = train.impl == "megatron-te"
        gather = np.where(megatron & (et > 1), group_collective_time(
            "all-gather", vol["gather"], et, et_in, links), 0.0)
        scatter = np.where(megatron & (et > 1), group_collective_time(
            "reduce-scatter", vol["gather"], et, et_in, links), 0.0)
        # the counts per expert before the dispatch: Megatron all-gathers them over tp_ep
        # (`preprocess`), torchtitan and the runtime swap them with an all-to-all; padded to
        # capacity, Megatron's `preprocess` returns before any exchange (every rank sends
        # `capacity` rows to every expert: the splits are known)
        count = (group_collective_time("all-gather", counts * et * e, et * e, group_in, links)
                 if megatron else
                 group_collective_time("all-to-all", counts, e, ep_in_node, links))
        if megatron and train.moe_capacity is not None:
            count = 0.0 * count
        pass_ = np.where(e > 1, a2a_d + a2a_c, 0.0) + gather + scatter
        fwd = pass_ + np.where(et * e > 1, count, 0.0)
        bwd_one = pass_
    comm_f = n_moe * fwd
    comm_b = n_moe * (bwd_one + full * fwd)
    overlap = train.moe_overlap
    if overlap == "none":
        return comm_f, comm_b
    sms = sm_count(ctx.accelerator)
    busy = float(train.comm_sms or COMM_SMS)
    if overlap == "shared":
        f_shared = model.expert_d_ff / t
        n_in = 2 if model.gated_mlp else 1
        rows = ctx.seq_len / c * b
        shared = model.n_shared_experts * (linear(ctx, rows, model.d_model, n_in * f_shared).fwd
                                           + linear(ctx, rows, f_shared, model.d_model).fwd)
        # the backward too: the comm outputs' grad_fn sequence numbers are raised
        # (`set_tensor_grad_fn_sequence_sr`), so autograd launches the gradients' dispatch and
        # combine first and the shared experts' backward (2x the forward GEMMs) beside them
        exposed_f = n_moe * (paired(fwd, shared, sms, busy) - shared)
        exposed_b = n_moe * (paired(bwd_one, 2 * shared, sms, busy) - 2 * shared
                             + full * (paired(fwd, shared, sms, busy) - shared))
        return exposed_f, exposed_b
    # "1f1b": m-1 pairs (F of one micro-batch beside B of another), the first alone
    both = comm_f + comm_b
    pair = paired(both, work_f + work_b, sms, busy) - (work_f + work_b)
    mean = ((m - 1) * pair + both) / np.maximum(m, 1)
    share = comm_f / np.maximum(both, 1e-30)
    return mean * share, mean * (1 - share)
