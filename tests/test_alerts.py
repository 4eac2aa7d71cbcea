"""Standing questions (issue 30 §1): a yes/no probe that leaves the cache as it was, the rising-edge rule
(hysteresis, cool-down), and alerts from the shipped toy on a synthetic:events stream delivered on the API's
SSE stream and to a webhook receiver; the API's rules; webhook retries and bounded queues."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time

import numpy as np
import pytest
import torch

import edgekv
from edgekv.apps.outputs.alerts import AlertBus, AlertEngine, AlertEvent, KeyframeRing
from edgekv.apps.outputs.webhooks import WebhookSender
from edgekv.config import AlertRuleSection, EdgeKVConfig
from edgekv.session import YesNo

SOURCE = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # purple triangle at pair 60
EVENT_PAIR = 60


def _toy_session():
    rt = edgekv.Runtime.from_pretrained("builtin:toy", model={"dtype": "fp32", "device": "cpu"},
                                        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
                                        video={"resolution": [112, 112], "fps": 2.0})
    return rt.session()


def _stream(session, pairs: int) -> None:
    from edgekv.video.sources import iter_frames

    for frame, t in iter_frames(SOURCE, max_frames=2 * pairs):
        session.ingest(frame, t=t)


# ---------------------------------------------------------------------------------------------- the probe
def test_a_probe_finds_the_event_and_leaves_the_cache_as_it_was():
    session = _toy_session()
    _stream(session, EVENT_PAIR)  # pairs 0-59: before the purple triangle
    before = session.probe("Was there a purple triangle?")
    from edgekv.video.sources import iter_frames

    frames = list(iter_frames(SOURCE, max_frames=2 * (EVENT_PAIR + 2)))[2 * EVENT_PAIR:]
    for frame, t in frames:
        session.ingest(frame, t=t)
    cache = session.cache
    n = cache.length
    saved = {name: getattr(cache, name)[:, :, :n].clone() for name in ("k", "v", "kind", "frame", "tpos")}
    stats = session.stats()
    after = session.probe("Was there a purple triangle?")
    assert before.p_yes < 0.1 < 0.9 < after.p_yes
    assert after.top_pairs(1) == [EVENT_PAIR]  # the evidence is the pair the triangle is in
    assert abs(sum(after.pair_mass.values()) - 1.0) < 0.5  # shares of the question's attention (text takes the rest)
    assert cache.length == n
    for name, tensor in saved.items():
        assert torch.equal(getattr(cache, name)[:, :, :n], tensor), name
    assert session.stats()["probes"] == stats["probes"] + 1 and session.counters.answer_tokens == 0


# ---------------------------------------------------------------------------------------------- the rule
class _Scripted:
    """A session whose probe returns the next scripted P(yes)."""

    def __init__(self, values):
        self.values = list(values)

    def probe(self, question):
        return YesNo(self.values.pop(0), {3: 0.7, 1: 0.1}, 1.0)


def test_rising_edges_hysteresis_and_cooldown():
    now = [0.0]
    bus = AlertBus()
    got: list[AlertEvent] = []
    bus.add(type("Sink", (), {"offer": lambda self, e: got.append(e)})())
    ring = KeyframeRing(4)
    for pair in range(6):
        ring.add(pair, np.full((8, 8, 3), pair * 30, np.uint8), float(pair))
    engine = AlertEngine([AlertRuleSection(question="Was there a red circle?", cooldown_s=10.0)], bus, ring,
                         clock=lambda: now[0])
    (rule,) = engine.list()
    session = _Scripted([0.1, 0.6, 0.45, 0.6, 0.2, 0.9, 0.1, 0.95])
    fired = []
    for pair, t in enumerate([0, 1, 2, 3, 4, 5, 20, 21]):
        now[0] = t
        fired.append(engine.evaluate(rule, session, pair) is not None)
    # 0.6 rises; 0.45 stays yes (hysteresis: falls below 0.3 only); 0.2 falls; 0.9 rises within the cool-down
    # (quiet); 0.1 falls; 0.95 at t=21 rises after the cool-down
    assert fired == [False, True, False, False, False, False, False, True]
    assert [e.evidence_pair for e in got] == [3, 3] and rule.fired == 2 and rule.evaluations == 8
    assert got[0].keyframe_jpeg[:2] == b"\xff\xd8" and "pair 3" in got[0].keyframe_note



def test_a_rule_with_a_window_asks_of_now_and_fires_for_each_visit():
    """``window_s``: the question reads only the last seconds, so its verdict falls back once the event has left
    them and a second visit raises a second alert; over the whole memory one sighting keeps the verdict "yes"
    while it is held (measured with the toy: P(yes) 1.0 from the first triangle to the end). A window of which
    nothing is held (no frame yet) leaves the verdict as it is."""
    from edgekv.video.events import Event, EventScene

    session = _toy_session()
    scene = EventScene(112, 112, 2.0, seed=4, events=[Event("triangle", "purple", 20, 1, (60, 56), 17),
                                                      Event("circle", "red", 30, 1, (40, 40), 14),
                                                      Event("triangle", "purple", 50, 1, (70, 60), 17)])
    bus = AlertBus()
    engine = AlertEngine([AlertRuleSection(question="Was there a purple triangle?", cooldown_s=0.0, window_s=8.0,
                                           name="now"),
                          AlertRuleSection(question="Was there a purple triangle?", cooldown_s=0.0, name="ever")],
                         bus, KeyframeRing(4))
    now, ever = engine.list()
    assert now.to_json()["window_s"] == 8.0 and ever.to_json()["window_s"] is None
    assert engine.evaluate(now, session, 0) is None and now.evaluations == 0  # no frame yet: nothing to read
    fired: dict[str, list[int]] = {"now": [], "ever": []}
    verdicts = []
    for pair in range(66):
        first, second = scene.pair_frames(pair)
        session.ingest(first, t=scene.time(2 * pair))
        session.ingest(second, t=scene.time(2 * pair + 1))
        for state in (now, ever):
            if engine.evaluate(state, session, pair) is not None:
                fired[state.name].append(pair)
        verdicts.append((now.verdict, ever.verdict))
    assert fired == {"now": [20, 50], "ever": [20]}
    assert verdicts[40] == (False, True) and verdicts[-1] == (False, True)  # the triangle left the last 8 s
    assert [e.name for e in bus.recent] == ["now", "ever", "now"]
    assert session.cache.length == session.stats()["cache_tokens"]  # the probes kept nothing

def test_due_rules_by_pairs_and_seconds():
    now = [0.0]
    engine = AlertEngine([AlertRuleSection(question="a?", every_pairs=3), AlertRuleSection(question="b?", every_s=5.0),
                          AlertRuleSection(question="c?")], AlertBus(), KeyframeRing(0), clock=lambda: now[0])
    by_name = lambda states: sorted(s.rule.question for s in states)
    assert by_name(engine.due(0)) == ["b?", "c?"]
    assert by_name(engine.due(2)) == ["a?", "b?", "c?"]
    b = next(s for s in engine.list() if s.rule.question == "b?")
    b.last_eval = 0.0
    now[0] = 4.0
    assert by_name(engine.due(5)) == ["a?", "c?"]
    now[0] = 5.0
    assert "b?" in by_name(engine.due(6))


def test_bad_rules_are_refused_naming_the_field():
    from edgekv.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"alerts.rules\[0\].every_pairs: must be >= 1"):
        config_from_dict({"alerts": {"rules": [{"question": "x?", "every_pairs": 0}]}})
    with pytest.raises(ConfigError, match="every_pairs or every_s, not both"):
        config_from_dict({"alerts": {"rules": [{"question": "x?", "every_pairs": 1, "every_s": 2.0}]}})
    with pytest.raises(ConfigError, match=r"alerts.rules\[0\].window_s: seconds > 0"):
        config_from_dict({"alerts": {"rules": [{"question": "x?", "window_s": 0}]}})
    with pytest.raises(ConfigError, match=r"alerts.webhooks\[0\]"):
        config_from_dict({"alerts": {"webhooks": ["ftp://x"]}})
    with pytest.raises(ConfigError, match=r"alerts.rules: 3 standing questions, over alerts.max_rules \(2\)"):
        config_from_dict({"alerts": {"max_rules": 2, "rules": [{"question": f"{c}?"} for c in "abc"]}})
    with pytest.raises(ConfigError, match=r"alerts.max_rules: must be >= 1"):
        config_from_dict({"alerts": {"max_rules": 0}})


def test_standing_questions_are_bounded():
    """Nothing bounded how many standing questions the API could add: each is held and evaluated over the cache
    while it stands, so a client adding them in a loop grew the daemon's memory without end. alerts.max_rules
    (32 by default) is the most, config and API together; one more is refused naming it, until one is deleted."""
    from edgekv.apps.outputs.alerts import MAX_RULES, AlertBus, AlertEngine, KeyframeRing

    engine = AlertEngine([AlertRuleSection(question="a?")], AlertBus(), KeyframeRing(0), camera="back", max_rules=3)
    added = [engine.add(AlertRuleSection(question=f"{c}?")) for c in "bc"]
    with pytest.raises(ValueError, match=r"alerts: 3 standing questions already on camera back, the most "
                                         r"alerts.max_rules allows \(3\); delete one first"):
        engine.add(AlertRuleSection(question="d?"))
    assert engine.remove(added[0].id)
    assert engine.add(AlertRuleSection(question="d?")).id == "back-alert-4" and len(engine.list()) == 3
    assert MAX_RULES == 32


def test_the_apis_standing_questions_stand_again_after_a_restart(tmp_path):
    """Standing questions added through the API lived only as long as the process: after a restart (a power cycle,
    a crash, an update) the memory came back and what the device was told to watch for did not. They are kept in
    state.dir/alerts.json (ids too: clients delete by id); the config's rules come from the config."""
    from edgekv.apps.outputs.alerts import RuleStore

    config_rules = [AlertRuleSection(question="From the config?")]
    engine = AlertEngine(config_rules, AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path))
    assert not (tmp_path / "alerts.json").exists()  # nothing added yet
    a = engine.add(AlertRuleSection(question="Is the door open?", every_s=5.0, cooldown_s=10.0, threshold=0.7))
    b = engine.add(AlertRuleSection(question="Is anyone in the kitchen?"))
    c = engine.add(AlertRuleSection(question="Temporary?"))
    assert engine.remove(c.id)
    assert [s.id for s in engine.list()] == ["alert-1", "alert-2", "alert-3"]

    again = AlertEngine(config_rules, AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path))
    by_question = {state.rule.question: state for state in again.list()}
    assert set(by_question) == {"From the config?", "Is the door open?", "Is anyone in the kitchen?"}
    assert by_question["Is the door open?"].id == a.id and by_question["Is the door open?"].rule == a.rule
    assert by_question["Is anyone in the kitchen?"].id == b.id and by_question["From the config?"].source == "config"
    assert [state.id for state in again.restored] == [a.id, b.id]
    fresh = again.add(AlertRuleSection(question="New?"))
    assert fresh.id not in (a.id, b.id, c.id)  # an id once given is not given to another rule
    assert again.remove(a.id) and not again.remove(a.id)
    third = AlertEngine([], AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path))
    assert sorted(state.rule.question for state in third.list()) == ["Is anyone in the kitchen?", "New?"]

    small = AlertEngine(config_rules, AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path), max_rules=2)
    assert [state.rule.question for state in small.list()] == ["Is anyone in the kitchen?", "From the config?"]
    assert small.dropped == [fresh.id]  # over max_rules with the config's: left out, and said by the daemon


