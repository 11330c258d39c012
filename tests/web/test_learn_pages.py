"""The Learn section in Debian's chromium: each explainer driven as a person would (clicks,
keyboard, sliders) and checked for the figures SPEC and the issue name. The `page` fixture fails a
test on any console error and saves a screenshot to test-artifacts/."""

from __future__ import annotations

import re

import pytest

from shardwise.arch import PRESETS
from shardwise.estimate.context import longest_context
from shardwise.layout import Layout
from tests.web.test_tools_pages import SMALLEST_TEXT

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect
expect.set_options(timeout=15_000)

WIDGETS = ["memory-budget", "ring-allreduce", "zero-stages", "tp-mlp", "bubble", "pipeline-grid",
           "ring-attention", "context-wall", "checkpoint-interval", "run-timeline"]


def test_learn_index_lists_the_ten_widgets(page, server_url, client):
    page.goto(server_url + "/learn/index")
    links = page.locator("#widgets a")
    expect(links).to_have_count(10)
    assert [links.nth(i).get_attribute("href") for i in range(10)] == [
        f"/learn/{name}" for name in WIDGETS]
    for name in WIDGETS:
        assert client.get(f"/learn/{name}").status_code == 200
    links.nth(0).click()
    expect(page).to_have_url(re.compile(r"/learn/memory-budget"))
    page.get_by_role("link", name="Step through the ring →").click()
    expect(page.locator("h1")).to_have_text("Step through the ring")


def test_memory_budget(page, server_url):
    page.goto(server_url + "/learn/memory-budget")
    total = page.locator("#total")
    expect(total).to_have_text("120.00 GB")  # SPEC §2: 7.5B on 64 devices, stage 0
    expect(page.locator("#stages tbody")).to_contain_text("31.41")
    page.locator(".seg label", has_text="1 opt").click()
    expect(total).to_have_text("31.41 GB")
    page.keyboard.press("ArrowRight")  # focus is on the stage radio group
    expect(total).to_have_text("16.64 GB")
    page.keyboard.press("ArrowRight")
    expect(total).to_have_text("1.88 GB")
    expect(page).to_have_url(re.compile(r"stage=3"))
    # 70B needs many devices even at stage 3: 16Ψ/N ≤ 80 GB from N = 14.
    params = page.locator("#params")
    params.focus()
    for _ in range(7):  # 7.5B -> 10B, 15B, 20B, 30B, 40B, 50B, 70B
        params.press("ArrowRight")
    expect(page.locator("output[for=params]")).to_have_text("70B")
    expect(page.locator("#caption")).to_contain_text("fits from N = 14 on")
    page.locator(".seg label", has_text="1 opt").click()
    expect(page.locator("#caption")).to_contain_text("no N up to 1024")
    # The link reproduces the page.
    page.goto(page.url)
    expect(page.locator("output[for=params]")).to_have_text("70B")
    expect(total).to_have_text(re.compile(r"^293\.1\d GB$"))  # 4Ψ + 12Ψ/64 = 293.125 GB


def test_ring_allreduce_steps_to_the_column_sums(page, server_url):
    page.goto(server_url + "/learn/ring-allreduce?devices=4")
    step_no = page.locator("#step-no")
    expect(step_no).to_have_text("0 / 6")
    rows = page.locator("#table tbody tr")
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    expect(step_no).to_have_text("3 / 6")
    expect(page.locator("#phase-name")).to_have_text("reduce-scatter")
    for i in range(4):  # one finished (ringed) chunk per device
        expect(rows.nth(i).locator("td.done")).to_have_count(1)
    for _ in range(3):
        page.get_by_role("button", name="Step ▶").click()
    expect(step_no).to_have_text("6 / 6")
    sums = page.locator("#sums td").all_inner_texts()[1:]
    assert sums == ["1,111", "2,222", "3,333", "4,444"]
    for i in range(4):
        assert rows.nth(i).locator("td").all_inner_texts() == sums
    expect(page.locator("#bytes")).to_contain_text("48 / 48 B")  # 2(N-1)/N · 32 B
    page.get_by_role("button", name="◀ Back").click()
    expect(step_no).to_have_text("5 / 6")
    page.locator("#devices").fill("2")
    expect(step_no).to_have_text("0 / 2")
    page.get_by_role("button", name="▶ Play").click()
    expect(step_no).to_have_text("2 / 2")
    assert rows.nth(0).locator("td").all_inner_texts() == rows.nth(1).locator(
        "td").all_inner_texts() == page.locator("#sums td").all_inner_texts()[1:]


