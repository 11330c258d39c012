"""ZeRO's configuration (`ZeroConfig`, `UnitSpec`) and its units: the flat buffers of a group of
parameters, sharded over the data-parallel group, gathered for use (`_GatherUnit`),
reduce-scattered after backward, and ZB-H1's deferred weight gradients (`_DeferredGrad`).
Design: docs/concepts/runtime.md#zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.collectives import GroupLike
from shardwise.runtime.pipeline import accumulate_grad, deferred_ops

if TYPE_CHECKING:
    from shardwise.runtime.zero.engine import ZeroDataParallel


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage and the Adam hyper-parameters (torch.optim.Adam's meaning)."""

    stage: int = 1
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    prefetch: bool = True  # stage 3: gather the next unit while this one computes
    # the dtype gradients are accumulated and reduced in (None: the weights'); fp32 with bf16
    # weights is Megatron's main_grad (`mixed_precision.accumulate_in_fp32`): stages 0-2 add
    # each micro-batch's gradient into an fp32 buffer per parameter and reduce those; stage 3
    # reduce-scatters each micro-batch's unit gradient in fp32 into the shard's fp32 main_grad
    grad_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ShardwiseError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage}")


@dataclass(frozen=True)
class UnitSpec:
    """One flat unit: the parameters of `module` (those whose qualified name `select`
    accepts; None: all not taken by an earlier unit), sharded over `group` (None: the
    engine's). The averaged gradient is the sum over the group ÷ (group size · `divide`)
    (experts under ep: `divide` = ep, their owner's gradient already sums the ep group)."""

    module: nn.Module
    group: GroupLike | None = None
    select: Callable[[str], bool] | None = None
    divide: int = 1
    # hybrid shard (HSDP): the ranks holding the same shard in other groups; the shard's
    # gradient is averaged over them after the reduce-scatter (None: no replicas)
    replicas: GroupLike | None = None


@dataclass
class _Slot:
    """One parameter inside a unit's flat buffer; `owners`: every (module, name) that holds
    it (a tied weight is held by two modules)."""

    module: nn.Module
    name: str
    qualname: str
    shape: torch.Size
    offset: int
    numel: int
    owners: tuple[tuple[nn.Module, str], ...] = ()


class _Marker:
    """What a saved view of a gathered stage-3 buffer becomes between forward and backward."""

    __slots__ = ("offset", "size", "stride", "unit")

    def __init__(self, unit: _Unit, t: torch.Tensor):
        self.unit, self.offset = unit, t.storage_offset()
        self.size, self.stride = tuple(t.size()), tuple(t.stride())


