"""Compose every parallelism on one model, one axis at a time (torchtitan's `parallelize`):
tensor (+ sequence) → context → expert parallel → pipeline split → recompute → data / ZeRO.

Every rank builds the same single-device `Transformer` from the seed, then each step keeps
this rank's share of it and swaps in the parallel operators through the model's swap points
(`runtime.model`): the parallel model starts from exactly the single-device weights, and its
parameters keep their single-device names. Each axis is applied by `runtime.parallel_axes`.

Design notes: docs/concepts/runtime.md#runtime-parallelize.
"""

from __future__ import annotations

import torch

from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError
from shardwise.layout import Layout
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.context_parallel import local_positions
from shardwise.runtime.data_parallel import GradientReducer
from shardwise.runtime.launch import group_timeout
from shardwise.runtime.mesh import AxisGroup, Mesh
from shardwise.runtime.model import MoE, Transformer
from shardwise.runtime.model.layers import ROPE_TYPES
from shardwise.runtime.model.variants import variant_problems
from shardwise.runtime.parallel_axes import (
    _tp_dim,
    apply_context_parallel,
    apply_expert_parallel,
    apply_recompute,
    apply_sequence_shards,
    apply_tensor_parallel,
    split_pipeline,
)
from shardwise.runtime.parallel_transformer import CP_LAYOUT, ParallelTransformer, ParamShard
from shardwise.runtime.zero import UnitSpec, ZeroConfig, ZeroDataParallel
from shardwise.schedules.registry import SCHEDULE_REGISTRY

__all__ = ["apply_context_parallel", "apply_expert_parallel", "apply_recompute",
           "apply_sequence_shards", "apply_tensor_parallel", "parallelize", "runtime_problems",
           "split_pipeline"]


# ------------------------------------------------------------------------ what is refused
def runtime_problems(layout: Layout, model: ModelSpec, seq_len: int | None = None
                     ) -> list[str]:
    """What this runtime cannot run, beyond `Layout.problems` (one sentence each)."""
    out = variant_problems(layout, model, seq_len)
    if not model.gated_mlp or model.norm != "rmsnorm" or model.bias or model.learned_positions:
        out.append(f"the training runtime runs Llama-style models (RMSNorm, SwiGLU, RoPE, no "
                   f"biases); {model.name} is not one")
    if model.rope_type not in ROPE_TYPES:
        out.append(f"RoPE scaling {model.rope_type!r} is not supported by the training runtime; "
                   f"valid: {', '.join(ROPE_TYPES)}")
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


# ----------------------------------------------------------------------------- parallelize
def parallelize(model: Transformer, mesh: Mesh, layout: Layout, seq_len: int,
                device: torch.device | None = None, grad_dtype: torch.dtype | None = None
                ) -> ParallelTransformer:
    """Apply `layout` to `model` (built identically on every rank) on `mesh`, one axis at a
    time; `seq_len` is the full sequence length (RoPE positions under CP). `grad_dtype`: the
    dtype gradients are accumulated and reduced in (None: the weights'; fp32 with bf16
    weights: `mixed_precision.accumulate_in_fp32` on every parameter, or ZeRO's per unit)."""
    problems = runtime_problems(layout, model.spec, seq_len)
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
