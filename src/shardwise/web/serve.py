"""`shardwise ui`: serve the web app with uvicorn on one socket we bind ourselves (so a taken
port is one clear line, and `--port 0` picks a free one), print its URL, open a browser, stop
on Ctrl-C."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import webbrowser

import click

from shardwise.errors import ShardwiseError


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or `ShardwiseError` saying why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, ValueError):  # unknown, or not a host name at all
        shown = host if len(host) <= 60 else f"{host[:60]}…"
        raise ShardwiseError(f"cannot resolve --host {shown!r}; try 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ShardwiseError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another "
                             "--port (0: any free one)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(host: str = "127.0.0.1", port: int = 8765, open_browser: bool = True) -> None:
    """Serve the web app on `host:port` until Ctrl-C (a `ShardwiseError` without the ui extra
    or for a taken port)."""
    try:
        import uvicorn

        from shardwise.web.app import create_app
    except ImportError as exc:
        raise ShardwiseError(f"`shardwise ui` needs the ui extra ({exc.name} is missing): "
                             "pip install 'shardwise[ui]'") from None
    sock = bind(host, port)  # an invalid host is refused before any warning
    if not _is_loopback(host):
        click.echo(f"warning: serving on {host}, reachable from other machines; the app has "
                   "no authentication", err=True)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}/"
    server = uvicorn.Server(uvicorn.Config(create_app(), log_level="warning"))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            click.echo(f"shardwise ui: {url}  (Ctrl-C stops it)")
            if open_browser:
                webbrowser.open(url)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        pass
    finally:
        sock.close()
    click.echo("shardwise ui: stopped")
