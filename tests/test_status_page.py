"""The status page in a real headless Chromium (Debian's package, driven by Playwright), with a token set:
the login form sets an HttpOnly SameSite=Strict cookie, then the page shows the figures, the latest frame
(an <img>, which no bearer header could authenticate), questions from every channel with their answers,
the memory sparkline, the frame shown true with the kept-patch overlay behind a toggle, a heatmap legend
drawn with the overlay's own colours, a question typed in the box
answered by streaming, and the "stream ended" and "daemon stopped" states.

Set EDGEKV_SCREENSHOTS=DIR to keep the screenshots."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from edgekv.apps.questions import Question
from helpers_server import RunningDaemon, poll, server_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "page-token-42"


def screenshot(page, tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("EDGEKV_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    page.screenshot(path=str(path), full_page=True)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 1100 and height >= 760
    return path


def test_page_with_a_token_login_figures_questions_and_states(tiny_checkpoint, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 760})
            page = context.new_page()
            page.goto(run.base + "/")
            assert page.is_visible("#login") and not page.query_selector("#frame")

            page.fill("#token", "wrong")
            page.click("#signin")
            poll(page, "document.querySelector('#error').textContent.includes('wrong token')")

            page.fill("#token", TOKEN)
            with page.expect_navigation():  # the form reloads the page once the cookie is set
                page.click("#signin")
            poll(page, "document.querySelector('#figures')?.textContent.includes('cache')")
            poll(page, "document.querySelector('#frame').naturalWidth > 0")  # an <img>: the cookie authenticates it
            cookie = {c["name"]: c for c in context.cookies()}["edgekv_session"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
            assert page.evaluate("() => document.cookie") == ""  # invisible to page scripts

            # a question from another channel shows with its answer
            run.daemon.submit(Question("What did stdin see?", source="stdin", max_new_tokens=3))
            poll(page, "document.querySelector('#questions').textContent.includes('What did stdin see?')")
            assert "stdin" in page.inner_text("#questions li")

            page.fill("#question", "What is moving?")
            page.click("#send")
            page.wait_for_selector("#answer[data-done='1']", timeout=60_000)
            answer = page.inner_text("#answer")
            assert answer.strip() and not answer.startswith("error")
            # when its evidence was seen (a live camera: a wall time), and the frame while the daemon keeps it
            evidence = page.inner_text("#evidence")
            assert evidence.startswith("evidence: seen ") and " s (frame pair " in evidence, evidence
            if "no longer kept" not in evidence:
                poll(page, "document.querySelector('#evidence img').naturalWidth > 0")  # the cookie authenticates it
            poll(page, "document.querySelector('#questions li .src').textContent === 'http'")

            poll(page, "document.querySelector('#memory polyline').getAttribute('points').split(' ').length >= 3")
            figures = page.inner_text("#figures")
            for label in ("ingest rate", "fps", "last answer TTFT", "ms", "tok/s", "process RSS",
                          "memory in the cache reaches back\tto "):  # a live camera: the wall time it goes back to
                assert label in figures, label
            assert page.inner_text("#state") == "live" and not page.is_visible("#banner")

            # the frame is shown true; the kept-patch overlay only when asked for (issue 25: it tinted grey olive)
            assert not page.is_visible("#heat") and page.is_visible("#frame")
            page.check("#overlay")
            assert page.is_visible("#heat")
            _legend_matches_the_overlay(page)
            page.uncheck("#overlay")
            assert not page.is_visible("#heat")
            live = screenshot(page, tmp_path, "status-live.png")

            # the stream ended: the real status with the daemon's stream state replaced
            def ended(route):
                response = route.fetch()
                payload = response.json()
                payload["daemon"].update(stream_state="ended", stream_detail="the source ended")
                route.fulfill(response=response, body=json.dumps(payload))

            page.route("**/v1/edgekv/status", ended)
            poll(page, "document.querySelector('#state').textContent === 'stream ended'")
            banner = page.inner_text("#banner")
            assert "the source ended" in banner and "about what was seen" in banner
            screenshot(page, tmp_path, "status-ended.png")
            page.unroute("**/v1/edgekv/status")
            poll(page, "document.querySelector('#state').textContent === 'live'")

            run.stop()  # the daemon stops: the page says so and stops offering the Ask button
            poll(page, "document.querySelector('#state').textContent === 'daemon stopped'", timeout_s=30)
            assert "not answering" in page.inner_text("#banner") and page.is_disabled("#send")
            screenshot(page, tmp_path, "status-stopped.png")
        finally:
            browser.close()
    assert live.stat().st_size > 10_000


def _legend_matches_the_overlay(page) -> None:
    """The legend's ends are the overlay's colours for 0 % and 100 % kept, and an overlay cell has the colour
    of its kept share."""
    colours = page.evaluate("""() => {
        const legend = document.querySelector('#legend').getContext('2d');
        const px = (ctx, x, y) => Array.from(ctx.getImageData(x, y, 1, 1).data);
        return {left: px(legend, 0, 0), right: px(legend, 63, 0), zero: keptColour(0), one: keptColour(1)};
    }""")
    assert close(colours["left"], colours["zero"]) and close(colours["right"], colours["one"])
    assert not close(colours["zero"], colours["one"])
    # the figures the overlay was last painted from, read in the same turn of the page's event loop as the
    # pixel (a status fetched separately may already hold newer figures than the ones painted)
    cell = page.evaluate("""() => {
        const k = window.paintedKept, heat = document.querySelector('#heat');
        return {px: Array.from(heat.getContext('2d').getImageData(0, 0, 1, 1).data), v: k.kept[0][0],
                colour: keptColour(k.kept[0][0])};
    }""")
    assert close(cell["px"], cell["colour"]), cell


def close(pixel: list[int], colour: list[int]) -> bool:
    """Equal RGBA up to the canvas's premultiplied-alpha rounding."""
    return all(abs(a - b) <= 2 for a, b in zip(pixel, colour, strict=True))