def test_zero_stages(page, server_url):
    page.goto(server_url + "/learn/zero-stages")
    total = page.locator("#total")
    expect(total).to_have_text("120.00 GB")
    page.get_by_role("button", name="Next stage ▶").click()
    expect(total).to_have_text("31.41 GB")
    expect(page.locator('rect[data-part=optimizer][data-partitioned="true"]')).to_have_count(4)
    expect(page.locator('rect[data-part=weights][data-partitioned="false"]')).to_have_count(4)
    page.keyboard.press("ArrowRight")
    expect(total).to_have_text("16.64 GB")
    page.keyboard.press("ArrowRight")
    expect(total).to_have_text("1.88 GB")
    expect(page.locator('rect[data-partitioned="true"]')).to_have_count(12)
    expect(page.get_by_role("button", name="Next stage ▶")).to_be_disabled()


def test_tp_mlp_has_one_communication_and_matches_one_device(page, server_url):
    page.goto(server_url + "/learn/tp-mlp")
    expect(page.locator("#equal")).to_have_text("Z equals the single-device result")
    notes = []
    for stage in range(5):
        expect(page.locator("#stages button[aria-current=step]")).to_have_text(re.compile(
            rf"^{stage + 1}\."))
        notes.append(page.locator("#values > p").inner_text())
        page.keyboard.press("ArrowRight")
    assert ["communication: all-reduce" in note for note in notes] == [False] * 4 + [True]
    expect(page.locator("#values table.matrix")).to_have_count(1)  # Z, replicated
    page.locator("#stages button", has_text="X·A").click()
    expect(page.locator("#values table.matrix")).to_have_count(2)  # one shard per device
    page.get_by_role("button", name="New numbers").click()
    expect(page).to_have_url(re.compile(r"seed=1"))
    expect(page.locator("#equal")).to_have_text("Z equals the single-device result")


def test_bubble_vs_microbatches(page, server_url):
    page.goto(server_url + "/learn/bubble?p=4&m=8")
    bubble = page.locator("#bubble")
    expect(bubble).to_have_text(f"{100 * 3 / 11:.1f}%")
    page.locator("#m").fill("16")  # M = 4P
    expect(bubble).to_have_text(f"{100 * 3 / 19:.1f}%")
    expect(page.locator("#bubble-4p")).to_have_text(f"{100 * 3 / 19:.1f}%")
    page.locator("#p").press("ArrowRight")  # P = 5: the marker moves to M = 20
    expect(bubble).to_have_text(f"{100 * 4 / 20:.1f}%")
    expect(page.locator("#stats")).to_contain_text("M = 4P = 20")
    page.get_by_label("show interleaved 1F1B").check()
    expect(page.locator("#bubble-v")).to_have_text(f"{100 * 4 / (2 * 16 + 4):.1f}%")


