"""Data parallelism: every rank holds the whole model, sees a different slice of the batch, and
the gradients are averaged before the optimizer step.

With a loss that is a mean over the batch and equal shards, the average of the ranks'
gradients is the full-batch gradient: `∇L = (1/N) Σ_i ∇L_i`.

Design notes: docs/concepts/runtime.md#runtime-data_parallel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.runtime import collectives as C
from shardwise.runtime import mixed_precision as mp
from shardwise.runtime.collectives import GroupLike
from shardwise.runtime.mesh import AxisGroup

__all__ = ["BucketedDataParallel", "DDPConfig", "GradientReducer", "broadcast_flat",
           "broadcast_parameters"]


def broadcast_parameters(module: nn.Module, group: AxisGroup) -> None:
    """Start every replica from the group's first rank's weights, as DDP does (setup, not
    counted as step traffic)."""
    if group.size == 1:
        return
    with C.counting(), torch.no_grad():
        for p in module.parameters():
            C.broadcast(p.data, group.ranks[0], group)


def broadcast_flat(t: torch.Tensor, group: AxisGroup) -> None:
    """`broadcast_parameters` for one tensor (a ZeRO unit's flat buffer)."""
    if group.size > 1:
        with C.counting(), torch.no_grad():
            C.broadcast(t, group.ranks[0], group)


@dataclass(frozen=True)
class DDPConfig:
    """Bucketed data parallelism: bucket capacity (PyTorch's default is 25 MiB)."""

    bucket_cap_bytes: int = 25 * 2**20


class _Bucket:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=mp.grad_dtype(params[0]),
                                  device=params[0].device)
        self.pending = set(range(len(params)))
        self.work = None


class GradientReducer:
    """Average the gradients of `params` over `group`, bucket by bucket, during backward.

    Use `no_sync()` for all micro-batches but the last of an accumulation step, or call
    `reduce()` after the last one. Gradients end in each parameter's `.grad` (its fp32
    `main_grad` where it accumulates in fp32, `mixed_precision.accumulate_in_fp32`: the
    buckets are then fp32 and the hooks must be registered after that one), equal on every
    rank; `reduced` says whether this step's reduction has happened (reset it with
    `start_step()`). `hooks=False`: no backward hooks, `reduce()` only.
    """

    def __init__(self, params: Sequence[torch.Tensor], group: GroupLike = "dp",
                 config: DDPConfig | None = None, *, hooks: bool = True):
        self.group = C.resolve(group)
        self.config = config or DDPConfig()
        params = [p for p in params if p.requires_grad]
        self.buckets = self._make_buckets(list(reversed(params)))
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets)
                       for i, p in enumerate(bucket.params)}
        self._sync = True
        self._armed = False
        self.reduced = False
        # ("launch", bucket, gradients of the whole model still missing at that moment) for
        # the last reduction: a launch with missing gradients happened during backward.
        self.events: list[tuple[str, int, int]] = []
        self._missing = 0
        self._next = 0  # the next bucket to launch (launches go in index order)
        if hooks and self.group.size > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _make_buckets(self, params: list[torch.Tensor]) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * mp.grad_dtype(p).itemsize  # the gradient bucket's bytes
            if current and (size + nbytes > self.config.bucket_cap_bytes
                            or mp.grad_dtype(p) != mp.grad_dtype(current[0])):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(current))
        return buckets

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside; the next backward outside synchronises."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def start_step(self) -> None:
        """A new optimizer step: nothing reduced yet."""
        self.reduced = False

    def reduce(self) -> None:
        """Reduce every bucket now (what backward's hooks would have done)."""
        if self.group.size == 1 or not self.buckets:
            self.reduced = True
            return
        self.events = []
        self._missing = 0
        self._finish()

    # ---------------------------------------------------------------- backward machinery
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._armed:  # first gradient of this backward: finish when it ends
            self._armed = True
            self.events = []
            self._missing = sum(len(b.params) for b in self.buckets)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._missing -= 1
        b, i = self._where[id(p)]
        self.buckets[b].pending.discard(i)
        self._launch_ready()

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        offset = 0
        for p in bucket.params:  # (numel_p,) slices of the flat bucket
            n = p.numel()
            g = mp.grad(p)
            if g is None:
                bucket.buffer[offset:offset + n].zero_()  # unused parameter: contributes 0
            else:
                bucket.buffer[offset:offset + n].copy_(g.reshape(-1))
            offset += n
        bucket.work = C.all_reduce(bucket.buffer, self.group, async_op=True)
        self.events.append(("launch", index, self._missing))

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self._next)
            self._next += 1

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters), wait, write back."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for bucket in self.buckets:
            C.wait(bucket.work)
            bucket.buffer.div_(self.group.size)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                view = bucket.buffer[offset:offset + n].view_as(p)  # (numel_p,) -> p.shape
                g = mp.grad(p)
                if g is None:
                    mp.set_grad(p, view.clone())
                else:
                    g.copy_(view)
                offset += n
            bucket.pending = set(range(len(bucket.params)))
            bucket.work = None
        self._next = 0
        self._armed = False
        self.reduced = True


class BucketedDataParallel(nn.Module):
    """Wrap `module`; gradients are averaged over `group` during backward by a
    `GradientReducer` (`buckets`, `events`, `no_sync()` are its)."""

    def __init__(self, module: nn.Module, group: GroupLike = "dp",
                 config: DDPConfig | None = None):
        super().__init__()
        self.module = module
        self.reducer = GradientReducer(list(module.parameters()), group, config)
        broadcast_parameters(self.module, self.reducer.group)

    @property
    def buckets(self) -> list[_Bucket]:
        return self.reducer.buckets

    @property
    def events(self) -> list[tuple[str, int, int]]:
        return self.reducer.events

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.reducer.no_sync()

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)
