"""Data parallelism: every rank holds the whole model, sees a different slice of the batch, and
the gradients are averaged before the optimizer step.

With a loss that is a mean over the batch and equal shards, the average of the ranks'
gradients is the full-batch gradient: `∇L = (1/N) Σ_i ∇L_i`.

Two implementations, both SUM-then-divide over the `dp` axis (gloo: prefer SUM to AVG):

* `all_reduce_gradients(model)` — after `backward()`, one all-reduce per parameter. Simple;
  nothing overlaps.
* `BucketedDataParallel(model, bucket_cap_bytes)` — PyTorch DDP's design (Li et al. 2020,
  "PyTorch Distributed", VLDB): parameters are packed, in reverse registration order (about
  the order backward produces their gradients), into buckets of ~`bucket_cap_bytes`; a hook
  fires as each gradient is accumulated, and when a bucket is complete its flat buffer is
  all-reduced *asynchronously* while backward continues on earlier layers. Buckets are issued
  in index order on every rank (the collectives must match across ranks). At the end of
  backward (an autograd-engine callback) the pending all-reduces are awaited and the averaged
  gradients copied back. Under `no_sync()` the hooks do nothing, so gradients accumulate
  locally over micro-batches and only the last micro-batch's backward communicates —
  one all-reduce of `2(N-1)/N · P·bytes` per optimizer step, however many micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.runtime import collectives as C
from shardwise.runtime.collectives import GroupLike
from shardwise.runtime.mesh import AxisGroup

__all__ = ["BucketedDataParallel", "DDPConfig", "all_reduce_gradients"]


def all_reduce_gradients(model: nn.Module, group: GroupLike = "dp", *,
                         impl: str = "native") -> None:
    """Manual data parallelism: all-reduce (SUM) every gradient, then divide by N."""
    g = C.resolve(group)
    if g.size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            C.all_reduce(p.grad, g, impl=impl)
            p.grad.div_(g.size)


def broadcast_parameters(module: nn.Module, group: AxisGroup) -> None:
    """Start every replica from the group's first rank's weights, as DDP does (setup, not
    counted as step traffic)."""
    if group.size == 1:
        return
    with C.counting(), torch.no_grad():
        for p in module.parameters():
            C.broadcast(p.data, group.ranks[0], group)


@dataclass(frozen=True)
class DDPConfig:
    """Bucketed data parallelism: bucket capacity (PyTorch's default is 25 MiB)."""

    bucket_cap_bytes: int = 25 * 2**20


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        self.pending = set(range(len(params)))
        self.work = None


class BucketedDataParallel(nn.Module):
    """Wrap `module`; gradients are averaged over `group` during backward, bucket by bucket.

    `forward` calls the module. Use `no_sync()` for all micro-batches but the last of an
    accumulation step. Gradients end in each parameter's `.grad`, equal on every rank.
    """

    def __init__(self, module: nn.Module, group: GroupLike = "dp",
                 config: DDPConfig | None = None):
        super().__init__()
        self.module = module
        self.group = C.resolve(group)
        self.config = config or DDPConfig()
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = self._make_buckets(list(reversed(params)))
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets)
                       for i, p in enumerate(bucket.params)}
        self._sync = True
        self._armed = False
        # ("launch", bucket, gradients of the whole model still missing at that moment):
        # a launch with missing gradients happened during backward (overlap).
        self.events: list[tuple[str, int, int]] = []
        self._missing = 0
        self._next = 0  # the next bucket to launch (launches go in index order)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        broadcast_parameters(self.module, self.group)

    def _make_buckets(self, params: list[nn.Parameter]) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > self.config.bucket_cap_bytes
                            or p.dtype != current[0].dtype):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(current))
        return buckets


    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside; the next backward outside synchronises."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ---------------------------------------------------------------- backward machinery
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync or self.group.size == 1:
            return
        if not self._armed:  # first gradient of this backward: finish when it ends
            self._armed = True
            self._missing = sum(len(b.params) for b in self.buckets)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._missing -= 1
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        bucket.pending.discard(i)
        self._launch_ready()

    def _launch(self, bucket: _Bucket) -> None:
        offset = 0
        for p in bucket.params:  # (numel_p,) slices of the flat bucket
            n = p.numel()
            if p.grad is None:
                bucket.buffer[offset:offset + n].zero_()  # unused parameter: contributes 0
            else:
                bucket.buffer[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        bucket.work = C.all_reduce(bucket.buffer, self.group, async_op=True)
        self.events.append(("launch", self.buckets.index(bucket), self._missing))

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters), wait, write back."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer.div_(self.group.size)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                view = bucket.buffer[offset:offset + n].view_as(p)  # (numel_p,) -> p.shape
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += n
            bucket.pending = set(range(len(bucket.params)))
            bucket.work = None
        self._next = 0
        self._armed = False
