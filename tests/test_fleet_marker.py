"""The "every retained status is in" marker of ``ask --fleet`` / ``forget --fleet`` (apps/outputs/mqtt.py
``_Gathering``) across a broker restart, against a real Mosquitto. Issue: the marker, published to the asker's own
reply topic after the SUBACK, was not sent again after the asker subscribed again on reconnecting, so a broker that
restarted before it came back left an asker of a fleet with nobody online waiting its whole timeout."""

from __future__ import annotations

import pytest

from helpers_mqtt import QUESTION, Mosquitto, need_mosquitto, returns_early, until


@pytest.mark.parametrize("kind", ["ask", "forget"])
def test_the_marker_lost_with_a_restarting_broker_is_sent_again_after_the_new_subscription(tmp_path, monkeypatch,
                                                                                          kind):
    need_mosquitto()
    from edgekv.apps.outputs import mqtt

    with Mosquitto(tmp_path / "broker") as broker:
        marked, send = mqtt._Gathering.mark_retained_end, mqtt._Gathering.send
        sent: list[int] = []

        def lost_with_the_broker(gathering, client, properties) -> None:
            sent.append(gathering.connection)  # the connection it goes on (each SUBACK's, from paho's thread)
            if len(sent) > 1:
                marked(gathering, client, properties)
            # the first marker never comes back: the broker goes down before delivering it (in send, below)

        def then_the_broker_restarts(gathering, client, *args) -> float:
            started = send(gathering, client, *args)
            broker.stop()
            broker.start()  # the same port, nothing persisted
            assert until(lambda: len(gathering.connected) == 2, 120)
            return started

        monkeypatch.setattr(mqtt._Gathering, "mark_retained_end", lost_with_the_broker)
        monkeypatch.setattr(mqtt._Gathering, "send", then_the_broker_restarts)
        if kind == "ask":
            result = returns_early(lambda: mqtt.ask_fleet(QUESTION, broker.url, timeout_s=3600))
        else:
            result = returns_early(lambda: mqtt.forget_fleet(broker.url, timeout_s=3600, last_s=5))
        assert result.nobody_online and result.answers == [] and sent == [1, 2]  # the second after the new SUBACK
        (lost,) = result.broker_lost
        assert lost.startswith("lost at ") and lost.endswith("and asked again")
