"""The planner's answer card, downloads and field errors in Chromium, against the CLI: the
recommended layout and the ties are `shardwise plan --json`'s, the choice between the simplest
and the fastest re-plans, the downloaded file is what `shardwise plan … --emit` prints under a
header whose command, run again, prints that file, and a compared layout's error shows on the
layout field."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from click.testing import CliRunner
from playwright.sync_api import expect

from shardwise.cli import cli
from tests.web.cli_json import cli_json


def test_answer_card_ties_choice_and_download(page, server_url):
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(server_url + "/planner?gpus=16")
    out = cli_json("plan", "llama3-8b", "--gpus", "16")
    expect(page.locator("#answer-layout")).to_have_text(out["recommended"]["short"])
    box = page.locator("#answer").bounding_box()  # the answer is on the first screen
    assert box["y"] + box["height"] <= 900, box
    ties = [e["rank"] for e in out["ranked"] if e["tier"] == 1]
    expect(page.locator("#ranked tbody tr.tie")).to_have_count(len(ties))
    expect(page.locator("#decisions li a.learn-link")).to_have_count(
        len(page.locator("#decisions li").all()))
    expect(page.locator("#why")).not_to_have_attribute("open", "")  # folded
    # the downloaded file: a header, then the CLI's --emit output for the same plan
    with page.expect_download() as download:
        page.locator("#download").click()
    text = Path(download.value.path()).read_text()
    assert download.value.suggested_filename == "launch-megatron.sh"
    command = re.search(r"^# the same file: (.+)$", text, re.M)[1]
    assert "this plan: " + server_url + "/planner?" in text
    emitted = CliRunner().invoke(cli, shlex.split(command)[1:], catch_exceptions=False)
    assert emitted.exit_code == 0 and text.endswith(emitted.output)
    assert "--tensor-model-parallel-size" not in text or "tensor parallelism:" in text
    # the fastest: a new request, the fastest layout recommended, its export
    page.locator("label:has(input[name=choose-view][value=fastest])").click()
    fastest = out["ranked"][0]["short"]
    expect(page.locator("#answer-layout")).to_have_text(fastest)
    assert "choose=fastest" in page.url
    expect(page.locator("#emit-for")).to_contain_text(f"the recommended layout, {fastest}")
    expect(page.locator("#emit-text")).to_contain_text(f"# shardwise: llama3-8b, {fastest},")


def test_replan_for_another_stack_and_layout_error_on_its_field(page, server_url):
    page.goto(server_url + "/planner?gpus=16")
    expect(page.locator("#ranked tbody tr")).to_have_count(10)
    page.get_by_role("tab", name="torchtitan").click()
    page.get_by_role("button", name="Re-plan for torchtitan").click()
    expect(page.locator("#impl")).to_have_value("torchtitan")
    expect(page.locator("#summary")).to_contain_text("for torchtitan")
    expect(page.locator("#download")).to_have_text("Download launch-torchtitan.sh")
    # issue 46: `tp=8,pp=3` on 16 GPUs is the layout field's error, not the GPUs field's
    page.get_by_label(re.compile("^Compare my layout")).fill("tp=8,pp=3")
    page.get_by_role("button", name="Plan", exact=True).click()
    expect(page.locator('[data-error-for="layout"]')).to_contain_text("does not divide")
    expect(page.locator('[data-error-for="gpus"]')).to_be_hidden()
    expect(page.locator("#layout")).to_have_attribute("aria-invalid", "true")
    page.console_errors.clear()  # the deliberate 400


def test_selected_segment_shows_the_keyboard_focus(page, server_url):
    page.goto(server_url + "/planner?gpus=16")
    expect(page.locator("#answer-layout")).not_to_be_empty()
    page.locator("input[name=choose-view][value=simplest]").focus()
    page.keyboard.press("Space")
    ring = page.locator("input[name=choose-view]:checked + span").evaluate(
        "s => [getComputedStyle(s).outlineStyle, getComputedStyle(s).outlineColor, "
        "getComputedStyle(s).backgroundColor]")
    assert ring[0] == "solid" and ring[1] != ring[2], ring  # a ring unlike the fill


def test_home_questions_open_prefilled_tools(page, server_url):
    """Each example question on the home page opens its tool with the question's inputs in
    the form and an answer, with no error."""
    page.goto(server_url + "/")
    links = page.locator("#questions a")
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    assert len(hrefs) >= 5
    answers = {"/planner": "#answer-layout", "/memory": "#stages td[data-part=total]",
               "/schedule": "#chart svg", "/learn/context-wall": "svg"}
    for href in hrefs:
        page.goto(server_url + "/")
        page.locator(f'#questions a[href="{href}"]').click()
        path, _, query = href.partition("?")
        expect(page.locator(answers[path]).first).to_be_visible(timeout=30_000)
        for key, value in (pair.split("=") for pair in query.split("&") if pair):
            radio = page.locator(f'#form input[type=radio][name="{key}"][value="{value}"]')
            if radio.count():
                expect(radio).to_be_checked()
            else:
                expect(page.locator(f'#form [name="{key}"]')).to_have_value(value)
        assert page.locator("#form-error").count() == 0 or page.locator(
            "#form-error").is_hidden(), href


def test_learn_cards_show_thumbnails(page, server_url):
    page.goto(server_url + "/learn/index")
    thumbs = page.locator("#widgets img.thumb")
    expect(thumbs).to_have_count(10)
    page.evaluate("() => Promise.all([...document.images].map((i) => i.decode()))")
    assert all(w > 100 for w in thumbs.evaluate_all("imgs => imgs.map((i) => i.naturalWidth)"))


def test_each_launcher_job_downloads_as_the_cli_writes_it(page, server_url):
    # 32 GPUs on 8-GPU nodes: 4 nodes, so the job's shape is not the single-node one
    page.goto(server_url + "/planner?gpus=32")
    expect(page.locator("#job-k8s")).to_contain_text("needs --image")  # no image on the page
    for launcher, filename in (("slurm", "megatron.sbatch"),
                               ("skypilot", "megatron-skypilot.yaml")):
        with page.expect_download() as download:
            page.locator(f"#job-{launcher}").click()
        assert download.value.suggested_filename == filename
        text = Path(download.value.path()).read_text()
        command = shlex.split(re.search(r"^# the same file: (.+)$", text, re.M)[1])
        assert command[-4:] == ["--emit", "megatron", "--launcher", launcher]
        printed = CliRunner().invoke(cli, command[1:], catch_exceptions=False)
        assert printed.exit_code == 0, printed.output
        job = printed.stdout
        if job.startswith("#!"):  # the header goes under the shebang
            first, job = job.split("\n", 1)
            assert text.startswith(first + "\n")
        assert text.endswith(job) and "this plan: " + server_url in text
    assert "num_nodes: 4" in text  # the SkyPilot task: the planned nodes
