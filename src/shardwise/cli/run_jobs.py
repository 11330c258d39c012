"""`shardwise train|check … --launcher L`: the job that runs the same command on a cluster.

The command's own argv, less the launcher options, becomes the program torchrun starts on
every node (`torchrun … -m shardwise train …`; the runtime runs in place under torchrun,
`runtime.launch.under_torchrun`), written by `emit.launchers` for `--nodes × --gpus-per-node`
ranks; a shape other than the layout's dp·tp·pp·cp ranks is refused in one line before torch
is imported. docs/howto/launch.md.
"""

from __future__ import annotations

import functools
import inspect
import math
import shlex
from collections.abc import Callable
from typing import Any

import click

from shardwise.emit.launchers import LAUNCHERS, SKYPILOT_ACCELERATORS, Launch, launcher_script
from shardwise.errors import ShardwiseError

# the launcher options (parameter name → option), not passed on to the job
LAUNCH_OPTIONS = {"launcher": "--launcher", "nodes": "--nodes", "gpus_per_node": "--gpus-per-node",
                  "image": "--image", "job_name": "--job-name", "accelerator": "--accelerator"}


class ArgvCommand(click.Command):
    """A command that keeps the arguments it was given (`ctx.meta["argv"]`) for its job."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["argv"] = list(args)
        return super().parse_args(ctx, args)


def job_argv(argv: list[str]) -> list[str]:
    """`argv` less the launcher options (`--nodes 2` and `--nodes=2` alike)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in LAUNCH_OPTIONS.values():
            skip = True
        elif not word.startswith(tuple(f"{name}=" for name in LAUNCH_OPTIONS.values())):
            out.append(word)
    return out


def launcher_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--launcher, --nodes, --gpus-per-node, --image, --job-name, --accelerator: with
    --launcher, print the job that runs this command on the cluster instead of running it."""
    named = {name for name, param in inspect.signature(func).parameters.items()
             if param.kind is not param.VAR_KEYWORD}

    @functools.wraps(func)
    def command(**kw: Any) -> Any:
        given = {name: kw.pop(name) for name in LAUNCH_OPTIONS}
        ctx = click.get_current_context()
        if given["launcher"] is None:
            extra = [option for name, option in LAUNCH_OPTIONS.items() if name != "launcher"
                     and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
            if extra:
                raise ShardwiseError(f"{', '.join(extra)} need --launcher "
                                     f"({'|'.join(LAUNCHERS)})")
            return func(**kw)
        layout_kw = {name: value for name, value in kw.items() if name not in named}
        click.echo(job(ctx, kw, layout_kw, **given), nl=False)
        return None

    options = [
        click.option("--launcher", type=click.Choice(LAUNCHERS), default=None,
                     help="Print the job that runs this command on a cluster (torchrun, a "
                          "Slurm sbatch script, a Kubeflow PyTorchJob, a SkyPilot task) "
                          "instead of running it."),
        click.option("--nodes", type=click.IntRange(1, 1 << 20), default=None,
                     help="With --launcher: nodes [default: the ranks ÷ --gpus-per-node]."),
        click.option("--gpus-per-node", type=click.IntRange(1, 1024), default=8,
                     show_default=True, help="With --launcher: GPUs (ranks) per node."),
        click.option("--image", default=None, help="Container image for --launcher k8s."),
        click.option("--job-name", default=None,
                     help="Job name for --launcher [default: the model and layout]."),
        click.option("--accelerator", type=click.Choice(list(SKYPILOT_ACCELERATORS)),
                     default="h100-sxm", show_default=True,
                     help="The nodes' GPU, for --launcher skypilot."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def job(ctx: click.Context, kw: dict[str, Any], layout_kw: dict[str, Any], *, launcher: str,
        nodes: int | None, gpus_per_node: int, image: str | None, job_name: str | None,
        accelerator: str) -> str:
    """The job `launcher` writes for this command: the layout checked as the run checks it
    (`runs._check_arguments`, less what only the nodes can check), then `emit.launchers`."""
    from shardwise.cli.runs import _check_arguments

    run = _check_arguments(kw["model_name"], dict(layout_kw), kw["seq"], kw["global_batch"],
                           kw["dtype"], kw["grad_dtype"], kw["flash"], kw["data_path"],
                           here=False)
    ranks = run.layout.world_size
    nodes = nodes or math.ceil(ranks / gpus_per_node)
    words = [str(ctx.info_name), *job_argv(ctx.meta.get("argv", []))]
    header = (f"# shardwise {ctx.info_name}: {run.spec.name}, {run.layout.short()}, {ranks} "
              f"rank(s) on {nodes} node(s) of {gpus_per_node} GPUs")
    launch = Launch(nodes, gpus_per_node, (), ("-m", "shardwise"),
                    tuple(shlex.quote(word) for word in words), header)
    return launcher_script(launcher, launch, ranks, image=image, accelerator=accelerator,
                           name=job_name or f"{run.spec.name}-{run.layout.short()}")
