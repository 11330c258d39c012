"""`shardwise models`, `memory`, `comm` and `schedule`: the analytic tools."""

from __future__ import annotations

from typing import Any

import click

from shardwise.arch import get_model
from shardwise.cli.common import (
    cluster_options,
    console,
    emit_json,
    gpu_option,
    json_option,
    layout_options,
    pop_stack_kw,
    precision_options,
    stack_options,
)
from shardwise.cli.group import cli
from shardwise.estimate.comm import ALGORITHMS, OPS
from shardwise.estimate.memory import ACTIVATION_FORMULAS
from shardwise.files import save_output
from shardwise.layout import SCHEDULES
from shardwise.preflight import writable_file
from shardwise.report.builders import (
    comm_payload,
    memory_payload,
    models_payload,
    schedule_payload,
    schedule_svg,
    simulate_schedule,
)
from shardwise.report.text import render_comm, render_memory, render_models, render_schedule
from shardwise.validate import (
    MAX_DEGREE,
    MAX_SCHEDULE_ACTIONS,
    MAX_SEQUENCES,
    MAX_TIME,
    degree,
    duration,
    finite,
    fraction,
    positive_int,
    schedule_shape,
)
from shardwise.validate import option as checked


# ------------------------------------------------------------------------------------ models
@cli.command(short_help="List the presets and their parameter counts.")
@json_option
def models(as_json: bool) -> None:
    """Presets with their parameter counts (total and active)."""
    rows = models_payload()
    if as_json:
        return emit_json(rows)
    render_models(rows, console)



@cli.command(short_help="Show one layout's memory per GPU, by stage.")
@cluster_options(gpus=8)
@layout_options
@click.option("--seq", default=8192, show_default=True, help="Sequence length.",
              callback=checked(positive_int, high=MAX_SEQUENCES))
@click.option("--global-batch", default=None, help="Sequences (1024) or tokens (16M-tokens).")
@click.option("--flash/--no-flash", default=True, show_default=True, help="FlashAttention.")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--grad-dtype", default=None, help="Gradient dtype [default: --dtype].")
@click.option("--optimizer", default="adam", show_default=True)
@click.option("--formula", default="generalised", show_default=True,
              type=click.Choice(ACTIVATION_FORMULAS), help="Activation count.")
@stack_options
@precision_options()
@click.option("--headroom", default=0.85, show_default=True, callback=checked(fraction),
              help="Usable fraction of GPU memory, in (0, 1].")
@click.option("--calibration", "calibration_path", default=None,
              type=click.Path(dir_okay=False),
              help="A `shardwise calibrate` file (with --gpu this-machine).")
@json_option
def memory(model: str, gpus: int, gpu: str, clock_mhz: float | None, gpus_per_node: int,
           seq: int,
           global_batch: str | None, flash: bool, dtype: str, grad_dtype: str | None,
           optimizer: str, formula: str, impl: str, headroom: float,
           calibration_path: str | None, as_json: bool, fp8: str | None, offload: str,
           offload_fraction: float, **layout_kw: Any) -> None:
    """Per-GPU training memory of MODEL (preset or config.json), stage by stage."""
    out = memory_payload(get_model(model), gpus=gpus, gpu=gpu_option(gpu, clock_mhz),
                         gpus_per_node=gpus_per_node,
                         seq=seq, global_batch=global_batch, flash=flash, dtype=dtype,
                         grad_dtype=grad_dtype, optimizer=optimizer, formula=formula,
                         impl=impl, headroom=headroom, stack_kw=pop_stack_kw(layout_kw),
                         calibration_path=calibration_path, fp8=fp8, offload=offload,
                         offload_fraction=offload_fraction, **layout_kw)
    if as_json:
        return emit_json(out)
    render_memory(out, console)


# -------------------------------------------------------------------------------------- comm
@cli.command(short_help="Time one collective and count its bytes.")
@click.option("--op", default="all-reduce", show_default=True,
              type=click.Choice(OPS))
