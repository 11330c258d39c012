"""A rank's share of a layout-independent checkpoint: each local parameter, ZeRO flat shard
or AdamW moment as chunks of the single-device tensor (`_Span`, `_Blocks`), which DCP
writes once and reads back into any other layout.
Design: docs/concepts/runtime.md#checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardwise.runtime.mixed_precision import MasterOptimizer
from shardwise.runtime.state import (
    TrainState,
)

if TYPE_CHECKING:
    from shardwise.runtime.parallel_transformer import ParallelTransformer


_MOMENTS = ("exp_avg", "exp_avg_sq")
# ------------------------------------------------------------------------ the rank's share
def _blocks(shape: tuple[int, ...], start: int, stop: int
            ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, stop) of a row-major tensor of `shape` as rectangular blocks
    (offsets, sizes), in memory order; each is contiguous in the flat tensor."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])  # elements per row (row = index along dim 0)
    rest = (0,) * (len(shape) - 1)
    out = []
    row, within = divmod(start, inner)
    if within:  # a partial first row
        end = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *z)) for o, z in _blocks(shape[1:], within, end - row * inner)]
        row, start = row + 1, end
    whole = (stop - start) // inner
    if start < stop and whole:  # whole rows
        out.append(((row, *rest), (whole, *shape[1:])))
        row, start = row + whole, start + whole * inner
    if start < stop:  # a partial last row
        out += [((row, *o), (1, *z)) for o, z in _blocks(shape[1:], 0, stop - start)]
    return out


@dataclass(frozen=True)
class _Span:
    """Elements [first, first + numel) of parameter `key`'s local shard (shape `local`, at
    `base` in the full tensor of shape `full`) are elements [at, at + numel) of the flat
    tensor number `tensor` (a parameter, a ZeRO shard, or their AdamW moments)."""

    key: str
    full: tuple[int, ...]
    local: tuple[int, ...]
    base: tuple[int, ...]
    tensor: int
    at: int
    first: int
    numel: int

    def blocks(self, tensor: torch.Tensor) -> _Blocks:
        """This span of `tensor` as chunks of the full tensor (views: writes land in place)."""
        flat = tensor.detach().view(-1)
        chunks, cursor = [], self.at
        for offsets, sizes in _blocks(self.local, self.first, self.first + self.numel):
            n = math.prod(sizes)
            chunks.append((tuple(b + o for b, o in zip(self.base, offsets)),
                           flat[cursor:cursor + n].view(sizes)))
            cursor += n
        return _Blocks(self.full, chunks)


class _Blocks(torch.Tensor):
    """A full tensor of `shape` of which this rank holds `chunks` — (global offsets, local
    view) — for DCP: it implements DCP's checkpointable protocol (`__create_write_items__`,
    `__create_chunk_list__`, `__get_tensor_shard__`), which DTensor implements for one regular
    shard. A metadata-only wrapper: no tensor operation runs on it."""

    _chunks: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], torch.Tensor]]
                ) -> _Blocks:
        first = chunks[0][1]
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=first.dtype,
                                                  device=first.device)
        out._chunks = chunks
        return out

    def _chunk_metadata(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self._chunks]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                              size=self.size()))
                for chunk, (_, t) in zip(self._chunk_metadata(), self._chunks)]

    def __create_chunk_list__(self) -> list[Any]:
        return self._chunk_metadata()

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, t in self._chunks:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"no local chunk of {index.fqn} at {tuple(index.offset)}")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise RuntimeError(f"_Blocks is checkpoint metadata, not a tensor to compute with "
                           f"({func})")


def _place(model: ParallelTransformer, name: str, local: tuple[int, ...]
           ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(checkpoint key, full shape, offsets of this rank's shard) of parameter `name`."""
    shard = model.shards[name]
    full, base = list(local), [0] * len(local)
    for dim, group in ((shard.tp_dim, "tp"), (0 if shard.expert else None, "ep")):
        if dim is not None:  # an even split (parallelize._keep): shard r starts at r·size
            axis = model.axis(group)
            copies = shard.tp_replicas if group == "tp" else 1  # replicated kv heads: once
            base[dim] = axis.rank // copies * local[dim]
            full[dim] = local[dim] * axis.size // copies
    key = "embedding.weight" if shard.tied_copy else name  # equal to the embedding it copies
    return key, tuple(full), tuple(base)


def _whole(model: ParallelTransformer) -> list[_Span]:
    """One span per module parameter (`model.model.named_parameters()` order): the whole
    local shard."""
    spans = []
    for i, (name, p) in enumerate(model.model.named_parameters()):
        key, full, base = _place(model, name, tuple(p.shape))
        spans.append(_Span(key, full, tuple(p.shape), base, i, 0, 0, p.numel()))
    return spans


def _flat(model: ParallelTransformer) -> list[_Span]:
    """Spans of the ZeRO shards (`zero.shards` order): each parameter's part of this rank's
    row of its unit's flat buffer (stage 0: the whole buffer)."""
    zero = model.zero
    assert zero is not None
    spans = []
    for i, unit in enumerate(zero.units):
        lo, hi = (0, unit.padded) if zero.config.stage == 0 else (unit.lo, unit.hi)
        for s in unit.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                key, full, base = _place(model, s.qualname, tuple(s.shape))
                spans.append(_Span(key, full, tuple(s.shape), base, i, a - lo, a - s.offset,
                                   b - a))
    return spans


def _layout(model: ParallelTransformer) -> tuple[list[torch.Tensor], list[_Span], list[_Span]]:
    """(the tensors holding the weights, the weights' spans over them, the spans of the
    optimizer's tensors `model.parameters()`). Without ZeRO both are the module parameters;
    ZeRO 0–2 keep full weights in the module (views of the flat buffers) and step on flat
    shards; ZeRO-3 keeps only the shards."""
    if model.zero is None:
        spans = _whole(model)
        return [p for _, p in model.model.named_parameters()], spans, spans
    if model.zero.config.stage < 3:
        return [p for _, p in model.model.named_parameters()], _whole(model), _flat(model)
    spans = _flat(model)
    return list(model.zero.shards), spans, spans


def _state_dict(state: TrainState, moments: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The DCP state dict over this rank's tensors: the live weights, and `moments[i]` (the
    exp_avg, exp_avg_sq and step of the optimizer's tensor i, and under mixed precision its
    fp32 master) for the optimizer state."""
    weights, weight_spans, state_spans = _layout(state.model)
    out: dict[str, Any] = {f"model.{s.key}": s.blocks(weights[s.tensor]) for s in weight_spans}
    for s in state_spans:
        for moment in _MOMENTS + (("master",) if "master" in moments[s.tensor] else ()):
            out[f"optim.{s.key}.{moment}"] = s.blocks(moments[s.tensor][moment])
        # One count per parameter, as AdamW keeps it (a ZeRO shard's parameters share theirs;
        # a shard of padding alone keeps 0, which moves nothing: its values stay 0).
        out[f"optim.{s.key}.step"] = moments[s.tensor]["step"]
    return out


def _stepped(state: TrainState) -> list[torch.Tensor]:
    """The tensors AdamW steps, in `model.parameters()` order: those parameters, or under
    mixed precision their fp32 masters (`MasterOptimizer.masters`, one per parameter or ZeRO
    shard, same shapes), whose moments and values the checkpoint keeps."""
    if isinstance(state.optimizer, MasterOptimizer):
        return state.optimizer.masters
    return list(state.model.parameters())


def _adamw_zeros(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `p` before its first step (what `torch.optim.AdamW` creates lazily;
    stepping from it is stepping from no state)."""
    return {"step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


