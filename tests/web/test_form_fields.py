"""Each form field of the planner, memory and schedule pages, driven in Chromium one after the
other: the request the page sends carries the new value, and the answer on the page changes.
A field the page ignores (issue 46: a second "Training stack" select that the request never
read) fails here, and so does a field that appears twice (Playwright's strict locators) or a
field with no entry in these tables (the lists are read from the page)."""

from __future__ import annotations

import json

from playwright.sync_api import TimeoutError, expect

# field → (what to set, what the request carries); applied in order, each on top of the last.
# The planner starts from 16 GPUs (a quick search), materialised attention, TE's bulk TP overlap,
# no DP overlap and asynchronous checkpoints, so that each of those fields can change to what
# PyTorch FSDP runs (data parallelism only, fused attention, DP overlap, synchronous saves);
# every step has layouts that fit.
PLANNER_BASE = ("/planner?gpus=16&top=5&flash=0&tp_overlap=bulk&dp_overlap=false"
                "&async_checkpoint=1")
PLANNER = {
    "model": ("mistral-7b", "mistral-7b"),
    "gpus": ("32", 32),
    "gpu": ("a100", "a100"),
    "gpus_per_node": ("4", 4),
    "seq": ("4096", 4096),
    "global_batch": ("2M-tokens", "2M-tokens"),
    "tokens": ("1T", "1T"),
    "price": ("2", 2),
    "layout": ("zero=3", "zero=3"),
    "top": ("3", 3),
    "max": ("tp=4", "tp=4"),
    "all_variants": (True, True),
    "intra": ("nvlink4", "nvlink4"),
    "inter": ("roce400", "roce400"),
    "dtype": ("fp32", "fp32"),
    "headroom": ("0.7", 0.7),
    "rank_by": ("goodput", "goodput"),
    "mtbf_gpu_hours": ("2000", 2000),
    "checkpoint_bandwidth": ("0.5GB/s", "0.5GB/s"),
    "restart_minutes": ("60", 60),
    "async_checkpoint": (False, False),
    "fix": ("zero=3", "zero=3"),
    "flash": (True, True),
    "attention": ("fa2", "fa2"),
    "tp_overlap": ("none", "none"),
    "dp_overlap": ("", ""),
    "impl": ("pytorch-fsdp", "pytorch-fsdp"),
    "compile": ("true", "true"),
}
# what the planner shows (its timings and the download's share link left out)
PLANNER_ANSWER = ["#summary", "#answer", "#ranked", "#given-note", "#goodput-card",
                  "#breakdown", "#rejected tbody"]

# the memory page starts from Mixtral with cp=2, ep=2 and an interleaved pipeline of 2 chunks,
# and materialised attention, so those fields can change (torchtitan runs fused attention only)
MEMORY_BASE = ("/memory?model=mixtral-8x7b&tp=2&cp=2&ep=2&pp=2&schedule=interleaved&chunks=2"
               "&flash=0&recompute=none")
MEMORY = {
    "ep": ("1", 1),
    "cp": ("1", 1),
    "model": ("llama3-8b", "llama3-8b"),
    "gpus": ("32", 32),
    "gpu": ("mi300", "mi300"),  # a budget of 192 GB, not 80 GB
    "gpus_per_node": ("4", 4),
    "seq": ("4096", 4096),
    "global_batch": ("256", "256"),
    "tp": ("4", 4),
    "pp": ("4", 4),
    "dp": ("2", 2),
    "micro_batch": ("2", 2),
    "chunks": ("4", 4),
    "schedule": ("1f1b", "1f1b"),  # with chunks=1 (COUPLED)
    "zero": ("0", 0),
    "flash": (True, True),
    "impl": ("torchtitan", "torchtitan"),  # before full recompute and Korthikanti's count
    "recompute": ("full", "full"),
    "sp": (False, False),
    "formula": ("korthikanti", "korthikanti"),
    "headroom": ("0.7", 0.7),
    "unit": ("GiB", None),  # display only: no request, the numbers change
}
# fields set, without an event, before the step's own field: 1F1B runs one chunk per stage
COUPLED = {"schedule": {"chunks": "1"}}
MEMORY_ANSWER = ["#verdict", "#stages", "#kpis", "#chart"]
# sent, same answer: per-GPU memory does not depend on how the GPUs are grouped into nodes, nor,
# with no pipeline yet (pp=1 when it is set), on how many micro-batches make the global batch;
# dp can only be set to what the GPUs leave (any other count is refused)
SAME_ANSWER = {"gpus_per_node", "global_batch", "dp"}