def test_the_stored_questions_are_sealed_with_the_key_and_a_damaged_file_is_set_aside(tmp_path):
    pytest.importorskip("cryptography")
    from edgekv.apps.outputs.alerts import RuleStore
    from edgekv.privacy import Key, KeyRing, SealError

    old, new = Key(b"\x01" * 32, "old"), Key(b"\x02" * 32, "new")
    engine = AlertEngine([], AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path, KeyRing(old)))
    engine.add(AlertRuleSection(question="Is the safe open?"))
    data = (tmp_path / "alerts.json").read_bytes()
    assert data.startswith(b"EDGEKV-SEALBLOB") and b"safe" not in data
    with pytest.raises(SealError, match="alerts.json: sealed with key"):
        RuleStore(tmp_path, KeyRing(new)).load()
    with pytest.raises(SealError, match="alerts.json: sealed .encrypted. and this deployment has no key"):
        RuleStore(tmp_path).load()
    assert (tmp_path / "alerts.json").read_bytes() == data  # left as it is
    rotated = RuleStore(tmp_path, KeyRing(new, [old]))
    assert rotated.reseal() and not rotated.reseal()  # edgekv rekey
    assert [rule.question for _, rule in RuleStore(tmp_path, KeyRing(new)).load()] == ["Is the safe open?"]

    data = (tmp_path / "alerts.json").read_bytes()
    (tmp_path / "alerts.json").write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])  # a flipped bit
    assert AlertEngine([], AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path, KeyRing(new))).list() == []
    assert (tmp_path / "alerts.json.bad").is_file() and not (tmp_path / "alerts.json").exists()
    (tmp_path / "alerts.json").write_text('{"format": 1, "rules": [{"id": "alert-1", "rule": {"question": ""}}]}')
    assert AlertEngine([], AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path)).list() == []
    assert (tmp_path / "alerts.json.bad").is_file() and not (tmp_path / "alerts.json").exists()


