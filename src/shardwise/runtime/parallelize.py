"""Compose every parallelism on one model, one axis at a time (torchtitan's `parallelize`):

    tensor (+ sequence) parallel → context parallel → expert parallel → pipeline split
    → activation recompute → data parallel / ZeRO

Every rank builds the same single-device `Transformer` from the seed, then each step keeps
this rank's share of it and swaps in the parallel operators through the model's swap points
(`runtime.model`): the parallel model starts from exactly the single-device weights, and its
parameters keep their single-device names.

* TP (Megatron, Shoeybi et al. 2019): Q, K, V and gate/up keep this rank's output rows (heads,
  f/t), O and down this rank's input columns; `Attention.enter`/`.leave` and `SwiGLU.enter`/
  `.leave` become `f` (identity fwd, all-reduce bwd) and `g` (all-reduce fwd, identity bwd);
  the embedding and the head are split by vocabulary and the loss is
  `vocab_parallel_cross_entropy`. With SP (Korthikanti et al. 2022) `f`/`g` become an
  all-gather / reduce-scatter along the sequence and the residual stream stays (b, s/t, h);
  the all-gather is fused with the column linears (`Attention.project`, `SwiGLU.project` become
  `gather_linears`), which keep the (b, s/t, h) shard and gather it again in backward for the
  weight gradients (Megatron), so QKV and gate/up save s/t rows, not s.
  `runtime.tensor_parallel` lays activations out (s, b, h); this model is (b, s, h), so its
  primitives are called on the transposed view (a free view: dim 0 becomes the sequence).
  Weights outside the pairs (norms, router, experts) are replicated over tp; under SP they see
  a slice of the sequence, so their gradients are summed over tp.
* CP (ring attention, Liu et al. 2023): `Attention.core` becomes `ring_attention` on the zigzag
  layout; each cp rank holds 2 of the 2c chunks of every sequence and their RoPE positions.
* EP (GShard): an MoE layer keeps experts [r·E/e, (r+1)·E/e) and `MoE.experts` becomes the
  all-to-all dispatch/combine of `expert_parallel_moe`. MoE layers under TP are replicated.
* PP: the layers are cut into p·v virtual stages (`pipeline.virtual_stages`); this rank keeps
  its chunks (the first stage the embedding, the last the final norm and head) and
  `run_pipeline` drives them through `TransformerStages`. Tied embeddings live on the first and
  the last stage; their gradients are summed over pp (Megatron's embedding group).
* recompute: "full" re-runs each block's forward in backward, "selective" only the attention
  core (Korthikanti et al. 2022).
* DP: gradients averaged over the dp×cp ranks with one flat all-reduce after the last
  micro-batch; ZeRO-1/2/3 (`runtime.zero`) shard over the same ranks instead.

Loss normalisation. The step's loss is the mean over all `N = B·s` tokens of the global batch.
Every rank holds `B/dp` sequences and, of each, `s/cp` tokens: `n = N/(dp·cp)` tokens, the same
on every rank. Each rank computes the mean over its own tokens, `L_r = (1/n) Σ_{t∈r} ℓ_t`
(split into m micro-batches of mean `L_rj`, `L_r = (1/m) Σ_j L_rj`: the pipeline's seed 1/m,
or `loss/m` per accumulation step), so `L = (1/(dp·cp)) Σ_r L_r`, and

    ∇L = (1/(dp·cp)) Σ_r ∇L_r        — average the gradients over the dp×cp ranks.

The cp ranks of one sequence hold different tokens but the same weights: ring attention's
backward already sends every key/value gradient back to the cp rank that owns the token, so
`∇L_r` is this rank's tokens' complete contribution and the average over dp×cp is the sum
above. An expert's gradient, on its owner, is already the sum over the e ranks of its ep
group (the all-to-all brought their tokens); averaging over `edp` (the ranks that hold the same
experts, dp·cp/e of them) and dividing by e gives the same `1/(dp·cp)` sum. TP ranks compute
identical per-token losses, so nothing is averaged over tp.

Gradient norm for clipping: `‖g‖² = Σ` over every unique parameter element once. A rank adds
the squares of the elements it is responsible for: tp-sharded weights on every tp rank,
tp-replicated ones on tp rank 0; dense weights on dp×cp rank 0 (edp rank 0 for experts), or
its own ZeRO shard on every dp×cp rank; a tied head on the last stage is the first stage's
embedding and is not counted again. One all-reduce over the world sums the parts.

Not supported (refused by `runtime_problems`, with the reason): the ZB-H1 schedule (the
Transformer stages do not split B from W), ZeRO with pp > 1 or ep > 1 or tied embeddings or
hybrid shard groups, full recompute with ZeRO-3, tp not dividing the kv heads, shared experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError
from shardwise.layout import Layout
from shardwise.runtime import collectives as C
from shardwise.runtime.context_parallel import local_positions, ring_attention, shard_for_rank
from shardwise.runtime.expert_parallel import expert_parallel_moe
from shardwise.runtime.mesh import AxisGroup, Mesh
from shardwise.runtime.model import MoE, SwiGLU, Transformer, identity
from shardwise.runtime.pipeline import (
    SavedOp,
    VirtualStage,
    run_pipeline,
    sync_data_parallel,
    virtual_stages,
)
from shardwise.runtime.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp,
    gather_linears,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    vocab_parallel_cross_entropy,
)
from shardwise.runtime.zero import ZeroConfig, ZeroDataParallel
from shardwise.schedules import make_schedule

__all__ = [
    "CP_LAYOUT",
    "ParallelTransformer",
    "ParamShard",
    "TransformerStages",
    "gather_shards",
    "parallelize",
    "runtime_problems",
]

CP_LAYOUT = "zigzag"  # causal balance: rank p holds chunks p and 2c-1-p


# ------------------------------------------------------------------------ what is refused
def runtime_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """What this runtime cannot run, beyond `Layout.problems` (one sentence each)."""
    out = []
    if not model.gated_mlp or model.norm != "rmsnorm" or model.bias or model.learned_positions:
        out.append(f"the training runtime runs Llama-style models (RMSNorm, SwiGLU, RoPE, no "
                   f"biases); {model.name} is not one")
    if model.n_shared_experts:
        out.append("shared experts are not supported by the training runtime")
    if model.vocab % layout.tp:
        out.append(f"tp={layout.tp} must divide the vocabulary {model.vocab} (vocabulary-"
                   "parallel embedding and head)")
    if model.n_kv_heads % layout.tp:
        out.append(f"tp={layout.tp} must divide n_kv_heads={model.n_kv_heads} (replicated kv "
                   "heads are not implemented in the runtime)")
    if layout.pp > 1 and layout.schedule == "zb-h1":
        out.append("schedule zb-h1 is not supported for training (the Transformer stages do "
                   "not split B from W); use gpipe, 1f1b or interleaved")
    if layout.zero:
        for bad, why in ((layout.pp > 1, "pp > 1"), (layout.ep > 1, "ep > 1"),
                         (model.tie_embeddings, "tied embeddings"),
                         (bool(layout.zero_group), "a hybrid shard group (zero_group)"),
                         (layout.zero == 3 and layout.recompute == "full", "full recompute")):
            if bad:
                out.append(f"ZeRO-{layout.zero} with {why} is not supported by the training "
                           "runtime")
    return out


# --------------------------------------------------------------------- per-parameter facts
@dataclass(frozen=True)
class ParamShard:
    """How this rank holds one parameter of the single-device model.

    `tp_dim`: the dim split over tp (None: replicated over tp); `expert`: dim 0 (the experts)
    split over ep; `sequence_parallel`: replicated over tp but fed a sequence slice under SP,
    so its gradient is partial over tp; `tied_copy`: the last stage's copy of a tied embedding.
    """

    tp_dim: int | None = None
    expert: bool = False
    sequence_parallel: bool = False
    tied_copy: bool = False


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
        pairs: list[tuple[nn.Module, tuple[str, ...], tuple[str, ...]]] = [
            (block.attention, ("wq", "wk", "wv"), ("wo",))]
        if isinstance(block.mlp, SwiGLU):
            pairs.append((block.mlp, ("w_gate", "w_up"), ("w_down",)))
        for module, columns, rows in pairs:
            for name in columns:  # output features: heads / f split, weight rows
                _keep(getattr(module, name), "weight", 0, r, t)
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
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if leaf in ("wq", "wk", "wv", "w_gate", "w_up", "embedding", "head"):
        return 0
    return 1 if leaf in ("wo", "w_down") else None


def apply_context_parallel(model: Transformer, cp: AxisGroup) -> None:
    """Ring attention over cp (causal, zigzag layout)."""
    for block in model.blocks:
        block.attention.core = partial(ring_attention, group=cp, causal=True, layout=CP_LAYOUT)


def _ep_experts(moe: MoE, ep: AxisGroup, x: torch.Tensor) -> torch.Tensor:
    """Tokens (T, h) through the experts of the whole ep group (all-to-all dispatch/combine).
    The routing of the call is left on `moe.ep_stats` (`runtime.measure` reads it)."""
    out, _aux, moe.ep_stats = expert_parallel_moe(x, moe.router, moe.w_gate, moe.w_up,
                                                  moe.w_down, moe.top_k, ep)
    return out


def apply_expert_parallel(model: Transformer, ep: AxisGroup) -> None:
    """Keep this rank's E/e experts of every MoE layer; dispatch tokens with all-to-all."""
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            for name in ("w_gate", "w_up", "w_down"):
                _keep(block.mlp, name, 0, ep.rank, ep.size)
            block.mlp.experts = partial(_ep_experts, block.mlp, ep)


