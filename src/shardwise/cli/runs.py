"""`shardwise train` and `shardwise check`: the runtime on local ranks or under torchrun."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import click

from shardwise.arch import get_model
from shardwise.cli.common import (
    cell,
    console,
    emit_json,
    every_steps,
    impl_option,
    import_runtime,
    json_option,
    layout_options,
    mtbf_option,
    need_matplotlib,
)
from shardwise.cli.group import cli
from shardwise.cli.run_jobs import ArgvCommand, launcher_options
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.files import regular_file, save_output
from shardwise.layout import TrainSpec
from shardwise.preflight import check_run
from shardwise.report.builders import build_layout
from shardwise.report.text import table as _table
from shardwise.units import human_time, parse_batch
from shardwise.validate import (
    MAX_FACTOR,
    MAX_SEQUENCES,
    finite,
    positive,
    seed,
)
from shardwise.validate import option as checked


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


class _Run(NamedTuple):
    """The run's arguments as read and checked before torch is imported."""

    spec: Any
    layout: Any
    global_batch: int
    moe: dict[str, Any]


def _check_arguments(model_name: str, layout_kw: dict[str, Any], seq: int, global_batch: str,
                     dtype: str, grad_dtype: str | None, flash: bool, data_path: str | None,
                     here: bool = True, **paths: dict[str, str | None]) -> _Run:
    """Every check of `run_options` that needs no torch, before the runtime is imported (2–3
    s): the model, the layout on it (`Layout.problems` for the shardwise stack), the batch,
    the --data file's kind, and on the launching process (rank 0 under torchrun)
    `preflight.check_run` (output paths, the sequence, this machine's memory). Not `here` (a
    --launcher job runs elsewhere): only the model, layout, batch and sequence. The runtime's
    own checks (`TrainConfig.validate`) follow in `_train_config`."""
    moe = {name: layout_kw.pop(name) for name in ("capacity_factor", "aux_loss_coef")}
    spec = get_model(model_name)
    layout = build_layout(1, spec.n_layers, **(layout_kw | {"dp": layout_kw["dp"] or 1}))
    batch = parse_batch(global_batch, seq)
    train = TrainSpec(seq_len=seq, global_batch=batch, dtype=dtype, grad_dtype=grad_dtype,
                      flash_attention=flash, impl="shardwise")  # `TrainConfig.train_spec`
    problems = layout.problems(spec, train=train)
    if problems:
        raise LayoutError(problems)
    if not here:
        check_run(spec, layout, seq, batch, dtype, flash, local=False)
        return _Run(spec, layout, batch, moe)
    if data_path is not None:
        regular_file(data_path, "--data file", math.inf)  # its size: `_preflight`
    if os.environ.get("RANK", "0") == "0":
        check_run(spec, layout, seq, batch, dtype, flash, local="RANK" not in os.environ,
                  **paths)
    return _Run(spec, layout, batch, moe)


def _train_config(run: _Run, model_name: str, seq: int, seed: int, data_path: str | None,
                  dtype: str, flash: bool, grad_dtype: str | None = None,
                  **settings: Any) -> Any:
    """The `runtime.train.TrainConfig` of `run_options` (--dp defaults to 1 here), checked
    (`_preflight`): imports torch."""
    rt = import_runtime("shardwise.runtime.train")
    from shardwise.runtime.hf import hf_weight_files

    if hf_weight_files(model_name):  # a Hugging Face checkpoint folder: start from its weights
        settings.setdefault("hf_weights", model_name)
    config = rt.TrainConfig(run.spec, run.layout, seq_len=seq, global_batch=run.global_batch,
                            seed=seed, data=data_path, dtype=dtype, grad_dtype=grad_dtype,
                            flash=flash, **run.moe, **settings)
    _preflight(config)
    return config


def _preflight(config: Any) -> None:
    """On the launching process (rank 0 under torchrun), what only the runtime can check:
    the whole config, the --data file's size, the Hugging Face weights (every tensor read
    once), and that --save-hf can describe the model."""
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


@cli.command(cls=ArgvCommand, short_help="Train a model for real on local ranks.")
@launcher_options
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
@click.option("--checkpoint-every", default="0", show_default=True, callback=every_steps,
              help="Steps between checkpoints (0: only after the last step), or auto: Daly's "
                   "interval from the measured write time and --mtbf-gpu-hours, in steps "
                   "(docs/concepts/goodput.md).")
@mtbf_option("With --checkpoint-every auto: GPU-hours between job-interrupting failures, per "
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
    if override and not resume:
        raise ShardwiseError("--override names settings a --resume changes from the "
                             "checkpoint's; add --resume, or drop --override")
    need_matplotlib("--plot", plot_path)
    run = _check_arguments(model_name, layout_kw, seq, global_batch, dtype, grad_dtype, flash,
                           data_path, files={"--plot": plot_path, "--log": log_path},
                           directories={"--checkpoint-dir": checkpoint_dir,
                                        "--save-hf": save_hf})
    rt = import_runtime("shardwise.runtime.train")
    from shardwise.runtime.checkpoint import check_start
    from shardwise.runtime.launch import rank

    config = _train_config(
        run, model_name, seq, seed, data_path, dtype, flash,
        grad_dtype=grad_dtype, steps=steps,
        lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
        log_path=log_path, progress=not quiet, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume,
        mtbf_gpu_hours=mtbf_gpu_hours,
        save_hf=save_hf, override=override)
    layout = config.layout
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
        return emit_json({"model": config.model.name, "layout": layout.to_dict(),
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
        rows.append(["checkpoints saved", f"{len(saves)}, {cell(saves[-1].checkpoint_bytes)} "
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


@cli.command(cls=ArgvCommand, short_help="Compare predicted and measured on real ranks.")
@launcher_options
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
    run = _check_arguments(model_name, layout_kw, seq, global_batch, dtype, grad_dtype, flash,
                           data_path)
    if calibration_path is not None:
        from shardwise.calibration.machine import read_machine

        read_machine(calibration_path)  # a bad file: one line, exit 2, before any rank runs
    measure = import_runtime("shardwise.runtime.measure")
    from shardwise.runtime.launch import rank

    config = _train_config(run, model_name, seq, seed, data_path, dtype, flash,
                           grad_dtype=grad_dtype, steps=steps)
    layout = config.layout
    rows = _on_ranks(lambda: measure.run_check(config, steps, timeout_s=timeout,
                                               per_rank=per_rank, impl=impl,
                                               reference=calibration_path is not None))
    step_time = import_runtime("shardwise.runtime.step_time")
    rows = step_time.with_prediction(rows, config, calibration_path)
    missed = [row for row in rows if not row.ok]
    if rank() == 0 and as_json:
        emit_json({"model": config.model.name, "layout": layout.to_dict(),
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
              "-" if row.predicted is None else cell(row.predicted),
              "-" if row.measured is None else cell(row.measured), _error_cell(row),
              row.target, "-" if row.target == "-" else "yes" if row.ok else "NO", row.note]
             for row in rows]))
        if not missed:
            console.print(f"All {len(rows)} rows meet their targets.")
    if missed:  # exit code 1, one line on stderr
        raise click.ClickException(f"{len(missed)} of {len(rows)} rows miss their target "
                                   "(see the notes)")

