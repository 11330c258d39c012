"""The one thin layer every runtime collective goes through, and ring collectives built from
point-to-point send/recv only.

`group` is an `AxisGroup`, an axis name on the current mesh ("tp", "dp", …, "world"), a raw
`ProcessGroup`, or None (the world); on a group of size 1 every collective moves nothing.
Modules: `meter` (groups, counting, the wire meter, clocking), `calls` (the counted
collectives, waiting), `rings` (rings from send/recv). The API, counting conventions and
waiting policy: docs/concepts/runtime.md#collectives.
"""

from shardwise.runtime.collectives.calls import (
    POLL_SECONDS,
    Pending,
    _polls,
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    ranks_running,
    recv,
    reduce_scatter,
    send,
    wait,
)
from shardwise.runtime.collectives.meter import (
    AxisGroup,
    CommCounter,
    GroupLike,
    blocked_in,
    chunk_sizes,
    clocking,
    counting,
    get_counter,
    labelled,
    note_send,
    resolve,
)
from shardwise.runtime.collectives.rings import (
    SEGMENT_BYTES,
    ring_all_gather_p2p,
    ring_all_reduce_p2p,
    ring_reduce_scatter_p2p,
)

__all__ = [
    "POLL_SECONDS",
    "SEGMENT_BYTES",
    "AxisGroup",
    "CommCounter",
    "GroupLike",
    "Pending",
    "_polls",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "blocked_in",
    "broadcast",
    "chunk_sizes",
    "clocking",
    "counting",
    "get_counter",
    "labelled",
    "note_send",
    "ranks_running",
    "recv",
    "reduce_scatter",
    "resolve",
    "ring_all_gather_p2p",
    "ring_all_reduce_p2p",
    "ring_reduce_scatter_p2p",
    "send",
    "wait",
]
