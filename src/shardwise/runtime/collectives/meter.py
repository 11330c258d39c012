"""What every runtime collective goes through before it runs: the group it names (`resolve`),
the counter of calls and bytes (`CommCounter`, `counting`, `labelled`), the wire meter
(`runtime.wire`) and the clock of time blocked in communication (`clocking`, `blocked_in`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime import wire
from shardwise.runtime.mesh import AxisGroup, current_mesh

GroupLike = AxisGroup | str | Any | None


@dataclass(eq=False)  # identity semantics: `counting()` pops its own counter
class CommCounter:
    """Payload, bytes sent (module docstring: Counting) and calls of this rank, per (axis, op)."""

    sent: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    payload: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    ncalls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    sizes: dict[str, int] = field(default_factory=dict)  # axis -> ranks in its group

    def add(self, axis: str, op: str, nbytes: float, payload: float | None = None,
            ranks: int | None = None) -> None:
        """One call sending `nbytes`, handed `payload` bytes (default: `nbytes`), on a group
        of `ranks`."""
        self.sent[(axis, op)] += nbytes
        self.payload[(axis, op)] += nbytes if payload is None else payload
        self.ncalls[(axis, op)] += 1
        if ranks is not None:
            self.sizes[axis] = ranks

    def bytes(self, axis: str | None = None, op: str | None = None) -> float:
        """Total bytes sent, optionally restricted to one axis and/or one op."""
        return sum(v for (a, o), v in self.sent.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def payload_bytes(self, axis: str | None = None, op: str | None = None) -> float:
        """Total payload, optionally restricted to one axis and/or one op."""
        return sum(v for (a, o), v in self.payload.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def calls(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(v for (a, o), v in self.ncalls.items()
                   if (axis is None or a == axis) and (op is None or o == op))

    def reset(self) -> None:
        self.sent.clear()
        self.payload.clear()
        self.ncalls.clear()
        self.sizes.clear()

    def rows(self) -> list[dict[str, Any]]:
        """[{"axis", "op", "calls", "bytes"}] sorted by axis then op."""
        return [{"axis": a, "op": o, "calls": self.ncalls[(a, o)], "bytes": self.sent[(a, o)]}
                for (a, o) in sorted(self.sent)]

    def as_dict(self) -> dict[str, float]:
        return {f"{a}/{o}": v for (a, o), v in sorted(self.sent.items())}


_COUNTERS: list[CommCounter] = [CommCounter()]


def get_counter() -> CommCounter:
    """The active counter (the process-wide one unless inside `counting()`)."""
    return _COUNTERS[-1]


@contextlib.contextmanager
def counting() -> Iterator[CommCounter]:
    """`with counting() as c: ...` — a fresh counter active inside the block."""
    c = CommCounter()
    _COUNTERS.append(c)
    try:
        yield c
    finally:
        for i in range(len(_COUNTERS) - 1, -1, -1):
            if _COUNTERS[i] is c:
                del _COUNTERS[i]
                break


_LABELS: list[str] = []  # `labelled`'s stack


@contextlib.contextmanager
def labelled(op: str) -> Iterator[None]:
    """Count (and meter) every call inside as `op`, e.g. expert parallelism's exchange of
    per-expert row counts as "all-to-all (counts)", apart from its dispatch."""
    _LABELS.append(op)
    try:
        yield
    finally:
        _LABELS.pop()


def _label(op: str) -> str:
    return _LABELS[-1] if _LABELS else op


def _record(g: AxisGroup, op: str, payload: float, sent: float,
            counter: CommCounter | None) -> None:
    (counter or get_counter()).add(g.name, _label(op), sent, payload, g.size)


def _open(g: AxisGroup, op: str) -> tuple[AxisGroup, str, int]:
    """Open a call on the active wire meter (`runtime.wire`); `_close` it once complete."""
    op = _label(op)
    return g, op, wire.opened(g, op)


def _close(call: tuple[AxisGroup, str, int] | None) -> None:
    if call is not None:
        wire.closed(*call)


@contextlib.contextmanager
def _metered(g: AxisGroup, op: str) -> Iterator[None]:
    call = _open(g, op)
    try:
        yield
    finally:
        _close(call)


def note_send(group: GroupLike, nbytes: float, counter: CommCounter | None = None) -> None:
    """A send issued outside this layer (the pipeline's own `isend`): counted as "send", and
    marked on the wire meter (its completion is not seen here)."""
    g = resolve(group)
    _record(g, "send", nbytes, nbytes, counter)
    wire.marked(g, _label("send"))


# ------------------------------------------------------------------------------ clocking
_CLOCKS: list[dict[str, float]] = []


@contextlib.contextmanager
def clocking() -> Iterator[dict[str, float]]:
    """`with clocking() as waited: ...` — waited[axis]: the wall seconds this rank spent
    blocked in that axis's collectives inside the block (module docstring: Clocking)."""
    clock: dict[str, float] = defaultdict(float)
    _CLOCKS.append(clock)
    try:
        yield clock
    finally:
        _CLOCKS[:] = [c for c in _CLOCKS if c is not clock]


@contextlib.contextmanager
def blocked_in(axis: str | None) -> Iterator[None]:
    """Charge the block's wall time to `axis` on every active clock (None: to none)."""
    if axis is None or not _CLOCKS:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        for clock in _CLOCKS:
            clock[axis] += time.perf_counter() - start


# ------------------------------------------------------------------------------- groups
def resolve(group: GroupLike) -> AxisGroup:
    """AxisGroup | axis name (on the current mesh) | ProcessGroup | None (world) → AxisGroup."""
    if isinstance(group, AxisGroup):
        return group
    if group is None or group == "world":
        return AxisGroup.world()
    if isinstance(group, str):
        mesh = current_mesh()
        if mesh is None:
            raise ShardwiseError(f"axis {group!r} given but no mesh was built in this process")
        return mesh.axis(group)
    return AxisGroup.of(group)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


def _reduce_op(op: str) -> Any:
    try:
        return _OPS[op]
    except KeyError:
        raise ShardwiseError(f"reduce op {op!r} unknown; valid: {', '.join(_OPS)}") from None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of `torch.tensor_split(x, n)` for a flat `x` of `numel`: the first `numel % n`
    chunks hold one element more."""
    q, r = divmod(numel, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _check_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ShardwiseError("collectives take contiguous tensors (call .contiguous())")


