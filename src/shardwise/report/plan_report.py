"""Render a `PlanResult`: ranked table, the winner's step-time and memory breakdowns, a
one-paragraph explanation, the baseline and given-layout comparisons, rejected regions and
search statistics (rich tables; units named: GiB = 2^30 B, GB = 10^9 B)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from shardwise.estimate.goodput import CHECKPOINTS
from shardwise.estimate.profiles import fused_attention, get_profile
from shardwise.estimate.uncertainty import COVERAGE, DOCS
from shardwise.layout import RECOMPUTE_LIGHTEST_FIRST, Layout
from shardwise.placement import members_per_node
from shardwise.plan import Alternative, PlanEntry, PlanResult
from shardwise.plan.rank import exposed_comm, parallel_axes
from shardwise.report.text import table as _table
from shardwise.units import human_count, human_rate, human_time
from shardwise.validate import finite_result

__all__ = ["band_text", "breakdown_table", "explain", "goodput_sentence", "goodput_summary",
           "goodput_table", "headline", "memory_table", "ranked_table", "ranked_title",
           "render_plan", "training_summary", "variants_text"]

_LABELS = {"compute": "compute", "tp_comm": "TP comm (exposed)",
           "cp_comm_exposed": "CP comm (exposed)", "ep_comm": "EP all-to-all",
           "pp_comm": "PP p2p", "bubble": "pipeline bubble",
           "dp_comm_exposed": "DP/ZeRO comm (exposed)", "optimizer": "optimizer step"}


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def _pct(x: float) -> str:
    return f"{x:.1%}"


def variants_text(n: int) -> str:
    """`+3 variants`: the other fitting layouts a row folds (`plan.rank.SECOND_ORDER`)."""
    return f"+{n} variant{'s' if n != 1 else ''}" if n else ""


def band_text(sure: Any) -> str:
    """"±6%" (the printed band, `estimate.uncertainty`), "not validated" where no group of
    published runs backs one, "" without a band (the this-machine preset)."""
    if sure is None:
        return ""
    return f"±{round(sure.band * 100)}%" if sure.band is not None else "not validated"


def ranked_title(result: PlanResult, wide: bool = True) -> str:
    """The ranked table's title: what the rows are ranked by, how many fit, what the tiers
    and marks mean, where the bands are measured; `wide`: what every column counts."""
    folded = ("" if result.all_variants else
              "; +N variants: layouts that differ only in ZeRO group size or stage partition, "
              "folded into their best (--all-variants lists them)")
    by = ("effective step time (step ÷ goodput: failures, checkpoints and restarts counted)"
          if result.rank_by == "goodput" else "step time")
    stack = result.train.stack
    export = f", --emit {stack.export}" if stack.export else ", no export"
    tiers = result.tiering
    columns = ("; memory = largest stage, GiB; MFU and HFU count full attention, "
               "6N + 12·L·h·s FLOPs per token" if wide else
               "; mem = largest stage, GiB; MFU counts full attention")
    return (f"Top {len(result.ranked)} layouts by {by} for {stack.title} "
            f"({stack.label}{export}; of {result.stats.fits:,} that fit{folded}; "
            f"tier: rows closer than the model resolves (±{tiers.resolution:.1%}) share one; "
            f"★ recommended ({result.choose}); step ± its {COVERAGE:.0%} band from published "
            f"runs of the group named in the explanation ({DOCS}); † relies on something no "
            f"published run validates{columns})")


def ranked_table(result: PlanResult, wide: bool = False) -> Table:
    """The top layouts, one row each, tiers separated and the recommended row marked:
    compact (fits 80 columns: step and its band, tokens/s, MFU, memory) or `wide` (also the
    effective step, goodput, HFU and the step's shares). Numbers never wrap or truncate; the
    layout column folds."""
    effective = result.rank_by == "goodput"
    heads = (["#", "tier", "layout", "step", *(["eff. step"] if effective else []),
              "goodput", "tokens/s", "MFU", "HFU", "mem GiB", "compute", "TP", "DP",
              "PP+bubble", "other"] if wide else
             ["#", "tier", "layout", "step", *(["eff. step"] if effective else []),
              "tok/s", "MFU", "mem"])
    table = _table(ranked_title(result, wide), heads)
    for i, column in enumerate(table.columns):
        if heads[i] == "layout":
            column.overflow, column.min_width, column.justify = "fold", 12, "left"
        else:
            column.no_wrap = True
    tiers = result.tiering
    for k, entry in enumerate(result.ranked):
        good = entry.goodput
        e = entry.estimate
        share = {key: v / e.total for key, v in e.breakdown().items()}
        other = share["cp_comm_exposed"] + share["ep_comm"] + share["optimizer"]
        folded = variants_text(entry.variants)
        sure = e.uncertainty
        band = band_text(sure)
        step = human_time(e.total) + ("\n" if band == "not validated" else " " if band else "")
        mark = " ★" if k == tiers.recommended else ""
        if folded and not wide:
            folded = f"+{entry.variants}"
        layout = (entry.layout.short() + (f" [dim]{folded}[/]" if folded else "")
                  + (" †" if sure and sure.unvalidated else ""))
        effective_cell = [human_time(entry.figure("goodput"))] if effective else []
        cells = ([_pct(good.goodput) if good else "", human_count(e.tokens_per_s), _pct(e.mfu),
                  _pct(e.hfu), _gib(entry.memory.total), _pct(share["compute"]),
                  _pct(share["tp_comm"]), _pct(share["dp_comm_exposed"]),
                  _pct(share["pp_comm"] + share["bubble"]), _pct(other)] if wide else
                 [human_count(e.tokens_per_s), _pct(e.mfu), _gib(entry.memory.total)])
        last = k + 1 == len(result.ranked) or tiers.tier[k + 1] != tiers.tier[k]
        table.add_row(str(entry.rank), f"{tiers.tier[k]}{mark}", layout, step + band,
                      *effective_cell, *cells, end_section=last)
    return table


def headline(result: PlanResult) -> str:
    """One line: the recommended layout, why it (its tier and the rule), and its figures."""
    rec, tiers = result.recommended, result.tiering
    e = rec.estimate
    band = band_text(e.uncertainty)
    why = ("the fastest row" if result.choose == "fastest" else
           "the simplest of the first tier: fewest parallel axes, then least exposed "
           "communication, then memory headroom")
    return (f"Recommended: {rec.layout.short()} (#{rec.rank}, {why}; {tiers.count} of "
            f"{len(result.ranked)} rows shown are in the first tier) — "
            f"{human_time(e.total)}{' ' + band if band else ''} per step, "
            f"{human_count(e.tokens_per_s)} tokens/s, {e.mfu:.1%} MFU, "
            f"{rec.memory.total / 2**30:.1f} GiB.")


def breakdown_table(entry: PlanEntry, title: str = "Step time") -> Table:
    """One layout's step time by component, in seconds and as a share of the step."""
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
    """The largest stage's memory by part, in GiB and GB."""
    m = entry.memory
    table = _table(f"Memory of the largest stage (stage {m.stage}, {m.layers} layers, "
                   f"{_in_flight(m.in_flight, entry.layout.chunks)})", ["part", "GiB", "GB"])
    for key, value in m.as_dict().items():
        label = f"[bold]{key}[/]" if key == "total" else key
        table.add_row(label, _gib(value), f"{value / 1e9:,.1f}")
    table.add_row("budget", _gib(entry.budget), f"{entry.budget / 1e9:,.1f}")
    return table


def _closest(alternatives: list[Alternative], axis: str,
             layout: Layout | None = None) -> Alternative | None:
    """The fastest alternative along `axis` (none with `layout`'s own value)."""
    own = getattr(layout, axis, None) if layout is not None else None
    options = [a for a in alternatives if a.axis == axis and a.best_total is not None
               and a.value != own]
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
            "full": "every layer's forward recomputed",
            "op-sac": "the matmuls per-op SAC does not save (wo, w3) recomputed"}[recompute]