# ---------------------------------------------------------------------------------------------- webhooks
class _Receiver:
    """A webhook receiver on 127.0.0.1: answers each POST with the next scripted status (200 when out)."""

    def __init__(self, statuses=(), gate: threading.Event | None = None):
        self.statuses, self.gate, self.bodies = list(statuses), gate, []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.gate is not None:
                    receiver.gate.wait(60)
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                if status == 200:
                    receiver.bodies.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _event(i: int = 0) -> AlertEvent:
    return AlertEvent(f"e{i}", "alert-1", "red", "Was there a red circle?", None, 0.9, 1.0, 2, 1.0, time.time(),
                      b"\xff\xd8jpeg", "pair 2")


def _until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_webhook_retries_5xx_with_backoff_and_keeps_a_4xx_final(monkeypatch):
    monkeypatch.setattr("edgekv.apps.outputs.webhooks.BACKOFF_S", 0.01)
    receiver = _Receiver([503, 500])
    sender = WebhookSender(receiver.url, timeout_s=10, retries=3).start()
    try:
        sender.offer(_event())
        assert _until(lambda: sender.sent == 1)
        assert sender.attempts == 3 and receiver.bodies[0]["keyframe_jpeg_base64"]
        receiver.statuses = [404]
        sender.offer(_event(1))
        assert _until(lambda: sender.failed == 1)
        assert sender.attempts == 4  # not retried
    finally:
        sender.stop()
        receiver.close()


