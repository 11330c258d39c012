"""Render a `PlanResult`: ranked table, the winner's step-time and memory breakdowns, a
one-paragraph explanation, the baseline and given-layout comparisons, rejected regions and
search statistics (rich tables; units named: GiB = 2^30 B, GB = 10^9 B)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from shardwise.estimate.profiles import fused_attention, get_profile
from shardwise.placement import members_per_node
from shardwise.plan import Alternative, PlanEntry, PlanResult
from shardwise.report.text import table as _table
from shardwise.units import human_count, human_time
from shardwise.validate import finite_result

__all__ = ["breakdown_table", "explain", "memory_table", "ranked_table", "render_plan",
           "training_summary"]

_LABELS = {"compute": "compute", "tp_comm": "TP comm (exposed)",
           "cp_comm_exposed": "CP comm (exposed)", "ep_comm": "EP all-to-all",
           "pp_comm": "PP p2p", "bubble": "pipeline bubble",
           "dp_comm_exposed": "DP/ZeRO comm (exposed)", "optimizer": "optimizer step"}


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def _pct(x: float) -> str:
    return f"{x:.1%}"


def ranked_table(result: PlanResult) -> Table:
    table = _table(
        f"Top {len(result.ranked)} layouts by step time "
        f"(of {result.stats.fits:,} that fit; memory = largest stage, GiB; MFU and HFU count "
        "full attention, 6N + 12·L·h·s FLOPs per token)",
        ["#", "layout", "step", "tokens/s", "MFU", "HFU", "mem GiB", "compute", "TP", "DP",
         "PP+bubble", "other"])
    for entry in result.ranked:
        e = entry.estimate
        share = {k: v / e.total for k, v in e.breakdown().items()}
        other = share["cp_comm_exposed"] + share["ep_comm"] + share["optimizer"]
        table.add_row(str(entry.rank), entry.layout.short(), human_time(e.total),
                      human_count(e.tokens_per_s), _pct(e.mfu), _pct(e.hfu),
                      _gib(entry.memory.total), _pct(share["compute"]), _pct(share["tp_comm"]),
                      _pct(share["dp_comm_exposed"]),
                      _pct(share["pp_comm"] + share["bubble"]), _pct(other))
    return table


def breakdown_table(entry: PlanEntry, title: str = "Step time") -> Table:
    e = entry.estimate
    table = _table(f"{title}: {entry.layout.short()} ({_count(e.microbatches, 'micro-batch')})",
                   ["component", "seconds", "share"])
    for key, label in _LABELS.items():
        value = getattr(e, key)
        table.add_row(label + (" (simulated)" if key == "bubble" and
                               e.bubble_source == "simulator" else ""),
                      f"{value:.4f}", _pct(value / e.total))
    table.add_row("[bold]total[/]", f"[bold]{e.total:.4f}[/]", "100.0%")
    return table


def memory_table(entry: PlanEntry) -> Table:
    m = entry.memory
    table = _table(f"Memory of the largest stage (stage {m.stage}, {m.layers} layers, "
                   f"{_in_flight(m.in_flight, entry.layout.chunks)})", ["part", "GiB", "GB"])
    for key, value in m.as_dict().items():
        label = f"[bold]{key}[/]" if key == "total" else key
        table.add_row(label, _gib(value), f"{value / 1e9:,.1f}")
    table.add_row("budget", _gib(entry.budget), f"{entry.budget / 1e9:,.1f}")
    return table


def _closest(alternatives: list[Alternative], axis: str) -> Alternative | None:
    options = [a for a in alternatives if a.axis == axis and a.best_total is not None]
    return min(options, key=lambda a: a.best_total or 0.0) if options else None


def _slower(alt: Alternative | None, best: float) -> str:
    if alt is None or alt.best_total is None:
        return ""
    return f" ({alt.axis}={alt.value} at best {alt.best_total / best - 1:+.0%}: {alt.best_layout})"


def _count(n: int, noun: str) -> str:
    """`1 micro-batch`, `2 micro-batches`."""
    return f"{n:,} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")


def _in_flight(count: int, chunks: int) -> str:
    """In flight on a stage: micro-batches, or with interleaving micro-batch-chunks (each
    1/chunks of the stage's layers), so a count above the step's micro-batches reads right."""
    if chunks == 1:
        return _count(count, "micro-batch") + " in flight"
    return (f"{_count(count, 'micro-batch-chunk')} in flight, {count / chunks:g} "
            f"micro-batches' worth of activations")


def _recompute_name(value: str) -> str:
    return "no recompute" if value == "none" else f"{value} recompute"


def _recompute_adds(recompute: str) -> str:
    return {"none": "nothing more: no recomputation",
            "selective": "the attention scores and P·V recomputed",
            "full": "every layer's forward recomputed"}[recompute]


def explain(result: PlanResult) -> str:
    """One paragraph: why the winner wins, axis by axis, from the search's own alternatives."""
    best = result.best
    lay, e = best.layout, best.estimate
    total = e.total
    alts = result.alternatives
    cl = result.cluster
    sentences = [
        f"{lay.short()} is the fastest of {result.stats.fits:,} layouts that fit: "
        f"{human_time(total)} per step, {human_count(e.tokens_per_s)} tokens/s, "
        f"{e.mfu:.1%} MFU ({e.mfu_causal:.1%} counting only the causal half of attention; "
        f"HFU {e.hfu:.1%} also counts {_recompute_adds(lay.recompute)})."]
    if lay.tp > 1:
        where = "inside each node" if lay.tp <= cl.gpus_per_node else "across nodes"
        sentences.append(
            f"TP {lay.tp} shards every layer {where} over {cl.intra.name}; its "
            f"{'reduce-scatters and all-gathers (sequence parallel)' if lay.sp else 'all-reduces'} "
            f"cost {e.tp_comm / total:.0%} of the step{_slower(_closest(alts, 'tp'), total)}.")
    else:
        sentences.append("No tensor parallelism: per-layer all-reduces would cost more than "
                         f"they save{_slower(_closest(alts, 'tp'), total)}.")
    if lay.pp > 1:
        in_node = members_per_node("pp", cl.gpus_per_node, pp=lay.pp, dp=lay.dp, cp=lay.cp,
                                   tp=lay.tp, ep=lay.ep)
        span = "inside the node" if in_node == lay.pp else "across nodes"
        sched = lay.schedule + (f" with v={lay.chunks}" if lay.chunks > 1 else "")
        split = lay.stage_partition(result.model.n_layers)
        each = (f"each stage {split[0] * lay.chunks} layers" if len(set(split)) == 1 else
                "its stages " + "/".join(map(str, split)) + " layers (first to last)")
        sentences.append(
            f"PP {lay.pp} {span} gives {each}; "
            f"{sched} over {_count(e.microbatches, 'micro-batch')} leaves a "
            f"{e.bubble / total:.1%} "
            f"bubble{_slower(_closest(alts, 'pp'), total)}.")
    else:
        sentences.append("No pipeline, so no bubble"
                         f"{_slower(_closest(alts, 'pp'), total)}.")
    if lay.cp > 1:
        sentences.append(f"CP {lay.cp} splits each sequence; the ring transfers add "
                         f"{e.cp_comm_exposed / total:.1%}.")
    if lay.ep > 1:
        sentences.append(f"EP {lay.ep} spreads the experts; the all-to-alls cost "
                         f"{e.ep_comm / total:.0%}.")
    if lay.zero:
        ranks = (f"{lay.dp} data-parallel replicas" if lay.cp == 1 else
                 f"{lay.dp * lay.cp} data×context-parallel ranks (dp {lay.dp} × cp {lay.cp})")
        where = (f"in groups of {lay.zero_group} of the {ranks} (hybrid shard)"
                 if lay.zero_group else f"over the {ranks}")
        sentences.append(
            f"ZeRO-{lay.zero} shards state {where}; "
            f"{e.dp_comm_exposed / total:.1%} of DP traffic stays exposed"
            f"{_slower(_closest(alts, 'zero'), total)}.")
    elif lay.dp * lay.cp > 1:
        sentences.append(f"Plain data parallelism over {lay.dp * lay.cp} replicas; "
                         f"{e.dp_comm_exposed / total:.1%} of the gradient all-reduce is "
                         "exposed.")
    lighter = [a for a in alts if a.axis == "recompute" and
               ["none", "selective", "full"].index(a.value) <
               ["none", "selective", "full"].index(lay.recompute)]
    if lighter:
        parts = []
        for a in lighter:
            if a.best_total is None and a.min_memory is not None:
                parts.append(f"with {_recompute_name(a.value)} the leanest layout needs "
                             f"{a.min_memory / 2**30:.1f} GiB (budget "
                             f"{best.budget / 2**30:.1f} GiB)")
            elif a.best_total is not None:
                parts.append(f"{_recompute_name(a.value)} at best "
                             f"{a.best_total / total - 1:+.0%}")
        sentences.append(f"{lay.recompute.capitalize()} recompute: " + "; ".join(parts) + ".")
    sentences.append(f"The largest stage needs {best.memory.total / 2**30:.1f} GiB of the "
                     f"{best.budget / 2**30:.1f} GiB budget.")
    if result.baseline is not None:
        ratio = result.baseline.estimate.total / total
        sentences.append(f"SPEC §7's rule picks {result.baseline.layout.short()}, "
                         f"{ratio - 1:.0%} slower ({result.baseline_note}).")
    return " ".join(sentences)


def training_summary(entry: PlanEntry, tokens: float | None, price: float | None
                     ) -> dict[str, float] | None:
    if not tokens:
        return None
    out = {"tokens": tokens, "seconds": entry.estimate.time_to_train(tokens),
           "gpu_hours": entry.estimate.gpu_hours(tokens)}
    if price is not None:
        out["cost"] = entry.estimate.cost(tokens, price)
        out["price_per_gpu_hour"] = price
    return finite_result(out, "training time and cost")


def render_plan(result: PlanResult, console: Console, *, tokens: float | None = None,
                price: float | None = None) -> None:
    """Print the whole plan report."""
    model, cl, tr = result.model, result.cluster, result.train
    counts = model.count_params()
    batch = tr.global_batch or 0
    fused = fused_attention(tr.impl, tr.flash_attention)
    kernel = "FlashAttention" if fused else "materialised attention"
    console.print(
        f"[bold]{model.name}[/] ({human_count(counts.total)} parameters) on {cl.n_gpus}× "
        f"{cl.accelerator.name} ({cl.nodes} nodes × {cl.gpus_per_node}, {cl.intra.name} / "
        f"{cl.inter.name}), s={tr.seq_len}, global batch {batch:,} sequences "
        f"({human_count(batch * tr.seq_len)} tokens), {tr.dtype}, "
        f"{kernel}, "
        f"activations of {get_profile(tr.impl).title} (--impl {tr.impl}); "
        f"budget {result.budget / 2**30:.1f} GiB per GPU ({result.headroom:.0%}).")
    console.print(ranked_table(result))
    console.print(breakdown_table(result.best, "Winner's step time"))
    console.print(memory_table(result.best))
    console.print(explain(result))
    summary = training_summary(result.best, tokens, price)
    if summary:
        line = (f"Training {human_count(summary['tokens'])} tokens: "
                f"{human_time(summary['seconds'])}, {summary['gpu_hours']:,.0f} GPU-hours")
        if "cost" in summary:
            line += f", ${summary['cost']:,.0f} at ${summary['price_per_gpu_hour']:g}/GPU-hour"
        console.print(line + ".")
    if result.given is not None:
        g = result.given
        ratio = g.estimate.total / result.best.estimate.total
        fit = "fits" if g.fits else (f"does NOT fit ({g.memory.total / 2**30:.1f} GiB > "
                                     f"{g.budget / 2**30:.1f} GiB)")
        console.print(f"Your layout {g.layout.short()}: {human_time(g.estimate.total)} per "
                      f"step, MFU {g.estimate.mfu:.1%}, {fit}; {ratio:.2f}× the best's step "
                      f"time ({result.given_note}).")
        console.print(breakdown_table(g, "Your layout's step time"))
    rejected = _table("Rejected regions of the search space (grid points)",
                      ["reason", "count", "example"])
    for r in result.rejected:
        rejected.add_row(r.reason, f"{r.count:,}", r.example)
    console.print(rejected)
    s = result.stats
    console.print(f"Searched {s.grid:,} grid points; evaluated {s.evaluated:,} valid layouts in "
                  f"{s.evaluation_seconds * 1e3:.0f} ms ({s.layouts_per_s / 1e6:.2f}M layouts/s),"
                  f" {s.seconds * 1e3:.0f} ms in all.")
