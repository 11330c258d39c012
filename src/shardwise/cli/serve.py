"""`shardwise ui` (the web app) and `shardwise mcp` (the tools for coding agents)."""

from __future__ import annotations

import click

from shardwise.cli.group import cli
from shardwise.errors import ShardwiseError


# ------------------------------------------------------------------------------------------ ui
@cli.command(short_help="Serve the planner and tools in a browser.")
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


# ----------------------------------------------------------------------------------------- mcp
@cli.command()
def mcp() -> None:
    """Serve the planner to agents over MCP.

    The Model Context Protocol on stdin/stdout, for coding agents (needs the mcp extra:
    pip install 'shardwise[mcp]')."""
    try:
        from shardwise.web.mcp_server import serve_stdio
    except ImportError as exc:
        raise ShardwiseError(f"`shardwise mcp` needs the mcp extra ({exc.name} is missing): "
                             "pip install 'shardwise[mcp]'") from None
    serve_stdio()
