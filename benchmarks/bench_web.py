"""Web app speed, measured over HTTP against a real uvicorn server on 127.0.0.1 (what
`shardwise ui` runs), with a keep-alive httpx client and Debian's chromium for page loads.

    /api/memory     Llama-3-70B, 64 H100, tp8 zero1 sp selective (SPEC §4)     target p50 < 10 ms
    /api/schedule   zb-h1, p=4, m=8 (timeline of 96 actions)                 target p50 < 10 ms
    /api/plan       Llama-3-405B, 16,384 H100, 16M-token batch, top 10,
                    with explanation and the three launch configurations     target p50 < 1 s
    page → chart    navigation start to the first chart's SVG in the DOM (a MutationObserver
                    set before the page's scripts records when it is inserted)
                    (memory, schedule, planner pages; fresh browser context) target < 1 s

Run: `python benchmarks/bench_web.py` (about half a minute; the page loads need
/usr/bin/chromium). Each figure is the median of the repeats after one warm-up request.

It writes its table to `docs/generated/bench_web.md` (`results.write_result`), which the
Accuracy page includes.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from results import markdown_table, write_result

from shardwise.web.app import create_app

MEMORY = {"model": "llama3-70b", "gpus": 64, "tp": 8, "zero": 1, "sp": True,
          "recompute": "selective"}
SCHEDULE = {"stages": 4, "microbatches": 8, "schedule": "zb-h1"}
PLAN = {"model": "llama3-405b", "gpus": 16384, "global_batch": "16M-tokens", "top": 10}
PAGES = {"memory": "#chart svg", "schedule": "#chart svg", "planner": "#breakdown svg"}
# run before the page's own scripts: the time the selector first matches (Playwright's
# wait_for_selector returns later, by its polling and the round trip to the browser)
FIRST_MATCH = """new MutationObserver((_, observer) => {
  if (document.querySelector(%s)) { window.__firstMatch = performance.now(); observer.disconnect(); }
}).observe(document, { childList: true, subtree: true });"""


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


def report(name: str, times: list[float], target: str) -> list[str]:
    """One table row: the median and 90th percentile of `times` (seconds), in ms."""
    times = sorted(times)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    return [name, f"{statistics.median(times) * 1e3:.1f} ms", f"{p90 * 1e3:.1f} ms",
            str(len(times)), target]


def page_loads(url: str, repeats: int = 5) -> list[list[str]]:
    """One row per page: navigation start to its first chart, the median of `repeats`
    fresh browser contexts (after one warm-up)."""
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        print("page → chart: skipped (no /usr/bin/chromium)")
        return []
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium),
                                             args=["--headless", "--no-sandbox"])
        for page_name, selector in PAGES.items():
            times = []
            for _ in range(repeats + 1):
                context = browser.new_context(viewport={"width": 1280, "height": 800})
                page = context.new_page()
                page.add_init_script(FIRST_MATCH % json.dumps(selector))
                page.goto(f"{url}/{page_name}")
                page.wait_for_selector(selector)
                # navigation start → the chart's insertion, in the page's own clock
                times.append(page.evaluate("window.__firstMatch") / 1e3)
                context.close()
            rows.append([f"page → chart: {page_name}",
                         f"{statistics.median(times[1:]) * 1e3:.0f} ms", "", str(repeats),
                         "< 1 s"])
        browser.close()
    return rows


def main() -> None:
    server, url = start_server()
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            rows = [report("/api/memory", timed_posts(client, "/api/memory", MEMORY, 100),
                           "p50 < 10 ms"),
                    report("/api/schedule", timed_posts(client, "/api/schedule", SCHEDULE, 100),
                           "p50 < 10 ms"),
                    report("/api/plan", timed_posts(client, "/api/plan", PLAN, 7), "p50 < 1 s")]
        rows += page_loads(url)
    finally:
        server.should_exit = True
    text = markdown_table(["request", "p50", "p90", "repeats", "target"], rows, "lrrrl")
    print(text)
    write_result("bench_web", text)

if __name__ == "__main__":
    main()
