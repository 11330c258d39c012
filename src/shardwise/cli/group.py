"""The `shardwise` click group and the console entry point (one line and exit 2 on bad input)."""

from __future__ import annotations

import sys

import click

from shardwise.errors import ShardwiseError, one_line


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="shardwise")
def cli() -> None:
    """Plan, simulate and run distributed training of Transformer language models."""


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

