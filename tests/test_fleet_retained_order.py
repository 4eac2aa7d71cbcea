"""``ask --fleet``'s "no device is online" answer (``FleetResult.nobody_online``) against brokers that deliver a new
subscription's retained statuses later than Mosquitto does, and a broker lost before the first SUBACK.

Issue: the asker took the return of a marker, published to its own reply topic after the SUBACK, for "every retained
status is in" and, with none online, returned at once. MQTT orders messages only per topic (MQTT 5.0 §4.6) and lets
a server send a subscription's retained messages after its SUBACK: HiveMQ sends them once the SUBACK is written, in
batches, and EMQX from another process, so there the marker can come back before an "online" status and the asker
said nobody was online while a device was about to answer. A stand-in for such a broker: ``PacketProxy`` holds back
the retained messages Mosquitto sends until after the next message that is not retained (the marker). Now the marker
is taken as the end of the retained statuses only from a broker known to queue them first (Mosquitto: its retained
``$SYS/broker/version`` arrived before the marker on the same connection); elsewhere the asker waits as it did
before the marker existed. Tests wait on conditions, never on time."""

from __future__ import annotations

import json
import time

from helpers_mqtt import QUESTION, Mosquitto, PacketProxy, publish_raw, returns_early, until
from test_fleet import announced, broker, fleet, runtime  # noqa: F401 (fixtures)


# an ask that gets no early answer waits this out: long enough for a busy machine to deliver every retained status
WAITED_OUT_S = 10


def _offline(url: str, name: str) -> None:
    publish_raw(url, f"edgekv/devices/{name}/status",
                json.dumps({"type": "edgekv.status", "device": name, "state": "offline", "unix": time.time()}).encode(),
                retain=True)


def test_an_online_status_delivered_after_the_marker_is_still_waited_for_and_answers(broker, fleet):
    """The device is online, but the broker (the stand-in) delivers its retained status only after the marker came
    back: the old asker said nobody was online and returned without its answer."""
    from edgekv.apps.outputs.mqtt import ask_fleet

    agent, _ = fleet.add(broker.url, "cam-red", status_every_s=3600.0)  # one status, at connecting: none live later
    assert until(lambda: announced(agent))
    _offline(broker.url, "gone-cam")
    late = PacketProxy(broker.port, hold_retained=True)
    try:
        result = returns_early(lambda: ask_fleet(QUESTION, late.url, timeout_s=3600))
    finally:
        late.close()
    assert not result.nobody_online and [(a.device, a.answer) for a in result.answers] == [("cam-red", "red")]
    assert result.offline == ["gone-cam"] and result.silent == []
    assert late.held >= 2  # both statuses came after the marker


def test_with_nobody_online_a_broker_delivering_retained_statuses_late_is_waited_out_and_read(broker):
    """Nobody online, the statuses delivered after the marker: no early answer (a status still on its way might have
    been "online"); at the timeout the late statuses are read and named."""
    from edgekv.apps.outputs.mqtt import ask_fleet

    _offline(broker.url, "gone-cam")
    late = PacketProxy(broker.port, hold_retained=True)
    try:
        result = ask_fleet(QUESTION, late.url, timeout_s=WAITED_OUT_S)
    finally:
        late.close()
    assert not result.nobody_online and result.answers == [] and result.offline == ["gone-cam"]
    assert late.held >= 1


def test_a_mosquitto_that_does_not_say_it_is_one_gets_no_early_answer(tmp_path):
    """Without $SYS topics (``sys_interval 0``, or an ACL that keeps ``$SYS/broker/version`` from the asker) the
    broker is not known to deliver its retained statuses first, so the marker decides nothing; the same broker with
    them answers at once."""
    from edgekv.apps.outputs.mqtt import ask_fleet

    with Mosquitto(tmp_path / "quiet", extra=("sys_interval 0",)) as quiet:
        _offline(quiet.url, "gone-cam")
        result = ask_fleet(QUESTION, quiet.url, timeout_s=WAITED_OUT_S)
        assert not result.nobody_online and result.offline == ["gone-cam"]
    with Mosquitto(tmp_path / "plain") as plain:
        _offline(plain.url, "gone-cam")
        fast = returns_early(lambda: ask_fleet(QUESTION, plain.url, timeout_s=3600))
        assert fast.nobody_online and fast.offline == ["gone-cam"]


def test_a_broker_lost_before_the_first_suback_is_subscribed_to_again(broker):
    """The connection is cut with the first SUBSCRIBE (the broker restarting then): the asker reconnects and
    subscribes again, as it does after a later loss, instead of ending in "did not confirm the subscriptions"."""
    from edgekv.apps.outputs.mqtt import FleetConnection, ask_fleet, forget_fleet

    _offline(broker.url, "gone-cam")
    for kind in ("ask", "forget"):
        cut = PacketProxy(broker.port, cut_first_subscribe=True)
        conn = FleetConnection(cut.url, connect_timeout_s=120)
        try:
            if kind == "ask":
                result = returns_early(lambda: ask_fleet(QUESTION, conn, timeout_s=3600))
            else:
                result = returns_early(lambda: forget_fleet(conn, timeout_s=3600, last_s=5))
        finally:
            cut.close()
        assert cut.cut == 1 and cut.accepted == 2
        assert result.nobody_online and result.offline == ["gone-cam"] and result.broker_lost == []


def test_a_mosquitto_that_drops_retained_statuses_past_its_queue_gives_no_early_answer(tmp_path):
    """Mosquitto drops the retained messages past a session's full queue (``max_queued_messages`` beyond those in
    flight) without a word: an asker of a fleet larger than that could not know every status. The broker's version
    is subscribed last, so it is dropped with them, and the asker waits (and reads the statuses that came)."""
    import paho.mqtt.client as mqtt

    from edgekv.apps.outputs.mqtt import ask_fleet

    with Mosquitto(tmp_path / "small", extra=("max_queued_messages 5", "max_inflight_messages 5")) as small:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        client.connect("127.0.0.1", small.port)
        client.loop_start()
        try:
            sent = [client.publish(f"edgekv/devices/cam-{i:02d}/status", json.dumps(
                {"type": "edgekv.status", "state": "offline", "unix": time.time()}), qos=1, retain=True)
                for i in range(30)]
            for info in sent:
                info.wait_for_publish(60)
        finally:
            client.disconnect()
            client.loop_stop()
        result = ask_fleet(QUESTION, small.url, timeout_s=WAITED_OUT_S)
        assert not result.nobody_online and 0 < len(result.offline) < 30
