"""The web app's resident memory under concurrent `/api/plan` load (issue 47): a real uvicorn
server on 127.0.0.1 (`uvicorn shardwise.web.app:create_app --factory`, what `shardwise ui`
serves), `--requests` concurrent plans of the largest preset (DeepSeek-V3, 671 B parameters;
1,024 H100, s=4096, 2,048 sequences: the search issue 47 measured at ~4 GB before pruning),
and the server process's RSS sampled every 50 ms from /proc (psutil).

The server's budget is `$SHARDWISE_WEB_MEMORY` (`--budget`, default 1.5 GB), shared by its
`PLAN_WORKERS` searches (`budget.web_request_budget`); a request over its share is a 400
naming a --fix/--max that fits, one beyond the workers a 503. Every request has a client
timeout and the server is stopped at the end, whatever happened.

Run: `python benchmarks/bench_web_memory.py [--requests 8] [--budget 1.5GB] [--gpus 1024]
[--json]` (a few minutes on a loaded 2-core machine). Prints the peak RSS, the base RSS
before the first request and each status code's count; exit code 1 when the peak is over
the budget.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil

from shardwise.units import parse_size

MODEL = "deepseek-v3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(budget: str) -> tuple[subprocess.Popen[bytes], str]:
    """A uvicorn server of the web app on a free loopback port, with `budget`."""
    port = free_port()
    env = os.environ | {"SHARDWISE_WEB_MEMORY": budget}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "shardwise.web.app:create_app",
                             "--factory", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/hardware", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 60 s")


def measure(requests: int, budget: str, body: dict, timeout: float = 300.0) -> dict:
    """Peak and base RSS (bytes) of the server while `requests` POST /api/plan `body` at
    once, and the count of each answer's status (`timeout` per request, then "timeout")."""
    proc, url = start(budget)
    try:
        server = psutil.Process(proc.pid)
        base = server.memory_info().rss
        peak = [base]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                try:
                    peak[0] = max(peak[0], server.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.05)

        statuses: collections.Counter[str] = collections.Counter()
        details: list[str] = []

        def post() -> None:
            try:
                response = httpx.post(f"{url}/api/plan", json=body, timeout=timeout)
                statuses[str(response.status_code)] += 1
                if response.status_code != 200:
                    details.append(str(response.json().get("detail"))[:200])
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start_time = time.monotonic()
        posts = [threading.Thread(target=post) for _ in range(requests)]
        for t in posts:
            t.start()
        for t in posts:
            t.join()
        wall = time.monotonic() - start_time
        # a search answered 408 still runs in its worker: sample until the server is idle
        # (under 5 % of a core over a second), at most `timeout` more
        settle = time.monotonic() + timeout
        while time.monotonic() < settle and server.cpu_percent(interval=1.0) > 5:
            pass
        done.set()
        sampler.join()
        return {"requests": requests, "budget_bytes": parse_size(budget), "base_rss": base,
                "peak_rss": peak[0], "statuses": dict(statuses), "wall_s": wall,
                "details": sorted(set(details)), "body": body}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--budget", default="1.5GB")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--global-batch", default="2048")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    body = {"model": args.model, "gpus": args.gpus, "seq": args.seq,
            "global_batch": args.global_batch, "top": 3}
    out = measure(args.requests, args.budget, body, args.timeout)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.requests} concurrent /api/plan ({args.model}, {args.gpus} GPUs) against "
              f"a {out['budget_bytes'] / 1e9:.2f} GB budget: peak RSS "
              f"{out['peak_rss'] / 1e9:.3f} GB (base {out['base_rss'] / 1e9:.3f} GB), "
              f"{out['wall_s']:.1f} s; answers {out['statuses']}")
        for detail in out["details"]:
            print(f"  {detail}")
    sys.exit(0 if out["peak_rss"] <= out["budget_bytes"] else 1)


if __name__ == "__main__":
    main()
