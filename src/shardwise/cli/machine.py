"""`shardwise demo` and `shardwise calibrate`: measure and check on this machine."""

from __future__ import annotations

import json

import click

from shardwise.cli.common import (
    cell,
    console,
    emit_json,
    import_runtime,
    json_option,
    need_matplotlib,
    print_rows,
)
from shardwise.cli.group import cli
from shardwise.errors import ShardwiseError
from shardwise.files import save_output
from shardwise.layout import SCHEDULES
from shardwise.preflight import writable_file
from shardwise.report.text import table as _table
from shardwise.validate import finite_result

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





@cli.command(short_help="Run one parallelism for real and check it.")
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
    run = getattr(import_runtime(module), function)
    kwargs = {"schedule": schedule} if schedule else {}
    result = run(ranks or default_ranks, **kwargs)
    payload = result if isinstance(result, dict) else {"rows": result}
    if as_json:
        return emit_json(payload)
    for key, value in payload.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            print_rows(f"demo {name}: {'checks' if key == 'rows' else key}", value)
        elif isinstance(value, str) and "\n" in value:
            console.print(f"[bold]{key}[/]\n{value}", soft_wrap=True)
        else:
            console.print(f"{key}: {cell(value)}")
    rows = [row for value in payload.values() if isinstance(value, list)
            for row in value if isinstance(row, dict)]
    if any(row.get("ok") is False for row in rows):
        raise ShardwiseError(f"demo {name}: some checks failed (ok = False above)")



# ----------------------------------------------------------------------------------- calibrate
@cli.command(short_help="Measure this machine and fit the constants.")
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
    need_matplotlib("--plot", plot_path)
    rt = import_runtime("shardwise.runtime.calibrate")
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
        return emit_json(data | {"path": out_path})
    console.print(_table(f"{backend}, {ranks} ranks: fitted constants (residuals: relative, "
                         "rms / max)", ["quantity", "value", "fit residual"],
                         rt.summary_rows(data)))
    console.print(f"Wrote {out_path}" + (f" and {plot_path}" if plot_path else "")
                  + f". Plan for this machine: shardwise plan tiny --gpus {ranks} "
                  f"--gpu this-machine --calibration {out_path}")
    return None

