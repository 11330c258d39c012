"""What a run really holds and moves, for comparison with the analytic model (SPEC §9).

`saved_bytes_per_layer` counts the bytes each Transformer block keeps for backward, through
autograd's saved-tensor hooks: every tensor an op saves is seen once (by storage), parameters
and buffers excluded, so the figure is the activation memory the layer pins until backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def saved_tensor_bytes(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Inside the block, record `{storage pointer: bytes}` of every tensor autograd saves,
    each storage once, skipping the storages in `exclude` (parameters, buffers)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in exclude:
            seen.setdefault(pointer, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
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