class _Unit:
    """The flat, padded, sharded parameters of one unit (a layer)."""

    def __init__(self, index: int, slots: list[_Slot], engine: ZeroDataParallel,
                 dtype: torch.dtype, device: torch.device, module: nn.Module,
                 group: C.AxisGroup, divide: int = 1, replicas: C.AxisGroup | None = None,
                 grad_dtype: torch.dtype | None = None):
        self.index, self.slots, self.engine = index, slots, engine
        self.module, self.group, self.divisor = module, group, group.size * divide
        self.replicas = replicas
        n, r = group.size, group.rank
        self.numel = sum(s.numel for s in slots)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel = self.padded // n
        self.lo, self.hi = r * self.shard_numel, (r + 1) * self.shard_numel
        self.dtype, self.device = dtype, device
        self.grad_dtype = grad_dtype or dtype
        self.main_grad = self.grad_dtype != dtype  # fp32 `main_grad`s of bf16 weights
        self.flat: torch.Tensor | None = None  # stages 0-2: the persistent full buffer
        self.gathered: torch.Tensor | None = None  # stage 3: buffer alive during compute
        self.prefetched: tuple[torch.Tensor, Any] | None = None
        self.awaiting_backward = False  # ran forward with autograd; backward not done yet
        self.fired: list[int] = []  # stages 1-2: accumulations per slot not yet reduced
        # stage 1: the flat gradient whose reduce-scatter backward started, and the function
        # that waits for it and returns the averaged owned row
        self.pending: tuple[torch.Tensor, Callable[[], torch.Tensor]] | None = None

    def new_buffer(self) -> torch.Tensor:
        return torch.empty(self.padded, dtype=self.dtype, device=self.device)

    def flat_grad(self) -> torch.Tensor:
        """(padded,) concatenation of the unit's gradients (zeros for missing / padding)."""
        g = torch.zeros(self.padded, dtype=self.grad_dtype, device=self.device)
        for s in self.slots:
            p = s.module._parameters[s.name]
            pg = None if p is None else mp.grad(p)
            if pg is not None:
                g[s.offset:s.offset + s.numel].copy_(pg.reshape(-1))
        return g

    def reduce_shard(self, full: torch.Tensor) -> torch.Tensor:
        """The averaged gradient of the owned row from this rank's full flat gradient:
        reduce-scatter over the group, then (hybrid) all-reduce over the replicas."""
        return self.start_reduce(full, async_op=False)()

    def start_reduce(self, full: torch.Tensor, async_op: bool = True
                     ) -> Callable[[], torch.Tensor]:
        """`reduce_shard` with the reduce-scatter started now; the function returned waits
        for it and finishes (replicas, division). `full` stays alive until then."""
        out = torch.empty(self.shard_numel, dtype=full.dtype, device=self.device)
        work = C.reduce_scatter(out, full, self.group, async_op=async_op)

        def finish(keep: torch.Tensor = full) -> torch.Tensor:  # (`keep`: alive till here)
            if async_op:
                C.wait(work)
            if self.replicas is not None and self.replicas.size > 1:
                C.all_reduce(out, self.replicas)
                return out.div_(self.divisor * self.replicas.size)
            return out.div_(self.divisor)
        return finish

    def free_grads(self) -> None:
        mp.clear_grads(s.module._parameters[s.name] for s in self.slots)

    # ------------------------------------------------------------------- stage 3 gathers
    def gather(self, prefetch: bool = False) -> torch.Tensor | None:
        """All-gather the flat weights; with `prefetch`, start it and keep the handle."""
        shard = self.engine.shards[self.index].detach()
        log = self.engine.events
        if prefetch:
            buf = self.new_buffer()
            work = C.all_gather(buf, shard, self.group, async_op=True)
            self.prefetched = (buf, work)
            log.append(("prefetch", self.index))
            return None
        if self.prefetched is not None:
            buf, work = self.prefetched
            self.prefetched = None
            C.wait(work)
            log.append(("use-prefetch", self.index))
            return buf
        buf = self.new_buffer()
        C.all_gather(buf, shard, self.group)
        log.append(("gather", self.index))
        return buf

    def set_views(self, full: torch.Tensor) -> None:
        for s in self.slots:  # (padded,) -> the parameter's shape
            view = full[s.offset:s.offset + s.numel].view(s.shape)
            for module, name in s.owners:
                setattr(module, name, view)

    def clear_views(self) -> None:
        for s in self.slots:
            for module, name in s.owners:
                setattr(module, name, None)

    def pack(self, t: torch.Tensor) -> Any:
        g = self.gathered
        if (g is not None and t.device == g.device
                and t.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()):
            return _Marker(self, t)
        return t

    def backward_buffer(self) -> torch.Tensor:
        """The weights for this unit's backward: gathered again (FSDP's pre-backward), with
        the unit before it prefetched; the module views them too, for a full recompute's
        replay of the forward (cleared once the unit's gradient is complete). The buffer
        requires grad, as the forward's did, so the replay saves what the forward saved; no
        gradient reaches it (the forward's graph carries them to `_GatherUnit`). The views
        are taken with grad enabled: this runs in a backward hook (grad off), and a view taken
        there has no autograd edge, so an op using it directly (the router's `x @ W_r`) would
        not save its other operand in the replay (a different count: checkpoint's error)."""
        if self.gathered is None:
            buf = self.gather()
            assert buf is not None
            self.gathered = buf.requires_grad_()
            with torch.enable_grad():
                self.set_views(buf)
            before = self.index - 1
            if self.engine.config.prefetch and before >= 0:
                unit = self.engine.units[before]
                if unit.awaiting_backward and unit.gathered is None and unit.prefetched is None:
                    unit.gather(prefetch=True)
        return self.gathered


def _unpack(x: Any) -> torch.Tensor:
    if isinstance(x, _Marker):
        buf = x.unit.backward_buffer()
        return buf.as_strided(x.size, x.stride, x.offset)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


