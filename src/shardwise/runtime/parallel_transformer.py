"""The training-step object: this rank's share of a parallelised Transformer and what one
optimizer step needs of it — forward and backward over the micro-batches (through the pipeline
schedule when pp > 1), the gradient reductions over the mesh, the global gradient norm, the
global loss — built by `runtime.parallelize.parallelize`.

Loss normalisation: the step's loss is the mean over all `N = B·s` tokens of the global
batch; each rank's mean over its own `N/(dp·cp)` tokens makes `∇L` the average of the ranks'
gradients over dp×cp (experts: over edp, divided by e; nothing over tp).

Design notes: docs/concepts/runtime.md#runtime-parallel_transformer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.context_parallel import shard_for_rank
from shardwise.runtime.data_parallel import GradientReducer
from shardwise.runtime.mesh import AxisGroup, Mesh
from shardwise.runtime.model import MoE, Transformer
from shardwise.runtime.pipeline import SavedOp, VirtualStage, defer_linears, run_pipeline
from shardwise.runtime.tensor_parallel import (
    allreduce_replicated_kv_grads,
    allreduce_sequence_parallel_grads,
)
from shardwise.runtime.zero import ZeroDataParallel
from shardwise.schedules import get_schedule, make_schedule

__all__ = ["CP_LAYOUT", "ParallelTransformer", "ParamShard", "TransformerStages",
           "gather_shards"]

CP_LAYOUT = "zigzag"  # causal balance: rank p holds chunks p and 2c-1-p


# --------------------------------------------------------------------- per-parameter facts
@dataclass(frozen=True)
class ParamShard:
    """How this rank holds one parameter of the single-device model.

    `tp_dim`: the dim split over tp (None: replicated over tp); `expert`: dim 0 (the experts)
    split over ep; `sequence_parallel`: replicated over tp with a gradient partial over tp —
    fed a sequence slice under SP, or MLA's down-projections and latent norms (summed over
    tp before the update); `tied_copy`: the last stage's copy of a tied embedding;
    `tp_replicas`: how many consecutive tp ranks hold the same slice (replicated kv heads).
    """

    tp_dim: int | None = None
    expert: bool = False
    sequence_parallel: bool = False
    tied_copy: bool = False
    tp_replicas: int = 1


# -------------------------------------------------------------------- pipeline protocol
@dataclass
class TransformerStages:
    """The `pipeline.StageModel` of a (parallelised) Transformer: virtual stage `k` runs the
    embedding (first), its layers, and the final norm, head and mean loss (last)."""

    model: Transformer
    positions: torch.Tensor  # (s_local,) RoPE positions of this rank's tokens
    sequence_split: int = 1  # tp under SP: stages exchange (b, s/t, h)

    @property
    def n_layers(self) -> int:
        return self.model.spec.n_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def message_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        return (batch, seq // self.sequence_split, self.model.spec.d_model)

    def named_parameters(self, stage: VirtualStage | None = None) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        if stage is None:
            return params
        prefixes = [f"blocks.{k}." for k in stage.layers]
        prefixes += ["embedding."] if stage.first else []
        prefixes += ["norm.", "head."] if stage.last else []
        return {n: p for n, p in params.items() if n.startswith(tuple(prefixes))}

    def forward_stage(self, stage: VirtualStage, inp: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      saved: list[SavedOp] | None = None) -> torch.Tensor:
        # zb-h1 (`saved` given): the linears' weight gradients wait for W (`defer_linears`)
        with defer_linears() if saved is not None else contextlib.nullcontext():
            x = self.model.embedding(inp) if stage.first else inp  # (b, s) -> (b, s, h)
            x = self.model.run_blocks(x, stage.layers, self.positions)
            if not stage.last:
                return x
            assert targets is not None
            return self.model.mean_loss(x, targets)


# ------------------------------------------------------------------ the parallel model
@dataclass
class ParallelTransformer:
    """This rank's share of a Transformer on a mesh, and what a training step needs of it.

    `forward_backward(inputs, targets)` takes this dp rank's rows of the global batch
    (B/dp, s), accumulates the gradients of its micro-batches and returns the mean loss over
    its tokens (None off the last pipeline stage). `step(update)` reduces the gradients and
    calls `update()` (clip + optimizer) on them; `parameters()` are the tensors the optimizer
    updates (ZeRO: this rank's flat shards); `grad_norm()` the global gradient norm.
    """

    model: Transformer
    mesh: Mesh
    layout: Layout
    seq_len: int
    shards: dict[str, ParamShard]
    stages: list[VirtualStage]
    positions: torch.Tensor
    zero: ZeroDataParallel | None = None
    # (tensor the optimizer updates, which of its elements this rank adds to ‖g‖²: 0/1 or a
    # bool mask); ZeRO: a mask per flat shard marking the sequence-parallel elements too
    norm_terms: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    _sp_masks: list[torch.Tensor | None] = field(default_factory=list)
    # ZeRO with replicated kv heads: per flat shard, its K/V elements (None: none)
    _kv_masks: list[torch.Tensor | None] = field(default_factory=list)
    # without ZeRO: the dense weights' reducer over dp×cp, and with ep > 1 the experts' over edp
    reducers: list[GradientReducer] = field(default_factory=list)
    # gradients are accumulated and reduced in this dtype (fp32 with bf16 weights: every
    # parameter's fp32 `main_grad`, `mixed_precision.accumulate_in_fp32`)
    grad_dtype: torch.dtype = torch.float32

    # ---------------------------------------------------------------------- axes
    @property
    def dp_axis(self) -> AxisGroup:
        """The ranks gradients are averaged over: dp×cp (named "dp" when cp = 1)."""
        return self.mesh.axis("dp_cp" if self.layout.cp > 1 else "dp")

    def axis(self, name: str) -> AxisGroup:
        return self.mesh.axis(name)

    @property
    def last_stage(self) -> bool:
        return self.model.head is not None

    # ------------------------------------------------------------------- one step
    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This cp rank's tokens of every sequence: (B/dp, s) -> (B/dp, s/cp)."""
        cp = self.axis("cp")
        if cp.size == 1:
            return inputs, targets
        return (shard_for_rank(inputs, cp.size, cp.rank, CP_LAYOUT),
                shard_for_rank(targets, cp.size, cp.rank, CP_LAYOUT))

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        inputs, targets = self.local_batch(inputs, targets)
        m = inputs.shape[0] // self.layout.micro_batch
        for module in self.model.modules():  # MoE auxiliary losses: 1/m, as the loss
            if isinstance(module, MoE):
                module.aux_loss_scale = 1 / m
        for reducer in self.reducers:
            reducer.start_step()
        if self.layout.pp > 1:  # reduced in `step`, after the last micro-batch
            schedule = make_schedule(self.layout.schedule, self.layout.pp, m,
                                     self.layout.chunks)
            stages = TransformerStages(self.model, self.positions,
                                       self.layout.tp if self.layout.sp else 1)
            with self._no_sync():
                return run_pipeline(stages, schedule, inputs, targets, self.axis("pp"),
                                    placement=get_schedule(self.layout.schedule).placement,
                                    sizes=self.layout.stage_sizes(self.model.spec.n_layers)
                                    ).loss
        total = 0.0
        for j, (x, y) in enumerate(zip(inputs.split(self.layout.micro_batch),
                                       targets.split(self.layout.micro_batch))):
            # the last micro-batch's backward reduces, overlapped; the others accumulate
            with self._no_sync() if j < m - 1 else contextlib.nullcontext():
                loss = self.model.loss(x, y, self.positions) / m  # mean over m micro-batches
                loss.backward()
            total += loss.item()
        return total

    def _no_sync(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for reducer in self.reducers:
            stack.enter_context(reducer.no_sync())
        if self.zero is not None:  # ZeRO-1: reduce-scatter in the last backward only
            stack.enter_context(self.zero.no_sync())
        return stack

    def parameters(self) -> list[torch.Tensor]:
        return [p for p, _ in self.norm_terms]

    def zero_grad(self) -> None:
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            mp.clear_grads(self.model.parameters())

    def step(self, update: Callable[[], None]) -> None:
        """Reduce this step's gradients over the mesh, then `update()` (which reads
        `parameters()` and their `.grad`)."""
        if self.zero is not None:  # ZeRO reduces, calls the optimizer, gathers weights
            self.zero.optimizer = _Update(update)
            self.zero.step(before_update=lambda: (self._sync_tied(), self._reduce_sp_shards(),
                                                  self._reduce_kv_shards()))
            return
        named = list(self.model.named_parameters())
        for _, p in named:  # a weight no token reached (an idle expert) still takes part
            if mp.grad(p) is None:
                mp.set_grad(p, torch.zeros_like(p, dtype=mp.grad_dtype(p)))
        self._sync_tied()
        allreduce_sequence_parallel_grads(self.model, self.axis("tp"))
        allreduce_replicated_kv_grads(self.model, self.axis("tp"))
        for reducer in self.reducers:  # sums commute: dp after tp/pp is dp before them
            if not reducer.reduced:  # under pp, or no gradient reached these weights
                reducer.reduce()
        experts = [p for n, p in named if self.shards[n].expert]  # only with ep > 1
        for p in experts:  # an owner's gradient is already the sum over its ep group
            mp.grad(p).div_(self.layout.ep)
        update()

    def _sync_tied(self) -> None:
        """Tied embeddings across stages: sum the first and last stage's gradients over pp
        (the other stages add zeros). Under ZeRO the embedding's and the head's units are
        padded and sharded alike, so their shards' gradients are summed."""
        pp = self.axis("pp")
        if not self.model.spec.tie_embeddings or pp.size == 1:
            return
        holder = self.model.embedding if self.model.embedding is not None else self.model.head
        spec, t = self.model.spec, self.layout.tp
        if self.zero is not None:
            units = self.zero.units
            if holder is not None:
                i = next(i for i, u in enumerate(units) if u.module is holder)
                C.all_reduce(mp.grad(self.zero.shards[i]), pp)
                return
            numel, n = spec.vocab // t * spec.d_model, self.layout.zero_degree
            shape: tuple[int, ...] = (-(-numel // n),)  # the unit's shard, padding included
        elif holder is not None:
            C.all_reduce(mp.grad(holder.weight), pp)
            return
        else:
            shape = (spec.vocab // t, spec.d_model)
        C.all_reduce(torch.zeros(shape, dtype=self.grad_dtype, device=self.positions.device),
                     pp)

    def _reduce_sp_shards(self) -> None:
        """ZeRO + SP: sum over tp the shard elements of sequence-parallel weights."""
        for (p, _), mask in zip(self.norm_terms, self._sp_masks):
            g = mp.grad(p)
            if mask is not None and g is not None:
                partial_sum = g * mask
                C.all_reduce(partial_sum, self.axis("tp"))
                g.copy_(torch.where(mask, partial_sum, g))

    def _reduce_kv_shards(self) -> None:
        """ZeRO + replicated kv heads (tp > a_kv): sum each K/V element of the shards over the
        t/a_kv tp ranks holding the same head (sums commute, so after the reduce-scatter is
        as before it). As `allreduce_replicated_kv_grads`, one all-reduce over tp of an
        (a_kv, shard) buffer per unit holding K/V: rank r fills row r // (t/a_kv) with its
        shard's K/V elements, the other rows stay zero."""
        tp = self.axis("tp")
        rep = tp.size // self.model.spec.n_kv_heads if self._kv_masks else 1
        for (p, _), mask in zip(self.norm_terms, self._kv_masks):
            g = mp.grad(p)
            if mask is not None and g is not None:
                slots = g.new_zeros((tp.size // rep, *g.shape))  # (a_kv, shard)
                slots[tp.rank // rep] = g * mask
                C.all_reduce(slots, tp)
                g.copy_(torch.where(mask, slots[tp.rank // rep], g))

    @torch.no_grad()
    def grad_norm(self) -> float:
        """‖g‖ over every unique parameter element (docs/concepts/runtime.md#runtime-parallel_transformer)."""
        total = torch.zeros(1, dtype=torch.float64, device=self.positions.device)
        for p, weight in self.norm_terms:
            g = mp.grad(p)
            if g is None or (not isinstance(weight, torch.Tensor) and not weight):
                continue
            # accumulated in fp64 without an fp64 copy of the gradient (as clip_grad_norm_)
            grad = g if not isinstance(weight, torch.Tensor) else g[weight]
            total += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
        C.all_reduce(total, self.axis("world"), counter=C.CommCounter())  # bookkeeping, not step traffic
        return float(total.sqrt())

    def global_loss(self, local: float | None) -> float:
        """The global batch's mean loss from each rank's mean over its tokens."""
        counts = self.last_stage and self.axis("tp").rank == 0
        share = torch.tensor([local / self.dp_axis.size if counts and local is not None
                              else 0.0], dtype=torch.float64, device=self.positions.device)
        C.all_reduce(share, self.axis("world"), counter=C.CommCounter())
        return float(share)

    # --------------------------------------------------------------- norm bookkeeping
    def _counted(self, name: str) -> bool:
        """Whether this rank adds parameter `name`'s squares to the global norm (per tp and
        pp position; dp replication is decided by the caller)."""
        shard = self.shards[name]
        tp_rank = self.axis("tp").rank
        return not shard.tied_copy and ((shard.tp_dim is not None and
                                        tp_rank % shard.tp_replicas == 0) or tp_rank == 0)

    def _init_norm_terms(self) -> None:
        if self.zero is None:
            for name, p in self.model.named_parameters():
                replicas = self.axis("edp") if self.shards[name].expert else self.dp_axis
                self.norm_terms.append((p, float(self._counted(name) and replicas.rank == 0)))
                self._sp_masks.append(None)
                self._kv_masks.append(None)
            return
        stage, dp = self.layout.zero, self.dp_axis
        for unit, shard in zip(self.zero.units, self.zero.shards):
            counted = torch.zeros(unit.padded, dtype=torch.bool, device=shard.device)
            sp, kv = torch.zeros_like(counted), torch.zeros_like(counted)
            counted[unit.numel:] = True  # the padding: its gradient is always zero
            for s in unit.slots:
                counted[s.offset:s.offset + s.numel] = self._counted(s.qualname)
                sp[s.offset:s.offset + s.numel] = self.shards[s.qualname].sequence_parallel
                kv[s.offset:s.offset + s.numel] = self.shards[s.qualname].tp_replicas > 1
            if stage > 0:  # the shards are disjoint over the group, equal over its replicas
                counted, sp, kv = counted[unit.lo:unit.hi], sp[unit.lo:unit.hi], kv[unit.lo:unit.hi]
                if unit.replicas is not None and unit.replicas.rank != 0:
                    counted = torch.zeros_like(counted)
            elif dp.rank != 0:  # stage 0 steps on the whole (replicated) buffer
                counted = torch.zeros_like(counted)
            # a uniform mask as 0/1: the norm then reads the gradient without a masked copy
            uniform = bool(counted.all()) or not bool(counted.any())
            self.norm_terms.append((shard, float(counted[0]) if uniform else counted))
            self._sp_masks.append(sp if bool(sp.any()) else None)
            # every unit holding K/V takes part, even one whose shard has none of them: the
            # all-reduce over tp then runs on every rank (all tp ranks shard alike)
            has_kv = any(self.shards[s.qualname].tp_replicas > 1 for s in unit.slots)
            self._kv_masks.append(kv if has_kv else None)

    # ------------------------------------------------------------------- inspection
    @torch.no_grad()
    def full_parameters(self, values: list[torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
        """The single-device parameters this rank's pipeline stage(s) hold, gathered over tp,
        ep and ZeRO (collective over those axes; not counted). `values`: tensors in place of
        `parameters()`, in its order (mixed precision's fp32 masters)."""
        if self.zero is not None:
            local = self.zero.full_parameters(values)
        else:
            named = list(self.model.named_parameters())
            local = {n: (p if values is None else values[i]).detach()
                     for i, (n, p) in enumerate(named)}
        out = {}
        with C.counting():
            for name, t in local.items():
                shard = self.shards[name]
                if shard.tied_copy:
                    continue
                if shard.tp_dim is not None:
                    t = gather_shards(t, shard.tp_dim, self.axis("tp"))
                    if shard.tp_replicas > 1:  # one copy of each replicated kv head
                        t = torch.cat(t.split(t.shape[0] // self.layout.tp)[::shard.tp_replicas])
                if shard.expert:
                    t = gather_shards(t, 0, self.axis("ep"))
                out[name] = t.clone()
        return out


class _Update:
    """Stands in for `ZeroDataParallel.optimizer`: its `step()` runs the training update."""

    def __init__(self, update: Callable[[], object]):
        self.step = update


def gather_shards(t: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """The full tensor from every rank's shard along `dim` (an all-gather over `group`)."""
    if group.size == 1:
        return t
    piece = t.movedim(dim, 0).contiguous()  # the split dim first: flat chunks = shards
    full = piece.new_empty((piece.shape[0] * group.size, *piece.shape[1:]))
    C.all_gather(full, piece, group)
    return full.movedim(0, dim)
