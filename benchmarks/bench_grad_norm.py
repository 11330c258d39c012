"""The global gradient norm of `shardwise train` (clipping) against PyTorch's own.

`ParallelTransformer.grad_norm` sums each gradient's squares in fp64 through
`torch.linalg.vector_norm(g, dtype=torch.float64)` — no fp64 copy of the gradient. Before, it
computed `(g.double().square() * w).sum()`: an fp64 copy and two temporaries per tensor.
`torch.nn.utils.get_total_norm` (what `clip_grad_norm_` computes; in the gradients' own dtype)
is the reference for speed; an fp64 norm of all gradients concatenated, for the value.

Run (one rank, gloo group of one; fp32 gradients of a Llama-style model, ~25 M parameters):
    PYTHONPATH=src python benchmarks/bench_grad_norm.py [--d-model 512] [--layers 8] [--iters 20]

It writes its table to `docs/generated/bench_grad_norm.md` (`results.write_result`). The fp64
copies (allocated afresh every step) dominated the old way; accumulating in fp64 costs a few
times PyTorch's fp32 norm, which in exchange carries fp32's rounding error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from results import markdown_table, write_result

from shardwise.arch import get_model
from shardwise.layout import Layout
from shardwise.runtime.train import TrainConfig, build


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = get_model("tiny").with_(name="bench", d_model=args.d_model, n_layers=args.layers,
                                   n_heads=8, n_kv_heads=8, d_ff=4 * args.d_model)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rdv"),
                                rank=0, world_size=1)
        try:
            state = build(TrainConfig(spec, Layout(), seq_len=16, global_batch=1))
            model = state.model
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            grads = [p.grad for p in model.parameters()]

            def before() -> float:  # the fp64 copy per gradient this module replaced
                total = torch.zeros(1, dtype=torch.float64)
                for g, (_, w) in zip(grads, model.norm_terms):
                    total += (g.double().square() * w).sum()
                return float(total.sqrt())

            exact = float(torch.cat([g.reshape(-1).double() for g in grads]).norm())
            rows = [("grad_norm (vector_norm, fp64 accumulation)", model.grad_norm),
                    ("before: fp64 copy per gradient", before),
                    ("torch.nn.utils.get_total_norm (fp32)",
                     lambda: float(torch.nn.utils.get_total_norm(grads)))]
            n = sum(g.numel() for g in grads)
            table = markdown_table(
                ["global gradient norm", "median", "relative error"],
                [[label, f"{_median_ms(fn, args.iters):.2f} ms",
                  f"{abs(fn() - exact) / exact:.1e}"] for label, fn in rows])
            text = (f"{n / 1e6:.1f} M fp32 gradients in {len(grads)} tensors, one thread, "
                    f"median of {args.iters}; error against an fp64 norm of all gradients "
                    f"concatenated.\n\n{table}")
            print(text)
            write_result("bench_grad_norm", text)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
