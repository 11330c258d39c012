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
    """A rich table: first column left-aligned, the others right-aligned; a cell too long for
    a narrow terminal folds onto the next line, never cut to "…"."""
    out = Table(title=title, title_justify="left", min_width=min(len(title) + 4, 100))
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        out.add_row(*(str(cell) for cell in row))
    return out


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    """Print `models_payload`'s rows as a table."""
    console.print(table(
        "Model presets (parameters: total / active)",
        ["model", "L", "h", "heads", "kv", "f", "V", "experts", "total", "active"],
        [[r["name"], r["layers"], r["hidden"], r["heads"], r["kv_heads"], r["ffn"], r["vocab"],
          f"{r['experts']}×top{r['top_k']}" if r["experts"] else "-",
          human_count(r["total_params"]), human_count(r["active_params"])] for r in rows],
    ))


def render_memory(out: dict[str, Any], console: Console) -> None:
    """Print `memory_payload`: per-stage memory, what a layer saves, whether it fits."""
    train = out["train"]
    kernel = "FlashAttention" if out["fused_attention"] else "materialised attention"
    console.print(f"[bold]{out['model']}[/] on {out['gpus']}× {out['accelerator']}, "
                  f"layout {out['layout_short']}, s={train['seq_len']}, {kernel}, "
                  + (f"activations of {out['profile_title']} (--impl {out['impl']})"
                     if out["formula"] == "generalised" else
                     f"{out['formula']} activation count"))
    parts = ("weights", "grads", "optimizer", *(("fp8",) if train.get("fp8") else ()),
             "activations", "logits", "workspace", "total")
    console.print(table(
        "Per-GPU memory by pipeline stage (GB = 10^9 bytes)",
        ["stage", "layers", "in flight", *parts, "total GiB", "peak", "peak from"],
        [[s["stage"], s["layers"], s["in_flight"], *(f"{s[k] / 1e9:.2f}" for k in parts),
          f"{s['total'] / 2**30:.2f}", f"{s['peak'] / 1e9:.2f}", s["peak_term"]]
         for s in out["stages"]],
    ))
    layer = out["layer_saved"]
    if layer["recompute"] != "full" and out["formula"] == "generalised":
        each = ", ".join(f"{name} {value / 2**20:,.0f}"
                         for name, value in layer["by_component"].items())
        kind = "MoE layer" if layer["moe"] else "layer"
        console.print(f"One {kind} saves {sum(layer['tensors'].values()) / 2**20:,.0f} MiB per "
                      f"micro-batch under --impl {layer['impl']}: {each} (MiB).")
    if train.get("fp8"):
        console.print(f"FP8 recipe {train['fp8']} ({out['impl']}): bf16 weights, gradients and "
                      "optimizer state as without it; fp8 = its held FP8 weight copies and "
                      "scaling state; linear inputs saved at its width "
                      "(docs/concepts/fp8-offload.md).")
    if train.get("offload", "none") != "none":
        console.print(f"Offloaded ({train['offload']}) to host memory: "
                      f"{gb(out['host_bytes_per_rank'])} per rank, "
                      f"{gb(out['host_bytes_per_node'])} per node of {out['gpus_per_node']} "
                      "GPUs (the largest stage's × GPUs per node).")
    worst = out["stages"][out["largest_stage"]]
    verdict = "[green]fits[/]" if out["fits"] else "[red]does not fit[/]"
    console.print(f"Largest stage {worst['stage']}: {gb(worst['total'])} ({gib(worst['total'])})"
                  f" — {verdict} in {gib(out['budget_bytes'])} ({out['headroom']:.0%} of "
                  f"{gib(out['memory_bytes'])} on {out['accelerator']}).")
    top = out["stages"][out["largest_peak_stage"]]
    console.print(f"Peak, stage {top['stage']}: {gb(top['peak'])} ({gib(top['peak'])}) — what it "
                  f"holds plus the {top['peak_transient'] or 'no'} transient; the largest term "
                  f"is {top['peak_term']}"
                  + ("" if top["peak"] <= out["budget_bytes"] else " — over the budget then")
                  + ". Modelled, not measured: the CPU allocator cannot report it; on a GPU "
                    "compare torch.cuda.max_memory_allocated (shardwise check).")
    if not out["fits"]:
        hints = out["fit_hints"]
        console.print("To make it fit, change one knob (the smallest change of each, least "
                      "disruptive first): " + ("; ".join(
                          f"{h['change']} → {h['short']}, {gib(h['total_bytes'])} "
                          f"({gib(h['margin_bytes'])} to spare)" for h in hints)
                          if hints else "no single change of ZeRO stage, recompute, tp or pp "
                                        "fits; try more GPUs (shardwise plan searches them)")
                      + ".")


def render_comm(out: dict[str, Any], console: Console) -> None:
    """Print `comm_payload`: rounds, bytes per rank, α-β time, bus bandwidth."""
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
    """Print the schedule's ASCII grid and `schedule_payload`'s figures (and write the SVG when
    asked)."""
    console.print(ascii_grid, soft_wrap=True)
    closed = out["bubble_closed_form"]
    times = f"t_f {out['t_f']:g}, t_b {out['t_b']:g}" + (
        f" (B {out['t_b'] - out['t_w']:g} + W {out['t_w']:g})" if out["t_w"] is not None else "")
    console.print(table(
        f"{out['schedule']}: {out['stages']} stages, {out['microbatches']} micro-batches, "
        f"{out['chunks']} chunk(s) per stage" + (" in a V" if out["placement"] == "v" else ""),
        ["quantity", "value"],
        [["actions", out["actions"]],
         ["times per stage and micro-batch", times],
         ["makespan", f"{out['makespan']:g}"],
         ["bubble (simulated)", f"{out['bubble_fraction']:.4f}"],
         ["bubble (closed form)", "-" if closed is None else f"{closed:.4f}"],
         ["peak micro-batches in flight per stage",
          " ".join(f"{n:g}" for n in out["peak_in_flight"])]]
        + ([["SVG", svg_path]] if svg_path else []),
    ))
