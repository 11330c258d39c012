"""What each layer saves for backward, measured: autograd's saved-tensor hooks count the bytes
of every tensor a layer's forward keeps (each storage once, parameters and optimizer state
excluded), per layer and per forward call (`saved_bytes_per_layer`, `LayerRecorder`).
The formula they are held to: `estimate.memory.saved_tensors_per_layer` (SPEC §3).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


@contextlib.contextmanager
def _observe_saved(record: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `record(t)` on every tensor autograd saves inside the block. Saved-tensor hooks do
    not nest (only the innermost pair runs), so a pair already active — ZeRO-3's, which swaps
    gathered weights for markers — still packs and unpacks every tensor through this one."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (_same, _same)

    def pack(t: torch.Tensor) -> Any:
        record(t)
        return outer_pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
        yield


def _same(x: Any) -> Any:
    return x


@contextlib.contextmanager
def saved_tensor_bytes(exclude: Container[int]) -> Iterator[dict[int, int]]:
    """Inside the block, record `{storage pointer: bytes}` of every tensor autograd saves,
    each storage once, skipping the storages in `exclude` (parameters, buffers)."""
    seen: dict[int, int] = {}

    def record(t: torch.Tensor) -> None:
        pointer, nbytes = _storage(t)
        if pointer not in exclude:
            seen.setdefault(pointer, nbytes)

    with _observe_saved(record):
        yield seen


def _state_storages(module: nn.Module) -> set[int]:
    tensors = [*module.parameters(), *module.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors}


def saved_bytes_per_layer(model: nn.Module, layers: list[nn.Module], run) -> list[int]:
    """Bytes saved for backward inside each of `layers` while `run()` does a forward pass of
    `model`; returns one figure per layer. Storages a layer saves that an earlier layer also
    saved (its input, say) are charged to the earlier layer only."""
    exclude = _state_storages(model)
    counts: list[dict[int, int]] = [{} for _ in layers]
    stack = contextlib.ExitStack()

    def enter(index: int):
        def hook(module: nn.Module, args: object) -> None:
            counts[index] = stack.enter_context(saved_tensor_bytes(exclude))
        return hook

    def leave(module: nn.Module, args: object, output: object) -> None:
        stack.close()

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(index)))
        handles.append(layer.register_forward_hook(leave))
    try:
        run()
    finally:
        stack.close()
        for handle in handles:
            handle.remove()
    charged: set[int] = set()
    result = []
    for seen in counts:
        result.append(sum(n for pointer, n in seen.items() if pointer not in charged))
        charged.update(seen)
    return result


@dataclass(frozen=True)
class LayerCall:
    """One forward call of one layer: bytes saved by the layer alone (`saved`; for an MoE
    layer without its MoE block) and by its MoE block (`moe`, None for a dense layer).
    `extra_rows`: under expert parallelism, rows this rank's experts ran beyond the k·T
    copies of its own tokens (rows received from other ranks minus rows sent to them; 0 when
    routing is balanced), less the assignments dropped at the capacity limit (`dropped`:
    the experts run those fewer rows, and the combine keeps that many fewer expert outputs)."""

    layer: int
    saved: int
    moe: int | None = None
    extra_rows: int = 0
    dropped: int = 0


@dataclass
class LayerRecorder:
    """While active (`with recorder:`), watches every Transformer block the rank holds.

    One *pass* is one `Transformer.run_blocks` call: one micro-batch through the layers of one
    virtual stage. Inside a pass a storage saved by one layer only is that layer's; one saved
    by several (full recompute's checkpoints all keep the same RoPE tables) is the pass's
    `shared`. Tensors for which `is_state` holds (weights) are skipped. MoE blocks are counted
    apart, and the routing of every expert-parallel call (`MoE.ep_stats`, which
    `runtime.parallelize` leaves there) is kept as `(layer, rows sent to other ranks, rows
    computed for other ranks)`, `ep_rank` being this rank's place in its ep group; of every
    MoE call, `expert_load` keeps (rows this rank's experts ran ÷ the call's tokens × k, the
    share of its experts that ran any row: `MoE.expert_rows`), and `dispatch_rows` the
    largest tokens × k of a call (the rows its dispatch sends). A full recompute's replay in
    backward runs outside the block hooks and is not recorded (its tensors are freed as they
    are used).
    """

    model: nn.Module
    is_state: Callable[[torch.Tensor], bool]
    ep_rank: int = 0
    calls: list[LayerCall] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)
    routing: list[tuple[int, int, int]] = field(default_factory=list)
    expert_load: list[tuple[float, float]] = field(default_factory=list)
    dispatch_rows: int = 0
    # (layer, part) -> {storage pointer: (bytes, the saved tensor, weakly)}
    _pass: dict[tuple[int, str], dict[int, tuple[int, Any]]] = field(default_factory=dict)
    _where: tuple[int, str] | None = None
    _extra_rows: dict[int, int] = field(default_factory=dict)
    _dropped: dict[int, int] = field(default_factory=dict)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _handles: list[Any] = field(default_factory=list)

    def __enter__(self) -> LayerRecorder:
        model = self.model
        run_blocks = model.run_blocks

        def run_in_pass(*args: Any, **kwargs: Any) -> torch.Tensor:
            self._pass = {}
            try:
                return run_blocks(*args, **kwargs)
            finally:
                self._close_pass()

        model.run_blocks = run_in_pass  # an instance attribute: both call sites see it
        for k, block in enumerate(model.blocks):
            if not hasattr(block, "attention"):  # another stage's layer
                continue
            self._handles += [block.register_forward_pre_hook(self._enter(k)),
                              block.register_forward_hook(self._leave, prepend=True)]
            if hasattr(block.mlp, "router"):  # an MoE block
                self._handles += [block.mlp.register_forward_pre_hook(self._part(k, "moe")),
                                  block.mlp.register_forward_hook(self._moe_done(k))]
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        del self.model.run_blocks

    # ------------------------------------------------------------------------ hooks
    def _record(self, t: torch.Tensor) -> None:
        if self._where is None or self.is_state(t):
            return
        pointer, nbytes = _storage(t)
        seen = self._pass.setdefault(self._where, {})
        if pointer not in seen or seen[pointer][1]() is None:  # new, or a freed one's address
            seen[pointer] = (nbytes, weakref.ref(t))

    def _enter(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            self._where = (k, "layer")
            self._stack.enter_context(_observe_saved(self._record))
        return hook

    def _leave(self, module: nn.Module, args: object, output: object) -> None:
        self._stack.close()
        self._where = None

    def _part(self, k: int, part: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            if self._where is not None:  # not a recompute replay
                self._where = (k, part)
        return hook

    def _moe_done(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            stats = getattr(module, "ep_stats", None)
            if self._where is None:
                return
            self._where = (k, "layer")
            x, rows = args[0], module.expert_rows  # x (…, h); rows (experts here,)
            assignments = x.numel() // x.shape[-1] * module.top_k
            self.dispatch_rows = max(self.dispatch_rows, assignments)
            self.expert_load.append((float(rows.sum()) / assignments,
                                     float((rows > 0).sum()) / rows.numel()))
            self._dropped[k] = getattr(module, "dropped", 0)
            self._extra_rows[k] = -self._dropped[k]
            if stats is not None:
                me = self.ep_rank
                out = sum(stats.sent_rows) - stats.sent_rows[me]
                into = sum(stats.received_rows) - stats.received_rows[me]
                self.routing.append((k, out, into))
                self._extra_rows[k] += into - out
                module.ep_stats = None
        return hook

    def _close_pass(self) -> None:
        """Charge the pass's saved tensors. Only those still alive count: a tensor saved for
        a graph that was dropped in the forward (the MoE's discarded auxiliary loss) is freed
        with it, and its address may be reused by a later layer's."""
        alive = {where: {p: n for p, (n, ref) in seen.items() if ref() is not None}
                 for where, seen in self._pass.items()}
        owners: dict[int, set[int]] = {}
        for (k, _), seen in alive.items():
            for pointer in seen:
                owners.setdefault(pointer, set()).add(k)
        shared = {p for p, layers in owners.items() if len(layers) > 1}
        sizes = {p: n for seen in alive.values() for p, n in seen.items()}
        if shared:
            self.shared.append(sum(sizes[p] for p in shared))
        for k in sorted({k for k, _ in alive}):
            own = alive.get((k, "layer"), {})
            moe = alive.get((k, "moe"))
            self.calls.append(LayerCall(
                k, sum(n for p, n in own.items() if p not in shared),
                None if moe is None else sum(n for p, n in moe.items()
                                             if p not in shared and p not in own),
                self._extra_rows.get(k, 0), self._dropped.get(k, 0)))
        self._pass = {}
        self._extra_rows = {}
        self._dropped = {}


