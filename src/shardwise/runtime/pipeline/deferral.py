"""ZB-H1's split backward: B computes the input gradient and defers each linear's weight
gradient (`defer_linears`, `deferring_weight_grads`); W computes them later
(`backward_weight`). Design: docs/concepts/runtime.md#pipeline-parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class GradTarget(Protocol):
    """Where W adds a weight gradient when the weight is no leaf parameter: a ZeRO-3 unit's
    gathered weights are dropped after B, so W adds dW into the unit's gradient instead
    (`runtime.zero`)."""

    def accumulate(self, grad: torch.Tensor) -> None: ...


@dataclass
class SavedOp:
    """What a weight-bearing op keeps for W: its weight (and bias), input X and output Y.
    The weight and bias may be `GradTarget`s standing for them (ZeRO-3)."""

    weight: Any  # torch.Tensor | GradTarget
    bias: Any  # torch.Tensor | GradTarget | None
    input: torch.Tensor  # linear: (..., k) activations; embedding: (b, s) token ids
    output: torch.Tensor | None  # (..., n); None once B has its dY (a deferred linear)
    embedding: bool = False


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            saved: list[SavedOp] | None) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    if saved is not None:
        saved.append(SavedOp(weight, bias, x, y))
    return y


def accumulate_grad(param: Any, grad: torch.Tensor) -> None:
    """`param.grad += grad`; a leaf parameter through autograd's own accumulation, so its
    post-accumulate-grad hooks (ZeRO-2's reduce-scatter once a unit's gradients are complete)
    fire after W as they fire after B; a `GradTarget` adds it where it stands for."""
    if not isinstance(param, torch.Tensor):
        param.accumulate(grad)
    elif param.is_leaf and param.requires_grad:
        torch.autograd.backward(param, grad)
    elif param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad.add_(grad)


def backward_input(out: torch.Tensor, inp: torch.Tensor | None, saved: list[SavedOp],
                   grad_out: torch.Tensor) -> tuple[torch.Tensor | None,
                                                    list[tuple[SavedOp, torch.Tensor]]]:
    """ZB-H1's B: the gradient of `out` with respect to the stage input `inp` (None on the
    first stage, whose input is token ids) and to the output Y of every op in `saved`, and
    nothing else — autograd runs only the ops on the paths from `out` back to those tensors, so
    no weight-gradient product is computed. Frees the graph; returns `dX` and the (op, dY)
    pairs `backward_weight` needs."""
    outputs = [op.output for op in saved if op.output is not None]
    wanted = ([] if inp is None else [inp]) + outputs
    grads = torch.autograd.grad(out, wanted, grad_out)
    for op, y in zip(saved, outputs):  # the graph is freed: keep plain tensors, no nodes
        op.input, op.output = op.input.detach(), y.detach()
    dys = grads[1:] if inp is not None else grads
    return (grads[0] if inp is not None else None), list(zip(saved, dys))


def backward_weight(pending: list[tuple[SavedOp, torch.Tensor]]) -> None:
    """ZB-H1's W: for each op, `dW += dYᵀ·X`, `db += Σ_rows dY`; for the embedding
    `dE[t] += dY` for every token t. Accumulates into `.grad`."""
    for op, dy in pending:
        weight = op.weight
        if op.embedding:
            grad = torch.zeros_like(weight)
            grad.index_add_(0, op.input.reshape(-1), dy.reshape(-1, weight.shape[1]))
            accumulate_grad(weight, grad)
            continue
        x2 = op.input.reshape(-1, op.input.shape[-1])  # (b, s, k) -> (b·s, k)
        dy2 = dy.reshape(-1, dy.shape[-1])  # (b, s, n) -> (b·s, n)
        accumulate_grad(weight, dy2.T @ x2)  # (n, k)
        if op.bias is not None:
            accumulate_grad(op.bias, dy2.sum(0))


class _DeferrableLinear(torch.autograd.Function):
    """`F.linear(x, w, b)` saving x and w, as `F.linear` does. Its backward returns dX (and
    db); dW = dYᵀ·X is computed there only outside `deferring_weight_grads` — inside, the op
    hands (X, dY) to the active collector and W computes dW later (`backward_weight`).
    `owner` holds the parameter when `w` is its detached alias: B then never reaches the
    parameter's gradient accumulator, whose hooks (ZeRO-2's) fire only when W accumulates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                owner: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)  # weight and bias are state (ZeRO-3: markers)
        ctx.owner = owner[0] if owner else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        param = weight if ctx.owner is None else ctx.owner
        dx = dy @ weight if ctx.needs_input_grad[0] else None  # (..., n) @ (n, k)
        if _COLLECTORS:  # ZB-H1's B: the weight gradient waits for W
            _COLLECTORS[-1].append((SavedOp(param, bias, x, None), dy))
            return dx, None, None, None
        dy2 = dy.reshape(-1, weight.shape[0])  # (..., n) -> (rows, n)
        dw = dy2.T @ x.reshape(-1, weight.shape[1]) if param.requires_grad else None
        db = dy2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        if ctx.owner is not None and dw is not None:  # not an input here: accumulate it
            accumulate_grad(ctx.owner, dw)
            dw = None
        return dx, dw, db, None


_COLLECTORS: list[list[tuple[SavedOp, torch.Tensor]]] = []  # the running B's (op, dY) pairs
_DEFERRING: list[defer_linears] = []  # the active `defer_linears` modes, innermost last


def deferred_ops() -> list[tuple[SavedOp, torch.Tensor]] | None:
    """The (op, dY) pairs the running ZB-H1 B has deferred so far (None outside B): a ZeRO-3
    unit's backward points its linears' weights at its own gradient (`runtime.zero`)."""
    return _COLLECTORS[-1] if _COLLECTORS else None


def replay_contexts() -> tuple[Any, Any]:
    """`torch.utils.checkpoint`'s `context_fn` for full recompute: the replay in backward
    runs under `defer_linears` when the forward did, so the replayed linears are the
    `_DeferrableLinear`s whose saved X the forward's graph expects, and B defers their dW."""
    return nullcontext(), defer_linears() if _DEFERRING else nullcontext()


class defer_linears(TorchFunctionMode):
    """While active, every `F.linear` that records a graph (nn.Linear, the column/row
    parallel linears) runs as a `_DeferrableLinear`, whose weight gradient a split backward
    defers to W. Linears inside another autograd function's forward (no graph recorded there,
    e.g. sequence parallelism's fused all-gather linears) and other weights (norms, router,
    experts, embedding) keep their gradients in B. A fully recomputed block replays its
    forward under it too (`replay_contexts`)."""

    def __enter__(self) -> defer_linears:
        _DEFERRING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _DEFERRING.remove(self)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, *rest = args
            bias = kwargs.get("bias", rest[0] if rest else None)
            if weight.is_leaf and weight.requires_grad:  # a parameter: W accumulates it
                return _DeferrableLinear.apply(x, weight.detach(), bias, (weight,))
            return _DeferrableLinear.apply(x, weight, bias)
        return func(*args, **kwargs)


@contextmanager
def deferring_weight_grads() -> Iterator[list[tuple[SavedOp, torch.Tensor]]]:
    """ZB-H1's B for a model run under `defer_linears`: a backward inside this context
    accumulates every gradient except the linears' dW, whose (op, dY) pairs it yields."""
    later: list[tuple[SavedOp, torch.Tensor]] = []
    _COLLECTORS.append(later)
    try:
        yield later
    finally:
        _COLLECTORS.pop()


