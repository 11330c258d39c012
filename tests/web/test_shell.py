"""The app shell: the home page, the API docs (offline), unknown pages, hover and focus
styles of the controls."""

from __future__ import annotations

import re
from urllib.parse import urlparse

from playwright.sync_api import expect

from tests.web.conftest import ARTIFACTS


def test_unknown_page_is_404(client):
    assert client.get("/no-such-page").status_code == 404
    assert client.get("/learn/..%2Fapp").status_code == 404


def test_openapi_docs(client):
    assert client.get("/docs").status_code == 200
    assert client.get("/openapi.json").json()["info"]["title"] == "shardwise"


def test_home_page_in_browser(page, server_url):
    page.goto(server_url + "/")
    assert page.locator("nav.topnav a.brand").inner_text() == "shardwise"
    assert page.get_by_role("link", name="Planner").count() >= 1


def test_unknown_pages_get_a_404_page_and_the_api_json(page, server_url, client):
    api = client.get("/api/no-such")
    assert api.status_code == 404 and api.headers["content-type"] == "application/json"
    response = page.goto(server_url + "/no-such-page")
    page.console_errors.clear()  # the browser logs the 404 itself
    assert response.status == 404 and "text/html" in response.headers["content-type"]
    expect(page.locator("h1")).to_have_text("Page not found")
    expect(page.locator("#path")).to_have_text("/no-such-page")
    page.locator("nav.topnav").get_by_role("link", name="Planner").click()
    expect(page).to_have_url(re.compile(r"/planner\?"))


def test_api_docs_render_with_no_network(page, server_url, client):
    """Every request that would leave the loopback interface is blocked: Swagger UI still
    renders one block per operation of the OpenAPI document, and nothing was blocked."""
    blocked: list[str] = []

    def loopback_only(route):
        if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.context.route("**/*", loopback_only)
    page.goto(server_url + "/docs")
    operations = sum(len(methods) for methods in client.get("/openapi.json").json()["paths"]
                     .values())
    expect(page.locator(".opblock")).to_have_count(operations)
    expect(page.locator(".opblock-summary-path", has_text="/api/plan").first).to_be_visible()
    assert blocked == []


FOCUS = """() => {
  const el = document.activeElement;
  const shown = el.matches('.seg input') ? el.nextElementSibling : el;
  const style = getComputedStyle(shown);
  return [el.tagName + (el.id ? '#' + el.id : ''), style.outlineStyle, parseFloat(style.outlineWidth)];
}"""

LABEL = "b => [getComputedStyle(b).color, getComputedStyle(b).backgroundColor]"


def test_primary_labels_stay_visible_and_every_control_shows_focus(page, server_url, browser):
    """The explainers' primary buttons keep a white label on the accent background when
    hovered (pointer) and after a tap (phone); Tab shows a focus ring on every planner control."""
    for name, label in (("zero-stages", "Next stage"), ("ring-allreduce", "Step")):
        page.goto(f"{server_url}/learn/{name}")
        button = page.get_by_role("button", name=re.compile(f"^{label}"))
        button.hover()
        color, background = button.evaluate(LABEL)
        assert color == "rgb(255, 255, 255)" and background != color, name
    page.screenshot(path=str(ARTIFACTS / "ring-allreduce-hover-1280x800.png"))
    phone = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True,
                                is_mobile=True)
    tapped = phone.new_page()
    tapped.goto(f"{server_url}/learn/zero-stages")
    button = tapped.get_by_role("button", name=re.compile("^Next stage"))
    button.tap()
    color, background = button.evaluate(LABEL)
    assert color == "rgb(255, 255, 255)" and background != color
    tapped.screenshot(path=str(ARTIFACTS / "zero-stages-tap-390x844.png"))
    phone.close()
    page.goto(server_url + "/planner")
    expect(page.locator("#results")).to_be_visible(timeout=30_000)
    seen = set()
    for _ in range(40):
        page.keyboard.press("Tab")
        name, style, width = page.evaluate(FOCUS)
        if name == "BODY":
            continue
        seen.add(name)
        assert style != "none" and width >= 1, (name, style, width)
    assert {"INPUT#gpus", "SELECT#model", "BUTTON#run", "INPUT#fix"} <= seen
