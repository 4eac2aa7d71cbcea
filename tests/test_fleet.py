"""The fleet over MQTT 5 (issue 30 §2) against a real Mosquitto: devices announce themselves (retained status, last
will), answer fleet questions (Response Topic + Correlation Data) with their evidence, publish alerts, keep
answering locally without the broker and come back with backoff; bad messages, oversized payloads and refused
credentials are counted or refused with the reason. The shipped toy answers on synthetic:events streams whose
ground truth differs (the circle is red, green or blue)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import pytest

import edgekv
from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.questions import Question
from edgekv.config import ConfigError, FleetSection, config_from_dict
from helpers_mqtt import QUESTION, STREAMS, Listener, Mosquitto, Relay, need_mosquitto, publish_raw, stream, until



# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("fleet, message", [
    ({"broker": "mqtt://b", "password": "hunter2"}, r"fleet.password: a password is never written in the YAML"),
    ({"broker": "http://b:1883"}, r"fleet.broker: expected mqtt://host\[:port\] or mqtts://host\[:port\]"),
    ({"broker": "mqtt://b:99999"}, r"fleet.broker: expected mqtt://"),
    ({"broker": "mqtt://user:pw@b"}, r"fleet.broker: .*credentials go in username / password_env"),
    ({"broker": "mqtt://b", "device_id": "a/b"}, r"fleet.device_id: one MQTT topic level"),
    ({"broker": "mqtt://b", "topic_prefix": "edgekv/#"}, r"fleet.topic_prefix: MQTT topic levels"),
    ({"broker": "mqtt://b", "password_env": "PW"}, r"fleet.password_env: a password needs a username"),
    ({"broker": "mqtts://b", "cert_file": "c.pem"}, r"fleet.cert_file and fleet.key_file: a client certificate needs both"),
    ({"broker": "mqtt://b", "ca_file": "ca.pem"}, r"fleet.ca_file: TLS files need an mqtts:// broker"),
    ({"broker": "mqtt://b", "keepalive_s": 0}, r"fleet.keepalive_s: must be 1 to 65535 s"),
    ({"broker": "mqtt://b", "reconnect_backoff_s": [5, 1]}, r"fleet.reconnect_backoff_s: expected \[first, max\]"),
    ({"broker": "mqtt://b", "queue": 0}, r"fleet.queue: must be >= 1"),
    ({"broker": "mqtt://b", "max_payload_bytes": "big"}, r"fleet.max_payload_bytes: expected an integer"),
    ({"brokers": "mqtt://b"}, r"fleet.brokers: unknown key"),
])
def test_the_fleet_section_is_refused_naming_the_key(fleet, message):
    with pytest.raises(ConfigError, match=message) as info:
        config_from_dict({"fleet": fleet})
    assert "\n" not in str(info.value)


def test_the_fleet_section_defaults_and_relative_tls_files(tmp_path):
    from edgekv.config import broker_address, load_config

    assert broker_address("mqtt://broker.local") == ("broker.local", 1883, False)
    assert broker_address("mqtts://[::1]") == ("::1", 8883, True)
    (tmp_path / "edgekv.yaml").write_text("fleet: {broker: 'mqtts://b:8884', ca_file: certs/ca.pem, username: cam,\n"
                                         "        password_env: EDGEKV_MQTT_PASSWORD}\n")
    fleet = load_config(tmp_path / "edgekv.yaml").fleet
    assert fleet.ca_file == str(tmp_path / "certs" / "ca.pem") and fleet.topic_prefix == "edgekv"
    assert FleetSection().broker is None  # not in a fleet unless asked


def test_a_camera_is_named_without_its_credentials():
    from edgekv.apps.outputs.mqtt import camera_name

    assert camera_name(0) == "camera 0" and camera_name("2") == "camera 2"
    assert camera_name("rtsp://admin:secret@10.0.0.5:554/stream1") == "rtsp://10.0.0.5:554/stream1"
    assert camera_name("/data/videos/dock.mp4") == "dock.mp4"
    assert camera_name("synthetic:events?seed=2") == "synthetic:events?seed=2"
    assert camera_name("gst:rtspsrc location=rtsp://u:p@cam/live ! decodebin") == (
        "gst:rtspsrc location=rtsp://cam/live ! decodebin")
    assert camera_name("0?width=1280&height=720&fourcc=MJPG") == "camera 0"  # its mode is not its name
    assert camera_name("/dev/v4l/by-id/usb-Cam_123-video-index0?fourcc=MJPG") == "usb-Cam_123-video-index0"
    assert camera_name("rtsp://admin:p@ss@10.0.0.5/live") == "rtsp://10.0.0.5/live"  # an unescaped @ in it


# ---------------------------------------------------------------------------------------------- requests
def _props(response_topic: str | None = "edgekv/replies/x", correlation: bytes | None = b"c1"):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    pytest.importorskip("paho.mqtt.client")
    properties = Properties(PacketTypes.PUBLISH)
    if response_topic is not None:
        properties.ResponseTopic = response_topic
    if correlation is not None:
        properties.CorrelationData = correlation
    return properties


@pytest.mark.parametrize("payload, properties, kind, message", [
    (b"\xff\xfe not json", {}, "malformed", "not JSON"),
    (b"[1, 2]", {}, "malformed", "expected a JSON object with a question, got list"),
    (b"{}", {}, "malformed", "question: expected a non-empty string, got None"),
    (b'{"question": 42}', {}, "malformed", "question: expected a non-empty string, got 42"),
    (b'{"question": "  "}', {}, "malformed", "question: expected a non-empty string"),
    (b'{"question": "x?", "max_new_tokens": "9"}', {}, "malformed", "max_new_tokens: expected an integer from 1 to 64"),
    (b'{"question": "x?", "max_new_tokens": 1000}', {}, "malformed", "max_new_tokens: expected an integer from 1 to 64"),
    (b'{"question": "x?", "max_new_tokens": true}', {}, "malformed", "max_new_tokens"),
    (b'{"question": "x?", "colour": "red"}', {}, "malformed",
     "unknown key 'colour' (known: question, max_new_tokens, camera, last_s, from, to, frame)"),
    (b'{"question": "x?", "frame": 1}', {}, "malformed", "frame: expected true or false, got 1"),
    (b'{"question": "x?", "from": 1, "to": 5}', {}, "malformed", "from and to: expected two wall times"),
    (b'{"question": "x?", "from": "10:00"}', {}, "malformed", "from and to: expected two wall times"),
    (b'{"question": "x?", "from": "noon", "to": "10:00"}', {}, "malformed", "from: 'noon': not a wall time"),
    (b'{"question": "x?", "from": "10:00", "to": "10:05", "last_s": 5}', {}, "malformed",
     "give either from and to, or last_s, not both"),
    (b'{"question": "x?", "last_s": 0}', {}, "malformed", "last_s: expected seconds > 0, got 0"),
    (b'{"question": "x?", "last_s": "5"}', {}, "malformed", "last_s: expected seconds > 0, got '5'"),
    (b'{"question": "x?", "last_s": true}', {}, "malformed", "last_s: expected seconds > 0, got True"),
    (b'{"question": "x?", "camera": ""}', {}, "malformed", "camera: expected a camera's name, got ''"),
    (b'{"question": "x?", "camera": 3}', {}, "malformed", "camera: expected a camera's name, got 3"),
    (b'{"question": "x?"}', {"response_topic": None}, "malformed", "no Response Topic"),
    (b'{"question": "x?"}', {"response_topic": "edgekv/replies/+"}, "malformed", "no Response Topic"),
    (b'{"question": "' + b"x" * 200 + b'"}', {}, "oversized", "payload of 216 bytes is over fleet.max_payload_bytes (100)"),
])
def test_a_bad_fleet_message_is_refused_naming_what_is_wrong(payload, properties, kind, message):
    from edgekv.apps.outputs.mqtt import FleetMessageError, parse_request

    with pytest.raises(FleetMessageError) as info:
        parse_request(payload, _props(**properties), max_bytes=100, max_new_tokens=64)
    assert info.value.kind == kind and message in str(info.value)
    good = parse_request(b'{"question": "x?", "max_new_tokens": 3}', _props(), max_bytes=100, max_new_tokens=64)
    assert good.last_s is None
    assert parse_request(b'{"question": "x?", "last_s": 300}', _props(), max_bytes=100, max_new_tokens=64).last_s == 300
    assert good.wall is None and parse_request(b'{"question": "x?", "from": "2027-01-15T08:00:00Z", "to": '
                                               b'"2027-01-15T08:01:00Z"}', _props(), max_bytes=100,
                                               max_new_tokens=64).wall == (WALL, WALL + 60)
    assert (good.question, good.max_new_tokens, good.response_topic, good.correlation) == ("x?", 3, "edgekv/replies/x",
                                                                                          b"c1")


# ---------------------------------------------------------------------------------------------- devices
WALL = 1_800_000_000.0  # 2027-01-15T08:00:00Z: the simulated devices' wall clock at their stream's start ...
WALL_START = {"cam-red": 0.0, "cam-green": 5.0, "cam-blue": 10.0}  # ... which each started so many seconds later


@pytest.fixture(scope="module")
def runtime():
    return edgekv.Runtime.from_pretrained("builtin:toy", model={"dtype": "fp32", "device": "cpu"},
                                          cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
                                          video={"resolution": [112, 112], "fps": 2.0})


@pytest.fixture
def broker(tmp_path):
    with Mosquitto(tmp_path / "broker") as running:
        yield running


class Fleet:
    """Simulated devices in this process: each a toy session over its own stream, behind a ``FleetAgent``."""

    def __init__(self, runtime) -> None:
        self.runtime, self.lock, self.devices = runtime, threading.Lock(), {}

    def add(self, url: str, name: str, password: str | None = None, lock: threading.Lock | None = None, **section):
        from edgekv.apps.outputs.mqtt import FleetAgent, SessionHost
        from edgekv.video.sources import iter_frames

        seed = STREAMS[name][0] if name in STREAMS else 0
        host = SessionHost(self.runtime.session(), stream(seed), model_lock=lock or self.lock)
        for frame, t in iter_frames(stream(seed)):
            host.ingest(frame, t, captured_unix=WALL + WALL_START.get(name, 0.0) + t)
        host.stream_state = "ended"
        values = {"broker": url, "device_id": name, "status_every_s": 0.5, "reconnect_backoff_s": [0.1, 0.5], **section}
        agent = FleetAgent(FleetSection(**values), host.start(), password)
        self.devices[name] = (agent, host)
        return agent.start(), host

    def close(self) -> None:
        for agent, host in self.devices.values():
            agent.stop()
            host.stop()


@pytest.fixture
def fleet(runtime):
    need_mosquitto()
    made = Fleet(runtime)
    yield made
    made.close()


def announced(agent) -> bool:
    """The device is connected and the broker has sent its own status back to it, so the status is retained there:
    an asker that subscribes now sees it online (one that subscribed before would find nobody online and not wait)."""
    return agent.connected.is_set() and agent.counts["status_echoed"] >= 1


def _statuses(listener: Listener, device: str) -> list[dict]:
    return [s for s in listener.json_on(f"/devices/{device}/status")]


def test_a_fleet_question_gets_every_device_answer_with_its_evidence(broker, fleet, capsys):
    from edgekv.apps.cli import main
    from edgekv.apps.outputs.mqtt import ask_fleet

    listener = Listener(broker.url, ["edgekv/devices/+/status"])
    try:
        for name in STREAMS:
            fleet.add(broker.url, name)
        assert until(lambda: all(any(s["state"] == "online" for s in _statuses(listener, n)) for n in STREAMS))
        result = ask_fleet(QUESTION, broker.url, timeout_s=60)
        assert sorted(a.device for a in result.answers) == sorted(STREAMS) and result.silent == result.offline == []
        for answer in result.answers:
            seed, colour, pairs = STREAMS[answer.device]
            assert answer.answer == colour and answer.error is None
            assert answer.camera == stream(seed)
            assert answer.evidence_pair in pairs and answer.evidence_t == fleet.devices[answer.device][1].times[
                answer.evidence_pair]
            assert answer.ttft_s > 0 and answer.latency_s >= answer.ttft_s
        # the retained status: what every late subscriber sees first
        late = Listener(broker.url, ["edgekv/devices/cam-red/status"])
        assert until(lambda: any(retained for *_, retained in late.messages))
        status = json.loads(next(payload for _, payload, _, retained in late.messages if retained))
        assert status["state"] == "online" and status["device"] == "cam-red"
        assert status["frame_pairs"] == 24 and status["cache_capacity_tokens"] == 640 and status["stream_state"] == "ended"
        late.close()
        # the last seconds of each device's own stream: the circles (pairs 11-16 of 24) are older than 5 s, so
        # every device reads only its last pairs, where its evidence is; 20 s holds them again
        recent = ask_fleet(QUESTION, broker.url, timeout_s=60, last_s=5)
        assert sorted(a.device for a in recent.answers) == sorted(STREAMS)
        for answer in recent.answers:
            times = fleet.devices[answer.device][1].times
            assert answer.error is None and times[answer.evidence_pair] >= max(times.values()) - 5, answer
        wider = ask_fleet(QUESTION, broker.url, timeout_s=60, last_s=20)
        assert sorted((a.device, a.answer) for a in wider.answers) == sorted(
            (name, colour) for name, (_, colour, _) in STREAMS.items())
        # one stretch of wall time, 08:00:10 to 08:00:20: each device reads what it saw then, by its own clock — red
        # its stream seconds 10-20 (its circle at 11-12), green 5-15 (12-13), blue 0-10 (its circle, 15-16, after)
        clock = ask_fleet(QUESTION, broker.url, timeout_s=60, wall=("2027-01-15T08:00:10Z", "2027-01-15T08:00:20Z"))
        assert sorted(a.device for a in clock.answers) == sorted(STREAMS)
        for answer in clock.answers:
            start = 10.0 - WALL_START[answer.device]
            t = fleet.devices[answer.device][1].times[answer.evidence_pair]
            assert answer.error is None and start <= t <= start + 10.0, (answer, t)
            assert answer.evidence_unix == WALL + WALL_START[answer.device] + answer.evidence_t  # by its own clock
        assert {a.device: a.answer for a in clock.answers if a.device != "cam-blue"} == {"cam-red": "red",
                                                                                        "cam-green": "green"}
        # one device asked by name; the others never see the question
        only = ask_fleet("Was there a red circle?", broker.url, timeout_s=60, device="cam-green")
        assert [(a.device, a.answer) for a in only.answers] == [("cam-green", "no")] and only.silent == []
        assert fleet.devices["cam-red"][0].counts["questions_received"] == 4
        # the command line
        assert main(["ask", "--fleet", "Was there a red circle?", "--broker", broker.url, "--timeout", "60"]) == 0
        out = capsys.readouterr().out
        assert "cam-red (synthetic:events" in out and ": yes   [evidence t=" in out
        assert re.search(r"evidence t=\d+\.\d s \(pair \d+\), seen 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d;", out), out
        assert "3 answer(s)" in out and "online but silent: none" in out
        assert main(["ask", "--fleet", QUESTION, "--broker", broker.url, "--timeout", "60", "--last", "20",
                     "--json"]) == 0
        assert sorted(a["answer"] for a in json.loads(capsys.readouterr().out)["answers"]) == ["blue", "green", "red"]
        assert main(["ask", "--fleet", QUESTION, "--broker", broker.url, "--timeout", "60", "--json", "--from",
                     "2027-01-15T08:00:10Z", "--to", "2027-01-15T08:00:20Z"]) == 0
        printed = {a["device"]: a["answer"] for a in json.loads(capsys.readouterr().out)["answers"]}
        assert (printed["cam-red"], printed["cam-green"]) == ("red", "green")
        assert main(["ask", "--fleet", QUESTION, "--broker", broker.url, "--json", "--device", "cam-blue"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert [a["answer"] for a in printed["answers"]] == ["blue"] and printed["answers"][0]["evidence_t"] is not None
    finally:
        listener.close()


def test_a_fleet_forget_removes_each_devices_own_stretch_only_where_it_is_accepted(broker, fleet, capsys):
    """``forget_fleet`` / ``edgekv forget --fleet``: one wall-clock window, 08:00:10-08:00:20, is each device's own
    stretch of stream time (red 10-20 s, green 5-15 s: they started 0 and 5 s after 08:00); each device where
    fleet.accept_forget is on removes exactly the pairs it saw then and says how many; one where it is off answers
    "refused" and keeps everything; a request that does not check is answered naming what is wrong."""
    from edgekv.apps.cli import main
    from edgekv.apps.outputs.mqtt import forget_fleet

    listener = Listener(broker.url, ["edgekv/devices/+/status"])
    try:
        for name in STREAMS:
            fleet.add(broker.url, name, accept_forget=name != "cam-blue")
        assert until(lambda: all(any(s["state"] == "online" for s in _statuses(listener, n)) for n in STREAMS))
        before = {name: dict(host.session.pair_times) for name, (_, host) in fleet.devices.items()}  # pair -> t
        result = forget_fleet(broker.url, timeout_s=60, wall=("2027-01-15T08:00:10Z", "2027-01-15T08:00:20Z"))
        assert sorted(a.device for a in result.answers) == sorted(STREAMS) and result.silent == []
        by_device = {a.device: a for a in result.answers}
        for name in ("cam-red", "cam-green"):
            start = 10.0 - WALL_START[name]
            gone = sorted(p for p, t in before[name].items() if start <= t <= start + 10.0)
            answer, host = by_device[name], fleet.devices[name][1]
            assert answer.error is None and answer.raw["type"] == "edgekv.fleet.forgot", answer
            assert answer.raw["result"]["pairs"] == len(gone) > 0
            assert set(host.session.pair_times) == set(before[name]) - set(gone)
            assert not set(gone) & {int(f) for f in host.session.cache.frame[0, 0, :host.session.cache.length]}
        assert by_device["cam-blue"].error.startswith("refused: this device does not take forgets from the fleet")
        assert fleet.devices["cam-blue"][1].session.pair_times == before["cam-blue"]  # kept everything
        # the command line: the last 2 s of each device's stream, on the two that accept; exit 1 (one refused)
        assert main(["forget", "--fleet", "--last", "2", "--broker", broker.url, "--timeout", "60"]) == 1
        out = capsys.readouterr().out
        assert "cam-red (" in out and "forgot " in out and "cam-blue (" in out and "error: refused" in out
        assert "3 answer(s); online but silent: none" in out
        assert main(["forget", "--fleet", "--from", "10", "--to", "20", "--broker", broker.url]) == 2  # stream s
        assert "stream seconds are each device's own" in capsys.readouterr().err
        assert main(["forget", "--last", "2", "--broker", broker.url, "--device", "cam-red"]) == 2  # not the fleet
        assert "--broker, --device: only with --fleet" in capsys.readouterr().err
        with pytest.raises(ValueError, match="a wall-time window .* or last_s"):
            forget_fleet(broker.url, timeout_s=5)
    finally:
        listener.close()


def _drop_counts(agent) -> tuple[int, int, int, int]:
    counts = agent.counts
    return counts["dropped_malformed"], counts["dropped_oversized"], counts["duplicates"], counts["answered"]


def test_bad_fleet_messages_are_counted_and_answered_with_the_reason_and_nothing_is_lost(broker, fleet):
    from edgekv.apps.outputs.mqtt import ask_fleet

    agent, host = fleet.add(broker.url, "cam-red", max_payload_bytes=1024)
    assert until(lambda: announced(agent))
    frames, cache_tokens = host.session.counters.frames, host.session.cache.length
    replies = Listener(broker.url, ["edgekv/replies/bad"])
    ask = "edgekv/fleet/ask"
    try:
        publish_raw(broker.url, ask, b"not json {", "edgekv/replies/bad", b"1")
        publish_raw(broker.url, ask, b'{"max_new_tokens": 2}', "edgekv/replies/bad", b"2")
        publish_raw(broker.url, ask, b'{"question": ["a"]}', "edgekv/replies/bad", b"3")
        publish_raw(broker.url, ask, b'{"question": "x?"}')  # no Response Topic: nowhere to say why
        publish_raw(broker.url, ask, json.dumps({"question": "x" * 3000}).encode(), "edgekv/replies/bad", b"5")
        publish_raw(broker.url, ask, b"y" * 10**6, "edgekv/replies/bad", b"6")  # over the Maximum Packet Size
        publish_raw(broker.url, ask, json.dumps({"question": QUESTION}).encode(), "edgekv/replies/bad", b"7")
        publish_raw(broker.url, ask, json.dumps({"question": QUESTION}).encode(), "edgekv/replies/bad", b"7")
        expected = (4, 1, 1, 1)  # malformed, oversized, duplicates, answered
        # the duplicate may reach the agent after the first copy's answer went out: wait for both
        assert until(lambda: len(replies.messages) == 5 and _drop_counts(agent) == expected)
        by_id = {bytes(p.CorrelationData): json.loads(body) for _, body, p, _ in replies.messages}
        assert by_id[b"1"]["error"].startswith("malformed: not JSON") and by_id[b"1"]["device"] == "cam-red"
        assert by_id[b"2"]["error"] == "malformed: question: expected a non-empty string, got None"
        assert by_id[b"3"]["error"] == "malformed: question: expected a non-empty string, got ['a']"
        assert by_id[b"5"]["error"].startswith("oversized: payload of 3")
        assert "is over fleet.max_payload_bytes (1024)" in by_id[b"5"]["error"]
        assert by_id[b"7"]["answer"] == "red" and b"6" not in by_id  # the broker never sent 1 MB to the device
        assert _drop_counts(agent) == expected and len(replies.messages) == 5
        # the device goes on: nothing ingested lost, the next question answered
        assert (host.session.counters.frames, host.session.cache.length) == (frames, cache_tokens)
        result = ask_fleet(QUESTION, broker.url, timeout_s=60)
        assert [a.answer for a in result.answers] == ["red"]
    finally:
        replies.close()


def test_the_last_will_marks_a_vanished_device_offline_and_it_comes_back_by_itself(broker, fleet):
    from edgekv.apps.outputs.mqtt import ask_fleet

    relay = Relay(broker.port)
    listener = Listener(broker.url, ["edgekv/devices/+/status"])
    try:
        agent, host = fleet.add(relay.url, "cam-blue", keepalive_s=60)
        fleet.add(broker.url, "cam-green")
        assert until(lambda: agent.counts["connects"] == 1
                     and any(s["state"] == "online" for s in _statuses(listener, "cam-blue")))
        relay.cut()  # the link goes; the broker sees the connection end without a DISCONNECT
        assert until(lambda: any(s.get("reason") == "connection lost (last will)"
                                 for s in _statuses(listener, "cam-blue")))
        assert until(lambda: not agent.connected.is_set())
        # without the broker the device still answers locally
        local = Question(QUESTION, max_new_tokens=4, temperature=0.0, source="cli")
        host.submit(local)
        assert local.done.wait(60) and local.answer.text == "blue"
        # the fleet hears from the others and knows which one is offline
        result = ask_fleet(QUESTION, broker.url, timeout_s=60)
        assert [a.device for a in result.answers] == ["cam-green"] and result.offline == ["cam-blue"]
        # alerts raised meanwhile wait in a bounded queue: the oldest beyond fleet.queue are dropped and counted
        for i in range(agent.section.queue + 3):
            agent.offer(AlertEvent(f"e{i}", "alert-1", "blue", "Was there a blue circle?", None, 0.9, 1.0, 15, 15.0, 0.0))
        assert agent.counts["outbox_dropped"] == 3 and agent.stats()["waiting"] == agent.section.queue
        alerts = Listener(broker.url, ["edgekv/devices/cam-blue/alerts"])
        relay.restore()  # the device reconnects with backoff, no restart
        assert until(lambda: agent.counts["connects"] == 2)
        assert until(lambda: len(alerts.json_on("/alerts")) == agent.section.queue)
        assert agent.counts["paho_queue_full"] == 0  # the burst waited here, within the window, not in paho
        assert [a["id"] for a in alerts.json_on("/alerts")][:2] == ["e3", "e4"]  # in order, the newest kept
        alerts.close()
        assert until(lambda: _statuses(listener, "cam-blue")[-1]["state"] == "online")
        back = ask_fleet(QUESTION, broker.url, timeout_s=60)
        assert sorted(a.device for a in back.answers) == ["cam-blue", "cam-green"]
        # a clean stop says so itself (retained), no will needed
        agent.stop()
        assert until(lambda: _statuses(listener, "cam-blue")[-1].get("reason") == "stopped")
    finally:
        listener.close()
        relay.close()


def test_a_busy_device_answers_busy(broker, fleet):
    from edgekv.apps.outputs.mqtt import ask_fleet

    agent, host = fleet.add(broker.url, "cam-red")
    assert until(lambda: announced(agent))
    host.queue_size = 0  # a device whose question queue is full
    (busy,) = ask_fleet(QUESTION, broker.url, timeout_s=60).answers
    assert busy.answer is None and "questions are already waiting" in busy.error and agent.counts["refused_busy"] == 1
    host.queue_size = 16
    (answer,) = ask_fleet(QUESTION, broker.url, timeout_s=60).answers
    assert answer.answer == "red"


@pytest.mark.slow
def test_a_silent_device_is_named(broker, fleet):
    from edgekv.apps.outputs.mqtt import ask_fleet

    stuck = threading.Lock()
    fleet.add(broker.url, "cam-red")
    fleet.add(broker.url, "cam-green", lock=stuck)
    assert until(lambda: all(announced(agent) for agent, _ in fleet.devices.values()))
    with stuck:  # cam-green's model is held: online, but it cannot answer within the timeout, however long
        result = ask_fleet(QUESTION, broker.url, timeout_s=10.0)
    assert [(a.device, a.answer) for a in result.answers] == [("cam-red", "red")]
    assert result.silent == ["cam-green"] and result.offline == [] and result.elapsed_s >= 10.0


def test_a_broker_that_refuses_the_credentials(tmp_path, fleet, monkeypatch, capsys):
    from edgekv.apps.cli import main
    from edgekv.apps.outputs.mqtt import FleetError, ask_fleet, preflight
    from edgekv.apps.outputs.mqtt import FleetConnection

    with Mosquitto(tmp_path / "broker", users={"cam": "right-horse-battery"}) as broker:
        agent, host = fleet.add(broker.url, "cam-red", password="wrong", username="cam", password_env="EDGEKV_MQTT_PW")
        assert until(lambda: agent.counts["connect_refused"] >= 1)
        assert not agent.connected.is_set()
        assert re.search(r"refused the connection: (Not authorized|Bad user name or password)", agent.last_error)
        local = Question("Was there a red circle?", max_new_tokens=4, temperature=0.0)
        host.submit(local)  # the device goes on answering locally
        assert local.done.wait(60) and local.answer.text == "yes"
        with pytest.raises(FleetError, match=r"refused the connection: (Not authorized|Bad user name or password)"):
            ask_fleet(QUESTION, FleetConnection(broker.url, username="cam", password="wrong"), timeout_s=5)
        with pytest.raises(FleetError, match="refused the connection"):
            ask_fleet(QUESTION, broker.url, timeout_s=5)  # anonymous
        monkeypatch.setenv("EDGEKV_MQTT_PW", "wrong")
        assert main(["ask", "--fleet", QUESTION, "--broker", broker.url, "--username", "cam",
                     "--password-env", "EDGEKV_MQTT_PW"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("edgekv ask: the broker mqtt://127.0.0.1") and "refused the connection" in err
        assert err.count("\n") == 1
        good, _ = fleet.add(broker.url, "cam-green", password="right-horse-battery", username="cam",
                            password_env="EDGEKV_MQTT_PW")
        assert until(good.connected.is_set)
        result = ask_fleet(QUESTION, FleetConnection(broker.url, username="cam", password="right-horse-battery"),
                           timeout_s=60)
        assert [(a.device, a.answer) for a in result.answers] == [("cam-green", "green")]
        # the daemon's preflight: a password variable that is not set is one line naming the key
        monkeypatch.delenv("EDGEKV_MQTT_PW")
        with pytest.raises(FleetError, match="fleet.password_env: the environment variable EDGEKV_MQTT_PW is not set"):
            preflight(FleetSection(broker=broker.url, username="cam", password_env="EDGEKV_MQTT_PW"))


# ---------------------------------------------------------------------------------------------- the daemon
ALERT_SOURCE = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # purple triangle at pair 60
ALERT_PAIR = 60


def _gated(gate: threading.Event):
    """``ALERT_SOURCE`` whose frames wait for ``gate``: the MQTT subscriber is there before anything is ingested."""
    from edgekv.video.sources import FrameSource, open_source

    class Gated(FrameSource):
        kind = "synthetic"

        def __init__(self):
            super().__init__(ALERT_SOURCE, live=False)
            self.inner = open_source(ALERT_SOURCE)
            self.scene = self.inner.scene

        def read(self):
            gate.wait(120)
            return self.inner.read()

        def close(self):
            self.inner.close()

    return Gated()


@pytest.mark.slow
def test_the_daemon_publishes_its_alert_and_status_and_answers_the_fleet(broker, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.apps.cli import main
    from edgekv.apps.outputs.mqtt import ask_fleet, forget_fleet
    from edgekv.config import EdgeKVConfig
    from edgekv.video.sources import SourceSpec
    from helpers_server import call

    gate = threading.Event()
    source = _gated(gate)
    monkeypatch.setattr("edgekv.apps.daemon.loop.open_video_source",
                        lambda config: (SourceSpec("synthetic", "events", raw=ALERT_SOURCE), source))
    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": ALERT_SOURCE, "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"port": 0}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 8},
        alerts={"rules": [{"question": "Was there a purple triangle?", "every_pairs": 1, "name": "purple"}]},
        fleet={"broker": broker.url, "device_id": "gate-3", "status_every_s": 0.5, "accept_forget": True})
    listener = Listener(broker.url, ["edgekv/devices/gate-3/#"])
    with open(tmp_path / "out.txt", "w") as log:
        daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True), out=log)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        try:
            assert daemon.ready.wait(120) and until(lambda: daemon.fleet.connected.is_set())
            assert daemon.fleet in daemon.alert_bus.sinks
            gate.set()
            assert until(lambda: daemon.stream_state == "ended", 300)
            assert until(lambda: listener.json_on("/alerts"))
            (alert,) = listener.json_on("/alerts")
            (event,) = list(daemon.alert_bus.recent)
            assert alert["id"] == event.id and alert["device"] == "gate-3" and alert["name"] == "purple"
            assert ALERT_PAIR <= alert["evidence_pair"] <= ALERT_PAIR + 1 and alert["keyframe_jpeg_base64"]
            assert until(lambda: _statuses(listener, "gate-3")[-1].get("stream_state") == "ended")
            assert _statuses(listener, "gate-3")[-1]["frame_pairs"] == 80
            result = ask_fleet("Was there a purple triangle?", broker.url, timeout_s=120)
            (answer,) = result.answers
            assert (answer.device, answer.answer, answer.camera) == ("gate-3", "yes", ALERT_SOURCE)
            assert ALERT_PAIR <= answer.evidence_pair <= ALERT_PAIR + 1
            assert answer.evidence_t == daemon.session.pair_times[answer.evidence_pair]  # the pair's first frame
            assert answer.evidence_jpeg is None and "evidence_jpeg_base64" not in answer.raw  # not asked for
            (framed,) = ask_fleet("Was there a purple triangle?", broker.url, timeout_s=120, frame=True).answers
            assert framed.evidence_pair == answer.evidence_pair
            assert framed.evidence_jpeg == daemon.keyframe_jpeg(answer.evidence_pair)  # from its keyframe ring
            saved = tmp_path / "frames"
            printed = tmp_path / "ask.txt"
            with open(printed, "w") as sink, contextlib.redirect_stdout(sink):
                assert main(["ask", "--fleet", "Was there a purple triangle?", "--broker", broker.url, "--timeout",
                             "120", "--frames", str(saved)]) == 0
            (file,) = saved.iterdir()
            assert file.name.startswith("gate-3-synthetic_events_size_112x112") and "?" not in file.name
            assert file.name.endswith(f"-pair{answer.evidence_pair}.jpg") and file.read_bytes() == framed.evidence_jpeg
            assert f", frame {file}" in printed.read_text()
            assert any(q["source"] == "fleet" for q in daemon.recent_questions())
            publish_raw(broker.url, "edgekv/devices/gate-3/ask", b"{not json", "edgekv/replies/x", b"1")
            assert until(lambda: daemon.fleet.counts["dropped_malformed"] == 1)
            metrics = call(daemon.server.port, "GET", "/metrics")[2].decode()
            assert 'edgekv_fleet_dropped_total{reason="malformed"} 1.0' in metrics
            assert 'edgekv_fleet_questions_total{outcome="answered"} 3.0' in metrics  # one plain, two with frames
            assert "edgekv_fleet_connected 1.0" in metrics
            assert daemon.status()["fleet"]["dropped_malformed"] == 1 and daemon.session.counters.frame_pairs == 80
            # a fleet forget of the device's last 5 s: the daemon's own forget (cache, snapshots, archive, frames)
            last = max(daemon.session.pair_times.values())
            (forgot,) = forget_fleet(broker.url, timeout_s=120, last_s=5).answers
            # a pair a second, and the one whose second frame is the window's first (74.0 and 74.5 of 74.5-79.5)
            assert forgot.error is None and forgot.raw["result"]["pairs"] == 6, forgot.raw
            assert max(daemon.session.pair_times.values()) < last - 4
        finally:
            gate.set()
            daemon.stop.event.set()
            thread.join(60)
    assert not thread.is_alive()
    assert until(lambda: _statuses(listener, "gate-3")[-1] == {**_statuses(listener, "gate-3")[-1], "state": "offline",
                                                                "reason": "stopped"})
    listener.close()


@pytest.fixture
def certificates(tmp_path):
    """A CA, a broker certificate for 127.0.0.1 and a client certificate, made with the openssl command."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path / "certs"
    d.mkdir()

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=edgekv test CA")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, extra in (("broker", ["-extfile", "san.cnf"]), ("client", [])):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{name}.pem", "-days", "2", *extra)
    return d