def test_a_stuck_receiver_costs_a_bounded_queue_never_the_caller():
    gate = threading.Event()
    receiver = _Receiver(gate=gate)
    sender = WebhookSender(receiver.url, timeout_s=30, retries=0, queue=4).start()
    try:
        sender.offer(_event(0))
        assert _until(lambda: sender.in_flight is not None and sender.attempts == 1)  # e0 is stuck in delivery
        for i in range(1, 11):
            sender.offer(_event(i))  # returns at once however stuck the receiver is
        assert len(sender.pending) == 4 and sender.dropped == 6
        gate.set()
        assert _until(lambda: sender.sent == 5)
        assert [b["id"] for b in receiver.bodies] == ["e0", "e7", "e8", "e9", "e10"]  # the newest waiting kept
    finally:
        gate.set()
        sender.stop()
        receiver.close()


# ---------------------------------------------------------------------------------------------- the daemon
def _gated_source(gate: threading.Event):
    """``SOURCE`` whose frames wait for ``gate``: outputs are connected before anything is ingested."""
    from edgekv.video.sources import FrameSource, open_source

    class Gated(FrameSource):
        kind = "synthetic"

        def __init__(self):
            super().__init__(SOURCE, live=False)
            self.inner = open_source(SOURCE)
            self.scene = self.inner.scene

        def read(self):
            gate.wait(120)
            return self.inner.read()

        def close(self):
            self.inner.close()

    return Gated()


def _sse_events(port: int, out: list, ready: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", "/v1/alerts/stream")
    response = conn.getresponse()
    ready.set()
    event = {}
    for raw in response:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            event = json.loads(line[6:])
        elif not line and event:
            out.append(event)
            event = {}
            if len(out) >= 1:
                conn.close()
                return


@pytest.mark.slow
def test_the_toy_raises_one_alert_when_the_event_appears_on_sse_and_webhook(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.video.sources import SourceSpec

    gate = threading.Event()
    source = _gated_source(gate)
    monkeypatch.setattr("edgekv.apps.daemon.loop.open_video_source",
                        lambda config: (SourceSpec("synthetic", "events", raw=SOURCE), source))
    receiver = _Receiver()
    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": SOURCE, "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"port": 0}, monitor={"backend": "cpu"},
        alerts={"rules": [{"question": "Was there a purple triangle?", "every_pairs": 1, "name": "purple"}],
                "webhooks": [receiver.url]})
    out = tmp_path / "out.txt"
    with open(out, "w") as log:
        daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True, exit_at_end=True), out=log)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        try:
            assert daemon.ready.wait(120)
            streamed, connected = [], threading.Event()
            reader = threading.Thread(target=_sse_events, args=(daemon.server.port, streamed, connected), daemon=True)
            reader.start()
            assert connected.wait(30)
            assert _until(lambda: len(daemon.alert_bus.sinks) == 2)  # the webhook and this SSE client
            gate.set()
            reader.join(120)
            assert _until(lambda: len(receiver.bodies) >= 1)
            thread.join(120)
            assert not thread.is_alive()
        finally:
            gate.set()
            daemon.stop.event.set()
            thread.join(30)
            receiver.close()
    (rule,) = daemon.alerts.list()
    # one alert for one event; evaluations are answer steps, so the fair share decides how many run while
    # frames wait (here every frame always waits: a file replayed as fast as it goes in)
    assert rule.fired == 1 and 1 <= rule.evaluations <= 80
    (event,) = list(daemon.alert_bus.recent)
    (sse,) = streamed
    (hook,) = receiver.bodies
    assert sse["id"] == hook["id"] == event.id and hook["name"] == "purple"
    assert EVENT_PAIR <= event.evidence_pair <= EVENT_PAIR + 1 and sse["evidence_pair"] == event.evidence_pair
    assert event.stream_t is not None and event.stream_t >= EVENT_PAIR * 1.0  # raised after it appeared
    assert hook["keyframe_jpeg_base64"] and sse["keyframe_url"].endswith("/keyframe.jpg")
    assert "ALERT [purple]" in out.read_text()


