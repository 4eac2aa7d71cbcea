"""The status page under a Content-Security-Policy without ``'unsafe-inline'``, in a real headless Chromium
(Debian's package, driven by Playwright): the login form and the page run from their own files, nothing is
refused by the policy (Chromium reports each refusal as a ``securitypolicyviolation`` event and a console error),
and signing out from the page kills the session server-side (a copy of its cookie is refused after)."""

from __future__ import annotations

import shutil

import pytest

from helpers_server import RunningDaemon, call, poll, server_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "csp-token-3"
# before any page script: every refusal of the policy, as the page itself would see it
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
                          (e) => window.__violations.push(e.violatedDirective + " " + e.blockedURI));
"""


def test_the_page_runs_under_a_policy_without_inline_scripts(tiny_checkpoint, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 760})
            context.add_init_script(RECORD_VIOLATIONS)
            page = context.new_page()
            console: list[str] = []
            page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
            response = page.goto(run.base + "/")
            assert "'unsafe-inline'" not in response.headers["content-security-policy"]
            assert page.evaluate("() => window.__violations") == []

            page.fill("#token", "wrong")
            page.click("#signin")  # login.js: the form is sent as JSON and the error shown
            poll(page, "document.querySelector('#error').textContent.includes('wrong token')")
            page.fill("#token", TOKEN)
            with page.expect_navigation():
                page.click("#signin")
            poll(page, "document.querySelector('#figures')?.textContent.includes('cache')")  # page.js runs
            poll(page, "document.querySelector('#frame').naturalWidth > 0")
            page.check("#overlay")  # its handlers are attached
            assert page.is_visible("#heat")
            assert page.evaluate("() => window.__violations") == []

            copied = {c["name"]: c["value"] for c in context.cookies()}["edgekv_session"]
            assert call(run.port, "GET", "/v1/edgekv/status", headers={"Cookie": f"edgekv_session={copied}"})[0] == 200
            poll(page, "!document.querySelector('#logout').hidden")
            with page.expect_navigation():
                page.click("#logout")
            poll(page, "document.querySelector('#login') !== null")
            status, _, _ = call(run.port, "GET", "/v1/edgekv/status", headers={"Cookie": f"edgekv_session={copied}"})
            assert status == 401  # the copy died with the sign-out
            assert page.evaluate("() => window.__violations") == []
            refused = [line for line in console if "Content Security Policy" in line]
            assert not refused, refused
        finally:
            browser.close()
