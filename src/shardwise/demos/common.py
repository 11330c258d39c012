"""What every demo shares: the dtypes it accepts, its tolerance, the row of a check."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ShardwiseError

__all__ = ["TOL", "check_row", "dtype_of", "flat_grads", "max_rel_diff", "mse"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Relative tolerance for "equal to float reassociation" (SPEC §8: fp32 ≤ 1e-5, typically 1e-7).
TOL = {"float32": 1e-5, "float64": 1e-12}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a demo's `dtype` argument ("float32" or "float64")."""
    if name not in _DTYPES:
        raise ShardwiseError(f"dtype {name!r} unknown; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def check_row(check: str, measured: float, expected: float | str, ok: bool | None = None
              ) -> dict[str, Any]:
    """One row of a demo's table; `ok` defaults to `measured ≤ tol` for an `expected` such as
    "≤ 1e-05", else to `measured == expected`."""
    if ok is None:
        if isinstance(expected, str):  # "≤ tol"
            ok = measured <= float(expected.split()[-1])
        else:
            ok = measured == expected
    return {"check": check, "measured": measured, "expected": expected, "ok": bool(ok)}


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale else diff


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every gradient of `model`, flattened into one vector."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of the summed squared error."""
    return ((model(x) - y) ** 2).sum(-1).mean()
