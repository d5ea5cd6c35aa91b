"""The web page at / (strata/web): served without the key, its API calls guarded by it, and, in a real
headless Chromium driven by Playwright, a streamed chat answer and a dashboard whose counters move,
on a live server and on a router over it.

The browser is the system's Chromium (Debian: `apt-get install chromium`; $STRATA_CHROMIUM to point
elsewhere) and Playwright's Python package (`pip install -e '.[web-test]'`); nothing is downloaded.
Where either is missing the browser tests skip and say which. `STRATA_UPDATE_SCREENSHOTS=1` also
writes the screenshots to docs/img/ (otherwise they go to the test's temp dir).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, free_port

pytestmark = pytest.mark.e2e

KEY = "web-test-key"
ROUTER_KEY = "router-web-key"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
SYSTEM = "You are a terse assistant. Answer in one short sentence and never add anything else to it."


@pytest.fixture(scope="module")
def server():
    with LiveServer("--served-model-name", "tiny", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def router(server):
    """`strata router` over the live server, with a key of its own."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the router's log, kept for the fixture's life
        prefix="strata-router-", suffix=".log", delete=False
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata.router",
            "--port",
            str(port),
            "--worker-urls",
            server.url,
            "--worker-api-key",
            KEY,
            "--api-key",
            ROUTER_KEY,
            "--log-level",
            "warning",
            "--load-poll-interval",
            "0.2",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (
                "router not ready: " + Path(log.name).read_text()
            )
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        os.unlink(log.name)


def test_page_is_public_and_its_api_calls_need_the_key(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith(
        "text/html"
    )
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert KEY not in page.text
    # every script and stylesheet is this server's own: nothing from a CDN
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("/ui/") for r in refs), refs
    for ref in refs:
        asset = httpx.get(server.url + ref)
        assert asset.status_code == 200 and asset.content, ref
        assert "http://" not in asset.text and "https://" not in asset.text, ref
    for path in ("/get_server_info", "/metrics", "/v1/models"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert (
            httpx.get(server.url + path, headers=server.headers).status_code == 200
        ), path


def test_router_page_is_public_and_its_api_calls_need_the_routers_key(router):
    assert httpx.get(router + "/").status_code == 200
    assert httpx.get(router + "/ui/app.js").status_code == 200
    assert httpx.get(router + "/workers").status_code == 401
    assert (
        httpx.get(
            router + "/workers", headers={"Authorization": f"Bearer {KEY}"}
        ).status_code
        == 401
    )
    assert (
        httpx.get(
            router + "/workers", headers={"Authorization": f"Bearer {ROUTER_KEY}"}
        ).status_code
        == 200
    )


# ------------------------------------------------------------------ in a browser


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        pytest.skip(
            "Playwright is not installed: pip install -e '.[web-test]' (.ci/run does)"
        )
    exe = (
        os.environ.get("STRATA_CHROMIUM")
        or shutil.which("chromium")
        or "/usr/bin/chromium"
    )
    if not os.path.exists(exe):
        pytest.skip(
            f"no Chromium at {exe}: apt-get install chromium (.ci/run tries), or set STRATA_CHROMIUM"
        )
    with sync_playwright() as pw:
        try:
            chromium = pw.chromium.launch(
                executable_path=exe, args=CHROMIUM_ARGS, headless=True
            )
        except Error as exc:
            pytest.skip(f"Chromium at {exe} did not start: {exc}")
        yield chromium
        chromium.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    if os.environ.get("STRATA_UPDATE_SCREENSHOTS") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        return DOCS_IMG
    return tmp_path


def open_page(browser, url: str, key: str):
    """The page loaded without a key: it asks for one; given it, it lists the models."""
    context = browser.new_context(viewport={"width": 1400, "height": 860})
    page = context.new_page()
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.wait_for_selector("#auth-banner", state="visible")
    assert page.evaluate("sessionStorage.length") == 0
    page.fill("#api-key", key)
    page.click("#save-key")
    page.wait_for_selector("#model option[value='tiny']", state="attached")
    assert page.evaluate("sessionStorage.getItem('strata.apiKey')") == key
    return context, page, requested, errors


def number(page, selector: str) -> float:
    text = page.inner_text(selector).replace(",", "").replace("%", "")
    return float(text) if text not in ("\N{EN DASH}", "") else float("nan")


def wait_number(page, selector: str, predicate, timeout_s: float = 30) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = number(page, selector)
        if predicate(value):
            return value
        assert time.monotonic() < deadline, (
            f"{selector} stayed at {page.inner_text(selector)!r}"
        )
        time.sleep(0.2)


def chat(page, prompt: str):
    """Send one message; returns (answer element, how many times its text changed while streaming)."""
    before = page.locator(".msg.assistant.done").count()
    page.evaluate(
        """() => {
            window.__updates = 0;  // changes of an answer's text (not of the list around it)
            const onChange = (records) => {
                for (const r of records) if (r.target.classList && r.target.classList.contains('content')
                    && r.target.closest('.assistant')) window.__updates += 1;
            };
            const options = {subtree: true, childList: true};
            new MutationObserver(onChange).observe(document.getElementById('messages'), options);
        }"""
    )
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector(f".msg.assistant.done >> nth={before}", timeout=60_000)
    answer = page.locator(".msg.assistant").nth(before)
    return answer, page.evaluate("window.__updates")


def test_chat_streams_and_the_dashboard_moves(browser, server, shots):
    context, page, requested, errors = open_page(browser, server.url, KEY)
    try:
        done_before = wait_number(
            page, "#stat-requests", lambda v: v == v
        )  # first poll answered
        page.fill("#system", SYSTEM)
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "24")
        assert page.is_checked("#stream")

        answer, updates = chat(page, "Why is the sky blue?")
        text = answer.locator(".content").inner_text()
        completion_tokens = int(answer.get_attribute("data-completion-tokens"))
        assert text and "error" not in text
        assert (
            completion_tokens == 24
        )  # the tiny random model never says EOS this early
        assert updates >= 5, (
            f"the answer arrived in {updates} DOM updates: not streamed"
        )
        assert int(answer.get_attribute("data-prompt-tokens")) > 0
        assert "first token" in answer.locator(".stats").inner_text()

        # the second turn resends the first: its prefix comes from the cache, and the page says so
        second, _ = chat(page, "And at sunset?")
        assert int(second.get_attribute("data-cached-tokens")) > 0
        assert "cached" in second.locator(".stats").inner_text()

        assert (
            wait_number(page, "#stat-requests", lambda v: v >= done_before + 2)
            >= done_before + 2
        )
        assert wait_number(page, "#stat-output-tokens", lambda v: v >= 48) >= 48
        wait_number(page, "#stat-hit-rate", lambda v: v > 0)
        ttft_row = page.locator(
            "#latency tr[data-metric='strata:time_to_first_token_seconds'] td"
        )
        assert ttft_row.nth(1).inner_text() != "\N{EN DASH}"
        page.wait_for_selector("#tiers tbody tr")

        page.locator("#playground").screenshot(path=str(shots / "playground.png"))
        page.locator("#dashboard").screenshot(path=str(shots / "dashboard.png"))
        assert not errors, errors
        assert all(u.startswith(server.url + "/") for u in requested), (
            requested
        )  # nothing from elsewhere
    finally:
        context.close()


