"""The tool pages in Chromium, used as a person would: the numbers they show equal what the
CLI prints for the same input, errors appear next to the field, a shared planner link
reproduces the table. One browser for the session; a screenshot of each test is saved."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from shardwise.report.plan_report import variants_text
from shardwise.units import human_count, human_time
from tests.web.cli_json import cli_json
from tests.web.conftest import ARTIFACTS

# SPEC §4: Llama-3-70B on 64 H100s, TP 8 × DP 8, ZeRO-1, selective recompute + SP, s=8192.
SPEC4 = ["memory", "llama3-70b", "--gpus", "64", "--tp", "8", "--zero", "1", "--sp",
         "--recompute", "selective", "--seq", "8192"]
PARTS = ["weights", "grads", "optimizer", "activations", "logits", "workspace", "total"]


def expect_stage_row(page, stage: dict, divisor: float) -> None:
    row = page.locator(f'#stages tr[data-stage="{stage["stage"]}"]')
    for part in PARTS:
        expect(row.locator(f'td[data-part="{part}"]')).to_have_text(
            f"{stage[part] / divisor:.2f}")


def test_memory_page_equals_cli(page, server_url):
    page.goto(server_url + "/memory")
    expect(page.locator("#model")).to_have_value("llama3-70b")
    # the SPEC §4 figures exactly: materialised attention, Korthikanti's closed form
    page.get_by_label("FlashAttention").uncheck()
    page.get_by_label("Activation count").select_option("korthikanti")
    spec = cli_json(*SPEC4, "--no-flash", "--formula", "korthikanti")
    stage = spec["stages"][0]
    assert round((stage["weights"] + stage["grads"]) / 1e9, 1) == 35.3  # SPEC §4
    expect_stage_row(page, stage, 1e9)
    expect(page.locator("#verdict")).to_contain_text("fits")
    # GiB switch: same bytes, binary units
    page.locator('label:has(input[name=unit][value=GiB])').click()
    expect_stage_row(page, stage, 2**30)
    expect(page.locator("#kpi-1")).to_have_text(f"{spec['budget_bytes'] / 2**30:.2f} GiB")
    # ZeRO-3 by keyboard (radio group: arrow keys), two pipeline stages, full recompute
    page.locator("input[name=zero][value='1']").focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    page.get_by_label("PP", exact=True).fill("2")
    page.locator('label:has(input[name=recompute][value=full])').click()
    zero3 = cli_json("memory", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "2",
                     "--zero", "3", "--sp", "--recompute", "full", "--no-flash", "--formula",
                     "korthikanti")
    assert len(zero3["stages"]) == 2
    for stage in zero3["stages"]:
        expect_stage_row(page, stage, 2**30)
    assert page.locator("#chart svg rect.seg-weights").count() == 2
    assert "zero=3" in page.url and "unit=GiB" in page.url


def test_memory_page_error_next_to_field(page, server_url):
    """A 400 names the field in plain words (the API says "--gpus 64", the page "GPUs (64)"),
    next to the field and in the banner; the last result stays, dimmed, under a badge."""
    page.goto(server_url + "/memory")
    expect(page.locator("#stages td[data-part=total]")).to_have_count(1)
    page.get_by_label("TP", exact=True).fill("3")
    error = page.locator('[data-error-for="tp"]')
    expect(error).to_have_text("tp·pp·cp = 3 does not divide GPUs (64)")
    expect(page.locator("#form-error")).to_have_text("TP: tp·pp·cp = 3 does not divide GPUs (64)")
    expect(page.get_by_label("TP", exact=True)).to_have_attribute("aria-invalid", "true")
    badge = page.locator("#results .stale-badge")
    expect(badge).to_be_visible()
    expect(badge).to_contain_text("Last valid result")
    # the dimming is a 0.15 s CSS transition: wait until it has settled below one half
    page.wait_for_function(
        "() => getComputedStyle(document.querySelector('#stages').closest('.card')).opacity < 0.5")
    page.screenshot(path=str(ARTIFACTS / "memory-error-1280x800.png"))
    page.get_by_label("TP", exact=True).fill("8")
    expect(error).to_be_hidden()
    expect(badge).to_be_hidden()
    page.console_errors.clear()  # the browser logs the deliberate 400


def test_schedule_page_equals_cli(page, server_url):
    page.goto(server_url + "/schedule")
    page.get_by_label("Schedule").select_option("zb-h1")
    slider = page.get_by_label(re.compile("^Micro-batches m"))
    slider.focus()
    for _ in range(4):
        page.keyboard.press("ArrowRight")  # m: 8 → 12
    expect(page.locator("#microbatches-out")).to_have_text("12")
    out = cli_json("schedule", "-p", "4", "-m", "12", "--schedule", "zb-h1")
    expect(page.locator('[data-kpi="makespan"]')).to_have_text(f"{out['makespan']:g}")
    expect(page.locator('[data-kpi="bubble (simulated)"]')).to_have_text(
        f"{out['bubble_fraction']:.4f}")
    expect(page.locator('[data-kpi="bubble (closed form)"]')).to_have_text(
        f"{out['bubble_closed_form']:.4f}")
    expect(page.locator("#peaks tbody td:not(:first-child)")).to_have_text(
        [f"{n:g}" for n in out["peak_in_flight"]])
    expect(page.locator("#chart g.ev")).to_have_count(out["actions"])
    expect(page.locator("#chart g.ev-W")).to_have_count(4 * 12)
    assert page.locator("#text").text_content() == out["text"]
    with page.expect_download() as download:
        page.get_by_role("link", name="Download SVG").click()
    assert Path(download.value.path()).read_text().startswith("<svg")


def ranked_texts(entry: dict) -> list[str]:
    e = entry["estimate"]
    folded = variants_text(entry["variants"])
    sure = e["uncertainty"]
    tier = "tie" if entry["tier"] == 1 else f"t{entry['tier']}"  # the first tier: ties
    return [f"{entry['rank']} {tier}", entry["short"] + (f" {folded}" if folded else "")
            + (" †" if sure["unvalidated"] else ""),
            f"{human_time(e['total'])} ±{round(sure['band'] * 100)}%",
            human_count(e["tokens_per_s"]), f"{e['mfu']:.1%}", f"{e['hfu']:.1%}",
            f"{entry['memory']['total'] / 2**30:.1f}"]


def test_planner_page_equals_cli_and_its_link_reproduces_it(page, server_url, browser):
    page.goto(server_url + "/planner")
    expect(page.locator("#ranked tbody tr")).to_have_count(10)
    page.get_by_label("GPUs", exact=True).fill("32")
    page.get_by_label("Top k").fill("5")
    page.get_by_label(re.compile("^Compare my layout")).fill("tp=2,zero=1")
    page.get_by_label(re.compile("^Training tokens")).fill("1T")
    page.get_by_label(re.compile("per GPU-hour")).fill("2")
    page.get_by_role("button", name="Plan", exact=True).click()
    out = cli_json("plan", "llama3-8b", "--gpus", "32", "--top", "5", "--layout",
                   "tp=2,zero=1", "--tokens", "1T", "--price", "2")
    rows = page.locator("#ranked tbody tr")
    expect(rows).to_have_count(6)  # five ranked and yours
    for i, entry in enumerate(out["ranked"]):
        cells = rows.nth(i).locator("td")
        expect(cells.nth(1)).to_have_text(ranked_texts(entry)[1])
        assert cells.all_text_contents()[:7] == ranked_texts(entry)
    # the table fits the 1280 px page; the winner's and your bars share one scale (px/s)
    assert page.locator("#ranked").evaluate("t => t.scrollWidth <= t.parentElement.clientWidth")
    widths = [page.locator(f"{chart} svg rect").first.evaluate(
        "r => r.getBoundingClientRect().width") for chart in ("#breakdown", "#given-breakdown")]
    computes = [out["ranked"][0]["estimate"]["compute"], out["given"]["estimate"]["compute"]]
    assert widths[0] / computes[0] == pytest.approx(widths[1] / computes[1], rel=0.02)
    link = page.locator("#learn-link a")
    assert link.get_attribute("href").startswith("/learn/")
    expect(page.locator("#ranked tr.given td").nth(1)).to_have_text(out["given"]["short"])
    expect(page.locator("#explanation")).to_have_text(out["explanation"])
    expect(page.locator("#training")).to_contain_text(f"${out['training']['cost']:,.0f}")
    # the goodput panel: the CLI's block, and the explainer set to this plan's numbers
    good = out["goodput"]
    expect(page.locator("#goodput-kpis")).to_contain_text(f"{100 * good['goodput']:.1f}%")
    expect(page.locator("#goodput-kpis")).to_contain_text(f"{good['days']:.1f}")
    expect(page.locator("#goodput-chart svg rect")).to_have_count(4)
    learn = page.locator("#goodput-learn a").get_attribute("href")
    assert learn.startswith("/learn/checkpoint-interval?gpus=32&")
    assert page.locator("#breakdown svg rect").count() == 8
    expect(page.locator("#memory svg rect.budget, #memory svg line.budget")).to_have_count(1)
    # the stack the layouts are for; its export (yours), with a copy button; the other
    # frameworks say which stack they run
    expect(page.locator("#ranked-title")).to_contain_text(out["stack"]["title"])
    expect(page.locator("#emit-text")).to_contain_text(out["emits"]["megatron"]["config"])
    page.get_by_role("button", name="Copy megatron config").click()
    expect(page.get_by_role("button", name="Copied")).to_be_visible()
    page.get_by_role("tab", name="megatron").focus()
    page.keyboard.press("ArrowLeft")  # wraps round to the last tab
    expect(page.get_by_role("tab", name="deepspeed")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_role("button", name=re.compile("^Re-plan for Megatron-DeepSpeed"))) \
        .to_be_visible()
    # sorting by MFU puts the highest first
    page.get_by_role("button", name="MFU", exact=True).click()
    mfus = [float(t.rstrip("%")) for t in page.locator("#ranked tbody td:nth-child(5)")
            .all_text_contents()]
    assert mfus == sorted(mfus, reverse=True)
    # the link reproduces the page
    shared = page.url
    assert "gpus=32" in shared and "layout=tp%3D2%2Czero%3D1" in shared
    other = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    other.goto(shared)
    expect(other.locator("#ranked tbody tr")).to_have_count(6)
    for i, entry in enumerate(out["ranked"]):
        assert other.locator("#ranked tbody tr").nth(i).locator("td") \
            .all_text_contents()[:7] == ranked_texts(entry)
    other.context.close()


def test_memory_page_with_an_uploaded_config(page, server_url):
    path = Path(__file__).parents[1] / "fixtures" / "hf" / "mixtral-8x7b" / "config.json"
    page.goto(server_url + "/memory?model=upload&gpus=64&tp=1&ep=8&zero=3&recompute=none&sp=0")
    expect(page.locator('[data-error-for="model"]')).to_contain_text("upload the config.json")
    expect(page.locator("#model")).to_have_value("upload")  # the pickers have loaded
    page.locator("input[type=file]").set_input_files(str(path))
    expect(page.locator("#upload-status")).to_contain_text("32 layers")
    out = cli_json("memory", str(path), "--gpus", "64", "--ep", "8", "--zero", "3")
    expect_stage_row(page, out["stages"][0], 1e9)
    expect(page.locator('[data-error-for="model"]')).to_be_hidden()


# the smallest size an SVG text element is drawn at on screen, in CSS pixels
SMALLEST_TEXT = """sel => Math.min(...[...document.querySelectorAll(sel)].map((t) => {
  const svg = t.ownerSVGElement, box = svg.viewBox.baseVal;
  const scale = box && box.width ? svg.getBoundingClientRect().width / box.width : 1;
  return parseFloat(getComputedStyle(t).fontSize) * scale;
}))"""


def test_phone_layout(page, server_url):
    """390×844: a link jumps to the results, the charts are drawn at the screen's width with
    text of at least 11 px, and nothing scrolls sideways."""
    page.set_viewport_size({"width": 390, "height": 844})
    for name, chart in (("planner", "#breakdown svg"), ("memory", "#chart svg")):
        page.goto(f"{server_url}/{name}")
        page.wait_for_selector(chart)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, name
        assert page.evaluate(SMALLEST_TEXT, ".chart svg text") >= 10.95, name
        for table in page.locator("#ranked").all():  # no hidden sideways scroll inside either
            assert table.evaluate("t => t.scrollWidth <= t.parentElement.clientWidth")
        page.get_by_role("link", name="Jump to results ↓").click()
        top = page.locator("#results").bounding_box()["y"]
        assert -1 <= top < 100, (name, top)
        page.screenshot(path=str(ARTIFACTS / f"{name}-390x844.png"))
    page.goto(f"{server_url}/schedule")
    page.wait_for_selector("#chart svg")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    # the Gantt chart is drawn at the phone's width: its labels stay readable (issue 46: 3.8 px)
    assert page.evaluate(SMALLEST_TEXT, "#chart svg text") >= 9
