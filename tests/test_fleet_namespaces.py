"""Three camera daemons, each in its own network namespace on its own veth link, one Mosquitto in the root
namespace listening on the links' host ends (issue 30 §2, "What it must show"): a fleet question gets three
answers, each right for its stream; one link cut -> the other two answer and the silent device is named; the
link restored -> the device reconnects by itself (no restart) and answers the next question.

Root is needed for ``ip netns`` (CI runs as root); elsewhere the test skips with the reason. It makes and removes
its namespaces and veths itself, even when it fails. Traffic flows only between the test's own addresses
(one private /24 no route on this machine uses) and loopback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers_mqtt import (QUESTION, STREAMS, Listener, Mosquitto, Namespaces, free_port, need_mosquitto, need_netns,
                          stream, until)

pytestmark = pytest.mark.slow
DEVICES = list(STREAMS)  # cam-red, cam-green, cam-blue: the circle is red, green, blue


def _config(broker: str, device: str) -> str:
    seed = STREAMS[device][0]
    return f"""
model: {{path: "builtin:toy", dtype: fp32, device: cpu}}
video: {{source: "{stream(seed)}", fps: 2.0, resolution: [112, 112]}}
cache: {{policy: infinipot_v, max_tokens: 640, text_reserve_tokens: 64}}
server: {{enabled: false}}
monitor: {{backend: cpu}}
generation: {{max_new_tokens: 4}}
runtime: {{threads: 1}}
fleet:
  broker: "{broker}"
  device_id: {device}
  keepalive_s: 2            # the device notices a dead link within seconds ...
  will_delay_s: 120         # ... while the broker keeps it "online" a while (a blip is not an outage)
  reconnect_backoff_s: [0.2, 1.0]
  status_every_s: 0.5
"""


def _latest(listener: Listener, device: str) -> dict:
    statuses = listener.json_on(f"/devices/{device}/status")
    return statuses[-1] if statuses else {}


def test_three_daemons_in_their_own_namespaces_answer_the_fleet_and_one_comes_back(tmp_path):
    need_mosquitto()
    need_netns()
    from edgekv.apps.outputs.mqtt import ask_fleet

    processes: list[subprocess.Popen] = []
    logs = []
    with Namespaces(len(DEVICES)) as ns:
        port = free_port()
        with Mosquitto(tmp_path / "broker", addresses=("127.0.0.1", *ns.host_addresses), port=port) as broker:
            listener = Listener(broker.url, ["edgekv/devices/+/status"])
            try:
                for index, device in enumerate(DEVICES):
                    path = tmp_path / f"{device}.yaml"
                    path.write_text(_config(f"mqtt://{ns.host_addresses[index]}:{port}", device))
                    log = open(tmp_path / f"{device}.log", "w")
                    logs.append(log)
                    processes.append(subprocess.Popen(
                        [*ns.exec_prefix(index), sys.executable, "-m", "edgekv.apps.daemon.camera", "--config",
                         str(path), "--no-stdin", "--quiet"], stdout=log, stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"}))

                def ready() -> bool:
                    for process, device in zip(processes, DEVICES):
                        if process.poll() is not None:
                            raise AssertionError(f"{device} exited: {(tmp_path / f'{device}.log').read_text()[-3000:]}")
                    return all(_latest(listener, d).get("stream_state") == "ended" for d in DEVICES)

                assert until(ready, 600), {d: _latest(listener, d) for d in DEVICES}
                assert all(_latest(listener, d)["frame_pairs"] == 24 for d in DEVICES)

                result = ask_fleet(QUESTION, broker.url, timeout_s=120)
                assert sorted(a.device for a in result.answers) == sorted(DEVICES) and result.silent == []
                for answer in result.answers:
                    _, colour, pairs = STREAMS[answer.device]
                    assert answer.answer == colour, answer
                    assert answer.evidence_pair in pairs and answer.evidence_t is not None

                ns.cut(2)  # cam-blue's link goes down
                cut = ask_fleet(QUESTION, broker.url, timeout_s=120)
                assert sorted((a.device, a.answer) for a in cut.answers) == [("cam-green", "green"), ("cam-red", "red")]
                # still "online" by its retained status (the will waits will_delay_s), but no longer refreshed: once
                # two refreshes are missed it is named as not answering, and the asker stops waiting for it
                assert list(cut.stale) == ["cam-blue"] and cut.silent == [] and cut.offline == []
                assert cut.elapsed_s < 120

                ns.restore(2)  # the same process reconnects with backoff: a second connection, no restart
                assert until(lambda: _latest(listener, "cam-blue").get("state") == "online"
                             and _latest(listener, "cam-blue")["fleet"]["connects"] >= 2, 180), _latest(listener, "cam-blue")
                back = ask_fleet(QUESTION, broker.url, timeout_s=120)
                assert sorted((a.device, a.answer) for a in back.answers) == [
                    ("cam-blue", "blue"), ("cam-green", "green"), ("cam-red", "red")]
                assert processes[2].poll() is None
            finally:
                for process in processes:
                    if process.poll() is None:
                        process.terminate()
                for process in processes:
                    try:
                        process.wait(30)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait(10)
                for log in logs:
                    log.close()
                listener.close()
    assert [process.returncode for process in processes] == [0, 0, 0]