def test_json_schema_box_sends_response_format(browser, server):
    context, page, _, errors = open_page(browser, server.url, KEY)
    try:
        sent: list[dict] = []
        page.on(
            "request",
            lambda r: (
                sent.append(r.post_data_json)
                if r.url.endswith("/v1/chat/completions")
                else None
            ),
        )
        page.fill("#schema", "{not json")
        page.fill("#prompt", "hi")
        page.click("#send")
        assert "not valid JSON" in page.inner_text("#chat-error")
        assert not sent  # nothing was sent with a broken schema

        schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
        page.fill("#schema", schema)
        page.fill("#max-tokens", "8")
        page.uncheck("#stream")
        page.fill("#prompt", "hi")
        page.click("#send")
        page.wait_for_selector(
            ".msg.assistant.done, .msg.assistant.failed", timeout=60_000
        )
        assert sent and sent[0]["response_format"] == {
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": json.loads(schema),
                "strict": True,
            },
        }
        assert sent[0]["stream"] is False and sent[0]["max_tokens"] == 8
        assert not errors, errors
    finally:
        context.close()


def test_router_dashboard_shows_each_workers_load(browser, router, server, shots):
    context, page, requested, errors = open_page(browser, router, ROUTER_KEY)
    try:
        page.wait_for_selector("#workers-box", state="visible")
        assert "router" in page.inner_text("#role")
        row = page.locator("#workers tbody tr").first
        row.wait_for()
        assert row.locator("td").nth(0).inner_text() == server.url
        assert row.locator("td").nth(1).inner_text() == "healthy"
        before = wait_number(page, "#stat-requests", lambda v: v == v)
        page.fill("#max-tokens", "8")
        answer, _ = chat(page, "Hello through the router")
        assert int(answer.get_attribute("data-completion-tokens")) > 0
        wait_number(page, "#stat-requests", lambda v: v > before)
        assert (
            int(row.locator("td").nth(8).inner_text()) >= 1
        )  # requests the router sent this worker
        page.locator("#dashboard").screenshot(path=str(shots / "router-dashboard.png"))
        assert not errors, errors
        assert all(u.startswith(router + "/") for u in requested), requested
    finally:
        context.close()