def _validation_sentence(result: PlanResult) -> str:
    """How sure the recommended layout's step time is (its band, the group and how it was
    formed, where it is published), and — when it relies on what no published run measured
    and beats the best validated layout shown by more than its band — why."""
    rec = result.recommended
    sure = rec.estimate.uncertainty
    if sure is None:
        return ""
    if sure.band is None:
        text = (f"Its step time is not validated: {sure.basis} ({DOCS})")
    else:
        text = (f"Its step time is good to ±{sure.band:.0%} at {sure.coverage:.0%} coverage "
                f"({sure.basis}; {DOCS})")
    if sure.on_ground:
        return text + "."
    text += f"; no published run measures {', '.join(sure.unvalidated)}"
    validated = [e for e in result.ranked if e.estimate.uncertainty
                 and e.estimate.uncertainty.on_ground]
    total = rec.estimate.total
    if not validated:
        return text + ", and no layout shown avoids that: treat the ranking as unvalidated."
    ref = validated[0]
    gain = ref.estimate.total / total - 1
    why = ("within the band" if sure.band is not None and gain <= sure.band else
           "more than the band: the gain comes from what is not validated")
    return (text + f". The best validated layout shown, {ref.layout.short()} (#{ref.rank}), "
            f"takes {human_time(ref.estimate.total)} ({gain:+.0%}), {why}.")


