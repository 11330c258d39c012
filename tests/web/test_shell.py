"""The app shell: the home page, the API docs, unknown pages."""

from __future__ import annotations


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
