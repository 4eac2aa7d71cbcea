"""Several cameras on one model (issue 28 §3, apps/daemon/cameras.py): the caps split from one budget, each
camera's questions answered about its own stream, questions routed by camera over HTTP, per-camera figures,
and a camera that is pulled leaving the others ingesting."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from edgekv.apps.daemon.cameras import FairLock, camera_configs, split_asks
from edgekv.config import ConfigError, EdgeKVConfig

FRONT = "synthetic:events?size=112x112&fps=2&frames=120&seed=1&rate=0.08"
BACK = "synthetic:events?size=112x112&fps=2&frames=120&seed=7&rate=0.08"


def _config(tmp_path, **extra) -> EdgeKVConfig:
    sections = dict(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": [{"name": "front", "source": FRONT}, {"name": "back", "source": BACK}], "fps": 2.0,
               "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 1280, "text_reserve_tokens": 64},
        state={"dir": str(tmp_path / "state"), "every_s": 3600}, monitor={"backend": "cpu"},
        server={"port": 0}, generation={"max_new_tokens": 2, "temperature": 0.0})
    sections.update(extra)
    return EdgeKVConfig().with_overrides(**sections)


def test_each_camera_gets_its_share_of_the_budget_and_its_own_folders(tmp_path):
    config = _config(tmp_path, cache={"max_mib": 12.0, "max_tokens": None},
                     archive={"dir": str(tmp_path / "archive"), "max_gib": 3.0, "frames_mib": 6.0},
                     video={"sources": [{"name": "front", "source": FRONT, "weight": 2},
                                        {"name": "back", "source": BACK, "fps": 1.0}],
                            "fps": 2.0, "resolution": [112, 112]},
                     alerts={"rules": [{"question": "Was there a red circle?", "camera": "back"},
                                       {"question": "Was there a blue square?"}]})
    configs = camera_configs(config)
    front, back = configs["front"], configs["back"]
    assert (front.cache.max_mib, back.cache.max_mib) == (8.0, 4.0)
    assert (front.archive.max_gib, back.archive.max_gib) == (2.0, 1.0)
    # the evidence frames too: each camera's file filled the whole archive.frames_mib (3.7 MiB for 2 in a soak)
    assert (front.archive.frames_mib, back.archive.frames_mib) == (4.0, 2.0)
    with pytest.raises(ValueError, match=r"archive\.frames_mib 2 is shared .* leaves 0\.67 MiB to the smallest share "
                                         r"\(at least 1 MiB each\): set it to at least 3"):
        camera_configs(config.with_overrides(archive={"frames_mib": 2.0}))
    assert (front.video.source, front.video.fps, back.video.fps) == (FRONT, 2.0, 1.0)
    assert front.state.dir == str(tmp_path / "state" / "front") and back.archive.dir == str(tmp_path / "archive" / "back")
    assert front.ros2.namespace == "/edgekv/front" and back.ros2.namespace == "/edgekv/back"
    assert [r.question for r in front.alerts.rules] == ["Was there a blue square?"]
    assert len(back.alerts.rules) == 2
    assert front.server.enabled and not back.server.enabled and not back.video.sources
    with pytest.raises(ValueError, match="camera 'side' is not one of video.sources"):
        camera_configs(_config(tmp_path, alerts={"rules": [{"question": "Was there a red circle?", "camera": "side"}]}))
    with pytest.raises(ConfigError, match=r"video.sources\[1\].name: 'front' names two cameras"):
        _config(tmp_path, video={"sources": [{"name": "front", "source": FRONT}, {"name": "front", "source": BACK}]})


def test_a_camera_name_with_a_dash_or_a_digit_first_starts_and_its_ros_topics_are_valid(tmp_path):
    """'front-left' is a valid camera name, but '/edgekv/front-left' is no ROS 2 namespace: every camera's config is
    checked whole, so such a camera refused to start even with ROS 2 off."""
    def cameras(*names: str, **extra) -> EdgeKVConfig:
        return _config(tmp_path, video={"sources": [{"name": name, "source": FRONT} for name in names], "fps": 2.0,
                                        "resolution": [112, 112]}, **extra)

    configs = camera_configs(cameras("front-left", "2nd"))
    assert configs["front-left"].ros2.namespace == "/edgekv/front_left"
    assert configs["front-left"].state.dir == str(tmp_path / "state" / "front-left")
    assert set(configs) == {"front-left", "2nd"}  # ROS 2 off: a name no ROS 2 token can hold is no matter
    ros = {"ros2": {"enabled": True, "namespace": "/robot"}}
    assert camera_configs(cameras("front-left", "back", **ros))["front-left"].ros2.namespace == "/robot/front_left"
    with pytest.raises(ConfigError, match=r"video.sources\[1\].name: '2nd' cannot name the camera's ROS 2 topics "
                                          r"\(/robot/2nd: a token may not start with a digit\)"):
        camera_configs(cameras("front", "2nd", **ros))
    with pytest.raises(ConfigError, match=r"video.sources\[1\].name: 'front_left' cannot name .* 'front-left' has it"):
        camera_configs(cameras("front-left", "front_left", **ros))


def test_camera_names_that_differ_only_in_case_are_refused(tmp_path):
    """A question names its camera ignoring case ("Front: ..."), so of 'Front' and 'front' only one was reachable."""
    with pytest.raises(ConfigError, match=r"video.sources\[1\].name: 'front' and 'Front' differ only in case"):
        _config(tmp_path, video={"sources": [{"name": "Front", "source": FRONT}, {"name": "front", "source": BACK}]})


def test_ask_prefixes_pick_a_camera():
    asks = split_asks(["front: Was there a red circle?", "What color was the square?", "side: x"], ["front", "back"])
    assert asks == {"front": ["Was there a red circle?", "What color was the square?", "side: x"],
                    "back": ["What color was the square?", "side: x"]}


def test_a_question_names_its_camera_typed_or_spoken():
    """``front: ...`` typed, ``Kitchen camera, ...`` / ``Ask the kitchen camera. ...`` as faster-whisper writes
    speech: that camera alone; a question naming none goes to each; a spoken command stays with the first camera
    (it reaches every camera by itself)."""
    from edgekv.apps.controls import addressed, route

    names = ["front", "kitchen", "front-left"]
    assert addressed("kitchen: was there a red circle?", names) == ("kitchen", "Was there a red circle?")
    assert addressed("Kitchen camera, how many times?", names) == ("kitchen", "How many times?")
    assert addressed("Ask the kitchen camera. How many times?", names) == ("kitchen", "How many times?")
    assert addressed("On the front camera how many times?", names) == ("front", "How many times?")
    assert addressed("front-left: x", names) == ("front-left", "X")  # the longer name first
    for text in ("Kitchens: x", "What color was the kitchen?", "The kitchen was red"):
        assert addressed(text, names) == (None, text)
    assert addressed("kitchen:", names) == addressed("Kitchen camera.", names) == ("kitchen", "")  # and nothing asked

    class One:
        camera = None

    class Daemon:
        def __init__(self, name):
            self.camera, self.cameras = name, None

    one = One()
    assert route(one, "front: x") == [(None, one, "front: x")]  # one camera: no name is a camera's
    front, kitchen = Daemon("front"), Daemon("kitchen")
    front.cameras = {"front": front, "kitchen": kitchen}
    assert route(front, "kitchen: Was there a red circle?") == [("kitchen", kitchen, "Was there a red circle?")]
    assert route(front, "Was there a red circle?") == [("front", front, "Was there a red circle?"),
                                                      ("kitchen", kitchen, "Was there a red circle?")]
    with pytest.raises(ValueError, match="'kitchen:' names the camera kitchen but asks it nothing"):
        route(front, "kitchen:")
    with pytest.raises(ValueError, match="--ask 'kitchen: ' names the camera kitchen but asks it nothing"):
        split_asks(["kitchen: "], ["front", "kitchen"])
    spoken = split_asks(["Forget the last five minutes.", "Kitchen camera, how many?", "How many?"],
                        ["front", "kitchen"], first_only=lambda text: text.startswith("Forget"))
    assert spoken == {"front": ["Forget the last five minutes.", "How many?"], "kitchen": ["How many?", "How many?"]}


def test_the_microphone_asks_the_camera_it_hears_named_or_each():
    """The voice loop (the first camera's) with two cameras: what it hears goes where ``controls.route`` says; a
    camera that is busy refuses its copy without losing the other's."""
    import numpy as np

    from edgekv.apps.questions import DaemonBusy
    from edgekv.apps.voice.listen import VoiceLoop
    from edgekv.config import VoiceSection

    class Camera:
        def __init__(self, name, busy=False):
            self.camera, self.cameras, self.asked, self.busy = name, None, [], busy

        def submit(self, question):
            if self.busy:
                raise DaemonBusy("16 questions are already waiting")
            self.asked.append((question.source, question.text))

    front, kitchen = Camera("front"), Camera("kitchen")
    front.cameras = {"front": front, "kitchen": kitchen}
    heard = iter(["Kitchen camera, how many times did the circle appear?", "Was there a red circle?",
                  "Was there a blue square?"])
    transcriber = type("Heard", (), {"transcribe": lambda self, audio: next(heard)})()
    loop = VoiceLoop(front, VoiceSection(enabled=True), source=[], transcriber=transcriber)
    loop._ask(np.zeros(1600, np.float32))
    loop._ask(np.zeros(1600, np.float32))
    assert kitchen.asked == [("voice", "How many times did the circle appear?"), ("voice", "Was there a red circle?")]
    assert front.asked == [("voice", "Was there a red circle?")]
    kitchen.busy = True
    loop._ask(np.zeros(1600, np.float32))
    assert front.asked[-1] == ("voice", "Was there a blue square?") and len(kitchen.asked) == 2
    assert [q.text for q in loop.questions][-1] == "Was there a blue square?" and len(loop.questions) == 4


def test_the_fair_lock_serves_waiting_threads_in_order():
    lock = FairLock()
    order: list[str] = []
    lock.acquire()
    assert lock.acquire(timeout=0)  # re-entrant
    lock.release()

    def take(name: str) -> None:
        with lock:
            order.append(name)

    threads = []
    for name in ("b", "c", "d"):
        thread = threading.Thread(target=take, args=(name,))
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 60
        while len(lock._waiting) < len(threads) and time.monotonic() < deadline:  # queued in this order
            time.sleep(0.001)
        assert len(lock._waiting) == len(threads)
    lock.release()
    for thread in threads:
        thread.join(10)
    assert order == ["b", "c", "d"]
    assert lock.acquire(timeout=0.01)
    lock.release()


class _Pulled:
    """A live camera that stops after ``frames`` frames and cannot be reopened (its cable pulled)."""

    def __init__(self, inner, frames: int, pulled: threading.Event) -> None:
        from edgekv.video.sources import FrameSource, SourceLost, SourceUnavailable

        outer = self

        class Source(FrameSource):
            kind = "synthetic"

            def __init__(self):
                super().__init__(inner.spec, live=True)
                self.scene = inner.scene
                self.count = 0

            def read(self):
                if self.count >= frames:
                    pulled.set()
                    raise SourceLost("cable pulled")
                self.count += 1
                return inner.read()

            def reopen(self):
                raise SourceUnavailable("no camera on the cable")

            def close(self):
                inner.close()

        outer.source = Source()


def _event_only_in(first, second):
    """(colour, shape) of an event of ``first``'s stream that ``second``'s never shows."""
    from edgekv.video.sources import open_source

    def events(spec):
        source = open_source(spec)
        try:
            return {(e.color, e.shape) for e in source.scene.events}
        finally:
            source.close()

    only = sorted(events(first) - events(second))
    assert only, "the two test streams share every event"
    return only[0]


def _chat_names_its_camera(port: int, asked: str) -> None:
    """A chat question naming a camera first (as stdin, ``--ask`` and the microphone take them) is that camera's."""
    from helpers_server import call

    def chat(text: str, **more):
        return call(port, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": text}], "max_tokens": 2, **more})
    status, _, body = chat(f"back: {asked}")
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "no", body
    status, _, body = chat(f"Front camera, {asked[0].lower()}{asked[1:]}")
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "yes", body
    status, _, body = chat(f"back: {asked}", stream=True)  # one camera named: its answer streams
    assert status == 200 and b'"content":"no"' in body.replace(b" ", b""), body
    status, _, body = chat("back:")
    assert status == 400 and b"names the camera back but asks it nothing" in body
    status, _, body = chat(f"back: {asked}", camera="all")  # the field, when given, decides
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"].startswith("front: "), body


def _standing_questions_per_camera(port: int, front, back, question: str) -> None:
    """The alerts API of a daemon with two cameras: each rule is one camera's, evaluated over its cache."""
    import http.client

    from helpers_mqtt import until
    from helpers_server import call

    status, _, body = call(port, "GET", "/v1/alerts")  # the config's rule, one on each camera
    listed = json.loads(body)["data"]
    assert [(r["id"], r["camera"]) for r in listed] == [("front-alert-1", "front"), ("back-alert-1", "back")], body
    assert front.alerts.list()[0].evaluations >= 1 and back.alerts.list()[0].evaluations >= 1  # each its own stream
    status, _, body = call(port, "POST", "/v1/alerts", {"question": question, "camera": "back"})
    assert status == 201, body
    rule = json.loads(body)
    assert rule["id"] == "back-alert-2" and rule["camera"] == "back"
    assert [s.id for s in back.alerts.list()] == ["back-alert-1", "back-alert-2"] and len(front.alerts.list()) == 1
    status, _, body = call(port, "POST", "/v1/alerts", {"question": question, "camera": "side"})
    assert status == 400 and json.loads(body)["error"]["param"] == "camera" and b"'side' is not one of front, back" in body
    status, _, body = call(port, "POST", "/v1/alerts", {"question": "Is it dark?"})  # every camera
    assert status == 201 and [r["camera"] for r in json.loads(body)["data"]] == ["front", "back"], body
    assert call(port, "DELETE", "/v1/alerts/back-alert-2")[0] == 200
    assert [s.id for s in back.alerts.list()] == ["back-alert-1", "back-alert-3"]
    assert [s.id for s in front.alerts.list()] == ["front-alert-1", "front-alert-2"]
    back.alerts.max_rules = 2  # back is full (alerts.max_rules): a rule for every camera is none's
    status, _, body = call(port, "POST", "/v1/alerts", {"question": "Is it light?"})
    assert status == 400 and b"on camera back, the most alerts.max_rules allows (2)" in body, body
    assert len(front.alerts.list()) == 2 and len(back.alerts.list()) == 2
    back.alerts.max_rules = 32
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # one SSE stream takes every camera's alerts
    try:
        conn.request("GET", "/v1/alerts/stream")
        assert conn.getresponse().status == 200
        assert until(lambda: front.alert_bus.sinks and back.alert_bus.sinks, 120)
        assert len(front.alert_bus.sinks) == len(back.alert_bus.sinks) == 1
        assert front.alert_bus.sinks[0] is back.alert_bus.sinks[0]
    finally:
        conn.close()


def test_two_cameras_on_one_model_answer_about_their_own_streams(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from helpers_server import call, daemon_args

    from edgekv.apps.daemon.cameras import CameraSet

    config = _config(tmp_path, alerts={"rules": [{"question": "Is anything moving?", "every_pairs": 1}]})
    cameras = CameraSet(config, daemon_args(realtime=False, quiz=6), out=open(tmp_path / "out.txt", "w"))
    assert cameras.first.cameras is cameras.daemons and list(cameras.daemons) == ["front", "back"]
    front, back = cameras.daemons["front"], cameras.daemons["back"]
    assert front.stop.event is back.stop.event is cameras.stop.event  # one stop; each camera its own SIGHUP flag
    assert front.stop.hangup is not back.stop.hangup
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    try:
        assert cameras.ready.wait(180)
        front, back = cameras.daemons["front"], cameras.daemons["back"]
        assert front.runtime.model is back.runtime.model  # the weights loaded once
        assert back.monitor is front.monitor and back.monitor_is_shared  # one power monitor for the device
        assert front.session.cache.capacity == back.session.cache.capacity == 640
        deadline = time.monotonic() + 300
        while (front.stream_detail is None or back.stream_detail is None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert front.stream_detail is not None and back.stream_detail is not None
        assert front.session.counters.frames == back.session.counters.frames == 120
        assert front.monitor.frames_counted == 240  # J/frame divides the device's energy by every camera's frames
        port = front.server.port
        color, shape = _event_only_in(FRONT, BACK)
        question = {"messages": [{"role": "user", "content": f"Was there a {color} {shape}?"}], "max_tokens": 2}
        status, _, body = call(port, "POST", "/v1/chat/completions", question)  # every camera by default
        assert status == 200, body
        answer = json.loads(body)
        assert answer["choices"][0]["message"]["content"] == "front: yes\nback: no"
        assert set(answer["edgekv"]["cameras"]) == {"front", "back"}
        status, _, body = call(port, "POST", "/v1/chat/completions", {**question, "evidence": 2})
        assert status == 200, body
        for name, figures in json.loads(body)["edgekv"]["cameras"].items():  # each camera's own pairs and times
            times = cameras.daemons[name].session.pair_times
            assert len(figures["evidence"]) == 2
            assert all(item["t"] == times[item["pair"]] for item in figures["evidence"])
            ring = cameras.daemons[name].alerts.keyframes.frames
            for item in figures["evidence"]:  # its frame from that camera's ring, while kept there
                kept = item["pair"] in ring
                assert item["frame"] == (f"/frame.jpg?pair={item['pair']}&camera={name}" if kept else None)
                path = f"/frame.jpg?pair={item['pair']}&camera={name}"
                assert call(port, "GET", path)[0] == (200 if kept else 404)
        status, _, body = call(port, "POST", "/v1/chat/completions", {**question, "camera": "back"})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "no"
        status, _, body = call(port, "POST", "/v1/chat/completions", {**question, "camera": "side"})
        assert status == 400 and b"'side' is not one of front, back" in body
        status, _, body = call(port, "POST", "/v1/chat/completions", {**question, "stream": True})
        assert status == 400 and b"name it with" in body
        _chat_names_its_camera(port, f"Was there a {color} {shape}?")
        status, _, body = call(port, "GET", "/metrics")
        text = body.decode()
        assert 'edgekv_camera_frames_total{camera="front"} 120.0' in text
        assert 'edgekv_camera_frames_total{camera="back"} 120.0' in text
        assert 'edgekv_camera_stream_state{camera="back",state="ended"} 1.0' in text
        status, headers, body = call(port, "GET", "/frame.jpg?camera=back")
        assert status == 200 and body[:2] == b"\xff\xd8"
        assert call(port, "GET", "/frame.jpg?camera=side")[0] == 400
        status, _, body = call(port, "GET", "/v1/edgekv/status")
        assert json.loads(body)["cameras"]["back"]["cache_capacity_tokens"] == 640
        _standing_questions_per_camera(port, front, back, f"Was there a {color} {shape}?")
    finally:
        cameras.stop.event.set()
        thread.join(120)
    out = (tmp_path / "out.txt").read_text()
    assert "[front] power (device, 2 cameras): no sensor" in out and "[back] power" not in out, out
    for name in ("front", "back"):
        graded = [line for line in out.splitlines() if line.startswith(f"[{name}] quiz: ")]
        assert graded and int(graded[0].split()[2].split("/")[0]) >= 5, graded  # each about its own stream
        assert (tmp_path / "state" / name).is_dir() and list((tmp_path / "state" / name).glob("snapshot-*.ekv"))


@contextlib.contextmanager
def _running(config: EdgeKVConfig, tmp_path, **args):
    """``config``'s cameras running in a thread: (front, back) once every one has started; stopped on the way out."""
    from helpers_cameras import running_cameras

    with running_cameras(config, tmp_path, **args) as cameras:
        yield cameras.daemons["front"], cameras.daemons["back"]


def test_a_pulled_camera_leaves_the_other_ingesting(tmp_path, monkeypatch):
    import edgekv.apps.daemon.loop as loop

    pulled = threading.Event()
    real = loop.open_video_source

    def opening(config):
        spec, source = real(config)
        if config.video.source == BACK:
            return spec, _Pulled(source, 10, pulled).source
        return spec, source

    monkeypatch.setattr(loop, "open_video_source", opening)
    config = _config(tmp_path, server={"enabled": False},
                     video={"sources": [{"name": "front", "source": FRONT.replace("frames=120", "frames=100000")},
                                        {"name": "back", "source": BACK}], "fps": 2.0, "resolution": [112, 112],
                            "reconnect_backoff_s": [0.05, 0.2]})
    # paced like cameras (a live source is never read losslessly)
    with _running(config, tmp_path, realtime=True) as (front, back):
        assert pulled.wait(120)
        deadline = time.monotonic() + 120
        while back.stream_state != "reconnecting" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert back.stream_state == "reconnecting"
        seen = front.session.counters.frames
        while front.session.counters.frames < seen + 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert front.session.counters.frames >= seen + 8 and front.stream_state == "running"
        assert back.session.counters.frames <= 10 and back.stream_state == "reconnecting"


def test_bench_cameras_writes_its_figures(tmp_path, capsys):
    from edgekv.apps.cli import main

    out_json = tmp_path / "cameras.json"
    assert main(["bench", "cameras", "--seconds", "2", "--fps", "4", "--size", "56", "--max-tokens", "512",
                 "--ask-every-s", "0.5", "--json", str(out_json), "--plot", str(tmp_path / "cameras.png")]) == 0
    result = json.loads(out_json.read_text())
    assert set(result["cameras"]) == {"cam0", "cam1"} and result["memory"]["caches_unchanged"] is True
    assert sum(c["share_of_ingested"] for c in result["cameras"].values()) == pytest.approx(1.0)
    assert result["questions_asked"] >= 2 and (tmp_path / "cameras.png").read_bytes()[:4] == b"\x89PNG"
    assert "% of all ingested" in capsys.readouterr().out


def test_the_fleet_agent_carries_every_cameras_alerts_and_asks_every_camera(tmp_path, capsys):
    """The device's one fleet agent (on the first camera) is an output of every camera's alerts, so an alert on
    ``back`` reaches the fleet as one on ``front`` does; a fleet question is asked of each camera (one answer per
    camera, each naming it, the asker waiting for both) or of the one it names (a real Mosquitto)."""
    from helpers_mqtt import Mosquitto, need_mosquitto, until

    need_mosquitto()
    from edgekv.apps.outputs.mqtt import ask_fleet

    color, shape = _event_only_in(FRONT, BACK)
    question = f"Was there a {color} {shape}?"
    with Mosquitto(tmp_path / "broker") as broker:
        config = _config(tmp_path, server={"enabled": False},
                         fleet={"broker": broker.url, "device_id": "rig", "status_every_s": 0.5})
        with _running(config, tmp_path, realtime=False, no_stdin=False) as (front, back):
            assert front.fleet is not None and back.fleet is None
            assert front.fleet in front.alert_bus.sinks and front.fleet in back.alert_bus.sinks
            assert until(lambda: front.stream_detail is not None and back.stream_detail is not None, 300)
            assert until(front.fleet.connected.is_set, 60)
            status = front.fleet.host.status()  # what the retained status carries: every camera's figures
            assert {name: s["frames"] for name, s in status["cameras"].items()} == {"front": 120, "back": 120}
            result = ask_fleet(question, broker.url, timeout_s=120)
            assert sorted((a.device, a.camera, a.answer) for a in result.answers) == [
                ("rig", "back", "no"), ("rig", "front", "yes")], result
            assert all(a.raw["cameras"] == ["front", "back"] for a in result.answers) and result.silent == []
            (only,) = ask_fleet(question, broker.url, timeout_s=120, camera="back").answers
            assert (only.camera, only.answer, only.raw["cameras"]) == ("back", "no", ["back"])
            (wrong,) = ask_fleet(question, broker.url, timeout_s=120, camera="side").answers
            assert wrong.answer is None and "camera: 'side' is not one of front, back" in wrong.error
            assert wrong.camera is None  # the device refused, not one of its cameras
            from edgekv.apps.cli import main

            capsys.readouterr()
            assert main(["ask", "--fleet", question, "--broker", broker.url, "--camera", "front", "--timeout", "120"]) == 0
            assert "  rig (front): yes   [evidence t=" in capsys.readouterr().out
            assert main(["ask", "--fleet", question, "--broker", broker.url, "--camera", "side", "--timeout", "120"]) == 1
            assert "rig: error: malformed: camera: 'side' is not one of front, back" in capsys.readouterr().out


def test_the_privacy_switch_and_forget_reach_every_camera(tmp_path, capsys):
    """With several cameras the wearer's controls — the API's pause / forget / resume and the spoken commands —
    act on every camera: a privacy switch that left the second camera watching would be no switch at all."""
    pytest.importorskip("fastapi")
    from helpers_mqtt import until
    from helpers_server import call

    from edgekv.apps.voice.commands import Command, run

    live = {"front": FRONT, "back": BACK}
    config = _config(tmp_path, video={"sources": [{"name": name, "source": source.replace("frames=120", "frames=100000")}
                                                  for name, source in live.items()],
                                      "fps": 2.0, "resolution": [112, 112]})
    with _running(config, tmp_path, realtime=True) as (front, back):
        port = front.server.port
        assert until(lambda: min(front.session.counters.frame_pairs, back.session.counters.frame_pairs) >= 3, 120)
        status, _, body = call(port, "POST", "/v1/privacy/pause", {})
        state = json.loads(body)
        assert status == 200 and state["paused"] is True, body
        assert state["cameras"] == {name: {"paused": True, "reason": "privacy switch (API)"} for name in live}
        assert front.paused is not None and back.paused is not None
        status, _, body = call(port, "POST", "/v1/memory/forget", {"last_s": 100000})
        result = json.loads(body)
        assert status == 200 and set(result["cameras"]) == {"front", "back"}, body
        assert all(r["pairs"] >= 3 for r in result["cameras"].values())
        assert result["pairs"] == sum(r["pairs"] for r in result["cameras"].values())
        assert not front.session.pair_times and not back.session.pair_times  # nothing either camera saw is held
        from edgekv.apps.cli import main

        capsys.readouterr()
        assert main(["forget", "--url", f"http://127.0.0.1:{port}", "--last", "5"]) == 0  # a line per camera
        lines = capsys.readouterr().out.splitlines()
        assert [line.split(": forgot ")[0] for line in lines] == ["front", "back"], lines
        status, _, body = call(port, "POST", "/v1/privacy/resume", {})
        assert status == 200 and json.loads(body)["paused"] is False and front.paused is None and back.paused is None
        assert run(front, Command("pause")) == "Paused: I am not watching."  # the voice: the same switch
        assert front.paused is not None and back.paused is not None
        assert run(front, Command("resume")) == "Watching again." and back.paused is None


def test_typed_questions_reach_the_camera_they_name_or_each(tmp_path, monkeypatch):
    """stdin (read by the first camera's daemon) with several cameras: ``back: ...`` is asked of back alone, a
    question naming no camera of each, each answer printed under its camera; once stdin closes and no other channel
    is open, every camera exits (the second camera is asked through the first's stdin, so it waited for it)."""
    import io
    import os
    import sys

    from helpers_mqtt import until

    color, shape = _event_only_in(FRONT, BACK)
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.FileIO(read_end, "r"), encoding="utf-8"))
    config = _config(tmp_path, server={"enabled": False})
    typed = io.TextIOWrapper(io.FileIO(write_end, "w"), encoding="utf-8", write_through=True)
    with _running(config, tmp_path, realtime=False, no_stdin=False) as (front, back):
        assert until(lambda: front.stream_detail is not None and back.stream_detail is not None, 300)
        typed.write(f"back:\nback: was there a {color} {shape}?\n\nWas there a {color} {shape}?\n")

        def asked(daemon):
            return [(h["question"], h["answer"]) for h in daemon.history if h.get("source") == "stdin"]

        assert until(lambda: len(asked(back)) == 2 and len(asked(front)) == 1, 120)
        assert asked(back) == [(f"Was there a {color} {shape}?", "no")] * 2  # the prefix is gone, the sentence starts
        assert asked(front) == [(f"Was there a {color} {shape}?", "yes")]  # each about its own stream
        typed.close()  # end of input: nothing can ask either camera any more

        def exited() -> bool:
            out = (tmp_path / "out.txt").read_text()
            return all(f"[{name}] no question can arrive" in out for name in ("front", "back"))

        assert until(exited, 120)
    out = (tmp_path / "out.txt").read_text()
    assert f"[back] Q [stdin]: Was there a {color} {shape}?" in out and "[front] A: yes" in out, out
    assert "[front] stdin question refused: 'back:' names the camera back but asks it nothing" in out, out


def test_one_watchdog_for_the_device_goes_quiet_when_either_camera_hangs(tmp_path, monkeypatch):
    """systemd's watchdog with several cameras: one pinger (the first camera's), fed by the oldest heartbeat of
    the cameras' loops. A hung second camera withholds WATCHDOG=1 (systemd restarts the service) although the first
    camera goes on; the pings come back when it does. (Each camera once ran its own watchdog: the first camera kept
    pinging while the second was stuck, and nothing ever restarted it.)"""
    from helpers_mqtt import until
    from test_daemon import NotifyListener

    listener = NotifyListener(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
    monkeypatch.setenv("WATCHDOG_USEC", "1500000")  # a ping every 0.5 s; a loop silent 0.75 s is hung
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    live = {"front": FRONT, "back": BACK}
    config = _config(tmp_path, server={"enabled": False},
                     video={"sources": [{"name": name, "source": source.replace("frames=120", "frames=100000")}
                                        for name, source in live.items()], "fps": 2.0, "resolution": [112, 112]})
    try:
        with _running(config, tmp_path, realtime=True) as (front, back):
            assert front.watchdog is not None and back.watchdog is None
            assert until(lambda: len(listener.pings()) >= 2, 60)
            release = threading.Event()
            tick = back._on_loop_tick  # back's loop stuck between steps (not holding the model: front goes on)
            back._on_loop_tick = lambda: (release.wait(120), tick())
            assert until(lambda: front.watchdog.withheld >= 2, 60)
            seen = front.session.counters.frames
            assert until(lambda: front.session.counters.frames > seen + 2, 60) and not release.is_set()
            release.set()
            back._on_loop_tick = tick
            resumed = time.monotonic()
            assert until(lambda: len(listener.pings(since=resumed)) >= 1, 60)
    finally:
        listener.close()
