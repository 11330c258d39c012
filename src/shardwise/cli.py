"""`shardwise …` commands.

Every command takes `--json`. Bad input — an unknown model, a malformed number, a layout that
cannot run — prints one line on stderr and exits with code 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any

import click
from rich.console import Console

from shardwise.arch import DEFAULT_MODEL, get_model
from shardwise.emit import FRAMEWORKS, framework_stack
from shardwise.errors import ShardwiseError, one_line
from shardwise.estimate.comm import ALGORITHMS, OPS
from shardwise.estimate.goodput import (
    DEFAULT_CHECKPOINT_BANDWIDTH,
    DEFAULT_MTBF_GPU_HOURS,
    DEFAULT_RESTART_S,
    RANK_BY,
)
from shardwise.estimate.memory import ACTIVATION_FORMULAS
from shardwise.estimate.profiles import DEFAULT_IMPL, profile_names
from shardwise.files import save_output
from shardwise.fp8 import recipe_names
from shardwise.layout import CP_KINDS, RECOMPUTE, SCHEDULES
from shardwise.preflight import writable_file
from shardwise.report.builders import (
    build_layout,
    comm_payload,
    emit_payload,
    memory_payload,
    models_payload,
    plan_payload,
    run_plan,
    schedule_payload,
    schedule_svg,
    simulate_schedule,
    training_budget,
)
from shardwise.report.text import render_comm, render_memory, render_models, render_schedule
from shardwise.report.text import table as _table
from shardwise.stacks import (
    ATTENTION_KERNELS,
    DEFAULT_STACK,
    OFFLOADS,
    STACKS,
    TP_OVERLAPS,
    parse_impl,
)
from shardwise.units import human_time, parse_batch
from shardwise.validate import (
    MAX_DEGREE,
    MAX_FACTOR,
    MAX_SCHEDULE_ACTIONS,
    MAX_SEQUENCES,
    MAX_TIME,
    degree,
    duration,
    finite,
    finite_result,
    fraction,
    positive,
    positive_int,
    schedule_shape,
    seed,
)
from shardwise.validate import (
    option as checked,
)

# Wide tables when piped (rich would wrap at 80 columns) unless COLUMNS says otherwise.
console = Console(highlight=False,
                  width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)


def _emit_json(payload: Any) -> None:
    def default(obj: Any) -> Any:
        if is_dataclass(obj):
            return asdict(obj)  # type: ignore[arg-type]
        raise TypeError(f"cannot serialise {type(obj).__name__}")

    finite_result(payload, "the result")  # never nan or inf as an answer
    click.echo(json.dumps(payload, indent=2, default=default, allow_nan=False))


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _stack_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return parse_impl(value)
    except ShardwiseError as exc:
        raise click.BadParameter(str(exc)) from None


def stack_options(func: Callable) -> Callable:
    """`--impl` (the training stack) and the stack's time choices; each left unset takes the
    stack's own default (`shardwise.stacks`), named as assumed in the report."""
    options = [
        click.option("--impl", default=DEFAULT_STACK, show_default=True, callback=_stack_name,
                     help="Training stack (name or name@version): "
                          + ", ".join(STACKS) + ". Decides activations, step-time "
                          "behaviours, the layouts searched and the export."),
        click.option("--compile/--no-compile", "compile", default=None,
                     help="torch.compile, where the stack has the choice [default: the "
                          "stack's]."),
        click.option("--tp-overlap", default=None, type=click.Choice(TP_OVERLAPS),
                     help="TP communication: exposed, bulk (TE userbuffers, Megatron "
                          "--tp-comm-overlap) or async (torchtitan) [default: the stack's]."),
        click.option("--dp-overlap/--no-dp-overlap", "dp_overlap", default=None,
                     help="DP/ZeRO traffic behind backward/forward (Megatron "
                          "--overlap-grad-reduce/--overlap-param-gather, DeepSpeed "
                          "overlap_comm) [default: the stack's].")]
    options.append(click.option(
        "--attention", default=None, type=click.Choice([k for k in ATTENTION_KERNELS
                                                        if k != "math"]),
        help="Fused attention kernel [default: the stack's]; --no-flash for the "
             "materialised softmax."))
    for option in reversed(options):
        func = option(func)
    return func


def precision_options(auto: bool = False) -> Callable:
    """`--fp8 RECIPE` and `--offload KIND` (`--offload-fraction`): FP8 training and host
    offload as the stack runs them (docs/concepts/fp8-offload.md); `auto`: `--offload auto`
    lets the planner compare the stack's offloads."""
    kinds = [*OFFLOADS, *(["auto"] if auto else [])]

    def add(func: Callable) -> Callable:
        for option in reversed([
            click.option("--fp8", default=None, type=click.Choice(recipe_names()),
                         help="FP8 recipe, by its framework's name (megatron-te: delayed, "
                              "tensorwise, mxfp8, blockwise; torchtitan: rowwise, "
                              "rowwise_with_gw_hp, mxfp8): the linear layers' GEMMs in FP8 "
                              "beside bf16 weights."),
            click.option("--offload", default="none", show_default=True,
                         type=click.Choice(kinds),
                         help="Training state in host memory: the optimizer (its step on "
                              "the CPU) or every sharded state class (params, ZeRO-3)"
                              + ("; auto: the planner compares the stack's offloads" if auto
                                 else "") + "."),
            click.option("--offload-fraction", default=1.0, show_default=True,
                         callback=checked(fraction),
                         help="Share of the optimizer state offloaded (megatron-te's "
                              "--optimizer-offload-fraction).")]):
            func = option(func)
        return func
    return add


