"""Speed of the runtime against plain PyTorch, paired in the same run and interleaved.

Part `model` (one process): a training step of the runtime `Transformer` against `PlainLlama`
below (the same architecture as a PyTorch user writes it, the same weights; the losses agree
to rounding), and the attention and SwiGLU kernels on their own against SDPA and autograd.
Part `layouts` (2 gloo ranks): one optimizer step of `runtime.train.train_step` against
PyTorch's own wrappers doing the same — dp2 (DDP), zero1 (ZeroRedundancyOptimizer), zero2/3
(FSDP2), tp2(+sp) (DTensor), pp2 1f1b/gpipe (torch.distributed.pipelining). Steps alternate
shardwise, native, …; rank 0's median and fastest step times and their ratios (< 1: shardwise
faster). Details: docs/accuracy/index.md.

Run: `PYTHONPATH=src python benchmarks/bench_runtime_speed.py [--part model|layouts|all]
[--layers 4] [--d-model 256] [--seq 256] [--batch 8] [--steps 10]`; writes
`docs/generated/bench_runtime_speed_{model,layouts}.md`. A step varies up to 2× on a shared
machine: rerun on a quiet one before quoting a single ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from results import markdown_table, write_result
from torch import nn

from shardwise.arch import ModelSpec, get_model
from shardwise.runtime.model import AttentionFunction, SwiGLUFunction, Transformer


# ------------------------------------------------------------------ the plain reference
class PlainAttention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        h, d = spec.d_model, spec.head_dim
        self.head_dim = d
        self.wq = nn.Linear(h, spec.n_heads * d, bias=False, dtype=dtype)
        self.wk = nn.Linear(h, spec.n_kv_heads * d, bias=False, dtype=dtype)
        self.wv = nn.Linear(h, spec.n_kv_heads * d, bias=False, dtype=dtype)
        self.wo = nn.Linear(spec.n_heads * d, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, heads·d) -> (b, heads, s, d); heads: what this rank holds under TP
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class PlainMLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.w_gate = nn.Linear(spec.d_model, spec.d_ff, bias=False, dtype=dtype)
        self.w_up = nn.Linear(spec.d_model, spec.d_ff, bias=False, dtype=dtype)
        self.w_down = nn.Linear(spec.d_ff, spec.d_model, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class PlainBlock(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = nn.RMSNorm(spec.d_model, spec.norm_eps, dtype=dtype)
        self.attention = PlainAttention(spec, dtype)
        self.mlp_norm = nn.RMSNorm(spec.d_model, spec.norm_eps, dtype=dtype)
        self.mlp = PlainMLP(spec, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class PlainLlama(nn.Module):
    """Llama the PyTorch way; parameter names match `runtime.model.Transformer`'s, so one
    state dict loads into both. `forward(tokens)` -> logits (b, s, V)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.spec = spec
        self.embedding = nn.Embedding(spec.vocab, spec.d_model, dtype=dtype)
        self.blocks = nn.ModuleList(PlainBlock(spec, dtype) for _ in range(spec.n_layers))
        self.norm = nn.RMSNorm(spec.d_model, spec.norm_eps, dtype=dtype)
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False, dtype=dtype)
        d = spec.head_dim
        inv_freq = spec.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(spec.max_seq, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)  # (max_seq, d)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:s], self.sin[:s])
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bench_spec(args: argparse.Namespace) -> ModelSpec:
    return get_model("tiny").with_(
        name="bench", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
        n_kv_heads=args.kv_heads, d_ff=args.d_ff or 8 * args.d_model // 3 // 64 * 64,
        vocab=args.vocab, max_seq=args.seq)


