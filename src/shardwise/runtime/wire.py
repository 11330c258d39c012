"""What a rank's collectives really put on the wire: the kernel's own counters of the TCP
connections gloo opened for each process group (Linux `TCP_INFO`).

Design notes: docs/concepts/runtime.md#runtime-wire.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.estimate.check import Traffic

__all__ = ["Meter", "active", "available", "closed", "connections_of", "marked", "metering",
           "opened"]

# struct tcp_info (linux/tcp.h): byte offsets of the fields read here
_STATE, _OPTIONS = 0, 5
_BYTES_RECEIVED, _SEGS_OUT, _NOTSENT_BYTES, _BYTES_SENT, _BYTES_RETRANS = 128, 136, 144, 200, 208
_INFO_SIZE = 216  # up to tcpi_bytes_retrans (Linux 4.19)
_ESTABLISHED, _TIMESTAMPS = 1, 1  # TCP_ESTABLISHED; TCPI_OPT_TIMESTAMPS


def available() -> str | None:
    """Why this rank's wire cannot be measured (None: it can)."""
    if not hasattr(socket, "TCP_INFO"):
        return "this platform has no TCP_INFO counters"
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return "not gloo over TCP (NCCL's transport has no per-connection counters here)"
    return None


def _info(sock: socket.socket) -> bytes | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    return info if len(info) >= _INFO_SIZE else None


def _header_bytes(sock: socket.socket, info: bytes) -> int:
    ip = 40 if sock.family == socket.AF_INET6 else 20
    return ip + 20 + (12 if info[_OPTIONS] & _TIMESTAMPS else 0)


def _connections() -> dict[str, tuple[socket.socket, int]]:
    """This process's established TCP connections: {"socket:[inode]": (a duplicate of its
    descriptor, header bytes per segment)}."""
    found: dict[str, tuple[socket.socket, int]] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:") or link in found:
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
            info = (_info(sock) if sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM else None)
            if info is None or info[_STATE] != _ESTABLISHED:
                sock.close()
                continue
            found[link] = (sock, _header_bytes(sock, info))
    return found


def _read(connections: dict[str, tuple[socket.socket, int]]
          ) -> dict[str, tuple[int, int, int, int]]:
    """{connection: (data bytes, segments sent, bytes received, bytes retransmitted)} now.
    Data bytes are those sent (retransmits included) plus those written but not sent yet, so
    a call's bytes are its own from the moment it writes them, even if the kernel sends some
    after it ends."""
    now = {}
    for conn, (sock, _) in connections.items():
        info = _info(sock)
        if info is not None:
            (sent,), (segments,), (waiting,), (received,), (again,) = (
                struct.unpack_from("=Q", info, _BYTES_SENT),
                struct.unpack_from("=I", info, _SEGS_OUT),
                struct.unpack_from("=I", info, _NOTSENT_BYTES),
                struct.unpack_from("=Q", info, _BYTES_RECEIVED),
                struct.unpack_from("=Q", info, _BYTES_RETRANS))
            now[conn] = (sent + waiting, segments, received, again)
    return now


def _key(group: Any) -> int:
    return id(group if group is not None else dist.group.WORLD)


