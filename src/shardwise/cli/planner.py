"""`shardwise plan`: search every layout and explain the best."""

from __future__ import annotations

from typing import Any

import click

from shardwise.arch import get_model
from shardwise.cli.common import (
    cluster_options,
    console,
    emit_json,
    goodput_options,
    gpu_option,
    json_option,
    layout_fields,
    pop_goodput_kw,
    precision_options,
    stack_options,
)
from shardwise.cli.group import cli
from shardwise.emit import FRAMEWORKS, framework_stack
from shardwise.emit.launchers import LAUNCHERS
from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import RANK_BY
from shardwise.estimate.goodput_sim import load_failure_model, measured_stragglers
from shardwise.report.builders import (
    emit_payload,
    plan_payload,
    run_plan,
    training_budget,
)
from shardwise.report.simulation import render_simulation, simulation_payload
from shardwise.validate import (
    MAX_SEQUENCES,
    finite,
    finite_result,
    fraction,
    positive_int,
)
from shardwise.validate import option as checked


# ---------------------------------------------------------------------------------------- plan
@cli.command(short_help="Search every layout and explain the best.")
@cluster_options(gpus=64)
@click.option("--intra", default=None, help="Intra-node link preset [default: the GPU's].")
@click.option("--inter", default=None, help="Inter-node link preset [default: the GPU's].")
@click.option("--seq", default=8192, show_default=True, help="Sequence length.",
              callback=checked(positive_int, high=MAX_SEQUENCES))
@click.option("--global-batch", default="4M-tokens", show_default=True,
              help="Sequences (1024) or tokens (16M-tokens).")
@click.option("--tokens", default=None, help="Training budget in tokens (15T) for time/cost.")
@click.option("--price", default=None, type=float, help="Price per GPU-hour (with --tokens).",
              callback=checked(finite, low=0))
@click.option("--top", default=10, show_default=True, type=click.IntRange(1, 1000),
              help="Layouts to show (each is simulated again; at most 1000).")
@click.option("--layout", "layout_text", default=None, callback=layout_fields,
              help="Evaluate this layout too, e.g. tp=8,pp=16,zero=1 (dp: the rest).")
@click.option("--partition", default=None,
              help="The --layout's layers per pipeline stage, first to last (7,8,…,8,7).")
@click.option("--first-stage-layers", default=None, type=click.IntRange(0),
              help="The --layout's first-stage layers, the rest even (Megatron's "
                   "--decoder-first-pipeline-num-layers).")
@click.option("--last-stage-layers", default=None, type=click.IntRange(0),
              help="The --layout's last-stage layers (--decoder-last-pipeline-num-layers).")
@click.option("--fix", "fix_text", default=None, callback=layout_fields,
              help="Search only layouts with these fields, e.g. tp=8,pp=4 (--layout syntax).")
@click.option("--max", "max_text", default=None, callback=layout_fields,
              help="Search only layouts with at most these counts, e.g. tp=8,pp=8.")
@click.option("--all-variants", is_flag=True,
              help="List layouts that differ only in ZeRO group size or stage partition as "
                   "rows of their own (by default folded into their best, '+N variants').")
@click.option("--emit", default=None, type=click.Choice(FRAMEWORKS),
              help="Print only the launch configuration of the chosen layout; searches that "
                   "framework's stack (megatron: megatron-te, torchtitan: torchtitan, "
                   "deepspeed: megatron-deepspeed) unless --impl names it.")
@click.option("--flash/--no-flash", default=True, show_default=True, help="FlashAttention.")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--grad-dtype", default=None, help="Gradient dtype [default: --dtype].")
@click.option("--optimizer", default="adam", show_default=True)
@stack_options
@precision_options(auto=True)
@click.option("--headroom", default=0.85, show_default=True, callback=checked(fraction),
              help="Usable fraction of GPU memory, in (0, 1].")
@click.option("--calibration", "calibration_path", default=None,
              type=click.Path(dir_okay=False), help="JSON file overriding efficiency constants.")
@click.option("--rank-by", default="step", show_default=True, type=click.Choice(RANK_BY),
              help="Rank by the step time, or by the effective step time with failures, "
                   "checkpoints and restarts (step ÷ goodput; docs/concepts/goodput.md).")
@click.option("--choose", default="simplest", show_default=True,
              type=click.Choice(["simplest", "fastest"]),
              help="The layout recommended (and exported) among the rows the model cannot "
                   "tell apart: the simplest, or the fastest (docs/howto/plan.md).")
@click.option("--wide", is_flag=True,
              help="Every column of the ranked table (the default fits 80 columns).")
@goodput_options
@click.option("--failure-model", "failure_model", type=click.Path(dir_okay=False),
              help="Simulate the chosen layout's run under this fleet's failures and compare "
                   "checkpoint policies (JSON: classes, spares, policy; "
                   "docs/concepts/goodput.md).")
@click.option("--simulate", "simulate", type=int, default=None,
              help="Runs per policy with --failure-model [default: 200].")
@click.option("--stragglers", "stragglers", type=click.Path(dir_okay=False),
              help="Slowest-rank cost from a `shardwise train --json` run's step times "
                   "(with --failure-model).")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default=None,
              help="With --emit: the job that runs it on the planned nodes (torchrun, a Slurm "
                   "sbatch script, a Kubeflow PyTorchJob, a SkyPilot task).")