def _stack_kw(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop the stack's time choices (`stack_options`) out of a command's keyword arguments."""
    return {name: kw.pop(name) for name in ("compile", "tp_overlap", "dp_overlap", "attention")}


def impl_option(default: str = DEFAULT_IMPL) -> Callable:
    """`--impl`: whose code trains the model, i.e. which tensors a layer saves for backward
    (`estimate.profiles`)."""
    return click.option(
        "--impl", default=default, show_default=True, type=click.Choice(profile_names()),
        help="Activation profile: what this training code saves per layer — megatron-te "
             "(Megatron-Core + Transformer Engine: what most large pretraining runs use, the "
             "default), hf-sdpa (Hugging Face transformers with SDPA: fine-tuning; ~45 % more "
             "per Llama layer), hf-eager, torchtitan, shardwise (SPEC §3, this package's "
             "runtime).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="shardwise")
def cli() -> None:
    """Plan, simulate and run distributed training of Transformer language models."""


# ------------------------------------------------------------------------------------ models
@cli.command()
@json_option
def models(as_json: bool) -> None:
    """Presets with their parameter counts (total and active)."""
    rows = models_payload()
    if as_json:
        return _emit_json(rows)
    render_models(rows, console)


# ----------------------------------------------------------------------------------- goodput
def _mtbf_option(help_text: str) -> Callable:
    return click.option("--mtbf-gpu-hours", "mtbf_gpu_hours", default=None, type=float,
                        callback=checked(finite, low=0, low_open=True, high=1e12),
                        help=help_text)


def goodput_options(func: Callable) -> Callable:
    """What failures and checkpoints cost (`estimate.goodput`): per-GPU MTBF, each node's
    checkpoint bandwidth, the restart, asynchronous checkpoints. Unset: published figures."""
    options = [
        _mtbf_option(f"GPU-hours between job-interrupting failures, per GPU [default: "
                     f"{DEFAULT_MTBF_GPU_HOURS:,.0f}, Llama 3's 419 interruptions in 54 days "
                     "on 16,384 GPUs]."),
        click.option("--checkpoint-bandwidth", default=None,
                     help=f"Each node's write bandwidth to storage, e.g. 2GB/s [default: "
                          f"{DEFAULT_CHECKPOINT_BANDWIDTH / 1e9:.3g} GB/s, Llama 3's 2 TB/s "
                          "over 2,048 nodes]."),
        click.option("--restart-minutes", default=None, type=float,
                     callback=checked(finite, low=0, high=1e6),
                     help=f"Failure to training again: detect, reschedule, reload [default: "
                          f"{DEFAULT_RESTART_S / 60:g}]."),
        click.option("--async-checkpoint", is_flag=True,
                     help="Asynchronous checkpoints: only the device→host copy stalls training "
                          "(Megatron --async-save, torchtitan checkpoint.async_mode)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _every(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    """`--checkpoint-every`: a step count ≥ 0 or "auto"."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if not text.isdigit():
        raise ShardwiseError(f"--checkpoint-every must be a whole number of steps ≥ 0 or auto, "
                             f"got {value!r}")
    return int(text)


def _goodput_kw(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop `goodput_options` out of a command's keyword arguments."""
    return {name: kw.pop(name) for name in ("mtbf_gpu_hours", "checkpoint_bandwidth",
                                            "restart_minutes", "async_checkpoint")}


# ------------------------------------------------------------------------------------ memory
def layout_options(func: Callable) -> Callable:
    """The options that describe one layout (shared by memory, plan --layout, check…)."""
    options = [
        click.option("--tp", default=1, show_default=True, help="Tensor-parallel degree.",
                     callback=checked(degree)),
        click.option("--pp", default=1, show_default=True, help="Pipeline stages.",
                     callback=checked(degree)),
        click.option("--dp", default=None, type=int, callback=checked(degree),
                     help="Data-parallel degree [default: memory/plan: gpus / (tp·pp·cp); "
                          "train/check: 1]."),
        click.option("--cp", default=1, show_default=True, help="Context-parallel degree.",
                     callback=checked(degree)),
        click.option("--ep", default=1, show_default=True, help="Expert-parallel degree.",
                     callback=checked(degree)),
        click.option("--etp", default=0, show_default=True, type=click.IntRange(0, MAX_DEGREE),
                     help="Expert tensor-parallel degree: the routed experts split over etp "
                          "ranks instead of tp (0: tp, Megatron's default)."),
        click.option("--cp-kind", default="ring", show_default=True, type=click.Choice(CP_KINDS),
                     help="Context parallelism: ring attention, Ulysses (all-to-all over heads), "
                          "hybrid (Ulysses inside groups of --ulysses ranks, ring across) or "
                          "allgather (K and V all-gathered: torchtitan's)."),
        click.option("--ulysses", default=0, type=click.IntRange(0, MAX_DEGREE),
                     help="Hybrid cp: ranks of each all-to-all group (Megatron's first "
                          "--hierarchical-context-parallel-sizes)."),
        click.option("--zero", default=0, show_default=True, type=click.IntRange(0, 3),
                     help="ZeRO stage."),
        click.option("--zero-group", default=0, type=click.IntRange(0, MAX_DEGREE),
                     help="Hybrid shard group size (0: all dp)."),
        click.option("--sp", is_flag=True, help="Sequence parallelism (with tp > 1)."),
        click.option("--schedule", default="1f1b", show_default=True,
                     type=click.Choice(SCHEDULES)),
        click.option("--chunks", default=1, show_default=True, callback=checked(degree),
                     help="Virtual chunks per stage (interleaved: ≥ 2; zbv, dualpipev: 2)."),
        click.option("--recompute", default="none", show_default=True,
                     type=click.Choice(RECOMPUTE)),
        click.option("--partition", default=None,
                     help="Layers per pipeline stage, first to last (7,8,…,8,7) "
                          "[default: even, or balanced with embedding and head as one layer "
                          "each when pp does not divide the layers]."),
        click.option("--first-stage-layers", default=None, type=click.IntRange(0),
                     help="Layers on the first stage, the rest spread evenly (Megatron's "
                          "--decoder-first-pipeline-num-layers)."),
        click.option("--last-stage-layers", default=None, type=click.IntRange(0),
                     help="Layers on the last stage (Megatron's "
                          "--decoder-last-pipeline-num-layers)."),
        click.option("--mbs", "micro_batch", default=1, show_default=True,
                     callback=checked(positive_int, high=MAX_SEQUENCES),
                     help="Micro-batch size (sequences)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _gpu(gpu: str, clock_mhz: float | None) -> Any:
    """`--gpu` and `--clock-mhz` as the estimators take them: this-machine stays a name (its
    figures come from --calibration), anything else resolves here (`hardware.resolve_gpu`)."""
    from shardwise.calibration.machine import THIS_MACHINE
    from shardwise.hardware import resolve_gpu

    if gpu.lower() == THIS_MACHINE:
        if clock_mhz is not None:
            raise ShardwiseError("--clock-mhz does not apply to --gpu this-machine (its "
                                 "figures were measured)")
        return gpu
    return resolve_gpu(gpu, clock_mhz=clock_mhz, files=True)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--gpus", default=8, show_default=True, help="Number of GPUs.",
              callback=checked(degree))
@click.option("--gpu", default="h100", show_default=True,
              help="Accelerator preset, an accelerator JSON FILE, or this-machine (with "
                   "--calibration FILE).")
@click.option("--clock-mhz", default=None, type=float, callback=checked(positive),
              help="Sustained SM clock: compute peaks × clock / boost clock.")
@click.option("--gpus-per-node", default=8, show_default=True, callback=checked(degree))
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
    out = memory_payload(get_model(model), gpus=gpus, gpu=_gpu(gpu, clock_mhz),
                         gpus_per_node=gpus_per_node,
                         seq=seq, global_batch=global_batch, flash=flash, dtype=dtype,
                         grad_dtype=grad_dtype, optimizer=optimizer, formula=formula,
                         impl=impl, headroom=headroom, stack_kw=_stack_kw(layout_kw),
                         calibration_path=calibration_path, fp8=fp8, offload=offload,
                         offload_fraction=offload_fraction, **layout_kw)
    if as_json:
        return _emit_json(out)
    render_memory(out, console)


# -------------------------------------------------------------------------------------- comm
@cli.command()
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
        return _emit_json(out)
    render_comm(out, console)


# ---------------------------------------------------------------------------------- schedule
@cli.command()
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
        return _emit_json(out)
    render_schedule(out, render_ascii(timeline, width=width), console, svg_path)


# -------------------------------------------------------------------------------------- demo
# name -> (module, function, default ranks); each function returns rows (dicts) of checks.
DEMOS = {
    "ring": ("shardwise.demos.ring", "run_ring_demo", 4),
    "ddp": ("shardwise.demos.data_parallel", "run_ddp_demo", 2),
    "zero": ("shardwise.demos.data_parallel", "run_zero_demo", 2),
    "tp": ("shardwise.demos.tensor_parallel", "run_tp_demo", 2),
    "pipeline": ("shardwise.demos.pipeline", "run_pipeline_demo", 4),
    "ring-attention": ("shardwise.demos.context_parallel", "run_ring_attention_demo", 4),
    "ulysses": ("shardwise.demos.ulysses", "run_ulysses_demo", 2),
    "moe": ("shardwise.demos.expert_parallel", "run_moe_demo", 4),
}


def _import_runtime(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "torch":
            raise ShardwiseError(
                "the runtime needs torch: pip install 'shardwise[torch]'") from None
        raise


def _cell(value: Any) -> str:
    if isinstance(value, float):
        exact = value.is_integer() and abs(value) < 1e15
        return f"{value:,.0f}" if exact else f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return " ".join(_cell(v) for v in value)
    return str(value)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    """A table with the union of the rows' keys as columns, in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    console.print(_table(title, columns, [[_cell(row.get(c, "")) for c in columns]
                                          for row in rows]))


@cli.command()
@click.argument("name", type=click.Choice(list(DEMOS)))
@click.option("--ranks", default=None, type=click.IntRange(1, 64),
              help="Local CPU processes (gloo) [default depends on the demo].")
@click.option("--schedule", default=None, type=click.Choice(SCHEDULES),
              help="Pipeline schedule (pipeline demo).")
@json_option
def demo(name: str, ranks: int | None, schedule: str | None, as_json: bool) -> None:
    """Run a parallelism for real on local processes and check it against one device."""
    module, function, default_ranks = DEMOS[name]
    if schedule and name != "pipeline":
        raise ShardwiseError(f"--schedule applies to the pipeline demo only, not {name!r}")
    run = getattr(_import_runtime(module), function)
    kwargs = {"schedule": schedule} if schedule else {}
    result = run(ranks or default_ranks, **kwargs)
    payload = result if isinstance(result, dict) else {"rows": result}
    if as_json:
        return _emit_json(payload)
    for key, value in payload.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            print_rows(f"demo {name}: {'checks' if key == 'rows' else key}", value)
        elif isinstance(value, str) and "\n" in value:
            console.print(f"[bold]{key}[/]\n{value}", soft_wrap=True)
        else:
            console.print(f"{key}: {_cell(value)}")
    rows = [row for value in payload.values() if isinstance(value, list)
            for row in value if isinstance(row, dict)]
    if any(row.get("ok") is False for row in rows):
        raise ShardwiseError(f"demo {name}: some checks failed (ok = False above)")


# --------------------------------------------------------------------------------------- train
def run_options(func: Callable) -> Callable:
    """What to run on which layout, for the commands that run the runtime (train, check):
    --model, the layout options, --seq, --global-batch, --seed, --data, --dtype,
    --grad-dtype, --flash,
    --timeout, --capacity-factor, --aux-loss-coef (MoE)."""
    options = [
        click.option("--model", "model_name", default="tiny", show_default=True,
                     help="Preset or Hugging Face config.json (Llama-style)."),
        layout_options,
        click.option("--seq", default=64, show_default=True,
                     type=click.IntRange(1, MAX_SEQUENCES), help="Sequence length."),
        click.option("--global-batch", default="8", show_default=True,
                     help="Sequences per step (8) or tokens (512-tokens)."),
        click.option("--seed", default=0, show_default=True, callback=checked(seed),
                     help="Initialisation and data order."),
        click.option("--data", "data_path", default=None, type=click.Path(dir_okay=False),
                     help="Train on this text file [default: the built-in corpus]."),
        click.option("--dtype", default="fp32", show_default=True,
                     type=click.Choice(["fp32", "fp64", "bf16"]),
                     help="Weights and compute; bf16: mixed precision with fp32 master "
                          "weights and AdamW state."),
        click.option("--grad-dtype", default=None,
                     help="Gradient dtype (accumulated and reduced) [default: --dtype]."),
        click.option("--flash/--no-flash", default=True, show_default=True,
                     help="Recompute attention scores in backward (FlashAttention-style)."),
        click.option("--timeout", default=600.0, show_default=True,
                     callback=checked(positive, high=366 * 86400),
                     help="Seconds before a stuck or failed run is stopped."),
        click.option("--capacity-factor", "capacity_factor", default=None, type=float,
                     callback=checked(positive, high=MAX_FACTOR),
                     help="MoE: each expert takes at most ⌈cf·T·k/E⌉ of the T tokens of one "
                          "micro-batch on one rank; the rest are dropped [default: no limit]."),
        click.option("--aux-loss-coef", "aux_loss_coef", default=0.0, show_default=True,
                     callback=checked(finite, low=0),
                     help="MoE: weight of Switch's load-balancing loss per MoE layer."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _train_config(model_name: str, layout_kw: dict[str, Any], seq: int, global_batch: str,
                  seed: int, data_path: str | None, dtype: str, flash: bool,
                  grad_dtype: str | None = None, **settings: Any) -> Any:
    """The `runtime.train.TrainConfig` of `run_options` (--dp defaults to 1 here)."""
    rt = _import_runtime("shardwise.runtime.train")
    from shardwise.runtime.hf import hf_weight_files

    moe = {name: layout_kw.pop(name) for name in ("capacity_factor", "aux_loss_coef")}
    spec = get_model(model_name)
    layout = build_layout(1, spec.n_layers, **(layout_kw | {"dp": layout_kw["dp"] or 1}))
    if hf_weight_files(model_name):  # a Hugging Face checkpoint folder: start from its weights
        settings.setdefault("hf_weights", model_name)
    return rt.TrainConfig(spec, layout, seq_len=seq,
                          global_batch=parse_batch(global_batch, seq), seed=seed,
                          data=data_path, dtype=dtype, grad_dtype=grad_dtype, flash=flash,
                          **moe, **settings)


def _preflight(config: Any, **paths: dict[str, str | None]) -> None:
    """`shardwise.preflight.check_run` on the launching process (rank 0 under torchrun), and
    what only the runtime can check: the --data file, the Hugging Face weights (every tensor
    read once), and that --save-hf can describe the model."""
    from shardwise.files import regular_file
    from shardwise.preflight import check_run
    from shardwise.runtime.data import MAX_DATA_BYTES

    if os.environ.get("RANK", "0") == "0":
        config.validate()
        if config.data is not None:
            regular_file(config.data, "--data file", MAX_DATA_BYTES)
        if config.hf_weights:
            from shardwise.runtime.hf import check_hf_weights

            check_hf_weights(config.model, config.hf_weights)
        if config.save_hf:
            from shardwise.runtime.hf import hf_config

            hf_config(config.model)
        check_run(config.model, config.layout, config.seq_len, config.global_batch,
                  config.dtype, config.flash, local="RANK" not in os.environ, **paths)


def _need_matplotlib(option: str, path: str | None) -> None:
    """--plot needs matplotlib: said before any work, not after it."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ShardwiseError(f"{option} needs matplotlib: pip install 'shardwise[plot]'"
                             ) from None


def _setting_names(ctx: Any, param: Any, value: str | None) -> tuple[str, ...]:
    """`lr,min-lr` → ("lr", "min_lr"): TrainConfig's names (checked there)."""
    if value is None:
        return ()
    return tuple(name.strip().removeprefix("--").replace("-", "_")
                 for name in value.split(",") if name.strip())


def _on_ranks(run: Callable[[], Any]) -> Any:
    """`run()` launches the ranks; a rank that raised, died or hung becomes its message on
    one line (exit code 1), never a traceback."""
    from shardwise.runtime.launch import RankFailure

    try:
        return run()
    except RankFailure as exc:
        raise click.ClickException(str(exc).split("\n--- rank")[0]) from None


@cli.command()
@run_options
@click.option("--steps", default=20, show_default=True, type=click.IntRange(0),
              help="Optimizer steps (0: none; with --save-hf, a checkpoint round trip).")
@click.option("--save-hf", "save_hf", default=None, type=click.Path(file_okay=False),
              help="Write the trained model here as Hugging Face config.json + safetensors.")
@click.option("--lr", default=3e-3, show_default=True, help="Peak learning rate.",
              callback=checked(positive))
@click.option("--min-lr", default=3e-4, show_default=True, help="Final learning rate (cosine).",
              callback=checked(finite, low=0))
@click.option("--warmup", default=2, show_default=True, help="Warm-up steps.",
              type=click.IntRange(0))
@click.option("--weight-decay", default=0.1, show_default=True, callback=checked(finite, low=0))
@click.option("--clip", default=1.0, show_default=True, help="Max gradient norm (0: off).",
              callback=checked(finite, low=0))
@click.option("--log", "log_path", default=None, type=click.Path(dir_okay=False),
              help="Write one JSON line per step here (rank 0).")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a loss-curve PNG here.")
@click.option("--checkpoint-dir", "checkpoint_dir", default=None,
              type=click.Path(file_okay=False), help="Save sharded checkpoints here.")
@click.option("--checkpoint-every", default="0", show_default=True, callback=_every,
              help="Steps between checkpoints (0: only after the last step), or auto: Daly's "
                   "interval from the measured write time and --mtbf-gpu-hours, in steps "
                   "(docs/concepts/goodput.md).")
@_mtbf_option("With --checkpoint-every auto: GPU-hours between job-interrupting failures, per "
              "GPU [default: Llama 3's fleet figure].")
@click.option("--checkpoint-keep", default=2, show_default=True, type=click.IntRange(1),
              help="Newest checkpoints kept.")
@click.option("--resume", is_flag=True,
              help="Continue from the newest checkpoint in --checkpoint-dir, on any layout "
                   "(from step 0 when there is none yet).")
@click.option("--override", default=None, callback=_setting_names,
              help="With --resume: the optimizer settings this run changes from the "
                   "checkpoint's for the steps it already took, e.g. lr,warmup (of lr, min-lr, "
                   "warmup, steps, weight-decay, clip); a change not named is refused.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@json_option
def train(model_name: str, steps: int, seq: int, global_batch: str, lr: float, min_lr: float,
          warmup: int, weight_decay: float, clip: float, seed: int, data_path: str | None,
          dtype: str, grad_dtype: str | None, flash: bool, log_path: str | None,
          plot_path: str | None, timeout: float,
          checkpoint_dir: str | None, checkpoint_every: int | str, checkpoint_keep: int,
          mtbf_gpu_hours: float | None, resume: bool, override: tuple[str, ...], quiet: bool,
          as_json: bool, save_hf: str | None, **layout_kw: Any) -> None:
    """Train --model for real on dp·tp·pp·cp local CPU ranks (gloo), or on the ranks torchrun
    started (`torchrun … -m shardwise train --dp 2 …`; NCCL on GPUs). The loss curve
    equals one device's on the same data; --dp defaults to 1 here. A --model folder with
    config.json and safetensors weights starts from those weights."""
    rt = _import_runtime("shardwise.runtime.train")
    from shardwise.runtime.checkpoint import check_start
    from shardwise.runtime.launch import rank

    config = _train_config(
        model_name, layout_kw, seq, global_batch, seed, data_path, dtype, flash,
        grad_dtype=grad_dtype, steps=steps,
        lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
        log_path=log_path, progress=not quiet, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume,
        mtbf_gpu_hours=mtbf_gpu_hours,
        save_hf=save_hf, override=override)
    layout = config.layout
    _need_matplotlib("--plot", plot_path)
    _preflight(config, files={"--plot": plot_path, "--log": log_path},
               directories={"--checkpoint-dir": checkpoint_dir, "--save-hf": save_hf})
    if resume and os.environ.get("RANK", "0") == "0":
        start = check_start(config.validate(),
                            report=lambda line: click.echo(f"warning: {line}", err=True))
        click.echo(f"note: resuming from {start}" if start else
                   f"note: no checkpoint in {checkpoint_dir} yet; starting from step 0", err=True)
    records = _on_ranks(lambda: rt.run(config, timeout_s=timeout))
    if rank() != 0:
        return None
    title = f"{config.model.name}, {layout.short()}, {layout.world_size} rank(s)"
    if plot_path:
        save_output(plot_path, lambda path: rt.plot_losses(records, str(path), title),
                    "--plot")
    if as_json:
        return _emit_json({"model": config.model.name, "layout": layout.to_dict(),
                           "ranks": layout.world_size,
                           "records": [r.as_dict() for r in records]})
    if not records:
        click.echo(f"no steps trained{'; saved ' + save_hf if save_hf else ''}")
        return None
    tail = records[len(records) // 2:]
    seconds = sum(r.seconds for r in tail)
    rows = [["loss first → last", f"{records[0].loss:.4f} → {records[-1].loss:.4f}"],
            ["tokens/s (second half)", f"{sum(r.tokens for r in tail) / seconds:,.0f}"],
            ["step time (second half)", human_time(seconds / len(tail))]]
    saves = [r for r in records if r.checkpoint_seconds is not None]
    if saves:
        rows.append(["checkpoints saved", f"{len(saves)}, {_cell(saves[-1].checkpoint_bytes)} "
                     f"bytes of tensors each, written in "
                     f"{human_time(sum(r.checkpoint_seconds or 0 for r in saves) / len(saves))} "
                     "on average"])
    chosen = [r.checkpoint_every for r in records if r.checkpoint_every is not None]
    if chosen:
        every = "every step" if chosen[-1] == 1 else f"every {chosen[-1]:,} steps"
        rows.append(["checkpoint interval (auto)", f"{every} (Daly's, from the measured write "
                     "and step times)"])
    rows += [["loss curve", plot_path]] if plot_path else []
    rows += [["log", log_path]] if log_path else []
    console.print(_table(title, ["quantity", "value"], rows))
    return None


# --------------------------------------------------------------------------------------- check
def _error_cell(row: Any) -> str:
    error = row.error
    if error is None:
        return "-"
    return "0" if error == 0 else f"{error:+.3%}"


@cli.command()
@run_options
@click.option("--steps", default=2, show_default=True, type=click.IntRange(1),
              help="Training steps to measure.")
@click.option("--per-rank", is_flag=True,
              help="One row per rank [default: per pipeline stage, the rank with the largest "
                   "error].")
@impl_option("shardwise")
@click.option("--calibration", "calibration_path", default=None,
              type=click.Path(dir_okay=False),
              help="Predict the step time with this file from `shardwise calibrate`, and "
                   "again with its collectives' and host's costs re-timed beside the run "
                   "(a one-rank reference step between its timed steps) [default: the built-in "
                   "constants, which have no figures for a CPU].")
@json_option
def check(model_name: str, seq: int, global_batch: str, seed: int, data_path: str | None,
          dtype: str, grad_dtype: str | None, flash: bool, timeout: float, steps: int,
          per_rank: bool, impl: str,
          calibration_path: str | None, as_json: bool, **layout_kw: Any) -> None:
    """Predicted versus measured (SPEC §9): train --model for a few steps on the layout, as
    `shardwise train` does, and compare what the ranks really sent and kept with the analytic
    model: the payload per mesh axis and collective (target: exact) and, on gloo, the bytes its
    TCP connections carried (reported; else "assumed (ring)"), bytes each layer saves for
    backward (within 1 %), parameters, gradients and optimizer state per rank (exact), peak GPU
    memory (reported). docs/howto/check.md says what is measured and what assumed. Exit code 0
    when every target is met, 1 otherwise."""
    measure = _import_runtime("shardwise.runtime.measure")
    from shardwise.runtime.launch import rank

    config = _train_config(model_name, layout_kw, seq, global_batch, seed, data_path, dtype,
                           flash, grad_dtype=grad_dtype, steps=steps)
    layout = config.layout
    if calibration_path is not None:
        from shardwise.calibration.machine import read_machine

        read_machine(calibration_path)  # a bad file: one line, exit 2, before any rank runs
    _preflight(config)
    rows = _on_ranks(lambda: measure.run_check(config, steps, timeout_s=timeout,
                                               per_rank=per_rank, impl=impl,
                                               reference=calibration_path is not None))
    step_time = _import_runtime("shardwise.runtime.step_time")
    rows = step_time.with_prediction(rows, config, calibration_path)
    missed = [row for row in rows if not row.ok]
    if rank() == 0 and as_json:
        _emit_json({"model": config.model.name, "layout": layout.to_dict(),
                    "ranks": layout.world_size, "steps": steps, "ok": not missed,
                    "activation_profile": impl,
                    "calibration": calibration_path or "built-in",
                    "rows": [row.as_dict() for row in rows]})
    elif rank() == 0:
        where = "rank" if per_rank else "worst of"
        console.print(_table(
            f"{config.model.name}, {layout.short()}, {layout.world_size} rank(s), {dtype}: "
            f"predicted vs measured over {steps} step(s) (bytes; comm per step, activations "
            f"per micro-batch against the {impl} profile"
            + (", which the runtime implements exactly)" if impl == "shardwise" else
               "; the runtime implements shardwise)"),
            ["stage", where, "item", "what", "predicted", "measured", "error", "target", "ok",
             "note"],
            [[row.stage, row.rank if per_rank else f"{row.ranks} ranks", row.item, row.what,
              "-" if row.predicted is None else _cell(row.predicted),
              "-" if row.measured is None else _cell(row.measured), _error_cell(row),
              row.target, "-" if row.target == "-" else "yes" if row.ok else "NO", row.note]
             for row in rows]))
        if not missed:
            console.print(f"All {len(rows)} rows meet their targets.")
    if missed:  # exit code 1, one line on stderr
        raise click.ClickException(f"{len(missed)} of {len(rows)} rows miss their target "
                                   "(see the notes)")


# ----------------------------------------------------------------------------------- calibrate
@cli.command()
@click.option("--backend", default="gloo", show_default=True, type=click.Choice(["gloo", "nccl"]))
@click.option("--ranks", default=2, show_default=True, type=click.IntRange(2, 64),
              help="Ranks for the collectives (group sizes 2, 4, … up to it).")
@click.option("--out", "out_path", default="calibration.json", show_default=True,
              type=click.Path(dir_okay=False), help="Write the calibration file here.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Draw measured points against the fitted curves (PNG).")
@click.option("--quick", is_flag=True, help="Fewer shapes and sizes: seconds, not two minutes.")
@json_option
def calibrate(backend: str, ranks: int, out_path: str, plot_path: str | None, quick: bool,
              as_json: bool) -> None:
    """Measure this machine (GEMMs, memory-bound kernels, attention, training steps,
    collectives) and fit the step-time model's constants; the file it writes works with
    `--calibration FILE` (plan, memory, comm, check) and `--gpu this-machine`."""
    writable_file(out_path, "--out")  # before minutes of measuring, not after
    writable_file(plot_path, "--plot")
    _need_matplotlib("--plot", plot_path)
    rt = _import_runtime("shardwise.runtime.calibrate")
    plan = rt.Plan(backend, ranks, quick).validate()
    if console.is_terminal and not as_json:
        with console.status("calibrating…") as status:
            data = rt.calibrate(plan, progress=lambda msg: status.update(msg + "…"))
    else:
        data = rt.calibrate(plan, progress=lambda msg: click.echo(f"calibrate: {msg}",
                                                                  err=True))
    text = json.dumps(finite_result(data, "the calibration"), indent=1, allow_nan=False)
    save_output(out_path, lambda path: path.write_text(text, encoding="utf-8"), "--out")
    if plot_path:
        save_output(plot_path, lambda path: rt.plot_calibration(data, str(path)), "--plot")
    if as_json:
        return _emit_json(data | {"path": out_path})
    console.print(_table(f"{backend}, {ranks} ranks: fitted constants (residuals: relative, "
                         "rms / max)", ["quantity", "value", "fit residual"],
                         rt.summary_rows(data)))
    console.print(f"Wrote {out_path}" + (f" and {plot_path}" if plot_path else "")
                  + f". Plan for this machine: shardwise plan tiny --gpus {ranks} "
                  f"--gpu this-machine --calibration {out_path}")
    return None


# ---------------------------------------------------------------------------------------- plan
@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--gpus", default=64, show_default=True, help="Number of GPUs.",
              callback=checked(degree))
@click.option("--gpu", default="h100", show_default=True,
              help="Accelerator preset, an accelerator JSON FILE, or this-machine (with "
                   "--calibration FILE).")
@click.option("--clock-mhz", default=None, type=float, callback=checked(positive),
              help="Sustained SM clock: compute peaks × clock / boost clock.")
@click.option("--gpus-per-node", default=8, show_default=True, callback=checked(degree))
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
@click.option("--layout", "layout_text", default=None,
              help="Evaluate this layout too, e.g. tp=8,pp=16,zero=1 (dp: the rest).")
@click.option("--partition", default=None,
              help="The --layout's layers per pipeline stage, first to last (7,8,…,8,7).")
@click.option("--first-stage-layers", default=None, type=click.IntRange(0),
              help="The --layout's first-stage layers, the rest even (Megatron's "
                   "--decoder-first-pipeline-num-layers).")
@click.option("--last-stage-layers", default=None, type=click.IntRange(0),
              help="The --layout's last-stage layers (--decoder-last-pipeline-num-layers).")
@click.option("--fix", "fix_text", default=None,
              help="Search only layouts with these fields, e.g. tp=8,pp=4 (--layout syntax).")
@click.option("--max", "max_text", default=None,
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
@goodput_options
@json_option
def plan(model: str, gpus: int, gpu: str, clock_mhz: float | None, gpus_per_node: int,
         intra: str | None,
         inter: str | None, seq: int, global_batch: str, tokens: str | None,
         price: float | None, top: int, layout_text: str | None, partition: str | None,
         first_stage_layers: int | None, last_stage_layers: int | None, fix_text: str | None,
         max_text: str | None, all_variants: bool, emit: str | None,
         flash: bool, dtype: str, grad_dtype: str | None, optimizer: str, impl: str,
         headroom: float, calibration_path: str | None, rank_by: str, as_json: bool,
         fp8: str | None, offload: str, offload_fraction: float, **stack_kw: Any) -> None:
    """Search every layout of MODEL (preset or config.json) and explain the best.

    With no arguments: llama3-8b on 64 H100s (8 nodes), s=8192, a 4M-token batch. Rows are
    ranked by the step time shown, or with --rank-by goodput by the effective step time
    (ties: the simpler layout; docs/howto/plan.md); each row's goodput prices failures,
    checkpoints and restarts (docs/concepts/goodput.md).
    """
    from shardwise.report.plan_report import render_plan

    if emit:  # the search is bound to the framework's stack (issue 33)
        impl = _emit_stack(emit, impl)
    spec = get_model(model)
    options: dict[str, Any] = {
        "gpus": gpus, "gpu": _gpu(gpu, clock_mhz), "gpus_per_node": gpus_per_node,
        "intra": intra,
        "inter": inter, "seq": seq, "global_batch": global_batch, "tokens": tokens,
        "price": price, "top": top, "layout_text": layout_text, "flash": flash, "dtype": dtype,
        "grad_dtype": grad_dtype, "optimizer": optimizer, "headroom": headroom,
        "calibration_path": calibration_path, "impl": impl, "stack_kw": stack_kw,
        "partition": partition,
        "first_stage_layers": first_stage_layers, "last_stage_layers": last_stage_layers,
        "fix_text": fix_text, "max_text": max_text, "all_variants": all_variants,
        "fp8": fp8, "offload": offload, "offload_fraction": offload_fraction,
        "rank_by": rank_by, **_goodput_kw(stack_kw), "export": emit}
    if console.is_terminal and not as_json and emit is None:
        with console.status("searching layouts…") as status:
            result = run_plan(spec, **options, progress=lambda msg: status.update(msg + "…"))
    else:
        result = run_plan(spec, **options)
    if emit:
        emitted = emit_payload(emit, result)
        if as_json:
            return _emit_json(emitted)
        click.echo(emitted["config"], nl=False)
        for line in emitted["notes"]:
            click.echo(f"note: {line}", err=True)
        return None
    if as_json:
        return _emit_json(plan_payload(result, tokens=tokens, price=price))
    finite_result(result.to_dict(), "plan")
    render_plan(result, console, tokens=training_budget(tokens, price), price=price)
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


# ------------------------------------------------------------------------------------------ ui
@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to serve on (anything but loopback is reachable from the network).")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: any free one).")
@click.option("--no-browser", is_flag=True, help="Do not open a browser.")
def ui(host: str, port: int, no_browser: bool) -> None:
    """The web app: planner, memory and schedule tools and the explainers (needs the ui
    extra: pip install 'shardwise[ui]'). Ctrl-C stops it."""
    from shardwise.web.serve import serve

    serve(host, port, open_browser=not no_browser)


# ------------------------------------------------------------------------------------- entry
def main(argv: list[str] | None = None) -> None:
    """Console entry point: one line and exit 2 on bad input, never a traceback."""
    try:
        cli.main(args=argv, prog_name="shardwise", standalone_mode=False)
    except ShardwiseError as exc:
        click.echo(f"error: {one_line(exc)}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:  # `shardwise` alone: the help, no error
        click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
        sys.exit(0)
    except click.ClickException as exc:
        click.echo(f"error: {one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