def test_page_says_a_camera_that_has_not_answered_yet(tiny_checkpoint, tmp_path):
    """An IP camera not up when the daemon starts (video.wait_for_stream): the page says "reconnecting" with the
    daemon's own words ("not reached yet", not "stopped delivering frames", which it never did), then "live" once it
    answers."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    pytest.importorskip("cv2")
    from helpers_cameras import MjpegCamera

    camera = MjpegCamera()
    config = server_config(tiny_checkpoint).with_overrides(
        video={"source": camera.url, "reconnect_backoff_s": [0.05, 0.2], "stream_timeout_s": 5.0})
    try:
        with RunningDaemon(config, tmp_path / "out.txt", pairs=0) as run, sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_context(viewport={"width": 1100, "height": 760}).new_page()
                page.goto(run.base + "/")
                poll(page, "document.querySelector('#state').textContent === 'reconnecting'", timeout_s=60)
                poll(page, "document.querySelector('#banner').textContent.includes('not reached yet')")
                assert "stopped delivering" not in page.inner_text("#banner")
                screenshot(page, tmp_path, "status-not-reached.png")
                camera.power_on()
                poll(page, "document.querySelector('#state').textContent === 'live'", timeout_s=60)
            finally:
                browser.close()
    finally:
        camera.close()


def test_page_picks_a_camera_when_several_watch(tmp_path):
    """video.sources: the page offers the cameras, lists each one's figures, shows the chosen camera's frame
    and asks the chosen camera (a streamed answer needs one)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    import threading

    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": [{"name": "front", "source": "synthetic:events?size=112x112&fps=4&frames=100000&seed=1"},
                           {"name": "back", "source": "synthetic:events?size=112x112&fps=4&frames=100000&seed=2"}],
               "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 1280, "text_reserve_tokens": 64},
        server={"port": 0}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 3})
    cameras = CameraSet(config, daemon_args(), out=open(tmp_path / "out.txt", "w"))
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    try:
        assert cameras.ready.wait(120)
        base = f"http://127.0.0.1:{cameras.first.server.port}"
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_context(viewport={"width": 1100, "height": 760}).new_page()
                page.goto(base + "/")
                poll(page, "!document.querySelector('#camera').hidden")
                assert page.evaluate("() => [...document.querySelectorAll('#camera option')].map(o => o.value)") == \
                    ["front", "back"]
                poll(page, "document.querySelector('#figures').textContent.includes('camera back')")
                page.select_option("#camera", "back")
                poll(page, "document.querySelector('#frame').src.includes('camera=back')")
                poll(page, "document.querySelector('#frame').naturalWidth > 0")
                page.fill("#question", "Was there a red circle?")
                page.click("#send")
                page.wait_for_selector("#answer[data-done='1']", timeout=60_000)
                answer = page.inner_text("#answer")
                assert answer.strip() and not answer.startswith("error"), answer
                screenshot(page, tmp_path, "status-cameras.png")
            finally:
                browser.close()
    finally:
        cameras.stop.event.set()
        thread.join(60)
    assert cameras.daemons["back"].session.counters.questions >= 1  # the chosen camera answered