def split_pipeline(model: Transformer, pp: AxisGroup, chunks: int) -> list[VirtualStage]:
    """Keep this rank's virtual stages (chunk c is virtual stage c·p + rank); drop the rest,
    keeping parameter names. Returns every virtual stage."""
    stages = virtual_stages(model.spec.n_layers, pp.size, chunks)
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
        if mode == "full":
            block.recompute = True
        elif mode == "selective":
            block.attention.core = partial(checkpoint, block.attention.core,
                                           use_reentrant=False)


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
        if saved is not None:
            raise LayoutError(["the Transformer stages do not split B from W (zb-h1)"])
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
        if self.layout.pp > 1:
            schedule = make_schedule(self.layout.schedule, self.layout.pp, m,
                                     self.layout.chunks)
            stages = TransformerStages(self.model, self.positions,
                                       self.layout.tp if self.layout.sp else 1)
            return run_pipeline(stages, schedule, inputs, targets, self.axis("pp")).loss
        total = 0.0
        for x, y in zip(inputs.split(self.layout.micro_batch),
                        targets.split(self.layout.micro_batch)):
            loss = self.model.loss(x, y, self.positions) / m  # the mean over m micro-batches
            loss.backward()
            total += loss.item()
        return total

    def parameters(self) -> list[torch.Tensor]:
        return [p for p, _ in self.norm_terms]

    def zero_grad(self) -> None:
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            self.model.zero_grad(set_to_none=True)

    def step(self, update: Callable[[], None]) -> None:
        """Reduce this step's gradients over the mesh, then `update()` (which reads
        `parameters()` and their `.grad`)."""
        if self.zero is not None:  # ZeRO reduces, calls the optimizer, gathers weights
            self.zero.optimizer = _Update(lambda: (self._reduce_sp_shards(), update()))
            self.zero.step()
            return
        named = list(self.model.named_parameters())
        for _, p in named:  # a weight no token reached (an idle expert) still takes part
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sync_tied()
        allreduce_sequence_parallel_grads(self.model, self.axis("tp"))
        sync_data_parallel([p for n, p in named if not self.shards[n].expert], self.dp_axis)
        experts = [p for n, p in named if self.shards[n].expert]  # only with ep > 1
        sync_data_parallel(experts, self.axis("edp"))
        for p in experts:  # an owner's gradient is already the sum over its ep group
            p.grad.div_(self.layout.ep)
        update()

    def _sync_tied(self) -> None:
        """Tied embeddings across stages: sum the first and last stage's gradients over pp
        (the other stages add zeros)."""
        pp = self.axis("pp")
        if not self.model.spec.tie_embeddings or pp.size == 1:
            return
        holder = self.model.embedding if self.model.embedding is not None else self.model.head
        if holder is not None:
            C.all_reduce(holder.weight.grad, pp)
        else:
            spec, t = self.model.spec, self.layout.tp
            C.all_reduce(torch.zeros(spec.vocab // t, spec.d_model, dtype=self.model.dtype,
                                     device=self.positions.device), pp)

    def _reduce_sp_shards(self) -> None:
        """ZeRO + SP: sum over tp the shard elements of sequence-parallel weights."""
        for (p, _), mask in zip(self.norm_terms, self._sp_masks):
            if mask is not None and p.grad is not None:
                partial_sum = p.grad * mask
                C.all_reduce(partial_sum, self.axis("tp"))
                p.grad.copy_(torch.where(mask, partial_sum, p.grad))

    @torch.no_grad()
    def grad_norm(self) -> float:
        """‖g‖ over every unique parameter element (see the module docstring)."""
        total = torch.zeros(1, dtype=torch.float64, device=self.positions.device)
        for p, weight in self.norm_terms:
            if p.grad is not None:
                total += (p.grad.double().square() * weight).sum()
        C.all_reduce(total, None, counter=C.CommCounter())  # bookkeeping, not step traffic
        return float(total.sqrt())

    def global_loss(self, local: float | None) -> float:
        """The global batch's mean loss from each rank's mean over its tokens."""
        counts = self.last_stage and self.axis("tp").rank == 0
        share = torch.tensor([local / self.dp_axis.size if counts and local is not None
                              else 0.0], dtype=torch.float64, device=self.positions.device)
        C.all_reduce(share, None, counter=C.CommCounter())
        return float(share)

    # --------------------------------------------------------------- norm bookkeeping
    def _counted(self, name: str) -> bool:
        """Whether this rank adds parameter `name`'s squares to the global norm (per tp and
        pp position; dp replication is decided by the caller)."""
        shard = self.shards[name]
        return not shard.tied_copy and (shard.tp_dim is not None or self.axis("tp").rank == 0)

    def _init_norm_terms(self) -> None:
        if self.zero is None:
            for name, p in self.model.named_parameters():
                replicas = self.axis("edp") if self.shards[name].expert else self.dp_axis
                self.norm_terms.append((p, float(self._counted(name) and replicas.rank == 0)))
                self._sp_masks.append(None)
            return
        stage, dp = self.layout.zero, self.dp_axis
        for unit, shard in zip(self.zero.units, self.zero.shards):
            counted = torch.zeros(unit.padded, dtype=torch.bool, device=shard.device)
            sp = torch.zeros_like(counted)
            for s in unit.slots:
                counted[s.offset:s.offset + s.numel] = self._counted(s.qualname)
                sp[s.offset:s.offset + s.numel] = self.shards[s.qualname].sequence_parallel
            if stage > 0:  # the shards are disjoint over dp×cp
                counted, sp = counted[unit.lo:unit.hi], sp[unit.lo:unit.hi]
            elif dp.rank != 0:  # stage 0 steps on the whole (replicated) buffer
                counted = torch.zeros_like(counted)
            self.norm_terms.append((shard, counted))
            self._sp_masks.append(sp if bool(sp.any()) else None)

    # ------------------------------------------------------------------- inspection
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The single-device parameters this rank's pipeline stage(s) hold, gathered over tp,
        ep and ZeRO (collective over those axes; not counted)."""
        local = (self.zero.full_parameters() if self.zero is not None else
                 {n: p.detach() for n, p in self.model.named_parameters()})
        out = {}
        with C.counting():
            for name, t in local.items():
                shard = self.shards[name]
                if shard.tied_copy:
                    continue
                if shard.tp_dim is not None:
                    t = gather_shards(t, shard.tp_dim, self.axis("tp"))
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


# ----------------------------------------------------------------------------- parallelize
def parallelize(model: Transformer, mesh: Mesh, layout: Layout, seq_len: int,
                device: torch.device | None = None) -> ParallelTransformer:
    """Apply `layout` to `model` (built identically on every rank) on `mesh`, one axis at a
    time; `seq_len` is the full sequence length (RoPE positions under CP)."""
    problems = runtime_problems(layout, model.spec)
    if problems:
        raise LayoutError(problems)
    tp, cp, ep, pp = (mesh.axis(a) for a in ("tp", "cp", "ep", "pp"))
    if tp.size > 1:
        apply_tensor_parallel(model, tp, layout.sp)
    if cp.size > 1:
        apply_context_parallel(model, cp)
    if ep.size > 1:
        apply_expert_parallel(model, ep)
    stages = split_pipeline(model, pp, layout.chunks)
    apply_recompute(model, layout.recompute)
    shards = _shard_table(model, layout)
    if device is not None:
        model.to(device)
    positions = local_positions(seq_len, cp.size, cp.rank, CP_LAYOUT)
    positions = positions if device is None else positions.to(device)
    result = ParallelTransformer(model, mesh, layout, seq_len, shards, stages, positions)
    if layout.zero:
        units = [m for m in (model.embedding, *model.blocks, model.norm, model.head)
                 if m is not None]
        result.zero = ZeroDataParallel(model, ZeroConfig(stage=layout.zero),
                                       result.dp_axis, units=units)
    result._init_norm_terms()
    return result


def _shard_table(model: Transformer, layout: Layout) -> dict[str, ParamShard]:
    tied_copy = model.spec.tie_embeddings and model.embedding is None
    table = {}
    for name, p in model.named_parameters():
        tp_dim = _tp_dim(name) if layout.tp > 1 else None
        sp = layout.sp and layout.tp > 1 and tp_dim is None
        if sp:
            p.sequence_parallel = True  # read by allreduce_sequence_parallel_grads
        table[name] = ParamShard(tp_dim, layout.ep > 1 and name.endswith(
            (".mlp.w_gate", ".mlp.w_up", ".mlp.w_down")), sp,
            tied_copy and name == "head.weight")
    return table