def test_pipeline_grid(page, server_url, client):
    page.goto(server_url + "/learn/pipeline-grid")
    expect(page.locator("#bubble")).to_have_text("27.3%")  # SPEC §6: 3/11
    expect(page.locator("#makespan")).to_have_text("22")
    expect(page.locator("#peak")).to_have_text("4 · 3 · 2 · 1")
    page.locator(".seg label", has_text="GPipe").click()
    expect(page.locator("#peak")).to_have_text("8 · 8 · 8 · 8")
    expect(page.locator("rect[data-kind]")).to_have_count(64)
    # interleaved, per-stage times: a chunk's box is half a stage's, the makespan
    # m(t_f+t_b) + (p-1)(t_f+t_b)/v = 19, stage 0 holds p + (p-1)/v micro-batches
    page.locator(".seg label", has_text="interleaved").click()
    expect(page.locator("#makespan")).to_have_text("19")
    expect(page.locator("#peak")).to_have_text("5.5 · 4.5 · 3.5 · 2.5")
    page.locator(".seg label", has_text="ZB-H1").click()
    page.get_by_label("backward takes 2× the forward").check()
    expect(page.locator("#makespan")).to_have_text("27")  # (3m + p - 1) with unit F, B, W
    expect(page.locator("#bubble")).to_have_text(f"{100 * 3 / 27:.1f}%")
    expect(page.locator('rect[data-kind="W"]')).to_have_count(32)
    page.locator("#time").fill("10")
    expect(page.locator("#time-out")).to_have_text("10 / 27")
    assert page.locator("rect[data-kind]").count() < 96
    # ZBV at equal chunk times (backward 2×: F = B = W = 1/2 a chunk) idles only the fill,
    # (p-1)/2: 8·3 + 1.5; DualPipeV outlines its overlapped F&B pairs, as many as the CLI's
    page.locator(".seg label", has_text="ZBV").click()
    expect(page.locator("#makespan")).to_have_text("25.5")
    expect(page.locator("#peak")).to_have_text("4 · 4 · 4 · 4")
    page.locator(".seg label", has_text="DualPipeV").click()
    out = client.post("/api/schedule", json={"stages": 4, "microbatches": 8, "t_b": 2,
                                             "schedule": "dualpipev"}).json()
    expect(page.locator("#makespan")).to_have_text(f"{out['makespan']:g}")
    expect(page.locator("rect[data-pair]")).to_have_count(sum(e["pair"] for e in out["timeline"]))


def test_ring_attention_causal_balance(page, server_url, client):
    page.goto(server_url + "/learn/ring-attention")
    imbalance = page.locator("#imbalance")
    expect(imbalance).to_have_text("14.18×")  # SPEC §8, 8 devices × 16 tokens, contiguous
    expect(page.locator("#range")).to_have_text("136 … 1,928")
    page.locator(".seg label", has_text="striped").click()
    expect(imbalance).to_have_text("1.11×")
    expect(page.locator("#range")).to_have_text("976 … 1,088")
    page.locator(".seg label", has_text="zigzag").click()
    zigzag = client.get("/api/learn/ring-attention", params={"layout": "zigzag"}).json()
    expect(imbalance).to_have_text(f"{zigzag['imbalance']:.2f}×")
    expect(page.locator("[data-arc]")).to_have_count(64)  # the ring has run: every arc full
    page.locator("#step").focus()
    page.keyboard.press("Home")
    expect(page.locator("[data-arc]")).to_have_count(0)
    page.get_by_role("button", name="Step ▶").click()
    expect(page.locator("[data-arc]")).to_have_count(8)
    expect(page.locator("#exact")).to_have_text(re.compile(r"e-1[5-9]$"))


def test_context_wall_moves_with_p(page, server_url):
    model = PRESETS["llama3-8b"]

    def wall(cp: int) -> int:
        return longest_context(model, Layout(tp=8, sp=True, cp=cp, recompute="selective"), 80e9)

    page.goto(server_url + "/learn/context-wall")
    tokens = page.locator("#wall-tokens")
    expect(tokens).to_have_text(f"{wall(8):,} tokens")
    page.locator("#cp").press("ArrowRight")
    expect(page.locator("#cp-out")).to_have_text("16")
    expect(tokens).to_have_text(f"{wall(16):,} tokens")
    assert wall(16) == 2 * wall(8)  # the wall moves out in step with P
    # the axis counts tokens in binary units, k = 1,024 (131,072 reads 128k, not 131k)
    ticks = page.locator("#chart text.muted").all_text_contents()
    powers = [t for t in ticks if re.fullmatch(r"\d+[kM]", t)]
    assert powers and all((int(t[:-1]) * {"k": 2**10, "M": 2**20}[t[-1]]).bit_count() == 1
                          for t in powers), ticks
    page.locator("#model").select_option("llama3-70b")
    page.locator("#tp").select_option("1")
    expect(tokens).to_have_text("none fits")
    expect(page.locator("#caption")).to_contain_text("more tensor parallelism")
    # at TP 8 the page does not ask for more TP
    page.goto(server_url + "/learn/context-wall?model=llama3-70b&budget_gb=10&tp=8&zero=0")
    expect(tokens).to_have_text("none fits")
    expect(page.locator("#caption")).to_contain_text("a higher ZeRO stage")
    expect(page.locator("#caption")).not_to_contain_text("tensor parallelism")


