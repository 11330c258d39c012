"""Our point-to-point ring all-reduce against the backend's own all_reduce.

Bus bandwidth as nccl-tests defines it: `algbw = S / t`, `busbw = algbw · 2(N-1)/N` for an
all-reduce of S bytes on N ranks — the per-link rate a ring achieves, comparable across N.
The p2p ring (`shardwise.runtime.collectives.ring_all_reduce_p2p`, built only from
isend/irecv pairs in a fixed order) should reach ≥ 0.8 of the backend's bus bandwidth.

Run:
    PYTHONPATH=src .venv/bin/python benchmarks/bench_collectives.py [--ranks 4]
        [--sizes-mb 1,4,16,64] [--iters 5]

Each size: 2 warm-up runs of each, then `iters` timed runs alternating backend and ring
(barrier before each; a run's time is the slowest rank's); medians are reported. float32
tensors, gloo on loopback.

It writes its table to `docs/generated/bench_collectives.md` (`results.write_result`).
With more ranks than cores (four on a 2-core machine) the figures measure loopback copies and
scheduling, not a network, and runs differ by about ±20 %. At small sizes the ring's
2(N-1) Python-level steps, each waking every process, cost more than gloo's single C++ call;
segmenting the reduce-scatter steps (`--segment-kib`) overlaps transfer and addition.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from results import markdown_table, write_result

from shardwise.estimate.comm import bus_bandwidth
from shardwise.runtime import collectives as C
from shardwise.runtime.launch import spawn


def _once(fn, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(x)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(elapsed)


def _bench(sizes_mb: list[float], iters: int, segment_bytes: int) -> list[dict[str, float]]:
    C.SEGMENT_BYTES = segment_bytes
    n = dist.get_world_size()
    native = lambda t: dist.all_reduce(t)  # noqa: E731
    ring = lambda t: C.ring_all_reduce_p2p(t)  # noqa: E731
    rows = []
    for mb in sizes_mb:
        numel = int(mb * 2**20) // 4
        x = torch.ones(numel, dtype=torch.float32)
        for _ in range(2):  # warm-up
            _once(native, x), _once(ring, x)
        # Alternate the two so background load hits both alike.
        t_native, t_ring = [], []
        for _ in range(iters):
            t_native.append(_once(native, x))
            t_ring.append(_once(ring, x))
        tn, tr = statistics.median(t_native), statistics.median(t_ring)
        size = numel * 4
        rows.append({"size_mb": mb, "t_native_s": tn, "t_ring_s": tr,
                     "busbw_native": bus_bandwidth("all-reduce", size, n, tn),
                     "busbw_ring": bus_bandwidth("all-reduce", size, n, tr)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes-mb", default="1,4,16,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--segment-kib", type=int, default=C.SEGMENT_BYTES // 1024,
                    help="ring segment size (pipelining of transfer and reduction)")
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    rows = spawn(_bench, args.ranks, sizes, args.iters, args.segment_kib * 1024,
                 timeout_s=1800, backend="gloo")[0]
    table = markdown_table(
        ["size", "backend busbw", "p2p ring busbw", "ratio (target ≥ 0.8)"],
        [[f"{r['size_mb']:g} MiB", f"{r['busbw_native'] / 1e9:.3f} GB/s",
          f"{r['busbw_ring'] / 1e9:.3f} GB/s", f"{r['busbw_ring'] / r['busbw_native']:.2f}"]
         for r in rows])
    text = (f"Ring all-reduce, {args.ranks} ranks, gloo, float32, median of {args.iters}, "
            f"segments of {args.segment_kib} KiB; bus bandwidth as nccl-tests defines it.\n\n"
            f"{table}")
    print(text)
    write_result("bench_collectives", text)

if __name__ == "__main__":
    main()