def test_mqtts_with_the_fleet_ca_and_a_client_certificate(tmp_path, fleet, certificates):
    from edgekv.apps.outputs.mqtt import FleetConnection, FleetError, ask_fleet

    c = certificates
    broker = Mosquitto(tmp_path / "broker", tls=(c / "ca.pem", c / "broker.pem", c / "broker.key"))
    broker.config_text = (lambda text: lambda: text() + "require_certificate true\n")(broker.config_text)
    with broker:
        url = f"mqtts://127.0.0.1:{broker.tls_port}"
        tls = {"ca_file": str(c / "ca.pem"), "cert_file": str(c / "client.pem"), "key_file": str(c / "client.key")}
        agent, _ = fleet.add(url, "cam-green", **tls)
        assert until(lambda: announced(agent))
        result = ask_fleet(QUESTION, FleetConnection(url, **tls), timeout_s=60)
        assert [(a.device, a.answer) for a in result.answers] == [("cam-green", "green")]
        with pytest.raises(FleetError, match=r"the broker mqtts://127.0.0.1:\d+ closed the connection before accepting "
                                             r"it \(.*\); does it require a client certificate"):
            ask_fleet(QUESTION, FleetConnection(url, ca_file=str(c / "ca.pem")), timeout_s=5)  # no client certificate
        stranger, _ = fleet.add(url, "cam-red", ca_file=str(c / "ca.pem"))  # trusts the broker, has no certificate
        assert until(lambda: stranger.counts["connect_failed"] >= 1)
        assert not stranger.connected.is_set() and "closed the connection before accepting it" in stranger.last_error