def test_checkpoint_interval(page, server_url):
    """Llama 3's failure rate (H = 50,677 GPU-hours at 16,384 GPUs): 7.8 interruptions a day;
    twice the GPUs, twice the rate and a √2 shorter interval; the restart moves the curve,
    not its minimum."""
    page.goto(server_url + "/learn/checkpoint-interval")
    expect(page.locator("#per-day")).to_have_text("7.8")
    interval = page.locator("#interval").text_content()
    page.locator("#restart").fill("30")
    expect(page).to_have_url(re.compile(r"restart_min=30"))
    expect(page.locator("#interval")).to_have_text(interval)
    expect(page.locator("#caption")).to_contain_text("30 min")
    page.locator("#gpus").press("ArrowRight")  # 32,768 GPUs
    expect(page.locator("#per-day")).to_have_text("15.5")
    expect(page.locator("#gpus-out")).to_have_text("32,768")
    expect(page.locator("#chart circle")).to_have_count(1)  # Daly's point on the curve


def test_run_timeline(page, server_url, client):
    """The page draws the run the API simulated: one marker per failure, one tick per
    checkpoint; the policy and the run drawn live in the URL, and each policy's bar shows its
    simulated mean goodput."""
    def api(**params):
        return client.get("/api/learn/run-timeline", params=params).json()

    page.goto(server_url + "/learn/run-timeline")
    d = api()
    expect(page.locator("#failures")).to_have_text(str(d["interruptions"]))
    expect(page.locator("#chart .failure")).to_have_count(d["interruptions"])
    expect(page.locator("#chart .checkpoint")).to_have_count(len(d["checkpoints"]))
    expect(page.locator("#chart .redone")).to_have_count(len(d["lost"]))
    expect(page.locator("#goodput")).to_have_text(f"{100 * d['goodput']:.1f}%")
    page.locator(".seg label", has_text="in-memory").click()
    expect(page).to_have_url(re.compile(r"policy=in-memory"))
    memory = api(policy="in-memory")
    mean = next(r["mean"] for r in memory["policies"] if r["name"] == "in-memory")
    expect(page.locator("#mean")).to_have_text(f"{100 * mean:.1f}%")
    expect(page.locator("#chart .checkpoint")).to_have_count(len(memory["checkpoints"]))
    assert len(memory["checkpoints"]) > len(d["checkpoints"])  # a copy stalls less: more often
    page.get_by_role("button", name="Another run").click()
    expect(page).to_have_url(re.compile(r"seed=1"))
    other = api(policy="in-memory", seed=1)
    expect(page.locator("#failures")).to_have_text(str(other["interruptions"]))
    expect(page.locator("#caption")).to_contain_text(f"the best policy here is {other['best']}")


def test_every_explainer_fits_a_phone(page, server_url):
    page.set_viewport_size({"width": 390, "height": 844})
    for name in WIDGETS:
        page.goto(f"{server_url}/learn/{name}")
        expect(page.locator("section.widget figure")).not_to_have_attribute("aria-busy", "true")
        expect(page.locator("figure svg > g").first).to_be_attached()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, name
        assert page.evaluate(SMALLEST_TEXT, "figure svg text") >= 10.95, name


def test_bad_input_shows_the_one_line_message(page, server_url):
    # Interleaved 1F1B needs M divisible by P: the API answers 400 and the page shows its line.
    page.goto(server_url + "/learn/pipeline-grid?schedule=interleaved&p=4&m=6")
    error = page.locator("#error")
    expect(error).to_have_text(re.compile(r"^interleaved 1F1B needs m divisible by p"))
    page.locator("#m").fill("8")
    expect(error).to_be_hidden()
    expect(page.locator("#bubble")).to_have_text(f"{100 * 3 / 19:.1f}%")
    page.console_errors.clear()  # the browser logs the deliberate 400
