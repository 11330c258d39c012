"""Terminal renderings of the builders' payloads (`shardwise.report.builders`): what the CLI
prints without `--json`. Every figure shown is read from the payload; nothing is recomputed
here (GB = 10^9 bytes, GiB = 2^30 bytes, as labelled)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table

from shardwise.units import gb, gib, human_count, human_time

__all__ = ["render_comm", "render_memory", "render_models", "render_schedule", "table"]


def table(title: str, columns: list[str], rows: Iterable[list[Any]] = ()) -> Table:
    """A rich table: first column left-aligned, the others right-aligned."""
    out = Table(title=title, title_justify="left", min_width=min(len(title) + 4, 100))
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*(str(cell) for cell in row))
    return out


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    console.print(table(
        "Model presets (parameters: total / active)",
        ["model", "L", "h", "heads", "kv", "f", "V", "experts", "total", "active"],
        [[r["name"], r["layers"], r["hidden"], r["heads"], r["kv_heads"], r["ffn"], r["vocab"],
          f"{r['experts']}×top{r['top_k']}" if r["experts"] else "-",
          human_count(r["total_params"]), human_count(r["active_params"])] for r in rows],
    ))


def render_memory(out: dict[str, Any], console: Console) -> None:
    train = out["train"]
    console.print(f"[bold]{out['model']}[/] on {out['gpus']}× {out['accelerator']}, "
                  f"layout {out['layout_short']}, s={train['seq_len']}, "
                  f"{'FlashAttention' if train['flash_attention'] else 'materialised attention'}"
                  f", {out['formula']} activation count")
    parts = ("weights", "grads", "optimizer", "activations", "logits", "workspace", "total")
    console.print(table(
        "Per-GPU memory by pipeline stage (GB = 10^9 bytes)",
        ["stage", "layers", "in flight", *parts, "total GiB"],
        [[s["stage"], s["layers"], s["in_flight"], *(f"{s[k] / 1e9:.2f}" for k in parts),
          f"{s['total'] / 2**30:.2f}"] for s in out["stages"]],
    ))
    worst = out["stages"][out["largest_stage"]]
    verdict = "[green]fits[/]" if out["fits"] else "[red]does not fit[/]"
    console.print(f"Largest stage {worst['stage']}: {gb(worst['total'])} ({gib(worst['total'])})"
                  f" — {verdict} in {gib(out['budget_bytes'])} ({out['headroom']:.0%} of "
                  f"{gib(out['memory_bytes'])} on {out['accelerator']}).")


def render_comm(out: dict[str, Any], console: Console) -> None:
    console.print(table(
        f"{out['op']} of {gb(out['size_bytes'])} on {out['ranks']} ranks over {out['link']} "
        f"({out['algorithm']})",
        ["quantity", "value"],
        [["ring rounds", out["rounds"]],
         ["bytes sent per rank", f"{out['bytes_sent_per_rank']:,.0f} B "
                                 f"({gb(out['bytes_sent_per_rank'])})"],
         ["time (α-β)", human_time(out["seconds"])],
         ["bus bandwidth", f"{out['bus_bandwidth'] / 1e9:.1f} GB/s"
          if out["bus_bandwidth"] else "-"]],
    ))


def render_schedule(out: dict[str, Any], ascii_grid: str, console: Console,
                    svg_path: str | None = None) -> None:
    console.print(ascii_grid, soft_wrap=True)
    closed = out["bubble_closed_form"]
    console.print(table(
        f"{out['schedule']}: {out['stages']} stages, {out['microbatches']} micro-batches, "
        f"{out['chunks']} chunk(s) per stage",
        ["quantity", "value"],
        [["actions", out["actions"]], ["makespan", f"{out['makespan']:g}"],
         ["bubble (simulated)", f"{out['bubble_fraction']:.4f}"],
         ["bubble (p-1)/(v·m+p-1)", "-" if closed is None else f"{closed:.4f}"],
         ["peak in flight per stage", " ".join(map(str, out["peak_in_flight"]))]]
        + ([["SVG", svg_path]] if svg_path else []),
    ))
