"""Shared options and helpers of the `shardwise` commands: the console, `--json`, the option
groups (stack, precision, goodput, layout), `--gpu`, the runtime import, table cells."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any

import click
from rich.console import Console

from shardwise.arch import DEFAULT_MODEL
from shardwise.choices import MOMENT_DTYPES, OFFLOAD_MODULES, RECOMPUTE_MODULES
from shardwise.cuda_graph import CUDA_GRAPH_SCOPES
from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import (
    DEFAULT_CHECKPOINT_BANDWIDTH,
    DEFAULT_MTBF_GPU_HOURS,
    DEFAULT_RESTART_S,
)
from shardwise.estimate.profiles import DEFAULT_IMPL, profile_names
from shardwise.fp8 import recipe_names
from shardwise.layout import CP_KINDS, MOE_DISPATCHERS, MOE_OVERLAPS, RECOMPUTE, SCHEDULES
from shardwise.report.text import table as _table
from shardwise.stacks import (
    ATTENTION_KERNELS,
    DEFAULT_STACK,
    OFFLOADS,
    STACKS,
    TP_OVERLAPS,
    parse_impl,
)
from shardwise.validate import (
    MAX_DEGREE,
    MAX_SEQUENCES,
    degree,
    finite,
    finite_result,
    fraction,
    positive,
    positive_int,
)
from shardwise.validate import option as checked

# Wide tables when piped (rich would wrap at 80 columns) unless COLUMNS says otherwise.
console = Console(highlight=False,
                  width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)


def emit_json(payload: Any) -> None:
    def default(obj: Any) -> Any:
        if is_dataclass(obj):
            return asdict(obj)  # type: ignore[arg-type]
        raise TypeError(f"cannot serialise {type(obj).__name__}")

    finite_result(payload, "the result")  # never nan or inf as an answer
    click.echo(json.dumps(payload, indent=2, default=default, allow_nan=False))


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _stack_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    _, at, version = value.partition("@")
    if at and not version.strip():
        raise ShardwiseError(f"--impl {value}: the version after @ is empty; give name or "
                             f"name@version ({', '.join(STACKS)})")
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
    options += moe_comm_options()
    options += memory_setting_options()
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


MOE_COMM_KW = ("moe_dispatcher", "moe_overlap", "moe_dispatch_fp8", "moe_capacity", "comm_sms",
               "expert_load", "cuda_graph")


def moe_comm_options() -> list[Callable]:
    """The expert-parallel communication choices (`TrainSpec.moe_*`, `estimate.expert`;
    docs/concepts/communication.md)."""
    return [
        click.option("--moe-dispatcher", default=None, type=click.Choice(MOE_DISPATCHERS),
                     help="MoE token dispatcher (Megatron --moe-token-dispatcher-type; flex: "
                          "DeepEP) [default: the stack's first, alltoall]."),
        click.option("--moe-overlap", default="none", show_default=True,
                     type=click.Choice(MOE_OVERLAPS),
                     help="Overlap of the expert-parallel collectives: shared (Megatron "
                          "--moe-shared-expert-overlap), 1f1b (--overlap-moe-expert-parallel-"
                          "comm, DualPipe's pairs); charged the SMs they hold."),
        click.option("--moe-dispatch-fp8", is_flag=True, default=False,
                     help="FP8 dispatch, BF16 combine (DeepSeek-V3's recipe; flex only)."),
        click.option("--moe-capacity", default=None, type=float,
                     help="Expert capacity factor, padded to capacity [default: dropless]."),
        click.option("--comm-sms", default=None, type=int,
                     help="SMs the overlapped expert-parallel kernels hold [default: 20]."),
        click.option("--expert-load", default=1.0, show_default=True, type=float,
                     help="Router load imbalance: the busiest expert-parallel rank's routed "
                          "rows ÷ the balanced share (≥ 1; 1: balanced), in its GEMMs, "
                          "all-to-alls and activations; `shardwise check` measures it."),
        click.option("--cuda-graph-scope", "cuda_graph", default="",
                     help="megatron-te: scopes replayed as CUDA graphs (Megatron "
                          "--cuda-graph-impl transformer_engine --cuda-graph-scope), "
                          "comma-separated, from " + ", ".join(CUDA_GRAPH_SCOPES)
                          + "; their kernels then cost the host one launch [default: none]."),
    ]


MEMORY_SETTINGS = ("recompute_modules", "recompute_share", "exp_avg_dtype", "exp_avg_sq_dtype",
                   "main_params_dtype", "act_fp8_store", "mtp_layers", "offload_modules")


def memory_setting_options() -> list[Callable]:
    """Memory as Megatron-Core trains it (`TrainSpec.recompute_modules` …; megatron-core
    0.16.1 flags of the same names)."""
    return [
        click.option("--recompute-modules", default=None,
                     help="With --recompute selective (or recompute=selective in --layout): "
                          "the modules re-run in backward, comma-separated, from "
                          + ", ".join(RECOMPUTE_MODULES) + " [default: core_attn]."),
        click.option("--recompute-share", "recompute_share", default=1.0, show_default=True,
                     callback=checked(fraction),
                     help="With --recompute full (or recompute=full in --layout): the share "
                          "P in (0, 1] of the layers fully recomputed, the rest keeping every "
                          "activation (Megatron's --recompute-method block, torchtitan's "
                          "every n-th block; `TrainSpec.recompute_share`)."),
        click.option("--exp-avg-dtype", default=None, type=click.Choice(MOMENT_DTYPES),
                     help="Adam's first moment (Megatron's precision-aware optimizer) "
                          "[default: fp32]."),
        click.option("--exp-avg-sq-dtype", default=None, type=click.Choice(MOMENT_DTYPES),
                     help="Adam's second moment [default: fp32]."),
        click.option("--main-params-dtype", default=None, type=click.Choice(("fp32", "fp16")),
                     help="Master weights [default: fp32]."),
        click.option("--activation-func-fp8-input-store", "act_fp8_store", is_flag=True,
                     default=False, help="Keep the SwiGLU inputs in FP8 for backward."),
        click.option("--offload-modules", default="",
                     help="Fine-grained activation offloading (Megatron's "
                          "--fine-grained-activation-offloading): the modules whose inputs "
                          "move to host memory, comma-separated, from "
                          + ", ".join(OFFLOAD_MODULES) + "."),
        click.option("--mtp-num-layers", "mtp_layers", default=None,
                     type=click.IntRange(0, 16),
                     help="Multi-token prediction modules trained, on the head's stage "
                          "[default: the model's, num_nextn_predict_layers]."),
    ]


def pop_stack_kw(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop the stack's time choices, expert-parallel communication and memory settings
    (`stack_options`) out of a command's keyword arguments."""
    return {name: kw.pop(name) for name in ("compile", "tp_overlap", "dp_overlap", "attention",
                                            *MOE_COMM_KW, *MEMORY_SETTINGS) if name in kw}


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




