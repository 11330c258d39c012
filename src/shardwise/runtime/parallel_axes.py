"""Each parallel axis applied to the single-device `Transformer` in place, through its swap
points: tensor (+ sequence) parallel, context parallel (ring, Ulysses, hybrid), the MoE's
sequence shards and expert parallelism, the pipeline split, activation recompute.
`parallelize.parallelize` composes them. Design notes: docs/concepts/runtime.md#runtime-parallelize.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.estimate.check import ROUTING_COUNTS_OP, ROUTING_GATHER_OP
from shardwise.ops.attention import layout_positions
from shardwise.ops.moe import SequenceShards, capacity_keep, expert_capacity
from shardwise.runtime import collectives as C
from shardwise.runtime.context_parallel import local_positions, ring_attention
from shardwise.runtime.expert_parallel import expert_parallel_moe
from shardwise.runtime.mesh import AxisGroup, Mesh
from shardwise.runtime.model import LatentAttention, MoE, SwiGLU, Transformer, identity
from shardwise.runtime.parallel_transformer import CP_LAYOUT
from shardwise.runtime.pipeline import VirtualStage, replay_contexts, virtual_stages
from shardwise.runtime.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_linears,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    vocab_parallel_cross_entropy,
)
from shardwise.runtime.ulysses import ulysses_attention


def _keep(module: nn.Module, name: str, dim: int, index: int, parts: int) -> None:
    """Replace parameter `name` of `module` by its `index`-th of `parts` slices along `dim`."""
    full = getattr(module, name).detach()
    size = full.shape[dim] // parts
    setattr(module, name, nn.Parameter(full.narrow(dim, index * size, size).clone()))


def _batch_first(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Call an (s, b, …)-layout op on a (b, s, …) tensor: transpose in, transpose out."""
    return lambda x: fn(x.transpose(0, 1)).transpose(0, 1)


def _batch_first_gather_linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                                group: AxisGroup) -> tuple[torch.Tensor, ...]:
    """`gather_linears` on (b, s/t, h) → (b, s, out_j) each (transposed views, no copies)."""
    outs = gather_linears(x.transpose(0, 1), weights, group)
    return tuple(y.transpose(0, 1) for y in outs)


class _BatchFirstEmbedding(VocabParallelEmbedding):
    """`VocabParallelEmbedding` on ids (b, s) → (b, s, h), or (b, s/t, h) under SP."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _batch_first(super().forward)(ids)


class _BatchFirstHead(ColumnParallelLinear):
    """The vocabulary-parallel head on (b, s, h) (or (b, s/t, h) under SP) → (b, s, V/t)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _batch_first(super().forward)(x)