def test_the_api_adds_lists_and_deletes_standing_questions(tiny_checkpoint, tmp_path):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call, server_config

    with RunningDaemon(server_config(tiny_checkpoint), tmp_path / "out.txt") as run:
        port = run.port
        for body, param in [({"question": ""}, "question"), ({"question": "x?", "every_pairs": 0}, "every_pairs"),
                            ({"question": "x?", "threshold": 1.5}, "threshold"), ({"question": 5}, "question"),
                            ({"question": "x?", "colour": "red"}, "colour"),
                            ({"question": "x?", "window_s": 0}, "window_s"),
                            ({"question": "x?", "camera": "side"}, "camera")]:  # one camera: none to name
            status, _, raw = call(port, "POST", "/v1/alerts", body)
            assert status == 400 and json.loads(raw)["error"]["param"] == param, (body, raw)
        status, _, raw = call(port, "POST", "/v1/alerts", {"question": "Is anything moving?", "every_pairs": 1,
                                                           "window_s": 5})
        assert status == 201, raw
        rule = json.loads(raw)
        assert rule["id"].startswith("alert-") and rule["source"] == "api" and rule["verdict"] == "no"
        assert rule["window_s"] == 5
        assert _until(lambda: json.loads(call(port, "GET", "/v1/alerts")[2])["data"][0]["evaluations"] >= 2)
        assert run.daemon.session.stats()["probes"] >= 2
        assert call(port, "DELETE", f"/v1/alerts/{rule['id']}")[0] == 200
        assert json.loads(call(port, "GET", "/v1/alerts")[2])["data"] == []
        assert call(port, "DELETE", f"/v1/alerts/{rule['id']}")[0] == 404
        assert call(port, "GET", "/v1/alerts/events/nope/keyframe.jpg")[0] == 404
        for index in range(32):  # alerts.max_rules: 32 by default
            assert call(port, "POST", "/v1/alerts", {"question": f"Is thing {index} here?"})[0] == 201
        status, _, raw = call(port, "POST", "/v1/alerts", {"question": "One more?"})
        assert status == 400 and "alerts.max_rules allows (32)" in json.loads(raw)["error"]["message"], raw


def test_a_standing_question_too_long_for_the_reserve_is_refused(tiny_checkpoint, tmp_path, capsys):
    """A standing question is evaluated over the full cache in the cache.text_reserve_tokens slots: one longer was
    taken, then failed every evaluation once the cache filled (a warning each frame pair). The API refuses it, and
    a config rule as long stops the start in one line."""
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call, daemon_args, server_config

    from edgekv.apps.daemon.loop import Daemon

    long = "Is there a red circle" + " and a red circle" * 40 + "?"
    config = server_config(tiny_checkpoint)  # text_reserve_tokens 96
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        status, _, raw = call(run.port, "POST", "/v1/alerts", {"question": long})
        assert status == 400 and "cache.text_reserve_tokens slots (96" in json.loads(raw)["error"]["message"], raw
        assert call(run.port, "POST", "/v1/alerts", {"question": "Is there a red circle?"})[0] == 201
    ruled = config.with_overrides(alerts={"rules": [{"question": long}]})
    with open(tmp_path / "out2.txt", "w") as out:
        assert Daemon(ruled, daemon_args(), out=out).run() == 2
    assert "cannot start: alert.question: " in capsys.readouterr().err