@click.option("--size", default="1GB", show_default=True, help="Tensor size, e.g. 13.5GB.")
@click.option("--ranks", default=8, show_default=True, type=click.IntRange(1, MAX_DEGREE))
@click.option("--link", default="nvlink4", show_default=True, help="Link preset.")
@click.option("--algorithm", default="ring", show_default=True,
              type=click.Choice(ALGORITHMS))
@click.option("--nodes", default=1, show_default=True, help="Nodes (hierarchical).",
              callback=checked(degree))
@click.option("--inter", default="ndr", show_default=True, help="Inter-node link (hierarchical).")
@click.option("--calibration", "calibration_path", default=None,
              type=click.Path(dir_okay=False),
              help="A `shardwise calibrate` file: --link this-machine is its measured link.")
@json_option
def comm(op: str, size: str, ranks: int, link: str, algorithm: str, nodes: int, inter: str,
         calibration_path: str | None, as_json: bool) -> None:
    """Bytes on the wire and alpha-beta time of one collective."""
    out = comm_payload(op=op, size=size, ranks=ranks, link=link, algorithm=algorithm,
                       nodes=nodes, inter=inter, calibration_path=calibration_path)
    if as_json:
        return emit_json(out)
    render_comm(out, console)


# ---------------------------------------------------------------------------------- schedule
@cli.command(short_help="Simulate and draw a pipeline schedule.")
@click.option("--stages", "-p", default=4, show_default=True,
              type=click.IntRange(1, MAX_SCHEDULE_ACTIONS))
@click.option("--microbatches", "-m", default=8, show_default=True,
              type=click.IntRange(1, MAX_SCHEDULE_ACTIONS))
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(SCHEDULES))
@click.option("--chunks", "-v", default=None, type=click.IntRange(1, MAX_SCHEDULE_ACTIONS),
              help="Chunks per stage [default: the schedule's own: 2 for interleaved, zbv and "
                   "dualpipev, else 1].")
@click.option("--tf", "t_f", default=1.0, show_default=True, callback=checked(duration),
              help="Forward time of one micro-batch on one stage (all its chunks: a chunk "
                   "takes 1/v of it).")
@click.option("--tb", "t_b", default=1.0, show_default=True, callback=checked(duration),
              help="Whole backward time of one micro-batch on one stage (input and weight "
                   "gradients, all chunks).")
@click.option("--tw", "t_w", default=None, type=float, callback=checked(duration),
              help="The weight-gradient part of --tb, for schedules that split the backward "
                   "into B and W (zb-h1, zbv, dualpipev) [default: half of --tb].")
@click.option("--p2p", "p2p_latency", default=0.0, show_default=True,
              callback=checked(finite, low=0, high=MAX_TIME),
              help="Latency between stages.")
@click.option("--svg", "svg_path", type=click.Path(dir_okay=False, writable=True),
              help="Write an SVG Gantt chart here.")
@click.option("--width", default=160, show_default=True, type=click.IntRange(1, 10**6),
              help="Cut ASCII rows at this width.")
@json_option
def schedule(stages: int, microbatches: int, schedule: str, chunks: int | None, t_f: float,
             t_b: float, t_w: float | None, p2p_latency: float, svg_path: str | None,
             width: int, as_json: bool) -> None:
    """Generate, simulate and draw a pipeline schedule (times per stage: every schedule does
    the same work)."""
    from shardwise.schedules import get_schedule, render_ascii

    schedule_shape(stages, microbatches, chunks or get_schedule(schedule).default_chunks,
                   limit=MAX_SCHEDULE_ACTIONS)
    writable_file(svg_path, "--svg")
    args: dict[str, Any] = {"stages": stages, "microbatches": microbatches,
                            "schedule": schedule, "chunks": chunks, "t_f": t_f, "t_b": t_b,
                            "t_w": t_w, "p2p_latency": p2p_latency}
    timeline = simulate_schedule(**args)
    out = schedule_payload(timeline, **args)
    if svg_path:
        svg = schedule_svg(timeline, out)
        save_output(svg_path, lambda path: path.write_text(svg, encoding="utf-8"), "--svg")
    if as_json:
        return emit_json(out)
    render_schedule(out, render_ascii(timeline, width=width), console, svg_path)