def explain(result: PlanResult) -> str:
    """One paragraph: why the winner wins, axis by axis, from the search's own alternatives
    (compared by the figure ranked: step time, or effective step time), and what failures and
    checkpoints cost it (`goodput_sentence`)."""
    best = result.recommended
    lay, e = best.layout, best.estimate
    total, figure = e.total, best.figure(result.rank_by)
    alts = result.alternatives
    cl = result.cluster
    sentences = [
        f"{_lead(result)}: "
        f"{human_time(e.total)} per step, {human_count(e.tokens_per_s)} tokens/s, "
        f"{e.mfu:.1%} MFU ({e.mfu_causal:.1%} counting only the causal half of attention; "
        f"HFU {e.hfu:.1%} also counts {_recompute_adds(lay.recompute)})."]
    sentences.append(_tier_sentence(result))
    sentences.append(_validation_sentence(result))
    if lay.tp > 1:
        where = "inside each node" if lay.tp <= cl.gpus_per_node else "across nodes"
        sentences.append(
            f"TP {lay.tp} shards every layer {where} over {cl.intra.name}; its "
            f"{'reduce-scatters and all-gathers (sequence parallel)' if lay.sp else 'all-reduces'} "
            f"cost {e.tp_comm / total:.0%} of the step{_slower(_closest(alts, 'tp', lay), figure)}.")
    else:
        sentences.append("No tensor parallelism: per-layer all-reduces would cost more than "
                         f"they save{_slower(_closest(alts, 'tp', lay), figure)}.")
    if lay.pp > 1:
        in_node = members_per_node("pp", cl.gpus_per_node, pp=lay.pp, dp=lay.dp, cp=lay.cp,
                                   tp=lay.tp, ep=lay.ep)
        span = "inside the node" if in_node == lay.pp else "across nodes"
        sched = lay.schedule + (f" with v={lay.chunks}" if lay.chunks > 1 else "")
        split = lay.stage_layers(result.model.n_layers)
        each = (f"each stage {split[0]} layers" if len(set(split)) == 1 else
                "its stages " + "/".join(map(str, split)) + " layers (first to last)")
        sentences.append(
            f"PP {lay.pp} {span} gives {each}; "
            f"{sched} over {_count(e.microbatches, 'micro-batch')} leaves a "
            f"{e.bubble / total:.1%} "
            f"bubble{_slower(_closest(alts, 'pp', lay), figure)}.")
    else:
        sentences.append("No pipeline, so no bubble"
                         f"{_slower(_closest(alts, 'pp', lay), figure)}.")
    if lay.cp > 1:
        moves = {"ring": "ring attention's K/V transfers",
                 "ulysses": "Ulysses' all-to-alls over heads",
                 "hybrid": f"all-to-alls inside groups of {lay.ulysses} and a ring across "
                           "them",
                 "allgather": "the all-gathers of K and V (and their gradients' "
                              "reduce-scatters)"}[lay.cp_kind]
        sentences.append(f"CP {lay.cp} splits each sequence; {moves} add "
                         f"{e.cp_comm_exposed / total:.1%}"
                         f"{_slower(_closest(alts, 'cp_kind', lay), figure)}.")
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
            f"{_slower(_closest(alts, 'zero', lay), figure)}.")
    elif lay.dp * lay.cp > 1:
        sentences.append(f"Plain data parallelism over {lay.dp * lay.cp} replicas; "
                         f"{e.dp_comm_exposed / total:.1%} of the gradient all-reduce is "
                         "exposed.")
    lighter = [a for a in alts if a.axis == "recompute" and
               RECOMPUTE_LIGHTEST_FIRST.index(a.value) < RECOMPUTE_LIGHTEST_FIRST.index(lay.recompute)]
    if lighter:
        parts = []
        for a in lighter:
            if a.best_total is None and a.min_memory is not None:
                parts.append(f"with {_recompute_name(a.value)} the leanest layout needs "
                             f"{a.min_memory / 2**30:.1f} GiB (budget "
                             f"{best.budget / 2**30:.1f} GiB)")
            elif a.best_total is not None:
                parts.append(f"{_recompute_name(a.value)} at best "
                             f"{a.best_total / figure - 1:+.0%}")
        sentences.append(f"{lay.recompute.capitalize()} recompute: " + "; ".join(parts) + ".")
    sentences.append(f"The largest stage needs {best.memory.total / 2**30:.1f} GiB of the "
                     f"{best.budget / 2**30:.1f} GiB budget.")
    if result.baseline is not None:
        ratio = result.baseline.figure(result.rank_by) / figure
        # faster only when the constraints keep the search from it
        compared = f"{ratio - 1:.0%} slower" if ratio >= 1 else f"{1 - ratio:.0%} faster"
        sentences.append(f"SPEC §7's rule picks {result.baseline.layout.short()}, "
                         f"{compared} ({result.baseline_note}).")
    sentences.append(goodput_sentence(best))
    return " ".join(sentences)