class _GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit's flat weights from the owned rows. Backward: reduce-scatter
    the flat gradient (SUM, then ÷N) back to the owned row, and free the gathered buffer."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: _Unit) -> torch.Tensor:
        ctx.unit = unit
        return unit.gather()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        unit: _Unit = ctx.unit
        gathered = unit.gathered
        unit.gathered, unit.awaiting_backward = None, False
        unit.clear_views()
        later = deferred_ops()
        if later is not None and gathered is not None and _DeferredGrad.attach(
                unit, gathered, later, grad_full):
            return None, None  # W completes the gradient and reduce-scatters it
        # (fp32 main_grad: this micro-batch's bf16 gradient reduce-scattered in fp32 and added
        # into the shard's fp32 buffer; autograd would accumulate it into a bf16 .grad)
        grad_shard = unit.reduce_shard(grad_full.to(unit.grad_dtype).contiguous())
        unit.engine.events.append(("reduce-scatter", unit.index))
        if unit.main_grad:
            unit.engine._add_to_shard(unit, grad_shard)
            return None, None
        return grad_shard, None


class _DeferredGrad:
    """A stage-3 unit's gradient of one micro-batch under ZB-H1, from its B until its W.

    B ran the unit's backward with the linears' weight gradients deferred (`pipeline.
    defer_linears`): the flat gradient that reaches `_GatherUnit` holds the other slots'
    (norms, router, experts) and zeros where the deferred linears' weights lie. Instead of
    reduce-scattering it, B keeps those other slots' gradients and points each deferred op's
    weight (and bias) at this object (`_SlotTarget`); the gathered weights are then freed, as
    after any backward (dW = dYᵀ·X needs X and dY, not W). W adds every dW in place; the last
    one completes the unit's flat gradient, which is reduce-scattered into the owned row once
    (one reduce-scatter per unit and micro-batch, as without ZB-H1). Held from B to W: X, dY
    (the pipeline's) and the kept slots' gradients; during W one flat (padded,) buffer."""

    def __init__(self, unit: _Unit, kept: list[tuple[int, torch.Tensor]], dtype: torch.dtype):
        self.unit, self.kept, self.dtype = unit, kept, dtype
        self.left = 0  # targets whose gradient W has not added yet
        self.full: torch.Tensor | None = None

    @classmethod
    def attach(cls, unit: _Unit, gathered: torch.Tensor, later: list[Any],
               grad_full: torch.Tensor) -> bool:
        """Re-point the deferred ops of `later` whose weights view `gathered`; False if none
        does (then the gradient is complete now)."""
        storage = gathered.untyped_storage().data_ptr()

        def mine(t: Any) -> bool:
            return (isinstance(t, torch.Tensor) and t.device == gathered.device
                    and t.untyped_storage().data_ptr() == storage)

        ops = [op for op, _ in later if mine(op.weight) or mine(op.bias)]
        if not ops:
            return False
        spans = [(t.storage_offset(), t.storage_offset() + t.numel())
                 for op in ops for t in (op.weight, op.bias) if mine(t)]
        kept = [(s.offset, grad_full[s.offset:s.offset + s.numel].clone()) for s in unit.slots
                if not any(lo < s.offset + s.numel and s.offset < hi for lo, hi in spans)]
        pending = cls(unit, kept, grad_full.dtype)
        for op in ops:
            op.weight = pending.target(op.weight) if mine(op.weight) else op.weight
            op.bias = pending.target(op.bias) if mine(op.bias) else op.bias
        return True

    def target(self, t: torch.Tensor) -> _SlotTarget:
        self.left += 1
        return _SlotTarget(self, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    @torch.no_grad()
    def add(self, target: _SlotTarget, grad: torch.Tensor) -> None:
        unit = self.unit
        if self.full is None:  # (padded,): the kept slots' gradients, zeros elsewhere
            self.full = torch.zeros(unit.padded, dtype=self.dtype, device=unit.device)
            for offset, g in self.kept:
                self.full[offset:offset + g.numel()].copy_(g)
            self.kept = []
        self.full.as_strided(target.size, target.stride, target.offset).add_(grad)
        self.left -= 1
        if self.left == 0:
            grad_shard = unit.reduce_shard(self.full.to(unit.grad_dtype))
            self.full = None
            unit.engine.events.append(("reduce-scatter", unit.index))
            if unit.main_grad:  # into the shard's fp32 buffer, as `_GatherUnit.backward`
                unit.engine._add_to_shard(unit, grad_shard)
                return
            with torch.enable_grad():  # autograd's accumulation, as B's would have been
                accumulate_grad(unit.engine.shards[unit.index], grad_shard)


@dataclass(frozen=True)
class _SlotTarget:
    """Where a deferred linear's weight (or bias) lay in its unit's gathered buffer: W's
    gradient goes to the same place of the unit's flat gradient (`pipeline.GradTarget`)."""

    pending: _DeferredGrad
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def accumulate(self, grad: torch.Tensor) -> None:
        self.pending.add(self, grad)


