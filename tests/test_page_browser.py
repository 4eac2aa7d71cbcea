"""The status page as its users meet it, in a real headless Chromium (Debian's package, driven by Playwright): a
phone in another time zone than the device, a 360 px phone and a desktop (and 200 % zoom), the privacy switch, a
daemon that restarts under a signed-in page, the states a daemon can be in, and text that is long, right-to-left,
emoji or HTML. Set EDGEKV_SCREENSHOTS=DIR to keep the screenshots."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from edgekv.apps.questions import Question
from helpers_server import RunningDaemon, call, poll, server_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "browser-token-7"
PHONE = {"width": 360, "height": 740}
DESKTOP = {"width": 1280, "height": 800}
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
                          (e) => window.__violations.push(e.violatedDirective + " " + e.blockedURI));
"""
WAIT_S = 120


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Watched:
    """A page with what went wrong in it recorded: uncaught errors, console errors, policy refusals."""

    def __init__(self, browser, viewport: dict, **context) -> None:
        self.context = browser.new_context(viewport=viewport, **context)
        self.context.add_init_script(RECORD_VIOLATIONS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.console: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", lambda m: self.console.append(m.text) if m.type == "error" else None)

    def sign_in(self, base: str) -> None:
        self.page.goto(base + "/")
        self.page.fill("#token", TOKEN)
        with self.page.expect_navigation():
            self.page.click("#signin")
        poll(self.page, "document.querySelector('#figures')?.textContent.includes('cache')", WAIT_S)

    def ask(self, question: str) -> str:
        self.page.fill("#question", question)
        self.page.click("#send")
        self.page.wait_for_selector("#answer[data-done='1']", timeout=WAIT_S * 1000)
        return self.page.inner_text("#answer")

    def assert_clean(self, console: bool = True) -> None:
        """Nothing went wrong; ``console``: not even a console error (a failed load: the favicon was a 401 before
        the sign-in and a 404 after it)."""
        assert self.errors == [], self.errors
        if console:
            assert self.console == [], self.console
        assert self.page.evaluate("() => window.__violations") == []
        assert not [line for line in self.console if "Content Security Policy" in line], self.console


def shot(page, tmp_path: Path, name: str) -> None:
    folder = Path(os.environ.get("EDGEKV_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=True)


def no_sideways_scroll(page) -> None:
    width, inner = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert width <= inner, f"the page is {width} px wide in a {inner} px window"


# ------------------------------------------------------------------------------------------------------ time zones
def test_times_are_the_devices_clock_in_a_browser_in_another_zone(tiny_checkpoint, tmp_path, zone, browser):
    """The device in Kathmandu (UTC+05:45), the phone in Los Angeles: the evidence's "seen", a question's "asked"
    and the memory's reach are the device's clock with its offset (what the wearer says to it and what it reads),
    and the page says that the browser's clock is another."""
    zone("Asia/Kathmandu")
    seen: list[str] = []

    def keep_evidence(route):  # the answer as the daemon sent it: its evidence's "seen" is ISO with its offset
        response = route.fetch()
        body = response.text()
        seen.extend(re.findall(r'"seen":\s*"([^"]+)"', body))
        route.fulfill(response=response, body=body)

    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        watched = Watched(browser, PHONE, timezone_id="America/Los_Angeles")
        page = watched.page
        watched.sign_in(run.base)
        page.route("**/v1/chat/completions", keep_evidence)
        answer = watched.ask("What is moving?")
        assert not answer.startswith("error"), answer
        assert seen, "the answer carried no evidence time"
        device = dt.datetime.fromisoformat(seen[0])
        assert device.utcoffset() == dt.timedelta(hours=5, minutes=45)
        evidence = page.inner_text("#evidence")
        assert f"seen {device:%H:%M:%S} (UTC+05:45)" in evidence, (evidence, seen[0])

        clock = page.inner_text("#clock")
        assert "device's clock" in clock and "Asia/Kathmandu (UTC+05:45)" in clock, clock
        assert re.search("this browser is at UTC\u2212(07|08):00", clock), clock

        poll(page, "document.querySelector('#questions').textContent.includes('What is moving?')", WAIT_S)
        asked = [q["asked_at"] for q in run.daemon.recent_questions() if q["question"] == "What is moving?"][0]
        assert f"asked {dt.datetime.fromtimestamp(asked):%H:%M:%S}" in page.inner_text("#questions li .meta")
        reach = page.evaluate("""() => [...document.querySelectorAll('#figures tr')]
            .map((tr) => tr.textContent).find((t) => t.startsWith('memory in the cache reaches back'))""")
        shown = re.search(r"to (\d\d):(\d\d):(\d\d)", reach)
        assert shown, reach
        now = dt.datetime.now()  # the device's clock (this process runs in its zone)
        apart = (now - now.replace(hour=int(shown[1]), minute=int(shown[2]), second=int(shown[3]))).total_seconds()
        assert min(apart % 86400, -apart % 86400) < 3600, (reach, now)  # the browser's clock: 13 h 45 min away

        # the wearer forgets by the times the page shows: the evidence's second, as shown, is what the device forgets
        page.fill("#question", "forget the last five minutes")
        page.click("#send")  # a forget typed as a question is not asked (the model would answer it, forgetting nothing)
        page.wait_for_selector("#answer[data-done='1']", timeout=WAIT_S * 1000)
        assert page.inner_text("#answer").startswith("Nothing was forgotten")
        assert not [q for q in run.daemon.recent_questions() if q["question"].startswith("forget")]
        page.on("dialog", lambda dialog: dialog.accept())
        until = (device + dt.timedelta(seconds=2)).strftime("%H:%M:%S")
        page.fill("#forget-from", f"{device:%H:%M:%S}")
        page.fill("#forget-to", until)
        page.click("#forget-send")
        poll(page, "document.querySelector('#forget-result').textContent.startsWith('Forgot ')", WAIT_S)
        result = page.inner_text("#forget-result")
        assert f"seen from {device:%H:%M:%S} (UTC+05:45) to {until} (UTC+05:45)" in result, result
        assert not result.startswith("Forgot 0 ") and " cache tokens freed" in result, result
        page.fill("#forget-from", until)  # the window swapped: refused, saying why
        page.fill("#forget-to", f"{device:%H:%M:%S}")
        page.click("#forget-send")
        poll(page, "document.querySelector('#forget-result').textContent.startsWith('Nothing was forgotten')", WAIT_S)
        assert "did you mean from" in page.inner_text("#forget-result")
        shot(page, tmp_path, "zone-phone.png")
        watched.assert_clean(console=False)  # the refused forget's 400 is a console error


def test_a_time_before_the_clocks_changed_shows_its_own_offset(tiny_checkpoint, tmp_path, zone, browser):
    """The device in Berlin, the browser in Tokyo: a moment of July is 14:00 (UTC+02:00) and one of January
    14:00 (UTC+01:00) on the device's clock, whatever the season now; a device whose zone has no name (a POSIX
    TZ rule) is shown at its offset now, said."""
    zone("Europe/Berlin")
    july, january = dt.datetime(2026, 7, 1, 12, 0, tzinfo=dt.timezone.utc), dt.datetime(2026, 1, 5, 13, 0,
                                                                                      tzinfo=dt.timezone.utc)
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        watched = Watched(browser, DESKTOP, timezone_id="Asia/Tokyo")
        page = watched.page
        watched.sign_in(run.base)
        poll(page, "document.querySelector('#clock').textContent.includes('Europe/Berlin')", WAIT_S)
        shown = page.evaluate("(t) => t.map((u) => deviceTime(u))", [july.timestamp(), january.timestamp()])
        assert shown == ["2026-07-01 14:00:00 (UTC+02:00)", "2026-01-05 14:00:00 (UTC+01:00)"]
        watched.assert_clean()


def test_the_device_clock_route_names_the_zone_or_gives_its_offset(tiny_checkpoint, tmp_path, zone):
    from edgekv.apps.server.page import device_clock

    for tz, name, offset in (("Europe/Berlin", "Europe/Berlin", 3600), (":Asia/Kathmandu", "Asia/Kathmandu", 20700),
                             ("/usr/share/zoneinfo/America/New_York", "America/New_York", -18000),
                             ("CET-1CEST,M3.5.0,M10.5.0/3", None, 3600), ("Nowhere/Land", None, 0)):
        zone(tz)
        clock = device_clock(dt.datetime(2027, 1, 15, 12, tzinfo=dt.timezone.utc).timestamp())
        assert (clock["zone"], clock["utc_offset_s"]) == (name, offset), (tz, clock)
    zone("Asia/Kathmandu")
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        assert call(run.port, "GET", "/v1/edgekv/clock")[0] == 401  # the page's, behind the token
        status, _, body = call(run.port, "GET", "/v1/edgekv/clock", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and json.loads(body)["zone"] == "Asia/Kathmandu"


# ---------------------------------------------------------------------------------- phone, desktop, keyboard, zoom
HOSTILE = [
    '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>',
    "ما الذي رأيته على الطاولة؟",  # right to left
    "Was the 🐈‍⬛ on the 🛋️? 👍🏽",
    "x" * 1500,  # one unbroken word, far wider than a phone
]


@pytest.mark.parametrize("viewport,scale", [(PHONE, 1), (DESKTOP, 1), ({"width": 640, "height": 400}, 2)],
                         ids=["phone", "desktop", "desktop-at-200%"])
def test_every_control_works_and_fits_on_a_phone_and_a_desktop(tiny_checkpoint, tmp_path, browser, viewport, scale):
    """Every control is labelled and reached by the keyboard, nothing scrolls sideways (a phone, a desktop, a
    1280 px desktop at 200 % zoom), questions that are HTML stay text, right-to-left ones read so, and the privacy
    switch pauses and resumes the camera."""
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        watched = Watched(browser, viewport, device_scale_factor=scale)
        page = watched.page
        page.goto(run.base + "/")
        assert page.evaluate("() => document.documentElement.lang") == "en"
        assert page.evaluate("() => document.querySelector('#token').labels[0].textContent") == "Token"
        no_sideways_scroll(page)
        watched.sign_in(run.base)
        assert page.evaluate("() => document.documentElement.lang") == "en"

        for text in HOSTILE:
            run.daemon.submit(Question(text, source="stdin", max_new_tokens=3))
        poll(page, "document.querySelectorAll('#questions li').length >= 4", WAIT_S)
        assert page.evaluate("() => window.__pwned") is None
        assert page.evaluate("() => document.querySelectorAll('#questions img, #questions script').length") == 0
        questions = page.evaluate("() => [...document.querySelectorAll('#questions .q')].map((q) => q.textContent)")
        assert set(HOSTILE) <= set(questions)
        directions = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#questions .q')]
            .map((q) => [q.textContent.slice(0, 8), getComputedStyle(q).direction]))""")
        assert directions[HOSTILE[1][:8]] == "rtl" and directions[HOSTILE[2][:8]] == "ltr"
        answer = watched.ask(HOSTILE[0])
        assert not answer.startswith("error"), answer
        no_sideways_scroll(page)

        unnamed = page.evaluate("""() => [...document.querySelectorAll('input, select, button')]
            .filter((e) => !e.hidden && e.type !== 'hidden')
            .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim())
            .map((e) => e.id)""")
        assert unnamed == []
        reached = set()
        page.evaluate("() => document.activeElement.blur()")
        for _ in range(12):
            page.keyboard.press("Tab")
            reached.add(page.evaluate("() => document.activeElement.id"))
        assert {"privacy", "logout", "overlay", "question", "send"} <= reached, reached

        page.focus("#privacy")  # the privacy switch, from the keyboard
        page.keyboard.press("Enter")
        poll(page, "document.querySelector('#state').textContent === 'paused (privacy)'", WAIT_S)
        assert run.daemon.paused is not None
        assert page.inner_text("#privacy") == "Resume camera" and "privacy switch" in page.inner_text("#banner")
        shot(page, tmp_path, f"paused-{viewport['width']}.png")
        page.click("#privacy")
        poll(page, "document.querySelector('#state').textContent === 'live'", WAIT_S)
        assert run.daemon.paused is None and page.inner_text("#privacy") == "Pause camera"
        no_sideways_scroll(page)
        shot(page, tmp_path, f"page-{viewport['width']}x{scale}.png")
        watched.assert_clean()


def contrast(fg: list[float], bg: list[float]) -> float:
    def luminance(rgb: list[float]) -> float:
        c = [v / 255 for v in rgb[:3]]
        c = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]

    high, low = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (high + 0.05) / (low + 0.05)


# ----------------------------------------------------------------------------------------------- daemon states
STATES = {  # what the daemon says -> what the page shows
    "stalled": ({"stream_state": "stalled", "stream_detail": "no frame ingested for 42 s"}, "stalled",
                ["no frame ingested for 42 s", "daemon log"], True),
    "degraded": ({"stream_state": "running", "problems": ["archive: disk full (/var/lib/edgekv)"]}, "live, degraded",
                 ["archive: disk full"], True),
    "paused": ({"stream_state": "paused", "problems": ["archive: disk full"]}, "paused (privacy)",
               ["privacy switch", "archive: disk full"], True),
    "ended": ({"stream_state": "ended", "stream_detail": "the source ended"}, "stream ended",
              ["the source ended", "about what was seen"], False),
    "stopping": ({"stream_state": "stopping"}, "daemon stopping", ["shutting down"], False),
}


def saying(daemon_says: dict):
    """A route handler: the real status, with the daemon's part updated by ``daemon_says``."""

    def fake(route) -> None:
        response = route.fetch()
        payload = response.json()
        payload["daemon"].update(daemon_says)
        route.fulfill(response=response, body=json.dumps(payload))

    return fake


def test_each_state_of_the_daemon_is_said_plainly_and_readably(tiny_checkpoint, tmp_path, browser):
    """Stalled, degraded (live with a problem), paused, ended, stopping: the badge says which in words on a colour
    whose contrast with its text is at least 4.5:1 (WCAG AA), the banner says why, and the privacy switch is
    offered only while there is a camera to switch."""
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        watched = Watched(browser, PHONE)
        page = watched.page
        watched.sign_in(run.base)
        for name, (daemon_says, badge, banner_words, switch) in STATES.items():
            page.route("**/v1/edgekv/status", saying(daemon_says))
            poll(page, f"document.querySelector('#state').textContent === {json.dumps(badge)}", WAIT_S)
            banner = page.inner_text("#banner")
            for words in banner_words:
                assert words in banner, (name, banner)
            assert page.is_visible("#privacy") == switch, name
            colours = page.evaluate("""() => { const s = getComputedStyle(document.querySelector('#state'));
                return [s.color, s.backgroundColor].map((c) => c.match(/[\\d.]+/g).map(Number)); }""")
            assert contrast(*colours) >= 4.5, (name, colours)
            no_sideways_scroll(page)
            shot(page, tmp_path, f"state-{name}.png")
            page.unroute("**/v1/edgekv/status")
        poll(page, "document.querySelector('#state').textContent === 'live'", WAIT_S)
        watched.assert_clean()

        # other pages open on the daemon (server.reads_per_second): a refused read is not a stopped daemon
        refused = []

        def too_many(route) -> None:
            refused.append(route.request.url)
            route.fulfill(status=429, content_type="application/json", headers={"retry-after": "1"},
                          body=json.dumps({"error": {"message": "too many reads", "type": "rate_limit_error",
                                                     "param": None, "code": "rate_limited"}}))

        page.route("**/v1/edgekv/status", too_many)
        deadline = time.monotonic() + WAIT_S
        while len(refused) < 6 and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert len(refused) >= 6 and page.inner_text("#state") == "live"
        page.unroute("**/v1/edgekv/status")


def test_a_long_streamed_answer_wraps_and_stays_text(tiny_checkpoint, tmp_path, browser):
    """An answer far longer than the screen, with an unbroken word, right-to-left text and HTML, streamed in many
    chunks: shown whole, as text, wrapped inside a phone's width."""
    pieces = ["<b>bold?</b> ", "على الطاولة كوب ", "🐈‍⬛ ", "y" * 800, " ", *(["and so on "] * 300)]
    chunks = [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in pieces]
    chunks.append({"choices": [], "edgekv": {"evidence": [{"pair": 3, "t": 1.5, "unix": None, "frame": None}]}})
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        watched = Watched(browser, PHONE)
        page = watched.page
        watched.sign_in(run.base)
        page.route("**/v1/chat/completions",
                   lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
        watched.ask("Tell me everything")
        assert page.evaluate("() => document.querySelector('#answer').textContent") == "".join(pieces)
        assert page.evaluate("() => document.querySelectorAll('#answer *').length") == 0
        assert page.inner_text("#evidence").startswith("evidence: stream 1.5 s (frame pair 3)")
        no_sideways_scroll(page)
        shot(page, tmp_path, "long-answer.png")
        watched.assert_clean()


# --------------------------------------------------------------------------------------------- a daemon restart
def test_a_restart_under_a_signed_in_page_shows_the_login_again(tiny_checkpoint, tmp_path, browser):
    """The daemon forgets every session when it restarts: the signed-in page says "daemon stopped" while it is
    down, then the login form once it is back (once: no reload loop), and signing in again shows the page."""
    config = server_config(tiny_checkpoint, token=TOKEN)
    first = RunningDaemon(config, tmp_path / "out1.txt")
    with first:
        watched = Watched(browser, PHONE)
        page = watched.page
        watched.sign_in(first.base)
        navigations: list[str] = []
        page.on("framenavigated", lambda frame: navigations.append(frame.url))
        first.stop()
        poll(page, "document.querySelector('#state').textContent === 'daemon stopped'", WAIT_S)
        assert page.is_disabled("#send") and "not answering" in page.inner_text("#banner")
    port = first.port
    with RunningDaemon(config.with_overrides(server={"port": port}), tmp_path / "out2.txt"):
        page.wait_for_selector("#login", timeout=WAIT_S * 1000)  # across the page's own reload
        assert page.is_visible("#token")
        logins = len(navigations)
        watched.sign_in(f"http://127.0.0.1:{port}")
        assert len(navigations) == logins + 2  # the goto and the sign-in's reload: nothing reloads by itself
        poll(page, "document.querySelector('#state').textContent === 'live'", WAIT_S)
        watched.assert_clean(console=False)  # the refused connections while it was down are console errors


def test_a_refused_session_with_the_daemon_gone_again_leaves_a_page_that_recovers(tiny_checkpoint, tmp_path,
                                                                                    browser):
    """The status says the session is refused (401) but the daemon does not answer the page itself (gone again, a
    proxy in between): the page says "signed out" and keeps trying, rather than reloading into the browser's error
    page, which never tries again; once the daemon answers with the page, it is the page again."""
    with RunningDaemon(server_config(tiny_checkpoint, token=TOKEN), tmp_path / "out.txt") as run:
        watched = Watched(browser, PHONE)
        page = watched.page
        watched.sign_in(run.base)
        navigations: list[str] = []
        page.on("framenavigated", lambda frame: navigations.append(frame.url))
        refused = []

        def unauthorized(route) -> None:
            refused.append(route.request.url)
            route.fulfill(status=401, content_type="application/json", body=json.dumps({"error": {
                "message": "a token is required", "type": "authentication_error", "param": None, "code": None}}))

        page.route(run.base + "/", lambda route: route.abort("connectionrefused"))
        page.route("**/v1/edgekv/status", unauthorized)
        poll(page, "document.querySelector('#state').textContent === 'signed out'", WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while len(refused) < 4 and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert len(refused) >= 4 and navigations == [], navigations
        assert "sign in again" in page.inner_text("#banner") and page.is_disabled("#send")
        page.unroute("**/v1/edgekv/status")
        page.unroute(run.base + "/")
        poll(page, "document.querySelector('#state').textContent === 'live'", WAIT_S)  # the cookie still holds
        assert navigations == []
        watched.assert_clean(console=False)  # the refused loads are console errors
