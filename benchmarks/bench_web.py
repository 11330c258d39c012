"""Web app speed, measured over HTTP against a real uvicorn server on 127.0.0.1 (what
`shardwise ui` runs), with a keep-alive httpx client and Debian's chromium for page loads.

    /api/memory     Llama-3-70B, 64 H100, tp8 zero1 sp selective (SPEC §4)     target p50 < 10 ms
    /api/schedule   zb-h1, p=4, m=8 (timeline of 96 actions)                 target p50 < 10 ms
    /api/plan       Llama-3-405B, 16,384 H100, 16M-token batch, top 10,
                    with explanation and the three launch configurations     target p50 < 1 s
    page → chart    navigation start to the first chart's SVG in the DOM
                    (memory, schedule, planner pages; fresh browser context) target < 1 s

Run: `python benchmarks/bench_web.py` (about half a minute; the page loads need
/usr/bin/chromium). Each figure is the median of the repeats after one warm-up request.

Recorded (2-core VM shared with seven other jobs, load average 15-20 during every run, so
these are upper bounds; four runs of this commit, range of the medians):

    /api/memory    p50   4.5 -  9.0 ms   (in-process: builder 0.3 ms)
    /api/schedule  p50   6.0 - 13.8 ms   (in-process: simulate 2.2 ms, payload + response
                                          validation 0.8 ms; the rest is HTTP under load)
    /api/plan      p50   228 -  375 ms
    page → chart   memory 527 - 849 ms, schedule 469 - 672 ms, planner 844 - 1340 ms (the
                   planner's first chart waits for a full search of Llama-3-8B on 64 GPUs)
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from shardwise.web.app import create_app

MEMORY = {"model": "llama3-70b", "gpus": 64, "tp": 8, "zero": 1, "sp": True,
          "recompute": "selective"}
SCHEDULE = {"stages": 4, "microbatches": 8, "schedule": "zb-h1"}
PLAN = {"model": "llama3-405b", "gpus": 16384, "global_batch": "16M-tokens", "top": 10}
PAGES = {"memory": "#chart svg", "schedule": "#chart svg", "planner": "#breakdown svg"}


def start_server() -> tuple[uvicorn.Server, str]:
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=0,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def timed_posts(client: httpx.Client, path: str, body: dict, n: int) -> list[float]:
    client.post(path, json=body).raise_for_status()  # warm-up
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.post(path, json=body).raise_for_status()
        times.append(time.perf_counter() - start)
    return times


def report(name: str, times: list[float], unit: float = 1e3) -> None:
    times = sorted(times)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    print(f"{name:<14} p50 {statistics.median(times) * unit:6.1f} ms   "
          f"(p90 {p90 * unit:6.1f} ms, {len(times)} requests)")


def page_loads(url: str, repeats: int = 5) -> None:
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        print("page → chart: skipped (no /usr/bin/chromium)")
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium),
                                             args=["--headless", "--no-sandbox"])
        figures = []
        for page_name, selector in PAGES.items():
            times = []
            for _ in range(repeats + 1):
                context = browser.new_context(viewport={"width": 1280, "height": 800})
                page = context.new_page()
                page.goto(f"{url}/{page_name}")
                page.wait_for_selector(selector)
                # navigation start → now, in the page's own clock
                times.append(page.evaluate("performance.now()") / 1e3)
                context.close()
            figures.append(f"{page_name} {statistics.median(times[1:]) * 1e3:.0f} ms")
        browser.close()
    print("page → chart  ", ", ".join(figures), f"(medians of {repeats})")


def main() -> None:
    server, url = start_server()
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            report("/api/memory", timed_posts(client, "/api/memory", MEMORY, 100))
            report("/api/schedule", timed_posts(client, "/api/schedule", SCHEDULE, 100))
            report("/api/plan", timed_posts(client, "/api/plan", PLAN, 7))
        page_loads(url)
    finally:
        server.should_exit = True
    sys.stdout.flush()


if __name__ == "__main__":
    main()