def apply_tensor_parallel(model: Transformer, tp: AxisGroup, sp: bool) -> None:
    """Megatron TP (+ SP) in place: shard the pairs, set f/g, vocab-parallel ends."""
    t, r = tp.size, tp.rank
    project: Callable[..., tuple[torch.Tensor, ...]] | None = None
    if sp:  # the all-gather happens inside `project`, fused with the column linears
        enter: Callable[[torch.Tensor], torch.Tensor] = identity
        project = partial(_batch_first_gather_linears, group=tp)
        leave = _batch_first(partial(reduce_scatter_to_sequence, group=tp))
    else:
        enter, leave = partial(copy_to_tp, group=tp), partial(reduce_from_tp, group=tp)
    for block in model.blocks:
        attention = (("wq_b" if hasattr(block.attention, "wq_b") else "wq", "wkv_b")
                     if isinstance(block.attention, LatentAttention) else ("wq", "wk", "wv"))
        pairs: list[tuple[nn.Module, tuple[str, ...], tuple[str, ...]]] = [
            (block.attention, attention, ("wo",))]
        if isinstance(block.mlp, SwiGLU):
            pairs.append((block.mlp, ("w_gate", "w_up"), ("w_down",)))
        for module, columns, rows in pairs:
            for name in columns:  # output features: heads / f split, weight rows (and biases)
                linear = getattr(module, name)
                # t > a_kv: rank r keeps kv head r // (t/a_kv), the one its query heads use
                rep = t // model.spec.n_kv_heads if name in ("wk", "wv") and \
                    model.spec.n_kv_heads < t else 1
                for leaf in ("weight", "bias") if linear.bias is not None else ("weight",):
                    _keep(linear, leaf, 0, r // rep, t // rep)
                    getattr(linear, leaf).tp_replicas = rep  # allreduce_replicated_kv_grads
            for name in rows:  # input features split, weight columns
                _keep(getattr(module, name), "weight", 1, r, t)
            module.enter, module.leave = enter, leave
            if project is not None:
                module.project = project
    spec, dtype = model.spec, model.dtype
    embedding = _BatchFirstEmbedding(spec.vocab, spec.d_model, tp, sequence_parallel=sp,
                                     dtype=dtype)
    head = _BatchFirstHead(spec.d_model, spec.vocab, tp, sequence_parallel=sp, dtype=dtype)
    _keep(model.embedding, "weight", 0, r, t)
    embedding.weight = model.embedding.weight
    if spec.tie_embeddings:
        head.weight = embedding.weight
    else:
        _keep(model.head, "weight", 0, r, t)
        head.weight = model.head.weight
    model.embedding, model.head = embedding, head
    model.cross_entropy = partial(vocab_parallel_cross_entropy, group=tp)


def _tp_dim(name: str) -> int | None:
    """The dim TP splits, from the parameter's single-device name."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else ""
    if leaf in ("wq", "wk", "wv", "wq_b", "wkv_b", "w_gate", "w_up", "embedding", "head"):
        return 0
    return 1 if leaf in ("wo", "w_down") and name.endswith(".weight") else None


def apply_context_parallel(model: Transformer, mesh: Mesh, kind: str, seq_len: int) -> None:
    """Context parallelism of `kind` (`Layout.cp_kind`) on the zigzag layout, causal: ring
    attention over cp; Ulysses, the all-to-all over cp around the single-device kernel; the
    hybrid, the all-to-all over `cp_a2a` around ring attention over `cp_ring`."""
    cp = mesh.axis("cp")
    held = layout_positions(seq_len, cp.size, CP_LAYOUT)  # (c, n): each cp rank's positions
    for block in model.blocks:
        if kind == "ring":
            core = partial(ring_attention, group=cp, causal=True, layout=CP_LAYOUT)
        elif kind == "ulysses":
            core = partial(ulysses_attention, core=block.attention.core, group=cp,
                           positions=held)
        else:  # cp rank j·u + i is member i of a2a group j, member j of ring group i
            a2a, ring = mesh.axis("cp_a2a"), mesh.axis("cp_ring")
            groups = held.reshape(ring.size, a2a.size, -1)  # (r, u, n)
            rings = groups.flatten(1).sort(dim=1).values  # (r, u·n): each group's tokens
            core = partial(ulysses_attention, group=a2a, positions=groups[ring.rank],
                           core=partial(ring_attention, group=ring, causal=True,
                                        positions=rings))
        block.attention.core = core


def _ep_experts(moe: MoE, ep: AxisGroup, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (T, h) through the experts of the whole ep group (all-to-all dispatch/combine),
    capacity per rank over its own T tokens; (output, this rank's load-balancing loss). The
    routing of the call is left on `moe.ep_stats` (`runtime.measure` reads it)."""
    out, aux, moe.ep_stats = expert_parallel_moe(x, moe.router, moe.w_gate, moe.w_up,
                                                 moe.w_down, moe.top_k, ep,
                                                 capacity_factor=moe.capacity_factor,
                                                 shards=moe.routing_shards,
                                                 routing=moe.rule())
    moe.dropped, moe.expert_rows = moe.ep_stats.dropped, moe.ep_stats.local_expert_rows
    return out, aux


def _sequence_total(groups: tuple[AxisGroup, ...], t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks holding the other parts of this rank's sequences: over tp
    (SP's slices), then over cp; counted under (axis, `ROUTING_COUNTS_OP`)."""
    t = t.clone()
    for g in groups:
        with C.labelled(ROUTING_COUNTS_OP):
            C.all_reduce(t, g)
    return t


def _gather_routing(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """x from every rank of `g`: (…) -> (g.size, …); counted under (axis, ROUTING_GATHER_OP)."""
    out = x.new_empty(g.size * x.numel())
    with C.labelled(ROUTING_GATHER_OP):
        C.all_gather(out, x.contiguous().view(-1), g)
    return out.view(g.size, *x.shape)


def _sequence_keep(tp: AxisGroup | None, cp: AxisGroup, seq_len: int, num_experts: int,
                   experts: torch.Tensor, capacity_factor: float) -> torch.Tensor:
    """Which of this rank's expert choices (T, k) the capacity keeps when its micro-batch's
    sequences are split over SP's tp ranks and the cp ranks: the group is the micro-batch of
    b whole sequences, as on one device. The choices are all-gathered (over tp: contiguous
    slices of the cp rank's tokens; over cp: the zigzag chunks), laid out in one device's
    token order (b, s, k), dropped by one device's rule (`ops.moe.capacity_keep`, capacity
    ⌈cf·b·s·k/E⌉), and this rank's tokens' decisions kept."""
    k, c = experts.shape[1], cp.size
    t = tp.size if tp is not None else 1
    s_cp = seq_len // c
    s_sp = s_cp // t
    b = experts.shape[0] // s_sp
    x = experts.reshape(b, s_sp, k)
    if tp is not None and t > 1:  # (t, b, s/(c·t), k) -> (b, s/c, k)
        x = _gather_routing(x, tp).permute(1, 0, 2, 3).reshape(b, s_cp, k)
    positions = [local_positions(seq_len, c, r, CP_LAYOUT).to(experts.device)
                 for r in range(c)]
    whole = x
    if c > 1:  # (c, b, s/c, k) -> (b, s, k) at each cp rank's token positions
        parts = _gather_routing(x, cp)
        whole = x.new_empty(b, seq_len, k)
        for r in range(c):
            whole[:, positions[r]] = parts[r]
    cap = expert_capacity(b * seq_len, k, num_experts, capacity_factor)
    keep = capacity_keep(whole.reshape(-1, k), num_experts, cap).view(b, seq_len, k)
    mine = positions[cp.rank]
    if tp is not None:
        mine = mine[tp.rank * s_sp:(tp.rank + 1) * s_sp]
    return keep[:, mine].reshape(-1, k)


def apply_sequence_shards(model: Transformer, tp: AxisGroup | None, cp: AxisGroup,
                          seq_len: int) -> None:
    """MoE layers whose tokens are slices of sequences other ranks hold too (SP over `tp`,
    ring attention's cp; `ops.moe.SequenceShards`): their load-balancing loss counts every
    slice's routing — a cp rank carries cp shares, as its gradients are averaged over cp,
    while SP's tp ranks sum theirs — and their capacity is the whole micro-batch's, as on
    one device (`_sequence_keep`)."""
    groups = tuple(g for g in (tp, cp) if g is not None and g.size > 1)
    if not groups:
        return
    ranks = math.prod(g.size for g in groups)
    tp = tp if tp is not None and tp.size > 1 else None
    shards = SequenceShards(ranks, partial(_sequence_total, groups), scale=cp.size,
                            keep=partial(_sequence_keep, tp, cp, seq_len,
                                         model.spec.n_experts))
    for block in model.blocks:
        if isinstance(getattr(block, "mlp", None), MoE):
            block.mlp.sequence_shards = shards


def apply_expert_parallel(model: Transformer, ep: AxisGroup) -> None:
    """Keep this rank's E/e experts of every MoE layer; dispatch tokens with all-to-all."""
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            for name in ("w_gate", "w_up", "w_down"):
                _keep(block.mlp, name, 0, ep.rank, ep.size)
            block.mlp.experts = partial(_ep_experts, block.mlp, ep)


def split_pipeline(model: Transformer, pp: AxisGroup, chunks: int,
                   sizes: tuple[int, ...] = ()) -> list[VirtualStage]:
    """Keep this rank's virtual stages (chunk c is virtual stage c·p + rank); drop the rest,
    keeping parameter names. Returns every virtual stage."""
    stages = virtual_stages(model.spec.n_layers, pp.size, chunks, sizes=sizes)
    mine = [stages[c * pp.size + pp.rank] for c in range(chunks)]
    held = {k for stage in mine for k in stage.layers}
    for k in range(len(model.blocks)):
        if k not in held:
            model.blocks[k] = nn.Module()  # an empty placeholder: later names stay put
    if not any(s.first for s in mine):
        model.embedding = None
    if not any(s.last for s in mine):
        model.norm = model.head = None
    return stages


def apply_recompute(model: Transformer, mode: str) -> None:
    """Activation recompute: every block ("full") or the attention core ("selective")."""
    for block in model.blocks:
        if not hasattr(block, "attention"):  # a placeholder of another stage's layer
            continue
        if mode == "full":  # a ZB-H1 pipeline's replay defers the linears' dW as F did
            block.recompute, block.recompute_contexts = True, replay_contexts
        elif mode == "selective":
            block.attention.core = partial(checkpoint, block.attention.core,
                                           use_reentrant=False, early_stop=False)


