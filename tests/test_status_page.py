"""The status page in a real headless Chromium (Debian's package, driven by Playwright): it loads, shows
the figures and the latest frame, and a question typed in the box gets an answer streamed back."""

from __future__ import annotations

import shutil
import struct

import pytest

from test_daemon import Running, _config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)"),
]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_page_loads_asks_and_shows_an_answer(tiny_checkpoint, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    with open(tmp_path / "out.txt", "w") as log, Running(_config(tiny_checkpoint), log) as run:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1000, "height": 700})
                page.goto(run.base + "/")
                page.wait_for_function("document.querySelector('#figures').textContent.includes('cache')",
                                       timeout=20_000)
                page.wait_for_function("document.querySelector('#frame').naturalWidth > 0", timeout=20_000)
                assert "tokens" in page.inner_text("#figures")
                page.fill("#question", "What is moving?")
                page.click("#send")
                page.wait_for_selector("#answer[data-done='1']", timeout=60_000)
                answer = page.inner_text("#answer")
                shot = tmp_path / "page.png"
                page.screenshot(path=str(shot))
            finally:
                browser.close()
    assert answer.strip() and not answer.startswith("error")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 700)
    assert run.daemon.session.stats()["questions"] >= 1
