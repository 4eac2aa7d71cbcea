"""The status page's alerts view (the last alerts of the standing questions, newest first, with their time, rule and
evidence frame) and its one request a second: ``/v1/edgekv/status`` carries the device's clock, so the page no
longer asks ``/v1/edgekv/clock`` too (kept for other clients)."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import time
import zoneinfo

import pytest

from helpers_server import RunningDaemon, call, poll, server_config

pytest.importorskip("fastapi")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "alerts-token-5"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 120
HOSTILE = '<img src=x onerror="window.__pwned=1">'
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
                          (e) => window.__violations.push(e.violatedDirective + " " + e.blockedURI));
"""


def raise_alert(daemon, name: str, raised_unix: float, keyframe: bytes | None, question: str = "Is a box there?"):
    """An alert as a standing question raises it, published on the daemon's bus (its outputs, its list, its log)."""
    from edgekv.apps.outputs.alerts import AlertEvent

    event = AlertEvent(id=f"evt-{name[:3].encode().hex()}-{int(raised_unix * 1000)}", rule_id="alert-1", name=name,
                       question=question, camera=None, p_yes=0.83, stream_t=1.0, evidence_pair=0, evidence_t=0.5,
                       raised_unix=raised_unix, keyframe_jpeg=keyframe, evidence_unix=raised_unix - 2)
    daemon.alerts.bus.publish(event)
    return event


def status(port: int) -> dict:
    code, _, body = call(port, "GET", "/v1/edgekv/status", headers=AUTH)
    assert code == 200
    return json.loads(body)


def test_the_status_carries_the_clock_and_the_last_alerts_newest_first(tiny_checkpoint, tmp_path, zone):
    zone("Asia/Kathmandu")
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        assert call(run.port, "GET", "/v1/edgekv/status")[0] == 401  # the alerts are behind the sign-in
        before = status(run.port)
        assert before["alerts"] == {"rules": 0, "events": []}
        clock = before["clock"]
        assert clock["zone"] == "Asia/Kathmandu" and clock["utc_offset_s"] == 20700
        assert abs(clock["unix"] - time.time()) < 60

        now = time.time()
        older = raise_alert(run.daemon, "a box on the table", now - 30, keyframe=None)
        newer = raise_alert(run.daemon, "the door is open", now - 5, keyframe=run.daemon.latest_jpeg())
        deadline = time.monotonic() + WAIT_S  # the figures are served again for FRESH_S
        while [e["id"] for e in status(run.port)["alerts"]["events"]] != [newer.id, older.id]:
            assert time.monotonic() < deadline, status(run.port)["alerts"]
            time.sleep(0.1)
        shown = status(run.port)["alerts"]["events"]
        assert [e["name"] for e in shown] == ["the door is open", "a box on the table"]
        assert shown[0]["raised_unix"] == newer.raised_unix and shown[0]["evidence_unix"] == newer.evidence_unix
        assert shown[0]["keyframe_url"] == f"/v1/alerts/events/{newer.id}/keyframe.jpg"
        assert "keyframe_url" not in shown[1]  # its frame was not kept: no link
        code, headers, body = call(run.port, "GET", shown[0]["keyframe_url"], headers=AUTH)
        assert code == 200 and headers["content-type"] == "image/jpeg" and body[:2] == b"\xff\xd8"
        assert "keyframe_jpeg_base64" not in json.dumps(shown)  # a link, not the picture, once a second
        assert call(run.port, "GET", "/v1/edgekv/clock", headers=AUTH)[0] == 200  # kept for other clients


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_the_page_shows_the_alerts_with_their_time_rule_and_evidence(tiny_checkpoint, tmp_path, zone):
    """Signed in from a browser in another zone: "no standing questions" at first, then the alerts newest first at
    the device's time, a name that is HTML shown as text, an evidence frame the cookie opens; one request a second
    (the clock comes with the status) and nothing the Content-Security-Policy refuses."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    zone("Asia/Kathmandu")
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context(viewport={"width": 360, "height": 740}, timezone_id="America/Los_Angeles")
            context.add_init_script(RECORD_VIOLATIONS)
            page = context.new_page()
            errors, requested = [], []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("request", lambda request: requested.append(request.url))
            page.goto(run.base + "/")
            page.fill("#token", TOKEN)
            with page.expect_navigation():
                page.click("#signin")
            poll(page, "document.querySelector('#alerts li.none')", WAIT_S)
            assert page.inner_text("#alerts").startswith("No standing questions")

            now = time.time()
            raise_alert(run.daemon, "a box on the table", now - 30, keyframe=None)
            raise_alert(run.daemon, HOSTILE, now - 5, keyframe=run.daemon.latest_jpeg(), question="Is it open?")
            poll(page, "document.querySelector('#alerts').dataset.count === '2'", WAIT_S)
            rows = page.evaluate("""() => [...document.querySelectorAll('#alerts li')].map((li) => ({
                when: li.querySelector('.when').textContent, rule: li.querySelector('.rule').textContent,
                title: li.querySelector('.rule').title, meta: li.querySelector('.meta').textContent,
                link: li.querySelector('a') ? li.querySelector('a').getAttribute('href') : null}))""")
            device = zoneinfo.ZoneInfo("Asia/Kathmandu")
            assert [r["rule"] for r in rows] == [HOSTILE, "a box on the table"]  # newest first, as text
            assert page.evaluate("() => window.__pwned") is None
            for row, raised in zip(rows, (now - 5, now - 30)):
                assert row["when"].endswith(dt.datetime.fromtimestamp(int(raised), device).strftime("%H:%M:%S")), row
                assert "P(yes) 0.83" in row["meta"] and "evidence seen " in row["meta"]
            assert rows[0]["title"] == "Is it open?"
            assert rows[0]["link"].startswith("/v1/alerts/events/") and rows[1]["link"] is None
            fetched = page.evaluate("""(href) => fetch(href, {credentials: 'same-origin'})
                .then((r) => [r.status, r.headers.get('content-type')])""", rows[0]["link"])
            assert fetched == [200, "image/jpeg"]  # the page's cookie opens the evidence frame

            polls = len([url for url in requested if url.endswith("/v1/edgekv/status")])
            poll(page, f"performance.getEntriesByName(location.origin + '/v1/edgekv/status').length > {polls + 2}",
                 WAIT_S)
            assert not [url for url in requested if "/v1/edgekv/clock" in url]
            assert "Asia/Kathmandu (UTC+05:45)" in page.inner_text("#clock")
            width, inner = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
            assert width <= inner  # a phone: the view wraps, never scrolls sideways
            assert errors == [] and page.evaluate("() => window.__violations") == []
        finally:
            browser.close()