@pytest.mark.slow
def test_bench_fleet_writes_its_figures(tmp_path, capsys):
    from edgekv.apps.cli import main

    need_mosquitto()
    out = tmp_path / "fleet.json"
    assert main(["bench", "fleet", "--devices", "3", "--questions", "2", "--pairs", "6", "--json", str(out),
                 "--plot", str(tmp_path / "fleet.png")]) == 0
    result = json.loads(out.read_text())
    assert [len(r["answers"]) for r in result["records"]] == [3, 3] and result["summary"]["silent"] == 0
    assert {a["device"] for a in result["records"][0]["answers"]} == {"device-00", "device-01", "device-02"}
    assert all(a["answer"] in ("yes", "no") and a["device_ms"] > 0 for r in result["records"] for a in r["answers"])
    assert result["summary"]["overhead_ms"]["n"] == 6 and (tmp_path / "fleet.png").stat().st_size > 0
    assert "3 devices x 2 questions: all answered in median" in capsys.readouterr().out


@pytest.mark.slow
def test_a_daemon_refused_by_the_broker_keeps_ingesting_and_answering(tmp_path, tiny_checkpoint, monkeypatch):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call, chat, server_config

    need_mosquitto()
    monkeypatch.setenv("EDGEKV_TEST_MQTT_PASSWORD", "wrong")
    with Mosquitto(tmp_path / "broker", users={"cam": "right-horse-battery"}) as broker:
        config = server_config(tiny_checkpoint).with_overrides(fleet={
            "broker": broker.url, "device_id": "cam-9", "username": "cam", "password_env": "EDGEKV_TEST_MQTT_PASSWORD",
            "reconnect_backoff_s": [0.2, 1.0]})
        with RunningDaemon(config, tmp_path / "out.txt") as run:
            fleet = run.daemon.fleet
            assert until(lambda: fleet.counts["connect_refused"] >= 2)  # refused, retried with backoff
            frames = run.daemon.session.counters.frames
            assert until(lambda: run.daemon.session.counters.frames > frames + 4)  # ingest goes on
            status, _, body = chat(run.port, "What do you see?", max_tokens=2)
            assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] is not None
            metrics = call(run.port, "GET", "/metrics")[2].decode()
            assert "edgekv_fleet_connected 0.0" in metrics
            assert re.search(r"edgekv_fleet_connect_refused_total [1-9]", metrics)
            assert "refused the connection" in run.daemon.status()["fleet"]["last_error"]
            assert run.daemon.stream_state == "running"
    log = (tmp_path / "out.txt").read_text()
    assert "fleet: device cam-9 on mqtt://127.0.0.1" in log


