"""ZeRO stages 0–3 over the data-parallel axis (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

Data parallelism replicates weights `w`, gradients `g` and optimizer state `o` bytes per
parameter on each of the N ranks. ZeRO partitions them instead (SPEC §2):

    stage  sharded            state per rank              traffic per step per rank
    0      nothing (DDP)      (w+g+o)·P                   all-reduce grads   2(N-1)/N·P·g
    1      optimizer state    (w+g)·P + o·P/N             RS grads + AG weights (N-1)/N·P·(g+w)
    2      + gradients        w·P + (g+o)·P/N             same as stage 1
    3      + weights          (w+g+o)·P/N                 AG fwd + AG bwd + RS (N-1)/N·P·(2w+g)

(`o` counts Adam's two moments and, when the weights are below fp32, the fp32 master copy. Under
mixed precision (`runtime.mixed_precision`) the master is the optimizer's fp32 copy of each
owned row, so it is sharded with the moments, as in Megatron-LM's distributed optimizer; the
updated bf16 rows are what stages 1-2 all-gather.)

Layout. Parameters are grouped into *units* (by default the module's children that own
parameters: one per layer; `UnitSpec` puts a unit over another group — experts over the
expert-data-parallel group — or adds replica groups: a hybrid shard (HSDP) reduce-scatters
within the group, then all-reduces the shard across its replicas). A parameter two modules
hold (a tied embedding and head) is one slot viewed by both. Each unit's parameters are flattened into one buffer padded to a
multiple of N, `(numel,) -> (N, numel/N)`; rank r owns row r. The optimizer (torch's Adam)
steps only on owned rows, as flat tensors — elementwise the same arithmetic as Adam on the
full parameters, so ZeRO training follows DDP training to the last bit when the summed
gradients are identical.

* stages 0–2: the module's parameters become views of the unit's flat buffer, so updating
  the owned row updates the module in place. Stage 0 all-reduces each unit's flat gradient and
  steps on the whole flat buffer; stage 1 reduce-scatters the flat gradient once per step: a
  backward outside `no_sync()` (DDP's contract: the last micro-batch's) starts each unit's
  reduce-scatter asynchronously as soon as it has produced all the unit's gradients, so it
  runs while backward goes on to earlier layers, as DDP's buckets do (PyTorch's
  `ZeroRedundancyOptimizer` sits on DDP's overlapped all-reduce); `step()` waits for them and
  reduce-scatters any unit backward did not complete. Stage 2 reduce-scatters a unit as soon as
  backward has produced all its gradients, every micro-batch (hooks), and frees the full
  gradients. Stages 1–2 all-gather the updated rows after the step (all units' gathers
  started, then awaited).
* stage 3 (FSDP "full shard"): only the owned row persists. Before a unit's forward its flat
  weights are all-gathered (`_GatherUnit`, whose backward reduce-scatters the flat gradient
  into the owned row); the next unit's gather is prefetched asynchronously. After the forward
  the gathered buffer is dropped: saved-tensor hooks replace every saved view of it by a
  marker. When the gradient reaches the unit's output (FSDP's pre-backward hook; or at the
  first use of a marker) the unit is gathered again and the unit before it prefetched; the
  buffer is freed once the unit's gradient has been reduce-scattered. The module views the
  backward's buffer too, so a full recompute's replay runs on it (no third gather). Under
  ZB-H1 (`pipeline.defer_linears`) B frees the buffer as usual and keeps the unit's gradient
  open until W has added the linears' dW (`_DeferredGrad`); then one reduce-scatter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.collectives import GroupLike
from shardwise.runtime.data_parallel import broadcast_flat
from shardwise.runtime.pipeline import accumulate_grad, deferred_ops

__all__ = ["UnitSpec", "ZeroConfig", "ZeroDataParallel"]


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
        gradient reaches it (the forward's graph carries them to `_GatherUnit`)."""
        if self.gathered is None:
            buf = self.gather()
            assert buf is not None
            self.gathered = buf.requires_grad_()
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