# ----------------------------------------------------------------------------- timing
def interleaved(fns: dict[str, Callable[[], Any]], steps: int, warmup: int = 2
                ) -> dict[str, list[float]]:
    """Seconds of each of `steps` calls of each function, called in turn (a, b, a, b, …) so
    that both see the same machine."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _median(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) for name, t in times.items()}


# ------------------------------------------------------------------ part 1: one process
def model_part(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    spec, dtype = bench_spec(args), torch.float32
    ours = Transformer(spec, dtype=dtype)
    plain = PlainLlama(spec, dtype)
    plain.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, spec.vocab, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        diff = (ours.loss(inputs, targets) - lm_loss(plain(inputs), targets)).abs().item()
    assert diff < 1e-4, f"the two models disagree: |Δloss| = {diff}"
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def step_ours() -> None:
        opt_ours.zero_grad()
        ours.loss(inputs, targets).backward()
        opt_ours.step()

    def step_plain() -> None:
        opt_plain.zero_grad()
        lm_loss(plain(inputs), targets).backward()
        opt_plain.step()

    tokens_per_step = args.batch * args.seq
    t = _median(interleaved({"shardwise": step_ours, "plain": step_plain}, args.steps))
    rows = [("training step: tokens/s", tokens_per_step / t["shardwise"],
             tokens_per_step / t["plain"])]

    # the kernels alone, forward + backward; (b, s, heads, d) as the runtime lays them out
    b, s, d = args.batch, args.seq, spec.head_dim
    q = torch.randn(b, s, spec.n_heads, d, requires_grad=True)
    k = torch.randn(b, s, spec.n_kv_heads, d, requires_grad=True)
    v = torch.randn(b, s, spec.n_kv_heads, d, requires_grad=True)
    dout = torch.randn(b, s, spec.n_heads, d)

    def attn_ours() -> None:
        AttentionFunction.apply(q, k, v, True, True).backward(dout)

    def attn_sdpa() -> None:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
        F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                       enable_gqa=True).transpose(1, 2).backward(dout)

    t = _median(interleaved({"shardwise": attn_ours, "plain": attn_sdpa}, args.steps))
    rows.append(("attention fwd+bwd: ms", 1e3 * t["shardwise"], 1e3 * t["plain"]))
    g = torch.randn(b, s, spec.d_ff, requires_grad=True)
    u = torch.randn(b, s, spec.d_ff, requires_grad=True)
    dy = torch.randn(b, s, spec.d_ff)
    t = _median(interleaved({"shardwise": lambda: SwiGLUFunction.apply(g, u).backward(dy),
                             "plain": lambda: (F.silu(g) * u).backward(dy)}, args.steps))
    rows.append(("SwiGLU fwd+bwd: ms", 1e3 * t["shardwise"], 1e3 * t["plain"]))
    return rows


def write_model_table(rows: list[tuple[str, float, float]], args: argparse.Namespace) -> None:
    table = markdown_table(
        ["", "shardwise", "PyTorch", "ratio (time, shardwise ÷ PyTorch)"],
        # the ratio of times either way: tokens/s is a rate, so its ratio is inverted
        [[name, f"{ours:.1f}", f"{plain:.1f}",
          f"{plain / ours if name.endswith('tokens/s') else ours / plain:.2f}"]
         for name, ours, plain in rows])
    text = (f"One process, fp32, {torch.get_num_threads()} thread(s): {args.layers} layers, "
            f"d_model {args.d_model}, {args.heads}/{args.kv_heads} heads, seq {args.seq}, "
            f"batch {args.batch}; median of {args.steps}, interleaved.\n\n{table}")
    print(text)
    write_result("bench_runtime_speed_model", text)


# ------------------------------------------------------------- part 2: the layouts
# name -> (shardwise layout keywords, native wrapper); micro-batches: one per step except pp (4)
LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    "dp2": ({"dp": 2}, "DDP"),
    "zero1": ({"dp": 2, "zero": 1}, "DDP + ZeroRedundancyOptimizer"),
    "zero2": ({"dp": 2, "zero": 2}, "FSDP2 (no reshard after fwd)"),
    "zero3": ({"dp": 2, "zero": 3}, "FSDP2"),
    "tp2": ({"tp": 2}, "DTensor parallelize_module"),
    "tp2+sp": ({"tp": 2, "sp": True}, "DTensor parallelize_module + SP"),
    "pp2 1f1b": ({"pp": 2, "schedule": "1f1b"}, "pipelining Schedule1F1B"),
    "pp2 gpipe": ({"pp": 2, "schedule": "gpipe"}, "pipelining ScheduleGPipe"),
}
PP_MICRO_BATCHES = 4
LR, CLIP = 1e-4, 1.0


class PlainStage(nn.Module):
    """Blocks `layers` of a `PlainLlama`, with the embedding on the first stage and the final
    norm and head on the last (torch.distributed.pipelining's manual split)."""

    def __init__(self, full: PlainLlama, layers: range, first: bool, last: bool):
        super().__init__()
        self.embedding = full.embedding if first else None
        self.blocks = nn.ModuleList(full.blocks[i] for i in layers)
        self.norm: nn.Module | None = full.norm if last else None
        self.head: nn.Module | None = full.head if last else None
        self.cos, self.sin = full.cos, full.sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        s = x.shape[1]
        for block in self.blocks:
            x = block(x, self.cos[:s], self.sin[:s])
        if self.norm is None or self.head is None:
            return x
        return self.head(self.norm(x))


def _clip_and_step(params: list[nn.Parameter], opt: torch.optim.Optimizer,
                   group: Any = None) -> None:
    """Clip by the global gradient norm as `clip_grad_norm_` does (`get_total_norm`, then
    foreach-scale), the optimizer step. DTensor gradients (FSDP2, TP) and plain ones (TP's
    replicated norms) are normed apart and combined; `group`: sum the squares over it when
    each rank holds different parameters (pipeline stages)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in params if p.grad is not None]
    kinds = ([g for g in grads if isinstance(g, DTensor)],
             [g for g in grads if not isinstance(g, DTensor)])
    square = torch.zeros(())
    for kind in kinds:
        if kind:
            norm = torch.nn.utils.get_total_norm(kind)
            square += (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
    if group is not None:
        dist.all_reduce(square, group=group)
    coef = min(1.0, CLIP / (square.sqrt().item() + 1e-6))
    for kind in kinds:
        if kind:
            torch._foreach_mul_(kind, coef)
    opt.step()


def _tp_plan(sp: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """torchtitan's Llama plan (torchtitan/models/llama3/parallelize.py): Megatron's column/row
    split of Q, K, V / O and gate, up / down; vocabulary-parallel embedding and head (loss
    parallel); with sp the norms run on sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    seq = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                use_local_output=False),
    }
    block: dict[str, Any] = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
        "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
        "mlp.w_down": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        top["norm"] = SequenceParallel()
        block |= {
            "attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
        }
    return top, block


