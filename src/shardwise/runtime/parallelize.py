"""Compose every parallelism on one model, one axis at a time (torchtitan's `parallelize`):
tensor (+ sequence) → context → expert parallel → pipeline split → recompute → data / ZeRO.

Every rank builds the same single-device `Transformer` from the seed, then each step keeps
this rank's share of it and swaps in the parallel operators through the model's swap points
(`runtime.model`): the parallel model starts from exactly the single-device weights, and its
parameters keep their single-device names.

Design notes: docs/concepts/runtime.md#runtime-parallelize.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError
from shardwise.estimate.check import ROUTING_COUNTS_OP, ROUTING_GATHER_OP
from shardwise.layout import Layout
from shardwise.ops.attention import layout_positions
from shardwise.ops.moe import SequenceShards, capacity_keep, expert_capacity
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.context_parallel import local_positions, ring_attention
from shardwise.runtime.data_parallel import GradientReducer
from shardwise.runtime.expert_parallel import expert_parallel_moe
from shardwise.runtime.launch import group_timeout
from shardwise.runtime.mesh import AxisGroup, Mesh
from shardwise.runtime.model import LatentAttention, MoE, SwiGLU, Transformer, identity
from shardwise.runtime.parallel_transformer import CP_LAYOUT, ParallelTransformer, ParamShard
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
from shardwise.runtime.zero import UnitSpec, ZeroConfig, ZeroDataParallel
from shardwise.schedules.registry import SCHEDULE_REGISTRY

__all__ = ["apply_context_parallel", "apply_expert_parallel", "apply_recompute",
           "apply_sequence_shards", "apply_tensor_parallel", "parallelize", "runtime_problems",
           "split_pipeline"]


# ------------------------------------------------------------------------ what is refused
def runtime_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """What this runtime cannot run, beyond `Layout.problems` (one sentence each)."""
    out = []
    if not model.gated_mlp or model.norm != "rmsnorm" or model.bias or model.learned_positions:
        out.append(f"the training runtime runs Llama-style models (RMSNorm, SwiGLU, RoPE, no "
                   f"biases); {model.name} is not one")
    if model.rope_type not in ("default", "llama3"):
        out.append(f"RoPE scaling {model.rope_type!r} is not supported by the training runtime; "
                   "valid: default, llama3")
    if model.out_bias and layout.tp > 1:
        out.append("an output-projection bias (attention_bias) with tp > 1 is not supported by "
                   "the training runtime")
    if model.vocab % layout.tp:
        out.append(f"tp={layout.tp} must divide the vocabulary {model.vocab} (vocabulary-"
                   "parallel embedding and head)")
    if model.is_mla and layout.sp and layout.tp > 1:
        out.append("sequence parallelism with multi-head latent attention is not supported by "
                   "the training runtime (its latents would be gathered, not the hidden state); "
                   "use sp=0")
    if model.is_mla and layout.cp > 1 and model.value_head_dim != model.head_dim:
        out.append(f"context parallelism with multi-head latent attention whose v_head_dim="
                   f"{model.value_head_dim} ≠ q/k head width {model.head_dim} is not supported "
                   "by the training runtime (ring attention sends K and V as one block)")
    if layout.cp > 1 and layout.cp_kind == "allgather":
        out.append("context parallelism by an all-gather of K/V (cp_kind=allgather, "
                   "torchtitan's) is not run by the training runtime; use ring, ulysses or "
                   "hybrid")
    if layout.expert_tp != layout.tp:
        out.append(f"expert tensor parallelism (etp={layout.etp} ≠ tp={layout.tp}) is not "
                   "supported by the training runtime; use etp=0")
    schedule = SCHEDULE_REGISTRY.get(layout.schedule)
    if layout.pp > 1 and schedule is not None and not schedule.trainable:
        out.append(f"the training runtime does not run the {schedule.name} schedule (its V "
                   "placement puts embedding and head on one rank); `shardwise demo pipeline "
                   f"--schedule {schedule.name}` runs it on the pipeline executor")
    k, e = layout.zero_group, layout.ep
    if layout.zero and k and e > 1 and k % e and e % k:
        out.append(f"ZeRO-{layout.zero} with a hybrid shard group zero_group={k} that is "
                   f"neither a multiple nor a divisor of ep={e} is not supported by the "
                   "training runtime (the experts' shard groups would not tile their edp group)")
    return out


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


# ----------------------------------------------------------------------------- the axes
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


# ----------------------------------------------------------------------------- parallelize
def parallelize(model: Transformer, mesh: Mesh, layout: Layout, seq_len: int,
                device: torch.device | None = None, grad_dtype: torch.dtype | None = None
                ) -> ParallelTransformer:
    """Apply `layout` to `model` (built identically on every rank) on `mesh`, one axis at a
    time; `seq_len` is the full sequence length (RoPE positions under CP). `grad_dtype`: the
    dtype gradients are accumulated and reduced in (None: the weights'; fp32 with bf16
    weights: `mixed_precision.accumulate_in_fp32` on every parameter, or ZeRO's per unit)."""
    problems = runtime_problems(layout, model.spec)
    if problems:
        raise LayoutError(problems)
    tp, cp, ep, pp = (mesh.axis(a) for a in ("tp", "cp", "ep", "pp"))
    if tp.size > 1:
        apply_tensor_parallel(model, tp, layout.sp)
    if cp.size > 1:
        apply_context_parallel(model, mesh, layout.cp_kind, seq_len)
    if ep.size > 1:
        apply_expert_parallel(model, ep)
    apply_sequence_shards(model, tp if layout.sp else None, cp, seq_len)
    stages = split_pipeline(model, pp, layout.chunks, layout.stage_sizes(model.spec.n_layers))
    apply_recompute(model, layout.recompute)
    shards = _shard_table(model, layout)
    if device is not None:
        model.to(device)
    positions = local_positions(seq_len, cp.size, cp.rank, CP_LAYOUT)
    positions = positions if device is None else positions.to(device)
    result = ParallelTransformer(model, mesh, layout, seq_len, shards, stages, positions,
                                 grad_dtype=grad_dtype or model.dtype)
    if layout.zero:
        shard, replicas = hybrid_shard_groups(mesh, layout)
        result.zero = ZeroDataParallel(model, ZeroConfig(stage=layout.zero, grad_dtype=grad_dtype),
                                       shard,
                                       units=_zero_units(model, shards, mesh, layout, replicas))
    result._init_norm_terms()
    if not layout.zero:
        if result.grad_dtype != model.dtype:  # before the reducers' hooks: they read main_grad
            for p in model.parameters():
                mp.accumulate_in_fp32(p)
        named = list(model.named_parameters())
        groups = ([(result.dp_axis, [p for n, p in named if not shards[n].expert]),
                   (mesh.axis("edp"), [p for n, p in named if shards[n].expert])]
                  if layout.ep > 1 else [(result.dp_axis, [p for _, p in named])])
        result.reducers = [GradientReducer(params, group) for group, params in groups
                           if params]
    return result


def hybrid_shard_groups(mesh: Mesh, layout: Layout) -> tuple[AxisGroup, AxisGroup | None]:
    """ZeRO's shard group and, for a hybrid shard (`zero_group` < dp·cp; PyTorch's HSDP,
    DeepSpeed's ZeRO++ hpZ), the replica group: each dp×cp group is cut into consecutive
    blocks of `zero_group` ranks that shard the state; the ranks at the same position of
    every block replicate it. Without `zero_group`: (dp×cp, None). With ep > 1 the experts'
    groups are left on the mesh as "edp_shard" (the block's ranks of this rank's edp group)
    and "edp_replica" (the ranks holding the same expert shard in the other blocks).
    Collective: every rank creates every group, in the same order."""
    whole = mesh.axis("dp_cp" if layout.cp > 1 else "dp")
    k, e = layout.zero_group, layout.ep
    if not k or k == whole.size:
        return whole, None
    me = torch.distributed.get_rank()
    mine: dict[str, AxisGroup] = {}
    for ranks in mesh.shape.groups(whole.name):  # (dp·cp,) global ranks of one (pp, tp)
        blocks = [ranks[i:i + k] for i in range(0, len(ranks), k)]  # shard groups
        named = [("zero_shard", b) for b in blocks] + [
            ("zero_replica", ranks[i::k]) for i in range(k)]
        if e > 1:  # experts: their edp ranks (i mod e) inside one block shard them, and the
            # ranks at the same place of every block replicate that shard (e | k or k | e)
            j = range(len(ranks))
            for name, key in (("edp_shard", lambda i: (i // k, i % e)),
                              ("edp_replica", lambda i: (i % e, i % k // e))):
                named += [(name, tuple(ranks[i] for i in j if key(i) == value))
                          for value in dict.fromkeys(map(key, j))]
        for name, members in named:
            group = (torch.distributed.new_group(list(members), timeout=group_timeout())
                     if len(members) > 1 else None)
            if me in members:
                mine[name] = AxisGroup(name, group, len(members), members.index(me),
                                       tuple(members))
    if e > 1:
        mesh.axes["edp_shard"], mesh.axes["edp_replica"] = mine["edp_shard"], mine["edp_replica"]
    return mine["zero_shard"], mine["zero_replica"]


def _zero_units(model: Transformer, shards: dict[str, ParamShard], mesh: Mesh,
                layout: Layout, replicas: AxisGroup | None = None) -> list[UnitSpec]:
    """ZeRO's flat units on this rank (`estimate.check.zero_units` predicts them): the
    embedding, each layer this stage holds, the final norm and the head, each over dp×cp;
    under ep > 1 an MoE layer's experts are a unit of their own over `edp` (Megatron's
    distributed optimizer shards expert state over the expert-data-parallel group)."""
    units = []
    for m in (model.embedding, *model.blocks, model.norm, model.head):
        if m is None:
            continue
        if layout.ep > 1 and isinstance(getattr(m, "mlp", None), MoE):
            hybrid = replicas is not None  # the experts' own shard and replica groups
            units += [UnitSpec(m, select=lambda n: not shards[n].expert, replicas=replicas),
                      UnitSpec(m, mesh.axes["edp_shard"] if hybrid else mesh.axis("edp"),
                               lambda n: shards[n].expert, layout.ep,
                               mesh.axes["edp_replica"] if hybrid else None)]
        else:
            units.append(UnitSpec(m, replicas=replicas))
    return units


_MLA_LATENT = (".attention.wq_a.weight", ".attention.q_norm.weight",
               ".attention.wkv_a.weight", ".attention.kv_norm.weight")


def _shard_table(model: Transformer, layout: Layout) -> dict[str, ParamShard]:
    tied_copy = model.spec.tie_embeddings and model.embedding is None
    table = {}
    for name, p in model.named_parameters():
        tp_dim = _tp_dim(name) if layout.tp > 1 else None
        # gradients partial over tp: replicated weights that see a sequence slice (SP), and
        # MLA's down-projections and latent norms (each rank backpropagates its heads only)
        sp = layout.tp > 1 and tp_dim is None and (layout.sp or name.endswith(_MLA_LATENT))
        if sp:
            p.sequence_parallel = True  # read by allreduce_sequence_parallel_grads
        table[name] = ParamShard(tp_dim, layout.ep > 1 and name.endswith(
            (".mlp.w_gate", ".mlp.w_up", ".mlp.w_down")), sp,
            tied_copy and name == "head.weight", getattr(p, "tp_replicas", 1))
    return table