def test_a_rule_the_api_added_stands_again_when_the_daemon_restarts(tiny_checkpoint, tmp_path):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call, server_config

    config = server_config(tiny_checkpoint).with_overrides(state={"dir": str(tmp_path / "state")})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        status, _, raw = call(run.port, "POST", "/v1/alerts", {"question": "Is anything moving?", "every_pairs": 3})
        assert status == 201, raw
        rule = json.loads(raw)
    with RunningDaemon(config, tmp_path / "out2.txt") as run:
        listed = json.loads(call(run.port, "GET", "/v1/alerts")[2])["data"]
        assert [(r["id"], r["question"], r["every_pairs"], r["source"]) for r in listed] == [
            (rule["id"], "Is anything moving?", 3, "api")]
        status, _, raw = call(run.port, "DELETE", f"/v1/alerts/{rule['id']}")
        assert status == 200 and json.loads(raw) == {"id": rule["id"], "deleted": True}  # for good
    assert "restored from" in (tmp_path / "out2.txt").read_text()
    with RunningDaemon(config, tmp_path / "out3.txt") as run:
        assert json.loads(call(run.port, "GET", "/v1/alerts")[2])["data"] == []
    ruled = config.with_overrides(alerts={"rules": [{"question": "From the config?"}]})
    with RunningDaemon(ruled, tmp_path / "out4.txt") as run:
        (listed,) = json.loads(call(run.port, "GET", "/v1/alerts")[2])["data"]
        status, _, raw = call(run.port, "DELETE", f"/v1/alerts/{listed['id']}")
        assert status == 200 and "stands again at the next start" in json.loads(raw)["note"], raw


def test_rules_added_and_deleted_at_once_are_saved_as_they_stand(tmp_path):
    """Many API clients at once: each add and delete rewrites the file; writers one at a time, each with the rules
    as they are, so the file read back is exactly the rules that stand (no torn or stale write)."""
    from concurrent.futures import ThreadPoolExecutor

    from edgekv.apps.outputs.alerts import RuleStore

    engine = AlertEngine([], AlertBus(), KeyframeRing(0), store=RuleStore(tmp_path), max_rules=64)

    def churn(worker: int) -> None:
        for index in range(10):
            state = engine.add(AlertRuleSection(question=f"Is thing {worker}-{index} here?"))
            if index % 2:
                assert engine.remove(state.id)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(churn, range(6)))
    standing = {(state.id, state.rule.question) for state in engine.list()}
    assert len(standing) == 30
    assert {(rule_id, rule.question) for rule_id, rule in RuleStore(tmp_path).load()} == standing
    assert not list(tmp_path.glob(".alerts.json.tmp-*"))


def test_a_standing_question_due_every_pair_does_not_starve_a_question(tmp_path):
    """Frames always waiting (a recording replayed losslessly, as a slow device's camera) and a standing question
    due every pair: each answer step the fair share allows went to its evaluation, and a question waited until the
    stream ended (found probing a daemon: 'no reply within 120 s'). Questions and evaluations now take turns: the
    question is answered while the stream is still being ingested, and the rule goes on being evaluated."""
    import io
    import threading

    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.apps.questions import Question
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:events?size=112x112&fps=2&frames=4000&seed=2&rate=0.05", "fps": 2.0,
               "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64}, server={"enabled": False},
        monitor={"backend": "cpu"}, alerts={"rules": [{"name": "purple", "question": "Was there a purple triangle?"}]})
    daemon = Daemon(config, DaemonOptions(no_stdin=True, no_server=True, quiet=True), out=io.StringIO())
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        assert daemon.ready.wait(120)
        for _ in range(600):  # until the rule has been evaluated (bounded: 60 s)
            if daemon.alerts.stats()["alert_evaluations"] > 3:
                break
            daemon.stream_ended.wait(0.1)
        question = Question("What color was the cross?", source="stdin", max_new_tokens=2)
        daemon.submit(question)
        assert question.done.wait(120) and question.error is None, question.error
        evaluations = daemon.alerts.stats()["alert_evaluations"]
        assert not daemon.stream_ended.is_set(), "answered only once the stream had ended: starved"
        for _ in range(600):  # and the rule is still evaluated after it
            if daemon.alerts.stats()["alert_evaluations"] > evaluations or daemon.stream_ended.is_set():
                break
            daemon.stream_ended.wait(0.1)
        assert daemon.alerts.stats()["alert_evaluations"] > evaluations
    finally:
        daemon.stop.event.set()
        thread.join(60)
