"""How ``ask --fleet`` treats devices that cannot answer, against a real Mosquitto: a device gone without its last
will firing (a half-open link) or a status left retained long ago is not waited for but named with its status's age;
a broker restart mid-wait is survived (subscribed and asked again, a device sends its kept answer again); two
processes answering under one device id are named; TLS files that cannot be used are named."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from helpers_mqtt import QUESTION, Listener, Mosquitto, Relay, publish_raw, returns_early, until
from test_fleet import announced, broker, certificates, fleet, runtime  # noqa: F401 (fixtures)


def _properties(**values) -> SimpleNamespace:
    return SimpleNamespace(**values)


def test_a_status_is_aged_by_the_broker_or_by_its_wall_time_and_older_statuses_are_still_read():
    from edgekv.apps.outputs.mqtt import LEGACY_STALE_S, read_status, stale_after_s, status_expiry_s

    assert status_expiry_s(30.0) == 300 and status_expiry_s(60.0) == 600 and status_expiry_s(1e12) == 2**32 - 1
    assert stale_after_s(30.0) == 70.0
    now = time.time()
    # this version: the age is the broker's count (expires_s less the expiry left), whatever the device's clock says
    new = json.dumps({"state": "online", "unix": now + 9999, "every_s": 30.0, "expires_s": 300}).encode()
    seen = read_status(new, _properties(MessageExpiryInterval=211), 5.0, now)
    assert (seen.state, seen.age_s, seen.stale_after_s) == ("online", 89.0, 70.0)
    assert seen.stale(5.0) and seen.age(7.5) == 91.5
    fresh = read_status(new, _properties(MessageExpiryInterval=300), 5.0, now)
    assert not fresh.stale(5.0) and fresh.stale_in(5.0) == 70.0 and fresh.stale(75.5)
    # ... the expiry stripped on the way (a bridge): its wall time, on this machine's clock
    stripped = read_status(json.dumps({"state": "online", "unix": now - 80, "every_s": 30.0}).encode(),
                           _properties(), 0.0, now)
    assert round(stripped.age_s) == 80 and stripped.stale(0.0)
    slow = read_status(json.dumps({"state": "online", "every_s": 145.0, "expires_s": 1450}).encode(),
                       _properties(MessageExpiryInterval=1400), 0.0, now)  # refreshed so rarely its limit is 300 s
    assert (slow.age_s, slow.stale_after_s) == (50.0, 300.0)
    # an older device's status (no every_s): its wall time, stale only past LEGACY_STALE_S
    old = {"type": "edgekv.status", "state": "online", "device": "cam-9", "unix": now - 120}
    legacy = read_status(json.dumps(old).encode(), None, 0.0, now)
    assert round(legacy.age_s) == 120 and legacy.stale_after_s == LEGACY_STALE_S and not legacy.stale(0.0)
    assert read_status(json.dumps({**old, "unix": now - 3600}).encode(), None, 0.0, now).stale(0.0)
    # a status that says nothing of its age is waited for, as before; "offline" is never stale
    ageless = read_status(b'{"state": "online"}', None, 0.0, now)
    assert ageless.age_s is None and not ageless.stale(1e9) and ageless.stale_in(0.0) == float("inf")
    assert not read_status(json.dumps({"state": "offline", "unix": 0}).encode(), None, 0.0, now).stale(0.0)
    for payload in (b"", b"not json", b"[1]", b'{"state": "sleeping"}', b"[" * 5000):
        assert read_status(payload, None, 0.0, now) is None


def test_a_device_gone_without_its_will_is_not_waited_for_and_is_named_with_its_status_age(broker, fleet, capsys):
    """The bug: a retained "online" with no will fired yet (a half-open link the broker notices only after the
    keep-alive, or a status left by an older client) made ask --fleet wait its whole timeout and then call the device
    "online but silent". Now the status's age is known (the broker's Message Expiry count, or its wall time) and a
    device whose status is older than two refreshes is named "not answering (status N s old)" without a wait."""
    from edgekv.apps.cli import main
    from edgekv.apps.outputs.mqtt import ask_fleet, format_result

    relay = Relay(broker.port)
    listener = Listener(broker.url, ["edgekv/devices/+/status"])
    try:
        fleet.add(broker.url, "cam-red")
        frozen, _ = fleet.add(relay.url, "cam-blue", keepalive_s=600)  # its will waits 900 s for the broker
        # an older client's status, left retained an hour ago; a device that left with its will fired
        publish_raw(broker.url, "edgekv/devices/old-cam/status", json.dumps(
            {"type": "edgekv.status", "device": "old-cam", "state": "online", "unix": time.time() - 3600}).encode(),
            retain=True)
        publish_raw(broker.url, "edgekv/devices/gone-cam/status", json.dumps(
            {"type": "edgekv.status", "device": "gone-cam", "state": "offline", "unix": time.time()}).encode(),
            retain=True)
        assert until(lambda: all(any(json.loads(p).get("state") == "online" for t, p, _, _ in listener.messages
                                     if t == f"edgekv/devices/{n}/status") for n in ("cam-red", "cam-blue")))
        # the status of this version: its refresh, its expiry at the broker, when this connection began
        topic, payload, properties, _ = next(m for m in listener.messages if m[0] == "edgekv/devices/cam-red/status")
        status = json.loads(payload)
        assert status["every_s"] == 0.5 and status["expires_s"] == 300 and status["since"] <= status["unix"]
        assert properties.MessageExpiryInterval == 300
        relay.freeze()  # cam-blue's link goes half-open: no more refreshes, no will
        result = ask_fleet(QUESTION, broker.url, timeout_s=120)
        assert [(a.device, a.answer) for a in result.answers] == [("cam-red", "red")]
        assert sorted(result.stale) == ["cam-blue", "old-cam"] and result.silent == []
        assert result.offline == ["gone-cam"] and result.stale["old-cam"] >= 3600
        assert result.elapsed_s < 120  # it stopped once cam-red answered and cam-blue's status went stale
        assert frozen.connected.is_set()  # the device itself has not noticed anything yet
        line = format_result(result).splitlines()[-1]
        assert "; online but silent: none; not answering: cam-blue (status " in line
        assert "old), old-cam (status 36" in line and line.endswith("; offline: gone-cam")
        assert main(["ask", "--fleet", QUESTION, "--broker", broker.url, "--timeout", "120", "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert [s["device"] for s in printed["stale"]] == ["cam-blue", "old-cam"]
        assert printed["stale"][1]["status_age_s"] >= 3600 and printed["silent"] == []
    finally:
        listener.close()
        relay.close()


def test_the_broker_restarting_mid_question_is_survived_and_said(tmp_path, fleet):
    """The bug: the asker's clean reconnection after a broker restart had no subscriptions, so every answer after it
    was lost and the asker waited out its timeout calling the device silent. Now it subscribes and asks again."""
    from edgekv.apps.outputs.mqtt import ask_fleet, format_result

    with Mosquitto(tmp_path / "broker") as broker:
        held = threading.Lock()
        agent, _ = fleet.add(broker.url, "cam-red", lock=held)
        assert until(lambda: announced(agent))
        results: list = []
        with held:  # the device holds the question until the broker has restarted
            asker = threading.Thread(target=lambda: results.append(ask_fleet(QUESTION, broker.url, timeout_s=120)))
            asker.start()
            assert until(lambda: agent.counts["questions_received"] == 1)
            broker.stop()
            broker.start()  # the same port, nothing persisted: every session and retained status is gone
            assert until(lambda: agent.counts["connects"] == 2)
        asker.join(150)
        (result,) = results
        assert [(a.device, a.answer) for a in result.answers] == [("cam-red", "red")] and result.silent == []
        (lost,) = result.broker_lost
        assert lost.startswith("lost at ") and ", back at " in lost and lost.endswith("and asked again")
        assert "; the broker: lost at " in format_result(result)
        assert agent.counts["answered"] == 1  # the question asked again was not answered twice


def test_a_device_asked_again_sends_its_kept_answer_again(broker, fleet):
    """An answer that reached the broker while the asker was away is lost to it; asked again (the "repeat" User
    Property), the device that answered sends its answer again; a plain QoS 1 duplicate is still only dropped."""
    from edgekv.apps.outputs.mqtt import REPEAT

    agent, _ = fleet.add(broker.url, "cam-red")
    assert until(lambda: announced(agent))
    replies = Listener(broker.url, ["edgekv/replies/again"])
    ask, request = "edgekv/fleet/ask", json.dumps({"question": QUESTION}).encode()
    try:
        publish_raw(broker.url, ask, request, "edgekv/replies/again", b"1")
        assert until(lambda: len(replies.messages) == 1)
        publish_raw(broker.url, ask, request, "edgekv/replies/again", b"1")  # a duplicate: dropped
        publish_raw(broker.url, ask, request, "edgekv/replies/again", b"1", user_properties=[REPEAT])
        assert until(lambda: len(replies.messages) == 2 and agent.counts["duplicates"] == 2)
        first, again = (json.loads(body) for _, body, _, _ in replies.messages)
        assert first == again and first["answer"] == "red" and first["instance"] == agent.instance
        assert agent.counts["answers_resent"] == 1 and agent.counts["answered"] == 1
        assert bytes(replies.messages[1][2].CorrelationData) == b"1"
    finally:
        replies.close()


def _answer(gathering, body: dict, correlation: bytes | None = None) -> None:
    gathering.on_message(None, None, SimpleNamespace(
        topic=gathering.reply_topic, payload=json.dumps(body).encode(),
        properties=SimpleNamespace(CorrelationData=correlation or gathering.correlation)))


def test_answers_from_two_processes_under_one_device_id_are_named_and_other_requests_ignored():
    from edgekv.apps.outputs.mqtt import FleetTopics, _Gathering, format_result

    gathering = _Gathering(FleetTopics(), None, "t0ken")
    gathering.sent_at = time.monotonic()
    _answer(gathering, {"device": "cam-1", "answer": "red", "instance": "a"})
    _answer(gathering, {"device": "cam-1", "answer": "red", "instance": "a"})  # the same process again: a repeat
    _answer(gathering, {"device": "cam-2", "answer": "blue", "instance": "b"})
    _answer(gathering, {"device": "cam-3", "answer": "green"}, correlation=b"another question")
    assert gathering.twins == set()
    _answer(gathering, {"device": "cam-2", "answer": "green", "instance": "c"})  # another process as cam-2
    result = gathering.result(QUESTION, gathering.sent_at)
    assert [(a.device, a.answer) for a in result.answers] == [("cam-1", "red"), ("cam-2", "blue")]
    assert result.twins == ["cam-2"] and result.to_json()["twins"] == ["cam-2"]
    assert "answered from two devices under one id: cam-2 (fleet.device_id must be unique" in format_result(result)


def test_tls_files_that_cannot_be_used_are_named(tmp_path):
    from edgekv.apps.outputs.mqtt import FleetConnection, FleetError, ask_fleet

    pytest.importorskip("paho.mqtt.client")
    url = "mqtts://127.0.0.1:9"
    with pytest.raises(FleetError, match=r"^ca_file \(--ca-file\): cannot read /nonexistent/ca.pem$"):
        ask_fleet(QUESTION, FleetConnection(url, ca_file="/nonexistent/ca.pem"), timeout_s=5)
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(FleetError, match=rf"^TLS files \(ca_file {garbage}\) cannot be used: "):
        ask_fleet(QUESTION, FleetConnection(url, ca_file=str(garbage)), timeout_s=5)
    with pytest.raises(FleetError, match="a client certificate needs both"):
        ask_fleet(QUESTION, FleetConnection(url, cert_file=str(garbage)), timeout_s=5)


def test_a_plain_client_at_a_tls_listener_and_the_reverse_are_told_which_it_is(tmp_path, certificates):
    from edgekv.apps.outputs.mqtt import FleetConnection, FleetError, ask_fleet

    c = certificates
    with Mosquitto(tmp_path / "broker", tls=(c / "ca.pem", c / "broker.pem", c / "broker.key")) as broker:
        with pytest.raises(FleetError, match=r"closed the connection before accepting it .*; is it a TLS listener "
                                             r"\(mqtts://\)\?"):
            ask_fleet(QUESTION, f"mqtt://127.0.0.1:{broker.tls_port}", timeout_s=5)
        with pytest.raises(FleetError, match=rf"; is 127.0.0.1:{broker.port} a TLS listener \(mqtt:// for a plain"):
            ask_fleet(QUESTION, FleetConnection(f"mqtts://127.0.0.1:{broker.port}", ca_file=str(c / "ca.pem")),
                      timeout_s=5)


def test_an_unreachable_broker_is_named_with_the_host_and_port_tried(tmp_path):
    import socket

    from edgekv.apps.outputs.mqtt import FleetError, ask_fleet

    pytest.importorskip("paho.mqtt.client")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 1883)) == 0:
            pytest.skip("something listens on 127.0.0.1:1883 here")
    with pytest.raises(FleetError, match=r"^cannot reach the broker mqtt://127.0.0.1 \(127.0.0.1:1883\): "):
        ask_fleet(QUESTION, "mqtt://127.0.0.1", timeout_s=5)


def test_with_every_retained_status_offline_or_stale_the_asker_says_so_and_does_not_wait(broker, capsys):
    """The bug: with no device online and fresh, nothing told the asker when the broker had sent every retained
    status, so ``ask --fleet`` waited its whole timeout (an hour here) for answers nobody could send. Now a marker
    published to its own reply topic after the SUBACK comes back after the retained statuses (Mosquitto queues them
    while it handles the SUBSCRIBE) and the asker returns at once, saying no device was online."""
    from edgekv.apps.cli import main
    from edgekv.apps.outputs.mqtt import ask_fleet, forget_fleet, format_result

    now = time.time()
    statuses = {
        "gone-cam": ({"state": "offline", "unix": now}, None),
        "old-cam": ({"state": "online", "unix": now - 3600}, None),  # an older device's status, an hour old
        # this version's status, aged by the broker: 300 s kept, 200 left, so 100 s old against a 0.5 s refresh
        "frozen-cam": ({"state": "online", "unix": now, "every_s": 0.5, "expires_s": 300}, 200)}
    for name, (body, expiry) in statuses.items():
        publish_raw(broker.url, f"edgekv/devices/{name}/status",
                    json.dumps({"type": "edgekv.status", "device": name, **body}).encode(), retain=True,
                    expiry_s=expiry)
    result = returns_early(lambda: ask_fleet(QUESTION, broker.url, timeout_s=3600))
    assert result.nobody_online and result.answers == [] and result.silent == []
    assert result.offline == ["gone-cam"] and sorted(result.stale) == ["frozen-cam", "old-cam"]
    assert "; no device is online with a fresh status, so none was waited for; online but silent: none; " \
           "not answering: " in format_result(result)
    one = returns_early(lambda: ask_fleet(QUESTION, broker.url, timeout_s=3600, device="gone-cam"))
    assert one.nobody_online and one.offline == ["gone-cam"] and one.stale == {}
    forgot = returns_early(lambda: forget_fleet(broker.url, timeout_s=3600, last_s=5))
    assert forgot.nobody_online and forgot.answers == []
    code = returns_early(lambda: main(["ask", "--fleet", QUESTION, "--broker", broker.url, "--timeout", "3600",
                                        "--json"]))
    printed = json.loads(capsys.readouterr().out)
    assert code == 1 and printed["nobody_online"] is True and printed["offline"] == ["gone-cam"]


def test_an_empty_fleet_is_not_waited_for_and_a_fresh_device_still_is(broker, fleet):
    """No retained status at all: nobody to wait for. A device online and fresh is still waited for (and answers),
    and the marker is not taken for an answer."""
    from edgekv.apps.outputs.mqtt import ask_fleet

    empty = returns_early(lambda: ask_fleet(QUESTION, broker.url, timeout_s=3600))
    assert empty.nobody_online and empty.answers == [] and empty.offline == [] and empty.stale == {}
    agent, _ = fleet.add(broker.url, "cam-red")
    assert until(lambda: announced(agent))
    result = returns_early(lambda: ask_fleet(QUESTION, broker.url, timeout_s=3600))
    assert not result.nobody_online and [(a.device, a.answer) for a in result.answers] == [("cam-red", "red")]
    assert agent.counts["answered"] == 1