def _lead(result: PlanResult) -> str:
    """What the recommended layout is among the layouts that fit."""
    rec, fits = result.recommended, result.stats.fits
    if result.rank_by == "goodput":
        what = (f"has the shortest effective step time (step ÷ goodput) of {fits:,} layouts "
                "that fit" if rec is result.best else
                f"is recommended among {fits:,} layouts that fit (effective step time "
                f"{human_time(rec.figure('goodput'))})")
        return f"{rec.layout.short()} {what}"
    what = (f"is the fastest of {fits:,} layouts that fit" if rec is result.best else
            f"is recommended among {fits:,} layouts that fit")
    return f"{rec.layout.short()} {what}"


def _tier_sentence(result: PlanResult) -> str:
    """Which rows the model cannot tell apart (the first tier) and why the recommended one
    (`plan.rank.recommend`): the rule, or the fastest."""
    tiers, rec, best = result.tiering, result.recommended, result.best
    count, shown = tiers.count, len(result.ranked)
    basis = f"the model orders step times {tiers.resolution:.1%} apart: {tiers.basis}"
    if count == 1:
        return f"No other row shown is in its tier ({basis})."
    tie = (f"The first tier holds {count} of the {shown} rows shown: each within "
           f"{tiers.resolution:.1%} of its neighbour, closer than the model can order ({basis})")
    if result.choose == "fastest":
        return tie + "; the fastest is recommended (--choose fastest)."
    slower = rec.figure(result.rank_by) / best.figure(result.rank_by) - 1
    versus = ("it is also the fastest" if rec is best else
              f"it is {slower:+.1%} against the fastest, {best.layout.short()}, which "
              "--choose fastest recommends")
    return (tie + f". Of them it has the fewest parallel axes ({parallel_axes(rec.layout)}), "
            "then the least exposed communication "
            f"({exposed_comm(rec.estimate) / rec.estimate.total:.1%} of its step), then the "
            f"most memory headroom; {versus}.")


_DOMINATES = {"restart": "restarts dominate", "checkpoint": "checkpoints dominate",
              "lost work": "lost work dominates"}
_REMEDY = {"restart": "a faster restart (--restart-minutes) gains most",
           "checkpoint": "faster storage (--checkpoint-bandwidth) or asynchronous checkpoints "
                         "(--async-checkpoint) gain most",
           "lost work": "a cheaper checkpoint (faster storage, asynchronous saves) allows a "
                        "shorter interval and gains most"}