def test_evidence_frames_from_devices_are_checked_and_saved_under_safe_names(tmp_path):
    """A device names itself and sends its frame: the name never leaves the folder, and only a JPEG is kept."""
    import base64

    from edgekv.apps.outputs.mqtt import FleetAnswer, FleetResult, _jpeg_or_none, format_result, save_frames

    jpeg = b"\xff\xd8\xff\xe0 a frame"
    assert _jpeg_or_none(base64.b64encode(jpeg).decode()) == jpeg
    for bad in (None, "", "not base64!", base64.b64encode(b"<svg>").decode(), 42):
        assert _jpeg_or_none(bad) is None
    answers = [FleetAnswer("../../etc/x", None, "yes", 7, 3.5, 0.01, 0.2, evidence_jpeg=jpeg),
               FleetAnswer("cam/era", "front door", "no", 9, 4.5, 0.01, 0.3, evidence_jpeg=jpeg),
               FleetAnswer("gate-3", None, "no", None, None, 0.01, 0.4)]
    result = FleetResult("Was there a red circle?", answers, [], [], 0.5)
    saved = save_frames(result, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cam_era-front_door-pair9.jpg", "etc_x-pair7.jpg"]
    assert all(p.read_bytes() == jpeg for p in tmp_path.iterdir())
    text = format_result(result, saved)
    assert f", frame {tmp_path / 'etc_x-pair7.jpg'}" in text and "gate-3: no   [evidence: unknown, no frame kept" in text


def test_a_fleet_forget_request_is_checked_naming_what_is_wrong():
    from edgekv.apps.outputs.mqtt import FleetMessageError, parse_forget

    ok = parse_forget(b'{"from": "2027-01-15T08:00:10Z", "to": "2027-01-15T08:00:20Z", "camera": "back"}', _props(),
                      1000)
    assert ok.window == {"unix": (1800000010.0, 1800000020.0)} and ok.camera == "back" and ok.correlation == b"c1"
    assert parse_forget(b'{"last_s": 30}', _props(), 1000).window == {"last_s": 30.0}
    for payload, message in ((b'{"from": 10, "to": 20}', "stream seconds are each device's own"),
                             (b'{"last_s": 0}', "last_s: must be > 0"), (b'{"when": 1}', "unknown key 'when'"),
                             (b'{"from": "2027-01-15T08:00:20Z", "to": "2027-01-15T08:00:10Z"}', "is after to"),
                             (b"{}", "from and to are required"), (b"[1]", "expected a JSON object"),
                             (b'{"last_s": 5, "camera": ""}', "camera: expected a camera's name")):
        with pytest.raises(FleetMessageError, match=message):
            parse_forget(payload, _props(), 1000)
    with pytest.raises(FleetMessageError, match="no Response Topic"):
        parse_forget(b'{"last_s": 5}', _props(None), 1000)
    with pytest.raises(FleetMessageError, match="over fleet.max_payload_bytes"):
        parse_forget(b'{"last_s": 5}' + b" " * 2000, _props(), 1000)


def test_a_forget_that_fails_unexpectedly_is_answered_and_the_next_is_still_carried_out(broker, fleet):
    """The forget thread survives any failure of a host's forget: the asker hears why, and the next forget runs."""
    from edgekv.apps.outputs.mqtt import forget_fleet

    agent, host = fleet.add(broker.url, "cam-red", accept_forget=True)
    assert until(lambda: announced(agent))
    real, calls = host.forget, []

    def flaky(**window):
        calls.append(window)
        if len(calls) == 1:
            raise RuntimeError("the disk controller went away")
        return real(**window)

    host.forget = flaky
    (first,) = forget_fleet(broker.url, timeout_s=60, last_s=2).answers
    assert first.error == "forget failed: RuntimeError: the disk controller went away"
    (second,) = forget_fleet(broker.url, timeout_s=60, last_s=2).answers
    assert second.error is None and second.raw["result"]["pairs"] > 0 and len(calls) == 2


def test_a_forget_reaching_a_stopping_device_is_answered_as_such(broker, fleet):
    """``Daemon.forget`` refuses once the daemon stops (DaemonStopping): the fleet logged a traceback and answered
    "forget failed"; the asker now hears that nothing was forgotten, and the next forget runs."""
    from edgekv.apps.outputs.mqtt import forget_fleet
    from edgekv.apps.questions import DaemonStopping

    agent, host = fleet.add(broker.url, "cam-red", accept_forget=True)
    assert until(lambda: announced(agent))
    real, calls = host.forget, []

    def stopping_once(**window):
        calls.append(window)
        if len(calls) == 1:
            raise DaemonStopping("the daemon is shutting down: nothing was forgotten; ask again once it is back")
        return real(**window)

    host.forget = stopping_once
    (first,) = forget_fleet(broker.url, timeout_s=60, last_s=2).answers
    assert first.error == "the daemon is shutting down: nothing was forgotten; ask again once it is back"
    assert agent.counts["forgets_refused"] == 1
    (second,) = forget_fleet(broker.url, timeout_s=60, last_s=2).answers
    assert second.error is None and len(calls) == 2


def test_a_deeply_nested_fleet_question_is_refused_and_the_device_goes_on_answering(broker, fleet):
    """A request nested deeper than Python's JSON decoder recurses (small enough for max_payload_bytes) raised
    RecursionError inside paho's callback, which ended the agent's network thread: the device went deaf."""
    from edgekv.apps.outputs.mqtt import ask_fleet

    agent, host = fleet.add(broker.url, "cam-red")
    assert until(lambda: announced(agent))
    replies = Listener(broker.url, ["edgekv/replies/deep"])
    try:
        publish_raw(broker.url, "edgekv/fleet/ask", b'{"question": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
                    "edgekv/replies/deep", b"1")
        assert until(lambda: len(replies.messages) == 1)
        assert json.loads(replies.messages[0][1])["error"].startswith("malformed: not JSON (nested too deeply")
        assert agent.counts["dropped_malformed"] == 1
        result = ask_fleet(QUESTION, broker.url, timeout_s=60)
        assert [a.answer for a in result.answers] == ["red"]
    finally:
        replies.close()


class _OddDevice:
    """A device of another make on the fleet's topics: its retained status says online, and it answers every question
    with ``reply`` (fields of the wrong types), as a buggy or hostile device would."""

    def __init__(self, url: str, name: str, reply: dict) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from edgekv.config import broker_address

        host, port, _ = broker_address(url)
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)

        def on_message(client, userdata, message):
            properties = Properties(PacketTypes.PUBLISH)
            properties.CorrelationData = message.properties.CorrelationData
            client.publish(message.properties.ResponseTopic, json.dumps(reply), qos=1, properties=properties)

        def on_connect(client, userdata, flags, reason, properties):
            client.publish(f"edgekv/devices/{name}/status", json.dumps({"state": "online"}), qos=1, retain=True)
            client.subscribe("edgekv/fleet/ask", qos=1)

        self.client.on_message, self.client.on_connect = on_message, on_connect
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.connect(host, port)
        self.client.loop_start()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_an_answer_with_fields_of_the_wrong_types_is_kept_without_them_and_the_others_still_come(broker, fleet):
    """A device answering with a list for its camera made the answer unhashable and ended ``ask_fleet``'s network
    thread (every later answer lost, the asker waiting out its timeout); a number there broke the printed lines."""
    from edgekv.apps.outputs.mqtt import ask_fleet, format_result

    agent, _ = fleet.add(broker.url, "cam-red")
    odd = _OddDevice(broker.url, "odd-cam", {"device": "odd-cam", "camera": ["x"], "answer": {"a": 1},
                                             "evidence_pair": "3", "evidence_t": "1.5", "ttft_s": [1], "error": 7})
    try:
        assert until(lambda: announced(agent)) and odd.subscribed.wait(30)
        result = ask_fleet(QUESTION, broker.url, timeout_s=60)
        by_device = {a.device: a for a in result.answers}
        assert sorted(by_device) == ["cam-red", "odd-cam"] and by_device["cam-red"].answer == "red"
        weird = by_device["odd-cam"]
        assert (weird.camera, weird.answer, weird.evidence_pair, weird.evidence_t, weird.ttft_s, weird.error) == \
            (None, None, None, None, None, None)
        lines = format_result(result).splitlines()
        assert any(line.startswith("  odd-cam: ") for line in lines)
        assert any(line.startswith("  cam-red (") and ": red " in line for line in lines)
    finally:
        odd.close()


def test_two_devices_with_the_same_id_are_named_as_such(broker, fleet, caplog):
    """Two devices configured with one device_id (the MQTT client id) take the connection from each other for ever;
    Mosquitto 2.0 just closes the older one, which each logged as a lost broker ("Unspecified error") and nothing
    said why. Each marks its status with its own instance, so the one that sees the other's says so."""
    first, _ = fleet.add(broker.url, "cam-red", reconnect_backoff_s=[0.1, 0.2])
    second, _ = fleet.add(broker.url, "cam-green", device_id="cam-red", reconnect_backoff_s=[0.1, 0.2])
    assert until(lambda: first.counts["twins_seen"] + second.counts["twins_seen"] > 0)
    assert "another client is online as device_id cam-red (fleet.device_id must be unique per broker" in caplog.text
    alone, _ = fleet.add(broker.url, "cam-blue")  # a device alone under its id, reconnecting, never says so
    assert until(lambda: alone.counts["status_sent"] >= 2 and alone.connected.is_set())
    alone._client.reconnect()
    assert until(lambda: alone.counts["connects"] >= 2 and alone.counts["status_sent"] >= 3)
    assert alone.counts["twins_seen"] == 0
