"""`shardwise ui` through the real entry point: serves the pages, warns off loopback, one
line and exit 2 on a taken port or a missing ui extra, a clean stop on Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx

from tests.cli_helpers import assert_one_line_error


def start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "ui", "--no-browser", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    assert line.startswith("shardwise ui: http://"), (line, proc.stderr.read())
    return proc, line.split()[2]


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "stopped" in out
    return out, err


def test_ui_serves_pages_and_stops_on_ctrl_c():
    proc, url = start("--port", "0")
    try:
        assert url.startswith("http://127.0.0.1:")
        for page in ("", "planner", "memory", "schedule"):
            response = httpx.get(url + page, timeout=10)
            assert response.status_code == 200 and "<html" in response.text
        assert httpx.get(url + "api/models", timeout=10).json()[0]["name"]
    finally:
        _, err = stop(proc)
    assert "warning" not in err


def test_ui_warns_off_loopback():
    proc, url = start("--host", "0.0.0.0", "--port", "0")
    port = url.rsplit(":", 1)[1].rstrip("/")
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200
    finally:
        _, err = stop(proc)
    assert "warning: serving on 0.0.0.0" in err


def test_ui_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "shardwise", "ui", "--no-browser",
                                 "--port", str(port)], capture_output=True, text=True,
                                timeout=60)
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{port}", "--port")


def test_ui_without_the_extra_is_one_line():
    # what `pip install shardwise` without [ui] leaves: no uvicorn to import
    code = ("import sys; sys.modules['uvicorn'] = None; from shardwise.cli import main; "
            "main(['ui', '--no-browser'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert_one_line_error(result, "pip install 'shardwise[ui]'")
