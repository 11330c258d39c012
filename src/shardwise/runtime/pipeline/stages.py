"""The model side of the pipeline: virtual stages (`VirtualStage`, `virtual_stages`: the layers
cut into p·v stages), the `StageModel` protocol the executor runs, and `PipelineModel`, a
small MLP stack that implements it for the tests and the demo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.runtime.pipeline.deferral import SavedOp, _linear
from shardwise.schedules import (
    partition_layers,
)


@dataclass(frozen=True)
class VirtualStage:
    """Virtual stage `index` of `count`: its layers, and whether it holds embedding / head."""

    index: int
    count: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def virtual_stages(n_layers: int, p: int, v: int = 1, *, first_stage_extra: float = 0.0,
                   last_stage_extra: float = 0.0, sizes: Sequence[int] = ()
                   ) -> list[VirtualStage]:
    """The `p·v` virtual stages, layers from `partition_layers` (contiguous, balanced) or
    contiguous runs of `sizes` layers (a layout's `stage_partition`)."""
    count = p * v
    if sizes:
        if len(sizes) != count or sum(sizes) != n_layers or min(sizes) < 1:
            raise ShardwiseError(f"stage sizes {list(sizes)} must be {count} counts ≥ 1 that "
                                 f"sum to n_layers={n_layers}")
        ends = list(accumulate(sizes))
        parts = [list(range(end - n, end)) for end, n in zip(ends, sizes)]
    else:
        parts = partition_layers(n_layers, count, first_stage_extra=first_stage_extra,
                                 last_stage_extra=last_stage_extra)
    return [VirtualStage(vs, count, tuple(layers)) for vs, layers in enumerate(parts)]


class StageModel(Protocol):
    """What `run_pipeline` needs of a model: its layer count and dtype, a virtual stage's
    parameters by name, the stage's forward, and the shape of an inter-stage message."""

    @property
    def n_layers(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def named_parameters(self, stage: VirtualStage | None = None) -> dict[str, torch.Tensor]:
        ...

    def forward_stage(self, stage: VirtualStage, inp: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      saved: list[SavedOp] | None = None) -> torch.Tensor: ...

    def message_shape(self, batch: int, seq: int) -> tuple[int, ...]: ...


@dataclass
class PipelineModel:
    """A small LM the executor splits into stages, built identically from a seed on every rank.

        x_0 = E[tokens]                                   embedding E (V, h)
        x_k = x_{k-1} + tanh(x_{k-1} W1ᵀ + b1) W2ᵀ + b2   residual tanh-MLP block, W1 (f, h)
        L   = cross_entropy(x_n Hᵀ, targets)              head H (V, h), mean over tokens

    `forward` is the single-device model, the reference every pipeline run is compared with.
    """

    embed: torch.Tensor
    blocks: list[dict[str, torch.Tensor]]
    head: torch.Tensor

    @classmethod
    def build(cls, n_layers: int, hidden: int, ffn: int, vocab: int, seed: int = 0,
              dtype: torch.dtype = torch.float64) -> PipelineModel:
        if min(n_layers, hidden, ffn, vocab) < 1:
            raise ShardwiseError(f"model sizes must be ≥ 1, got n_layers={n_layers}, "
                                 f"hidden={hidden}, ffn={ffn}, vocab={vocab}")
        gen = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=dtype) * scale
            return t.requires_grad_()

        embed = param(vocab, hidden, scale=1.0)
        blocks = [{"w1": param(ffn, hidden, scale=hidden ** -0.5),
                   "b1": param(ffn, scale=0.1),
                   "w2": param(hidden, ffn, scale=ffn ** -0.5 / 2),
                   "b2": param(hidden, scale=0.1)} for _ in range(n_layers)]
        head = param(vocab, hidden, scale=hidden ** -0.5)
        return cls(embed, blocks, head)

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def hidden(self) -> int:
        return int(self.embed.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def message_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """Activations (b, s, h) between stages."""
        return (batch, seq, self.hidden)

    def named_parameters(self, stage: VirtualStage | None = None) -> dict[str, torch.Tensor]:
        """Every parameter by name ("embed", "blocks.3.w1", "head"), or one virtual stage's."""
        layers = range(self.n_layers) if stage is None else stage.layers
        out: dict[str, torch.Tensor] = {}
        if stage is None or stage.first:
            out["embed"] = self.embed
        for k in layers:
            out.update({f"blocks.{k}.{name}": t for name, t in self.blocks[k].items()})
        if stage is None or stage.last:
            out["head"] = self.head
        return out

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The single-device model: mean cross-entropy over all `(b, s)` tokens."""
        whole = VirtualStage(0, 1, tuple(range(self.n_layers)))
        return self.forward_stage(whole, tokens, targets)

    def forward_stage(self, stage: VirtualStage, inp: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      saved: list[SavedOp] | None = None) -> torch.Tensor:
        """Virtual stage `stage` on `inp` (token ids (b, s) on the first stage, else activations
        (b, s, h)); returns activations (b, s, h), or the loss on the last stage. With `saved`,
        every weight-bearing op appends its (weight, input, output) for a split backward."""
        if stage.first:
            x = F.embedding(inp, self.embed)  # (b, s) -> (b, s, h)
            if saved is not None:
                saved.append(SavedOp(self.embed, None, inp, x, embedding=True))
        else:
            x = inp
        for k in stage.layers:
            block = self.blocks[k]
            hidden = torch.tanh(_linear(x, block["w1"], block["b1"], saved))  # (b, s, f)
            x = x + _linear(hidden, block["w2"], block["b2"], saved)
        if not stage.last:
            return x
        if targets is None:
            raise ShardwiseError("the last stage needs the targets to compute the loss")
        logits = _linear(x, self.head, None, saved)  # (b, s, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