# ----------------------------------------------------------------------------------- goodput
def mtbf_option(help_text: str) -> Callable:
    return click.option("--mtbf-gpu-hours", "mtbf_gpu_hours", default=None, type=float,
                        callback=checked(finite, low=0, low_open=True, high=1e12),
                        help=help_text)


def goodput_options(func: Callable) -> Callable:
    """What failures and checkpoints cost (`estimate.goodput`): per-GPU MTBF, each node's
    checkpoint bandwidth, the restart, asynchronous checkpoints. Unset: published figures."""
    options = [
        mtbf_option(f"GPU-hours between job-interrupting failures, per GPU [default: "
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


def every_steps(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    """`--checkpoint-every`: a step count ≥ 0 or "auto"."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if not text.isdigit():
        raise ShardwiseError(f"--checkpoint-every must be a whole number of steps ≥ 0 or auto, "
                             f"got {value!r}")
    return int(text)


def pop_goodput_kw(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop `goodput_options` out of a command's keyword arguments."""
    return {name: kw.pop(name) for name in ("mtbf_gpu_hours", "checkpoint_bandwidth",
                                            "restart_minutes", "async_checkpoint")}


# ----------------------------------------------------------------------------------- cluster
def cluster_options(gpus: int) -> Callable[[Callable], Callable]:
    """MODEL and the cluster a command plans for: --gpus (default `gpus`), --gpu, --clock-mhz,
    --gpus-per-node (shared by memory and plan)."""
    def decorate(func: Callable) -> Callable:
        options = [
            click.argument("model", default=DEFAULT_MODEL),
            click.option("--gpus", default=gpus, show_default=True, help="Number of GPUs.",
                         callback=checked(degree)),
            click.option("--gpu", default="h100", show_default=True,
                         help="Accelerator preset, an accelerator JSON FILE, or this-machine "
                              "(with --calibration FILE)."),
            click.option("--clock-mhz", default=None, type=float, callback=checked(positive),
                         help="Sustained SM clock: compute peaks × clock / boost clock."),
            click.option("--gpus-per-node", default=8, show_default=True,
                         callback=checked(degree)),
        ]
        for option in reversed(options):
            func = option(func)
        return func
    return decorate


# ------------------------------------------------------------------------------------ layout
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


def gpu_option(gpu: str, clock_mhz: float | None) -> Any:
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


def import_runtime(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "torch":
            raise ShardwiseError(
                "the runtime needs torch: pip install 'shardwise[torch]'") from None
        raise


def cell(value: Any) -> str:
    if isinstance(value, float):
        exact = value.is_integer() and abs(value) < 1e15
        return f"{value:,.0f}" if exact else f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return " ".join(cell(v) for v in value)
    return str(value)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    """A table with the union of the rows' keys as columns, in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    console.print(_table(title, columns, [[cell(row.get(c, "")) for c in columns]
                                          for row in rows]))



def need_matplotlib(option: str, path: str | None) -> None:
    """--plot needs matplotlib and a file name whose extension matplotlib writes (none: PNG,
    as `savefig` does): said before any work, not after it."""
    if path is None:
        return
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ShardwiseError(f"{option} needs matplotlib: pip install 'shardwise[plot]'"
                             ) from None
    formats = FigureCanvasBase.get_supported_filetypes()  # extension → description
    extension = os.path.splitext(path)[1][1:].lower()  # savefig reads the format so
    if extension and extension not in formats:
        raise ShardwiseError(f"{option} {path}: matplotlib cannot write .{extension} files; "
                             f"valid: {', '.join(sorted(formats))}")


def layout_fields(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`--layout`/`--fix`/`--max` text: refused in one line when an item is empty
    (`tp=8,,pp=2`, a trailing comma), which `Layout.parse_fields` would skip."""
    from shardwise.validate import layout_items

    return layout_items(value, param.opts[0])