def goodput_sentence(entry: PlanEntry) -> str:
    """What failures, checkpoints and restarts leave of the wall time, and what dominates the
    loss (`estimate.goodput`)."""
    g = entry.goodput
    if g is None:
        return ""
    parts = {"restart": f"restarts {_pct(g.shares['restart'])} ({human_time(g.restart_s)} "
                        "each)",
             "lost work": f"work lost since the last checkpoint {_pct(g.shares['lost work'])}",
             "checkpoint": f"checkpoints {_pct(g.shares['checkpoint'])} (a "
                           f"{human_time(g.stall_s)} stall every {human_time(g.interval_s)})"}
    order = sorted(parts, key=lambda k: -g.shares[k])
    return (f"Failures and checkpoints leave it {_pct(g.goodput)} of the wall time (goodput; a "
            f"failure every {human_time(g.job_mtbf_s)} on {g.gpus:,} GPUs, "
            f"{human_rate(g.interruptions_per_day)}): " + ", ".join(parts[k] for k in order)
            + f"; {_DOMINATES[g.dominant]}, so {_REMEDY[g.dominant]}.")


def goodput_table(entry: PlanEntry) -> Table:
    """One layout's goodput: job MTBF, checkpoint size and write, interval, restart, goodput
    and what the loss goes to (GB = 10^9 B)."""
    g = entry.goodput
    assert g is not None
    writing = (f"{human_time(g.write_s)}: {g.node_bytes / 1e9:,.2f} GB from the busiest node "
               f"at {g.node_bandwidth / 1e9:.3g} GB/s, after a {human_time(g.copy_s)} "
               f"device→host copy over {g.host_link}")
    stall = (f"{human_time(g.stall_s)} (asynchronous: the copy; the write ends "
             f"{human_time(g.lag_s)} later)" if g.async_checkpoint else
             f"{human_time(g.stall_s)} (synchronous: the whole write)")
    rows = [
        ["job MTBF", f"{human_time(g.job_mtbf_s)} ({g.mtbf_gpu_hours:,.0f} GPU-hours per GPU "
                     f"÷ {g.gpus:,} GPUs): {human_rate(g.interruptions_per_day, 'interruption')}"],
        ["checkpoint", f"{g.checkpoint_bytes / 1e9:,.1f} GB ({g.bytes_per_param:g} B/param, "
                       f"{CHECKPOINTS[g.stack].title}); the busiest rank writes "
                       f"{g.rank_bytes / 1e9:,.2f} GB"],
        ["write", writing],
        ["stall per checkpoint", stall],
        ["interval", f"{human_time(g.interval_s)} of training, every {g.every_steps:,} steps "
                     f"(Daly 2006; Young 1974: {human_time(g.young_interval_s)})"],
        ["restart", f"{human_time(g.restart_s)} (detect, reschedule, reload); each "
                    f"interruption costs {human_time(g.lost_per_interruption_s)} with the "
                    "lost work"],
        ["goodput", f"{_pct(g.goodput)}: effective step {human_time(g.effective_step_s)}"],
        ["lost to", ", ".join(f"{k} {_pct(v)}" for k, v in g.shares.items())],
    ]
    return _table(f"Failures, checkpoints and restarts: {entry.layout.short()}",
                  ["quantity", "value"], rows)


def goodput_summary(entry: PlanEntry, tokens: float | None, price: float | None
                    ) -> dict[str, Any] | None:
    """`entry`'s goodput (`Goodput.to_dict`, with `interruption_rate` in words) and, for a
    budget of `tokens`, the wall-clock time with failures: `expected_interruptions`, `days`,
    `gpu_hours` (and `cost` with `price`); those are None without `tokens`."""
    g = entry.goodput
    if g is None:
        return None
    out: dict[str, Any] = g.to_dict() | {
        "interruption_rate": human_rate(g.interruptions_per_day, "interruption"),
        "tokens": tokens, "expected_interruptions": None, "days": None, "gpu_hours": None,
        "cost": None}
    if tokens:
        wall = g.budget(entry.estimate.time_to_train(tokens))
        out |= {"expected_interruptions": wall["expected_interruptions"], "days": wall["days"],
                "gpu_hours": wall["seconds"] * g.gpus / 3600}
        if price is not None:
            out["cost"] = out["gpu_hours"] * price
    return out


def training_summary(entry: PlanEntry, tokens: float | None, price: float | None
                     ) -> dict[str, float] | None:
    """Seconds and GPU-hours (and cost, with `price`) of training `tokens` on `entry`'s layout
    if nothing failed; None without `tokens` (`goodput_summary`: with failures)."""
    if not tokens:
        return None
    out = {"tokens": tokens, "seconds": entry.estimate.time_to_train(tokens),
           "gpu_hours": entry.estimate.gpu_hours(tokens)}
    if price is not None:
        out["cost"] = entry.estimate.cost(tokens, price)
        out["price_per_gpu_hour"] = price
    return finite_result(out, "training time and cost")