def native_step(name: str, spec: ModelSpec, args: argparse.Namespace) -> Callable[[], None]:
    """One optimizer step of PyTorch's own equivalent of layout `name` on this rank."""
    import torch.distributed as dist
    torch.manual_seed(0)
    plain = PlainLlama(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = LAYOUTS[name][0].get("dp", 1)
    tokens = torch.randint(0, spec.vocab, (args.batch // dp, args.seq + 1),
                           generator=torch.Generator().manual_seed(rank))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kind = LAYOUTS[name][1]
    if kind.startswith("DDP"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        model: nn.Module = DistributedDataParallel(plain)
        opt: torch.optim.Optimizer = (
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
            if "Zero" in kind else torch.optim.AdamW(model.parameters(), lr=LR))
    elif kind.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard
        reshard = "no reshard" not in kind
        for block in plain.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        model = fully_shard(plain, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    elif kind.startswith("DTensor"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,))
        top, per_block = _tp_plan("SP" in kind)
        for block in plain.blocks:
            parallelize_module(block, mesh, per_block)
        model = parallelize_module(plain, mesh, top)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def tp_step() -> None:
            opt.zero_grad()
            with loss_parallel():
                lm_loss(model(inputs), targets).backward()
            _clip_and_step(list(model.parameters()), opt)
        return tp_step
    else:  # pipelining
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        half = spec.n_layers // 2
        layers = range(0, half) if rank == 0 else range(half, spec.n_layers)
        stage_module = PlainStage(plain, layers, rank == 0, rank == world - 1)
        stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
        schedule_cls = Schedule1F1B if "1F1B" in kind else ScheduleGPipe
        schedule = schedule_cls(stage, PP_MICRO_BATCHES, loss_fn=lm_loss)
        params = list(stage_module.parameters())
        opt = torch.optim.AdamW(params, lr=LR)

        def pp_step() -> None:
            opt.zero_grad()
            if rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=targets)
            _clip_and_step(params, opt, group=dist.group.WORLD)
        return pp_step

    def step() -> None:
        opt.zero_grad()
        lm_loss(model(inputs), targets).backward()
        _clip_and_step(list(model.parameters()), opt)
    return step


def layout_rank(name: str, args: argparse.Namespace) -> dict[str, float]:
    """On each rank: the shardwise step and the native step of layout `name`, interleaved;
    the median and the fastest of each (the fastest is the least disturbed by other load)."""
    from shardwise.layout import Layout
    from shardwise.runtime.train import TrainConfig, build, train_step
    spec = bench_spec(args)
    keywords = LAYOUTS[name][0]
    dp = keywords.get("dp", 1)
    micro = args.batch // PP_MICRO_BATCHES if keywords.get("pp", 1) > 1 else args.batch // dp
    config = TrainConfig(model=spec, layout=Layout(**keywords, micro_batch=micro),
                         steps=10**6, seq_len=args.seq, global_batch=args.batch, lr=LR, min_lr=LR,
                         clip=CLIP, warmup=0, dtype="fp32")
    state = build(config)
    native = native_step(name, spec, args)
    times = interleaved({"shardwise": lambda: train_step(state), "native": native}, args.steps)
    return {f"{name} {stat.__name__}": stat(t)
            for name, t in times.items() for stat in (statistics.median, min)}


def layouts_part(args: argparse.Namespace, names: list[str]
                 ) -> list[tuple[str, str, dict[str, float]]]:
    from shardwise.runtime.launch import launch
    rows = []
    for name in names:
        times = launch(layout_rank, 2, name, args, timeout_s=args.timeout)[0]
        rows.append((name, LAYOUTS[name][1], times))
        print(f"  {name}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items()),
              flush=True)
    return rows


def write_layout_table(rows: list[tuple[str, str, dict[str, float]]],
                       args: argparse.Namespace) -> None:
    def pair(t: dict[str, float], side: str) -> str:
        return f"{1e3 * t[side + ' median']:.0f} / {1e3 * t[side + ' min']:.0f}"

    table = markdown_table(
        ["layout", "PyTorch native", "shardwise (ms)", "native (ms)", "ratio", "ratio, fastest"],
        [[name, native, pair(t, "shardwise"), pair(t, "native"),
          f"{t['shardwise median'] / t['native median']:.2f}",
          f"{t['shardwise min'] / t['native min']:.2f}"] for name, native, t in rows],
        "llrrrr")
    text = (f"2 gloo ranks, 1 thread each, fp32; global batch {args.batch}, seq {args.seq}; one "
            f"micro-batch per step (pp: {PP_MICRO_BATCHES}); rank 0's steps, {args.steps} of "
            f"each, interleaved; median / fastest, and their ratios shardwise ÷ native (< 1: "
            f"shardwise faster).\n\n{table}")
    print(text)
    write_result("bench_runtime_speed_layouts", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("model", "layouts", "all"), default="all")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="comma-separated subset of: " + ", ".join(LAYOUTS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=0, help="0: 8/3·d_model rounded to 64")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="part model's torch threads")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.part in ("model", "all"):
        torch.set_num_threads(args.threads)
        write_model_table(model_part(args), args)
    if args.part in ("layouts", "all"):
        names = [n.strip() for n in args.layouts.split(",")]
        unknown = [n for n in names if n not in LAYOUTS]
        if unknown:
            parser.error(f"unknown layout(s) {', '.join(unknown)}; valid: {', '.join(LAYOUTS)}")
        write_layout_table(layouts_part(args, names), args)


if __name__ == "__main__":
    main()