class ZeroDataParallel(nn.Module):
    """Train `module` with ZeRO-`stage` over `group` (default: the mesh's dp axis).

    Usage: `out = zdp(x); loss.backward(); zdp.step(); zdp.zero_grad()`.
    `units`: the modules whose parameters form one flat unit each, or `UnitSpec`s (a unit
    over another group, or a subset of a module's parameters); default: the children that own
    parameters. Every parameter must belong to exactly one unit; a parameter two modules hold
    (tied embeddings) is one slot of the first unit that reaches it, viewed by both modules.
    """

    def __init__(self, module: nn.Module, config: ZeroConfig | None = None,
                 group: GroupLike = "dp", units: Sequence[nn.Module | UnitSpec] | None = None):
        super().__init__()
        self.module = module
        self.config = config or ZeroConfig()
        self.group = C.resolve(group)
        # Stage 3's gathers and scatters in order, ("gather" | "prefetch" | "use-prefetch" |
        # "reduce-scatter", unit index): what the tests read to check the schedule.
        self.events: list[tuple[str, int]] = []
        specs = [u if isinstance(u, UnitSpec) else UnitSpec(u) for u in (
            units if units is not None else
            [m for m in module.children() if any(True for _ in m.parameters())])]
        self.units = self._make_units(specs)
        self.shards: list[nn.Parameter] = []
        stage = self.config.stage
        for unit in self.units:
            flat = unit.new_buffer()
            flat.zero_()
            for s in unit.slots:
                flat[s.offset:s.offset + s.numel].copy_(
                    s.module._parameters[s.name].detach().reshape(-1))
            broadcast_flat(flat, unit.group)  # every replica starts from the first's
            if unit.replicas is not None:
                broadcast_flat(flat, unit.replicas)
            if stage == 3:
                for s in unit.slots:
                    for owner, name in s.owners:
                        del owner._parameters[name]
                unit.clear_views()
                self.shards.append(nn.Parameter(flat[unit.lo:unit.hi].clone()))
            else:
                unit.flat = flat
                for s in unit.slots:  # module parameters become views of the flat buffer
                    view = nn.Parameter(flat[s.offset:s.offset + s.numel].view(s.shape))
                    for owner, name in s.owners:
                        owner._parameters[name] = view
                # stage 0 steps on the whole buffer; 1-2 on the owned row (a view: no copy)
                self.shards.append(nn.Parameter(flat if stage == 0 else flat[unit.lo:unit.hi]))
        self._sync = True  # stage 1: backward starts the reduce-scatters (not in no_sync)
        self.optimizer = torch.optim.Adam(self.shards, lr=self.config.lr,
                                          betas=self.config.betas, eps=self.config.eps,
                                          weight_decay=self.config.weight_decay, foreach=False)
        for unit, shard in zip(self.units, self.shards):
            if unit.main_grad:
                mp.keep_main_grad(shard)
        if stage < 3:
            self._install_grad_hooks()
        if stage == 3:
            for unit in self.units:
                # the unit's module, then any other module viewing its weights (a tied head)
                inside = set(map(id, unit.module.modules()))
                users = [unit.module, *dict.fromkeys(
                    owner for s in unit.slots for owner, _ in s.owners
                    if id(owner) not in inside)]
                for i, user in enumerate(users):
                    user.register_forward_pre_hook(self._pre_forward(unit, prefetch=i == 0))
                    user.register_forward_hook(self._post_forward(unit))

    # -------------------------------------------------------------------------- setup
    def _make_units(self, specs: list[UnitSpec]) -> list[_Unit]:
        qual = {id(p): name for name, p in self.module.named_parameters()}
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for mod in self.module.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((mod, name))
        seen: set[int] = set()
        units = []
        for spec in specs:
            slots, offset = [], 0
            for mod in spec.module.modules():
                for name, p in list(mod._parameters.items()):
                    if p is None or id(p) in seen:
                        continue
                    qualname = qual.get(id(p), name)
                    if spec.select is not None and not spec.select(qualname):
                        continue
                    seen.add(id(p))
                    slots.append(_Slot(mod, name, qualname, p.shape, offset, p.numel(),
                                       tuple(owners.get(id(p), [(mod, name)]))))
                    offset += p.numel()
            if slots:
                first = slots[0].module._parameters[slots[0].name]
                group = self.group if spec.group is None else C.resolve(spec.group)
                replicas = None if spec.replicas is None else C.resolve(spec.replicas)
                units.append(_Unit(len(units), slots, self, first.dtype, first.device,
                                   spec.module, group, spec.divide, replicas,
                                   self.config.grad_dtype))
        missing = [n for n, p in self.module.named_parameters() if id(p) not in seen]
        if missing:
            raise ShardwiseError(f"parameters {missing} belong to no ZeRO unit; pass units= "
                                 "covering every parameter")
        return units

    def _install_grad_hooks(self) -> None:
        """Stages 0-2: fp32 accumulation of lower-precision weights' gradients (first), then
        stage 1's and 2's reduce-scatter hooks."""
        stage = self.config.stage
        for unit in self.units:
            unit.fired = [0] * len(unit.slots)
            for i, s in enumerate(unit.slots):
                p = s.module._parameters[s.name]
                count = (self._stage2_hook(unit, i) if stage == 2 else
                         self._stage1_hook(unit, i) if stage == 1 else None)
                if unit.main_grad:  # calls `count` only after an accumulation
                    mp.accumulate_in_fp32(p, count)
                elif count is not None:  # a call without a gradient is no accumulation
                    p.register_post_accumulate_grad_hook(
                        lambda p, count=count: None if p.grad is None else count(p))

    def _stage1_hook(self, unit: _Unit, i: int) -> Any:
        """Outside `no_sync()`: once every slot of the unit has its gradient of this backward,
        start the unit's reduce-scatter (asynchronous) and free its full gradients (their
        flat copy lives until `step`). Units complete in the same order on every rank (the
        same graph), so the collectives pair up, as stage 2's do."""
        def hook(p: torch.Tensor) -> None:
            if not self._sync:
                return
            if unit.pending is not None:
                raise ShardwiseError(
                    "ZeRO-1: a second backward reached gradients already reduce-scattered "
                    "this step; run every micro-batch's backward but the last under no_sync()")
            unit.fired[i] += 1
            if min(unit.fired) > 0:
                flat = unit.flat_grad()
                unit.pending = flat, unit.start_reduce(flat)
                unit.free_grads()
                unit.fired = [0] * len(unit.fired)
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's: a backward inside only accumulates gradients (stage 1: reduced by the
        next backward outside, or at `step`). Stages 0, 2 and 3 reduce as before."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _stage2_hook(self, unit: _Unit, i: int) -> Any:
        """Count each slot's accumulations; once every slot has one more (a micro-batch's
        gradients are complete), reduce-scatter what has accumulated and free it. Counting,
        not a set, keeps this exact when a slot's next micro-batch arrives before another's
        current one (ZB-H1 runs B of micro-batch j+1 before W of j: the norms' gradients come
        twice before the linears' first; W accumulates theirs through autograd, so these
        hooks see it). A call without a gradient is no accumulation (autograd calls the hook
        of a weight whose gradient a function returned as None): the caller filters it out."""
        def hook(p: torch.Tensor) -> None:
            unit.fired[i] += 1
            while min(unit.fired) > 0:
                self._reduce_scatter_into_shard(unit)
                unit.free_grads()
                unit.fired = [n - 1 for n in unit.fired]
        return hook

    def _reduce_scatter_into_shard(self, unit: _Unit) -> None:
        if unit.pending is not None:  # stage 1: started in backward
            out, unit.pending = unit.pending[1](), None
        else:
            out = unit.reduce_shard(unit.flat_grad())
        self._add_to_shard(unit, out)

    def _add_to_shard(self, unit: _Unit, out: torch.Tensor) -> None:
        """The owned row's gradient += `out` (a reduced micro-batch or step)."""
        shard = self.shards[unit.index]
        g = mp.grad(shard)
        if g is None:
            mp.set_grad(shard, out)
        else:
            g.add_(out)

    # ------------------------------------------------------------------- stage-3 hooks
    def _pre_forward(self, unit: _Unit, prefetch: bool = True) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            full = _GatherUnit.apply(self.shards[unit.index], unit)
            unit.gathered = full
            unit.set_views(full)
            nxt = unit.index + 1
            if (prefetch and self.config.prefetch and nxt < len(self.units)
                    and self.units[nxt].prefetched is None):
                self.units[nxt].gather(prefetch=True)
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            ctx.__enter__()
            unit._hooks_ctx = ctx  # type: ignore[attr-defined]
        return hook

    def _pack(self, t: torch.Tensor) -> Any:
        """A saved view of any gathered unit becomes its marker (two units of one module, as
        a layer's dense weights and its experts, nest their hooks; the inner one is active)."""
        for unit in self.units:
            if unit.gathered is not None:
                packed = unit.pack(t)
                if packed is not t:
                    return packed
        return t

    def _post_forward(self, unit: _Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            unit._hooks_ctx.__exit__(None, None, None)  # type: ignore[attr-defined]
            unit.clear_views()
            unit.gathered = None  # freed now; gathered again before its backward
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs and torch.is_grad_enabled():
                unit.awaiting_backward = True
                # Pre-backward: the gradient reaching the unit's output triggers the gather.
                outs[0].register_hook(lambda grad: (unit.backward_buffer(), grad)[1])
        return hook

    # ------------------------------------------------------------------------ training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def step(self, before_update: Callable[[], object] | None = None) -> None:
        """Reduce gradients (stages 0, 1), `before_update()` (more reductions of the shards'
        gradients), Adam on the owned rows, gather weights (1, 2)."""
        stage = self.config.stage
        for unit, shard in zip(self.units, self.shards):
            if stage == 0:
                g = unit.flat_grad()
                C.all_reduce(g, unit.group)
                mp.set_grad(shard, g.div_(unit.divisor))
            elif stage == 1:  # wait for backward's reduce-scatter (or run it), free grads
                self._reduce_scatter_into_shard(unit)
                unit.free_grads()
                unit.fired = [0] * len(unit.fired)
        if before_update is not None:
            before_update()
        self.optimizer.step()
        if stage in (1, 2):  # every unit's gather started, then awaited
            works = [C.all_gather(unit.flat, shard.detach().clone(), unit.group, async_op=True)
                     for unit, shard in zip(self.units, self.shards)]
            for work in works:
                C.wait(work)
        for unit in self.units:  # a stale prefetch (forward without backward) is dropped
            if unit.prefetched is not None:
                C.wait(unit.prefetched[1])
                unit.prefetched = None

    def zero_grad(self) -> None:
        for unit in self.units:  # stage 1: a reduction started without a step is dropped
            if unit.pending is not None:
                unit.pending[1]()
                unit.pending = None
            unit.fired = [0] * len(unit.fired)
        mp.clear_grads(self.shards)
        mp.clear_grads(self.module.parameters())

    # ----------------------------------------------------------------------- inspection
    def state_bytes(self) -> dict[str, int]:
        """Bytes of persistent training state this rank holds now: weights, gradients and
        optimizer state (Adam's moments; the scalar step counter excluded), each tensor's
        storage counted once. Measure after `backward()` and before `step()` (from the second
        step on, when Adam's moments exist): gradients are then in their persistent form —
        full on stages 0-1 (stage 1: each unit's flat gradient, its reduce-scatter started),
        the owned row on stages 2-3."""
        seen: set[int] = set()

        def nbytes(tensors: Any) -> int:
            total = 0
            for t in tensors:
                if t is None or t.dim() == 0:
                    continue
                key = t.untyped_storage().data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return total

        weights = nbytes([u.flat for u in self.units] if self.config.stage < 3 else
                         [s.detach() for s in self.shards])
        grads = nbytes([g for p in [*self.module.parameters(), *self.shards]
                        for g in (p.grad, getattr(p, "main_grad", None))] +
                       [u.pending[0] for u in self.units if u.pending is not None])
        optim = nbytes([v for st in self.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor)])
        return {"weights": weights, "grads": grads, "optimizer": optim}

    @torch.no_grad()
    def full_parameters(self, shards: Sequence[torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
        """Every parameter's full value by qualified name (stage 3 gathers; not counted).
        `shards`: values in place of `self.shards` (the fp32 master shards of mixed
        precision), gathered over each unit's group."""
        out = {}
        with C.counting():
            for unit in self.units:
                if shards is not None:
                    mine = shards[unit.index].detach()
                    flat = mine.new_empty(unit.padded)
                    C.all_gather(flat, mine, unit.group)
                elif self.config.stage == 3:
                    flat = unit.new_buffer()
                    C.all_gather(flat, self.shards[unit.index].detach(), unit.group)
                else:
                    flat = unit.flat
                assert flat is not None
                for s in unit.slots:
                    out[s.qualname] = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
        return out

    @property
    def n_params(self) -> int:
        return sum(u.numel for u in self.units)