def render_plan(result: PlanResult, console: Console, *, tokens: float | None = None,
                price: float | None = None, wide: bool = False) -> None:
    """Print the whole plan report (`wide`: every column of the ranked table)."""
    model, cl, tr = result.model, result.cluster, result.train
    counts = model.count_params()
    batch = tr.global_batch or 0
    fused = fused_attention(tr.profile, tr.flash_attention)
    kernel = "FlashAttention" if fused else "materialised attention"
    console.print(
        f"[bold]{model.name}[/] ({human_count(counts.total)} parameters) on {cl.n_gpus}× "
        f"{cl.accelerator.name} ({cl.nodes} nodes × {cl.gpus_per_node}, {cl.intra.name} / "
        f"{cl.inter.name}), s={tr.seq_len}, global batch {batch:,} sequences "
        f"({human_count(batch * tr.seq_len)} tokens), {tr.dtype}, "
        + (f"FP8 {tr.fp8} GEMMs, " if tr.fp8 else "")
        + (f"{tr.offload} offloaded to host, " if tr.offload != "none" else "")
        + f"{kernel}, "
        f"on {tr.settings().describe()}; activations of {get_profile(tr.profile).title}; "
        f"budget {result.budget / 2**30:.1f} GiB per GPU ({result.headroom:.0%})"
        + (f"; searched only {result.constraint}." if result.constraint else "."))
    rec = result.recommended
    table = ranked_table(result, wide)
    # every column at its full width, past the terminal's if need be (it wraps the lines)
    need = Measurement.get(console, console.options.update_width(400), table).maximum \
        if wide else console.width
    width = console.width
    console.width = max(width, need)
    try:
        console.print(table)
    finally:
        console.width = width
    console.print(headline(result))
    console.print(breakdown_table(rec, "Recommended layout's step time"))
    console.print(memory_table(rec))
    console.print(goodput_table(rec))
    console.print(explain(result))
    summary = training_summary(rec, tokens, price)
    failing = goodput_summary(rec, tokens, price)
    if summary and failing:
        line = (f"Training {human_count(summary['tokens'])} tokens: "
                f"{human_time(summary['seconds'])} if nothing failed; with failures "
                f"{failing['days']:,.1f} days at {_pct(failing['goodput'])} goodput (about "
                f"{failing['expected_interruptions']:,.0f} interruptions), "
                f"{failing['gpu_hours']:,.0f} GPU-hours")
        if failing["cost"] is not None:
            line += (f", ${failing['cost']:,.0f} at ${summary['price_per_gpu_hour']:g}/"
                     f"GPU-hour (${summary['cost']:,.0f} without failures)")
        console.print(line + ".")
    if result.given is not None:
        g = result.given
        ratio = g.estimate.total / rec.estimate.total
        fit = "fits" if g.fits else (f"does NOT fit ({g.memory.total / 2**30:.1f} GiB > "
                                     f"{g.budget / 2**30:.1f} GiB)")
        console.print(f"Your layout {g.layout.short()}: {human_time(g.estimate.total)} per "
                      f"step, MFU {g.estimate.mfu:.1%}, {fit}; {ratio:.2f}× the recommended "
                      f"layout's step time ({result.given_note}).")
        console.print(breakdown_table(g, "Your layout's step time"))
    rejected = _table("Rejected regions of the search space (grid points)",
                      ["reason", "count", "example"])
    for r in result.rejected:
        rejected.add_row(r.reason, f"{r.count:,}", r.example)
    console.print(rejected)
    s = result.stats
    console.print(f"Searched {s.grid:,} grid points; evaluated {s.evaluated:,} valid layouts in "
                  f"{s.evaluation_seconds * 1e3:.0f} ms ({s.layouts_per_s / 1e6:.2f}M layouts/s),"
                  f" {s.seconds * 1e3:.0f} ms in all; ranked by the exact "
                  f"{'step time' if result.rank_by == 'step' else 'effective step time'}, "
                  f"{_count(s.simulated, 'uneven pipeline')} simulated (the closed form "
                  "bounds the rest).")
