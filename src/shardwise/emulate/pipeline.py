"""Pipeline parallelism in one process: micro-batch gradient accumulation (SPEC §6, §8).

The teaching oracle behind `runtime.pipeline`. An MLP of `num_layers` layers
`x ← tanh(x Wᵀ + b)` (width `width`) is cut into `num_stages` contiguous stages with
`partition_layers`; the batch of `batch` rows into `m` equal micro-batches. Each stage keeps its
own autograd graph per micro-batch and talks to its neighbours only through detached tensors
in a mailbox — the activation forward, the gradient backward — as the real stages do through
send/recv. The actions run in the order the schedule's simulation starts them (a valid order:
an action starts only after its dependencies end), so GPipe (Huang et al. 2019), 1F1B
(Narayanan et al. 2021) and ZB-H1 (Qi et al. 2023) all give the same gradient.

Design notes: docs/concepts/runtime.md#emulate-pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.errors import ShardwiseError
from shardwise.schedules import make_schedule, partition_layers, simulate

__all__ = ["GradientMatch", "gradient_match", "mlp_forward", "mlp_params"]


def mlp_params(num_layers: int, width: int, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_layers` pairs (W (width, width), b (width,)), leaves requiring grad, from `seed`."""
    if num_layers < 1 or width < 1:
        raise ShardwiseError(f"num_layers and width must be ≥ 1, got {num_layers}, {width}")
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(width, width, generator=gen, dtype=dtype) * width ** -0.5)
             .requires_grad_(),
             (torch.randn(width, generator=gen, dtype=dtype) * 0.1).requires_grad_())
            for _ in range(num_layers)]


def mlp_forward(params: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                layers: list[int] | None = None) -> torch.Tensor:
    """`x ← tanh(x Wᵀ + b)` through `layers` (all by default); x is (rows, width)."""
    for k in range(len(params)) if layers is None else layers:
        weight, bias = params[k]
        x = torch.tanh(x @ weight.T + bias)
    return x


@dataclass(frozen=True)
class GradientMatch:
    """Full-batch vs micro-batch-accumulated loss and gradients (W and b of every layer)."""

    loss_full: float
    loss_accumulated: float
    grads_full: list[torch.Tensor]
    grads_accumulated: list[torch.Tensor]
    stages: list[list[int]]
    schedule: str
    max_abs_diff: float
    max_rel_diff: float

    @property
    def matches(self) -> bool:
        """Equal to float reassociation: relative difference below 1e-12 (float64)."""
        return self.max_rel_diff <= 1e-12 and abs(self.loss_full - self.loss_accumulated) <= \
            1e-12 * max(1.0, abs(self.loss_full))


def _data(batch: int, width: int, seed: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(batch, width, generator=gen, dtype=dtype),
            torch.randn(batch, width, generator=gen, dtype=dtype))


def gradient_match(num_layers: int, width: int, batch: int, num_stages: int,
                   num_microbatches: int, *, schedule: str = "gpipe", seed: int = 0,
                   dtype: torch.dtype = torch.float64) -> GradientMatch:
    """Run an MLP as a `num_stages`-stage pipeline over `num_microbatches` micro-batches in one
    process and compare the accumulated gradient with the full-batch one.

    Inputs and targets are `(batch, width)` normal samples from `seed + 1`, parameters from
    `mlp_params(num_layers, width, seed)`; loss = mean squared error.
    """
    p, m = num_stages, num_microbatches
    if m < 1 or batch % m:
        raise ShardwiseError(f"batch={batch} does not split into {m} equal micro-batches "
                             "(unequal ones would need weights n_j/n instead of 1/m)")
    stages = partition_layers(num_layers, p)
    plan = make_schedule(schedule, p, m)
    split = any(a.kind == "W" for actions in plan.values() for a in actions)
    x, y = _data(batch, width, seed, dtype)

    full = mlp_params(num_layers, width, seed, dtype)
    loss_full = torch.mean((mlp_forward(full, x) - y) ** 2)
    grads_full = list(torch.autograd.grad(loss_full, [t for pair in full for t in pair]))

    params = mlp_params(num_layers, width, seed, dtype)
    xs, ys = x.chunk(m), y.chunk(m)  # m × (batch/m, width)
    mailbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, j, to stage) -> tensor
    stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    losses = []
    # unit actions: F, B and W take 1 (a split backward is t_b = 2 with t_w = 1)
    timeline = simulate(plan, 1.0, 2.0 if split else 1.0, 1.0 if split else None)
    for event in sorted(timeline.events, key=lambda e: (e.start, e.stage)):
        i, j, kind = event.stage, event.action.micro_batch, event.action.kind
        weights = [t for k in stages[i] for t in params[k]]
        if kind == "F":
            inp = (xs[j] if i == 0 else mailbox.pop(("F", j, i))).detach().requires_grad_()
            out = mlp_forward(params, inp, stages[i])
            if i == p - 1:
                out = torch.mean((out - ys[j]) ** 2)
                losses.append(out.detach())
            else:
                mailbox[("F", j, i + 1)] = out.detach()  # "send" the activation
            stash[(i, j)] = (inp, out)
        elif kind == "B":
            inp, out = stash[(i, j)] if split else stash.pop((i, j))
            seed_grad = torch.full_like(out, 1.0 / m) if i == p - 1 else mailbox.pop(("B", j, i))
            if split:  # input gradient now, keep the graph for W
                (dx,) = torch.autograd.grad(out, [inp], seed_grad, retain_graph=True)
            else:
                torch.autograd.backward(out, seed_grad)
                dx = inp.grad
            if i > 0:
                mailbox[("B", j, i - 1)] = dx.detach()  # "send" the gradient
            if split:
                stash[(i, j)] = (inp, out)
                mailbox[("W", j, i)] = seed_grad
        else:
            inp, out = stash.pop((i, j))
            grads = torch.autograd.grad(out, weights, mailbox.pop(("W", j, i)))
            for t, g in zip(weights, grads):
                t.grad = g if t.grad is None else t.grad + g
    loss_acc = torch.stack(losses).sum() / m
    grads_acc = [t.grad for pair in params for t in pair]
    abs_diff = max(float((a - b).abs().max()) for a, b in zip(grads_acc, grads_full))
    rel_diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
                   for a, b in zip(grads_acc, grads_full))
    return GradientMatch(float(loss_full.detach()), float(loss_acc),
                         [g.detach() for g in grads_full], [g.detach() for g in grads_acc],
                         stages, schedule, abs_diff, rel_diff)