@dataclass
class Meter:
    """The counters of every connection at each call's start and end (docs/concepts/runtime.md#runtime-wire)."""

    connections: dict[str, tuple[socket.socket, int]] = field(default_factory=_connections)
    # (what, call id, group key, axis, op, counters at that moment)
    events: list[tuple[str, int, int, str, str, dict]] = field(default_factory=list)
    groups: dict[int, Any] = field(default_factory=dict)  # group key -> AxisGroup seen
    _calls: int = 0

    def __post_init__(self) -> None:
        self.start = _read(self.connections)

    def event(self, what: str, g: Any, op: str, call: int = 0) -> int:
        if not call:
            self._calls += 1
            call = self._calls
        self.groups.setdefault(_key(g.group), g)
        self.events.append((what, call, _key(g.group), g.name, op, _read(self.connections)))
        return call

    def close(self) -> None:
        self.end = _read(self.connections)

    def traffic(self, groups: Sequence[Any]) -> dict[tuple[str, str], Traffic]:
        """{(axis, op): Traffic} this rank sent inside the block (docs/concepts/runtime.md#runtime-wire), once,
        after it. A collective: every rank calls it with its AxisGroups (any order).
        Bytes on a group's connections before its first call (a receive the pipeline posted
        ahead) are that call's; on a group with no call at all, ("?", "?")'s."""
        try:
            owner = connections_of([*groups, *self.groups.values()], self.connections)
        finally:
            for sock, _ in self.connections.values():
                sock.close()
        header = {conn: h for conn, (_, h) in self.connections.items()}
        result: dict[tuple[str, str], Traffic] = defaultdict(Traffic)
        early: dict[int, Traffic] = defaultdict(Traffic)  # per group, before its first call
        open_calls: dict[int, dict[int, tuple[str, str]]] = defaultdict(dict)
        latest: dict[int, tuple[str, str]] = {}
        before = self.start
        moments = [*self.events, ("end", 0, 0, "", "", self.end)]
        for what, call, key, axis, op, now in moments:
            for conn, group in owner.items():
                if conn not in now or conn not in before:
                    continue
                data, segments, _, again = (a - b for a, b in zip(now[conn], before[conn]))
                if not data and not segments:
                    continue
                bytes_ = Traffic(data, segments, header[conn], again)
                calls = list(open_calls[group].values())
                if calls or group in latest:
                    who = calls[-1] if calls else latest[group]
                    result[who] += bytes_
                else:
                    early[group] += bytes_
            before = now
            if what == "open":
                open_calls[key][call] = (axis, op)
            elif what == "close":
                open_calls[key].pop(call, None)
            if what in ("open", "mark"):
                if key not in latest and key in early:
                    result[(axis, op)] += early.pop(key)
                latest[key] = (axis, op)
        for bytes_ in early.values():  # groups that never had a call
            result[("?", "?")] += bytes_
        return dict(result)


def connections_of(groups: Sequence[Any], connections: dict[str, tuple[socket.socket, int]]
                   ) -> dict[str, int]:
    """{connection: group key}: which of this rank's connections belong to which process group.

    Every rank calls this with its own groups; the union of their (name, ranks) is taken in one
    order, and each group in turn exchanges one element between every pair of its members
    (an all-to-all): the connections this rank sent data on then are that group's (what it
    receives may be a faster peer's exchange of the next group). Groups are visited in the
    same order everywhere, so the lowest group not yet done always has all its members ready
    (no deadlock)."""
    mine = {(g.name, g.ranks): g for g in groups if g.size > 1}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    owner: dict[str, int] = {}
    for name, ranks in sorted({key for keys in everyone for key in keys}):
        g = mine.get((name, ranks))
        if g is None:
            continue  # not a member
        before = _read(connections)
        out = torch.empty(g.size, dtype=torch.int64)
        dist.all_to_all_single(out, torch.zeros(g.size, dtype=torch.int64), group=g.group)
        after = _read(connections)
        for conn, now in after.items():
            was = before.get(conn)
            if was is not None and now[0] != was[0]:
                owner.setdefault(conn, _key(g.group))
    return owner


# --------------------------------------------------------------- the collectives' hooks
_METERS: list[Meter] = []


@contextlib.contextmanager
def metering() -> Iterator[Meter]:
    """`with metering() as meter: ...` — every collective call inside is metered."""
    meter = Meter()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        meter.close()
        _METERS[:] = [m for m in _METERS if m is not meter]


def active() -> bool:
    """Whether a meter is active (the collectives layer then completes every call at once)."""
    return bool(_METERS)


def opened(g: Any, op: str) -> int:
    """A call of `op` on AxisGroup `g` starts (0 when no meter is active)."""
    return _METERS[-1].event("open", g, op) if _METERS else 0


def closed(g: Any, op: str, call: int) -> None:
    """Call `call` (from `opened`) has completed."""
    if call and _METERS:
        _METERS[-1].event("close", g, op, call)


def marked(g: Any, op: str) -> None:
    """A call whose completion this layer does not see (the pipeline's own isend)."""
    if _METERS:
        _METERS[-1].event("mark", g, op)