@click.option("--image", default=None, help="Container image for --launcher k8s.")
@click.option("--job-name", default=None, help="Job name for --launcher [default: the model "
                                               "and layout].")
@click.option("--memory-budget", default="8GB", show_default=True,
              help="Refuse a search estimated to hold more memory than this (GB = 10^9), "
                   "naming a --fix/--max that fits.")
@json_option
def plan(model: str, gpus: int, gpu: str, clock_mhz: float | None, gpus_per_node: int,
         intra: str | None,
         inter: str | None, seq: int, global_batch: str, tokens: str | None,
         price: float | None, top: int, layout_text: str | None, partition: str | None,
         first_stage_layers: int | None, last_stage_layers: int | None, fix_text: str | None,
         max_text: str | None, all_variants: bool, emit: str | None,
         flash: bool, dtype: str, grad_dtype: str | None, optimizer: str, impl: str,
         headroom: float, calibration_path: str | None, rank_by: str, choose: str,
         wide: bool, as_json: bool, fp8: str | None, offload: str, offload_fraction: float,
         failure_model: str | None, simulate: int | None, stragglers: str | None,
         launcher: str | None, image: str | None, job_name: str | None,
         memory_budget: str, **stack_kw: Any) -> None:
    """Search every layout of MODEL (preset or config.json) and explain the best.

    With no arguments: llama3-8b on 64 H100s (8 nodes), s=8192, a 4M-token batch. Rows are
    ranked by the step time shown, or with --rank-by goodput by the effective step time;
    rows closer than the model resolves share a tier, and the simplest of the first (or the
    fastest, --choose fastest) is recommended and exported (docs/howto/plan.md); each row's
    goodput prices failures, checkpoints and restarts (docs/concepts/goodput.md).
    """
    from shardwise.budget import parse_budget
    from shardwise.report.plan_report import render_plan

    if (launcher or image or job_name) and not emit:
        raise ShardwiseError("--launcher, --image and --job-name need --emit FRAMEWORK")
    if emit:  # the search is bound to the framework's stack (issue 33)
        impl = _emit_stack(emit, impl)
    spec = get_model(model)
    if (simulate is not None or stragglers) and not failure_model:
        raise ShardwiseError("--simulate and --stragglers need --failure-model FILE")
    if failure_model:  # a bad file is refused before the search
        load_failure_model(failure_model, gpus)
        if stragglers:
            measured_stragglers(stragglers)
    simulation = {"failure_model": failure_model, "simulate": simulate,
                  "stragglers": stragglers}
    options: dict[str, Any] = {
        "gpus": gpus, "gpu": gpu_option(gpu, clock_mhz), "gpus_per_node": gpus_per_node,
        "intra": intra,
        "inter": inter, "seq": seq, "global_batch": global_batch, "tokens": tokens,
        "price": price, "top": top, "layout_text": layout_text, "flash": flash, "dtype": dtype,
        "grad_dtype": grad_dtype, "optimizer": optimizer, "headroom": headroom,
        "calibration_path": calibration_path, "impl": impl, "stack_kw": stack_kw,
        "partition": partition,
        "first_stage_layers": first_stage_layers, "last_stage_layers": last_stage_layers,
        "fix_text": fix_text, "max_text": max_text, "all_variants": all_variants,
        "fp8": fp8, "offload": offload, "offload_fraction": offload_fraction,
        "rank_by": rank_by, **pop_goodput_kw(stack_kw), "export": emit, "choose": choose,
        "memory_budget": parse_budget(memory_budget, "--memory-budget")}
    if console.is_terminal and not as_json and emit is None:
        with console.status("searching layouts…") as status:
            result = run_plan(spec, **options, progress=lambda msg: status.update(msg + "…"))
    else:
        result = run_plan(spec, **options)
    if emit:
        emitted = emit_payload(emit, result, launcher, image, job_name)
        if as_json:
            return emit_json(emitted)
        click.echo(emitted["script"] or emitted["config"], nl=False)
        for line in emitted["notes"]:
            click.echo(f"note: {line}", err=True)
        return None
    if as_json:
        return emit_json(plan_payload(result, tokens=tokens, price=price, **simulation))
    finite_result(result.to_dict(), "plan")
    budget = training_budget(tokens, price)
    render_plan(result, console, tokens=budget, price=price, wide=wide)
    if failure_model:
        render_simulation(simulation_payload(result, failure_model, runs=simulate,
                                             tokens=budget, stragglers=stragglers), console)
    return None


def _emit_stack(framework: str, impl: str) -> str:
    """The stack a `plan --emit FRAMEWORK` searches: the framework's, unless `--impl` names
    another (then one line, exit 2)."""
    stack = framework_stack(framework).name
    source = click.get_current_context().get_parameter_source("impl")
    if source is not click.core.ParameterSource.DEFAULT and impl != stack:
        raise ShardwiseError(f"--emit {framework} runs the {stack} stack, --impl {impl} another; "
                             f"drop --impl or use --impl {stack}")
    return stack