SCHEDULE = {  # from interleaved with 2 chunks
    "chunks": ("4", 4),
    "schedule": ("zb-h1", "zb-h1"),  # with chunks=1 (COUPLED)
    "stages": ("6", 6),
    "microbatches": ("12", 12),
    "t_f": ("1.5", 1.5),
    "t_b": ("2.5", 2.5),
    "t_w": ("1", 1),
    "p2p_latency": ("0.2", 0.2),
}
SCHEDULE_ANSWER = ["#kpis", "#chart", "#peaks"]

ANSWER_TEXT = "sels => sels.map((s) => document.querySelector(s)?.textContent ?? '').join('|')"


def form_fields(page) -> list[str]:
    """The names of the form's visible controls, each once (radio groups by name)."""
    return page.eval_on_selector_all(
        "#form [name]", "els => [...new Set(els.filter((e) => e.type !== 'hidden')"
                        ".map((e) => e.name))]")


def set_field(page, name: str, value) -> None:
    control = page.locator(f'#form [name="{name}"]')
    control.first.evaluate("e => { const d = e.closest('details'); if (d) d.open = true; }")
    kind = control.first.evaluate("e => e.type")
    if kind == "radio":
        page.locator(f'#form label:has(input[name="{name}"][value="{value}"])').click()
    elif kind == "checkbox":
        control.set_checked(value)  # strict: one control per name
    elif kind.startswith("select"):
        control.select_option(value)
    elif kind == "range":
        control.evaluate("(e, v) => { e.value = v; e.dispatchEvent(new Event('input', "
                         "{bubbles: true})); }", value)
    else:
        control.fill(value)


def drive(page, fields: dict, answer: list[str], endpoint: str, submit: bool) -> None:
    assert sorted(form_fields(page)) == sorted(fields), "a field without a test value"
    sent_bodies: list[dict] = []
    page.on("request", lambda r: sent_bodies.append(json.loads(r.post_data))
            if r.url.endswith(endpoint) and r.method == "POST" else None)
    for name, (value, sent) in fields.items():
        before = page.evaluate(ANSWER_TEXT, answer)
        seen = len(sent_bodies)
        for other, quiet in COUPLED.get(name, {}).items():
            page.locator(f'#form [name="{other}"]').evaluate("(e, v) => { e.value = v; }", quiet)
        set_field(page, name, value)
        if submit:
            page.get_by_role("button", name="Plan", exact=True).click()
        if sent is not None:
            for _ in range(100):
                if any(body.get(name) == sent for body in sent_bodies[seen:]):
                    break
                page.wait_for_timeout(100)
            else:
                raise AssertionError(f"{name}: no request carried {sent!r}: "
                                     f"{[b.get(name) for b in sent_bodies[seen:]]}")
        if name in SAME_ANSWER and endpoint == "/api/memory":
            continue
        try:
            page.wait_for_function(f"before => ({ANSWER_TEXT})({json.dumps(answer)}) !== "
                                   "before && !document.querySelector('.stale')",
                                   arg=before, timeout=20_000)
        except TimeoutError:
            raise AssertionError(f"{name}: the answer did not change; "
                                 f"{page.locator('#form-error').text_content()}") from None


def test_each_planner_field_changes_the_request_and_the_answer(page, server_url):
    page.goto(server_url + PLANNER_BASE)
    expect(page.locator("#ranked tbody tr")).to_have_count(5)
    drive(page, PLANNER, PLANNER_ANSWER, "/api/plan", submit=True)
    expect(page.locator("#summary")).to_contain_text("PyTorch FSDP")


def test_each_memory_field_changes_the_request_and_the_answer(page, server_url):
    page.goto(server_url + MEMORY_BASE)
    expect(page.locator("#stages td[data-part=total]").first).to_be_visible()
    drive(page, MEMORY, MEMORY_ANSWER, "/api/memory", submit=False)


def test_each_schedule_field_changes_the_request_and_the_answer(page, server_url):
    page.goto(server_url + "/schedule?chunks=2&schedule=interleaved")
    expect(page.locator("#chart svg")).to_be_visible()
    drive(page, SCHEDULE, SCHEDULE_ANSWER, "/api/schedule", submit=False)
