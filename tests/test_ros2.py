"""ROS 2 on the wire (edgekv/video/ros2.py, apps/outputs/ros2.py) against an independent publisher: real Cyclone DDS
participants on loopback (explicit peer 127.0.0.1, multicast off), each test on its own random ROS domain,
started and stopped here. The other side is tests/helpers_ros2.py in its own process, written against the
binding directly; its messages are checked byte for byte against rosbags' CDR serialization."""

from __future__ import annotations

import contextlib
import io
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
pytest.importorskip("cyclonedds", reason="the Cyclone DDS binding is not installed (pip install 'edgekv[ros2]')")
pytest.importorskip("rosbags", reason="rosbags is not installed (pip install 'edgekv[ros2]')")

from edgekv.config import ConfigError, EdgeKVConfig, Ros2Section, config_from_dict  # noqa: E402
from edgekv.video.ros_images import IMAGE, typestore  # noqa: E402
from edgekv.video.sources import CorruptFrame, SourceLost, SourceUnavailable, open_source, parse_spec  # noqa: E402

HELPER = Path(__file__).with_name("helpers_ros2.py")
ROOT = Path(__file__).resolve().parents[1]
# one green circle in frame pairs 12-14 of 20 (seed 2), at 10 fps: the questions' answers are known
SCENE = "synthetic:events?size=112x112&fps=10&frames=40&seed=2&rate=0.1&duration=2-3"


def _domain() -> int:
    """A ROS domain of its own for each test (0..232 is ROS_DOMAIN_ID's range; ports 7400 + 250 x domain)."""
    return random.Random().randrange(100, 232)


def _loopback(domain: int, **keys) -> Ros2Section:
    return Ros2Section(domain_id=domain, interface="lo", peers=["127.0.0.1"], multicast=False, **keys)


class Robot:
    """tests/helpers_ros2.py in its own process; ``result()`` waits for it (bounded) and reads what it saw."""

    def __init__(self, tmp_path: Path, domain: int, *args: str) -> None:
        self.out = tmp_path / f"robot-{domain}.json"
        self.process = subprocess.Popen([sys.executable, str(HELPER), "--domain", str(domain), "--out", str(self.out),
                                         *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float = 120) -> dict:
        output, _ = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, output
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _read(source, robot: Robot, count: int, timeout: float = 120) -> tuple[list, list[str]]:
    """Frames (and the reasons of corrupt ones) from a live source until ``count`` came or the robot has
    finished and the topic went quiet (``stale``), at most ``timeout`` seconds."""
    frames, errors, deadline = [], [], time.monotonic() + timeout
    while len(frames) + len(errors) < count and time.monotonic() < deadline:
        try:
            frames.append(source.read())
        except CorruptFrame as exc:
            errors.append(str(exc))
        except SourceLost:
            if robot.process.poll() is not None:
                break  # the robot is done; what was dropped on the way is counted by the source
    return frames, errors


# ---------------------------------------------------------------------------------------------- names and config
def test_ros2_names_on_the_wire():
    from edgekv.video.ros2 import dds_topic, dds_type, resolve_name, ros_type

    assert dds_topic(resolve_name("/camera/image_raw")) == "rt/camera/image_raw"
    assert resolve_name("input_query", "/edgekv") == "/edgekv/input_query"
    assert resolve_name("output", "/") == "/output"
    assert dds_type("sensor_msgs/msg/Image") == "sensor_msgs::msg::dds_::Image_"
    assert ros_type("std_msgs::msg::dds_::String_") == "std_msgs/msg/String"
    for bad in ("/camera//raw", "/2d/image", "cam era", "/x/", "~/private"):
        with pytest.raises(ValueError, match="ROS topic"):
            resolve_name(bad, "/edgekv")
    spec = parse_spec("ros2:/front/image_raw/compressed?stale=2")
    assert spec.live and spec.params["type"] == "sensor_msgs/msg/CompressedImage" and spec.params["stale"] == 2.0
    assert parse_spec("ros2:/front/image_raw?type=compressed").params["type"] == "sensor_msgs/msg/CompressedImage"
    with pytest.raises(ValueError, match="expected image .* or compressed"):
        parse_spec("ros2:/depth?type=depth")


def test_ros2_section_is_validated_with_the_key_named():
    base = {"model": {"path": "builtin:toy"}}
    cfg = config_from_dict({**base, "ros2": {"enabled": True, "domain_id": 7, "peers": ["127.0.0.1"],
                                             "multicast": False}})
    assert cfg.ros2.enabled and cfg.ros2.domain_id == 7 and cfg.ros2.question_topic == "input_query"
    cases = [({"domain_id": 233}, "ros2.domain_id"), ({"namespace": "edgekv"}, "ros2.namespace"),
             ({"answer_topic": "out put"}, "ros2.answer_topic"), ({"multicast": False}, "needs ros2.peers"),
             ({"image_reliability": "sometimes"}, "ros2.image_reliability"), ({"image_depth": 0}, "ros2.image_depth"),
             ({"topics": {}}, "ros2.topics: unknown key"), ({"evidence": 9}, r"ros2.evidence: must be 0..8"),
             ({"evidence_topic": "a//b"}, "ros2.evidence_topic"), ({"json_topic": "1x"}, "ros2.json_topic")]
    for keys, message in cases:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**base, "ros2": keys})


def test_a_json_request_on_input_query_is_checked_naming_what_is_wrong():
    from edgekv.apps.outputs.ros2 import parse_request

    assert parse_request("What is on the table?", 1) == {"question": "What is on the table?", "evidence": 1}
    assert parse_request('{"question": " q? ", "last_s": 30, "evidence": 0, "recall": false}', 1) == {
        "question": "q?", "evidence": 0, "recall": False, "window_last_s": 30.0}
    assert parse_request('{"question": "q?", "from": 10, "to": 20.5}', 2)["window"] == (10.0, 20.5)
    wall = parse_request(json.dumps({"question": "q?", "from": "2026-12-05T10:00:00+00:00",
                                     "to": "2026-12-05T10:05:00+00:00"}), 1)
    assert wall["window_unix"] == (1796464800.0, 1796465100.0) and "window" not in wall
    refused = {'{"question": 3}': "question: the question's text is required",
               '{"question": "q", "when": 1}': "when: not a request key",
               '{"question": "q", "evidence": 9}': "evidence: a whole number of frame pairs from 0 to 8",
               '{"question": "q", "evidence": true}': "evidence: a whole number",
               '{"question": "q", "recall": "yes"}': "recall: true or false",
               '{"question": "q", "last_s": 0}': "last_s: seconds > 0",
               '{"question": "q", "last_s": Infinity}': "last_s: seconds > 0",
               '{"question": "q", "last_s": 5, "from": 1, "to": 2}': "either from and to, or last_s",
               '{"question": "q", "from": 1}': "from and to: both are required",
               '{"question": "q", "from": NaN, "to": 2}': "from: expected stream seconds",
               '{"question": "q", "from": 5, "to": 2}': "from \\(5.0\\) is after to",
               '{"question": "q", "from": [1], "to": 2}': "from: stream seconds \\(a number\\) or a wall time",
               '{"question": "q", "from": 1, "to": "10:00"}': "give both in stream seconds",
               '{not json': "a request starting with '\\{' is JSON",
               '{"question": ' + "[" * 20_000: "nested too deeply to decode", "[]": None}
    for text, message in refused.items():
        if message is None:
            assert parse_request(text, 1)["question"] == text  # not an object's brace: a plain question
            continue
        with pytest.raises(ValueError, match=message):
            parse_request(text, 1)


def test_cyclone_config_is_loopback_unicast_and_refuses_a_missing_interface():
    from edgekv.video.ros2 import cyclone_config

    assert cyclone_config(Ros2Section()) is None  # nothing set: $CYCLONEDDS_URI or Cyclone's defaults decide
    xml = cyclone_config(_loopback(5))
    assert '<NetworkInterface name="lo"/>' in xml and "<AllowMulticast>false</AllowMulticast>" in xml
    assert '<Peer address="127.0.0.1"/>' in xml and "<ParticipantIndex>auto</ParticipantIndex>" in xml
    assert '<NetworkInterface address="127.0.0.1"/>' in cyclone_config(Ros2Section(interface="127.0.0.1"))
    with pytest.raises(SourceUnavailable, match=r"ros2.interface: no network interface or local address 'nope0'"):
        cyclone_config(Ros2Section(interface="nope0"))


def test_a_missing_binding_is_one_line_with_the_install_command(monkeypatch):
    from edgekv.video import ros2

    ros2.binding.cache_clear()
    monkeypatch.setitem(sys.modules, "cyclonedds", None)
    monkeypatch.setitem(sys.modules, "cyclonedds.domain", None)
    try:
        with pytest.raises(SourceUnavailable, match=r"pip install 'edgekv\[ros2\]'") as caught:
            open_source("ros2:/camera/image_raw", ros2=_loopback(5))
        assert "\n" not in str(caught.value)
    finally:
        ros2.binding.cache_clear()


def test_daemon_refuses_a_missing_interface_in_one_line_before_the_model_loads(capsys):
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    config = EdgeKVConfig().with_overrides(model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
                                           video={"source": SCENE, "resolution": [112, 112]},
                                           server={"enabled": False}, ros2={"enabled": True, "interface": "nope0"})
    daemon = Daemon(config, DaemonOptions(no_stdin=True, no_server=True, exit_at_end=True), out=io.StringIO())
    assert daemon.run() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot start: ros2.interface: no network interface or local address 'nope0'" in err[0]
    assert daemon.session is None  # refused before the model loaded


# ---------------------------------------------------------------------------------------------- frames in
def test_images_from_an_independent_publisher_match_rosbags_bytes_and_decode_exactly(tmp_path):
    """The robot publishes rgb8 Images at 10 Hz; edgekv's reader gets the bytes rosbags serializes for the same
    message (plus the binding's zero padding to 4 bytes), and the ros2: source turns them into the video's
    own frames at the video's own times."""
    from edgekv.video.ros2 import Ros2Graph, sensor_qos

    domain = _domain()
    settings = _loopback(domain)
    raw: list[bytes] = []
    graph = Ros2Graph.acquire(settings)
    tap = graph.subscribe("/camera/image_raw", IMAGE, sensor_qos(), raw.append)
    source = open_source("ros2:/camera/image_raw?stale=2", ros2=settings)
    robot = Robot(tmp_path, domain, "--spec", SCENE.replace("frames=40", "frames=12"), "--encoding", "rgb8")
    try:
        frames, errors = _read(source, robot, 12)
        result = robot.result()
    finally:
        robot.stop()
        source.close()
        tap.close()
        graph.release()
    expected = list(open_source(SCENE.replace("frames=40", "frames=12")))
    assert result["published"] == 12 and not errors
    # the wire format: the binding's serialization == rosbags' (two implementations of ROS 2's CDR)
    store = typestore()
    T, H, I = store.types["builtin_interfaces/msg/Time"], store.types["std_msgs/msg/Header"], store.types[IMAGE]
    first, t0 = expected[0]
    rgb = np.ascontiguousarray(first[:, :, ::-1])
    message = I(header=H(stamp=T(sec=1_700_000_000, nanosec=0), frame_id="camera"), height=112, width=112,
                encoding="rgb8", is_bigendian=0, step=336, data=rgb.reshape(-1))
    reference = bytes(store.serialize_cdr(message, IMAGE))
    assert bytes.fromhex(result["first_serialized"]) == reference
    assert raw, "edgekv's reader received nothing"
    assert raw[0][:len(reference)] == reference and set(raw[0][len(reference):]) <= {0} \
        and len(raw[0]) - len(reference) < 4
    # frames and times as the video has them (latest-frame-wins may drop some under load: match by time)
    assert len(frames) >= 6
    by_time = {round(t, 6): frame for frame, t in expected}
    for frame, t in frames:
        assert round(t, 6) in by_time, t
        assert np.array_equal(frame, by_time[round(t, 6)])
    assert frames[0][1] == 0.0 and all(b[1] > a[1] for a, b in zip(frames, frames[1:]))


def test_bad_messages_on_the_wire_are_counted_skips_and_nothing_else_is_lost(tmp_path):
    """A wrong encoding (32FC1) and a truncated image (half its pixel data) between good frames: both skipped
    and counted, every good frame still arrives. (A message whose CDR itself is cut cannot be sent through
    Cyclone DDS, which refuses to write it; rosbags' decoding of such bytes is tested on bags.)"""
    domain = _domain()
    settings = _loopback(domain)
    source = open_source("ros2:/camera/image_raw?stale=2", ros2=settings)
    robot = Robot(tmp_path, domain, "--spec", SCENE.replace("frames=40", "frames=10"), "--rate", "5",
                  "--bad", "3:encoding", "--bad", "6:truncated")
    try:
        frames, errors = _read(source, robot, 10)
        result = robot.result()
    finally:
        robot.stop()
        source.close()
    assert result["published"] == 10
    stats = source.stats()
    # latest-frame-wins: a message overwritten before it was read is counted as dropped, never lost silently
    assert len(frames) + stats["corrupt"] + stats["messages_dropped"] == 10, stats
    assert stats["corrupt"] == len(errors) >= 1 and stats["frames"] == len(frames) >= 6, (stats, errors)
    kinds = {"encoding '32FC1' is not supported" if "32FC1" in e else "truncated" if "truncated" in e else e
             for e in errors}
    assert kinds <= {"encoding '32FC1' is not supported", "truncated"}, errors
    if stats["messages_dropped"] == 0:
        assert len(kinds) == 2
    good = {round(t, 6): frame for frame, t in open_source(SCENE.replace("frames=40", "frames=10"))}
    bad_times = {round(3 / 10, 6), round(6 / 10, 6)}
    for frame, t in frames:  # every frame read is a good one, intact
        assert round(t, 6) not in bad_times and np.array_equal(frame, good[round(t, 6)])


def test_a_topic_of_another_type_is_named_in_the_error(tmp_path):
    """std_msgs/String published on the image topic: DDS never matches the two, and the source says why."""
    domain = _domain()
    source = open_source("ros2:/camera/image_raw?stale=1", ros2=_loopback(domain))
    robot = Robot(tmp_path, domain, "--spec", SCENE.replace("frames=40", "frames=30"),
                  *[arg for i in range(30) for arg in ("--bad", f"{i}:string")])
    try:
        message = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                source.read()
            except SourceLost as exc:
                message = str(exc)
                if "published as" in message:
                    break
        robot.stop()
    finally:
        robot.stop()
        source.close()
    assert message is not None and "/camera/image_raw is published as std_msgs/msg/String, not " \
        "sensor_msgs/msg/Image" in message, message


def test_a_stopping_capture_wakes_a_source_waiting_on_a_silent_topic():
    from edgekv.video.capture import CaptureThread

    capture = CaptureThread(open_source("ros2:/nobody/publishes?stale=60", ros2=_loopback(_domain()))).start()
    deadline = time.monotonic() + 30
    while not capture.source.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert capture.source.waiting  # inside read(), which would wait 60 s for a message
    assert capture.stop(timeout=10)
    assert capture.stats()["ended"] == "stopped"


# ---------------------------------------------------------------------------------------------- the daemon
@pytest.mark.slow
def _robot_config(domain: int, ros2: dict | None = None, **sections) -> EdgeKVConfig:
    """The shipped toy watching the robot's camera topic, the ROS 2 topics on (loopback, the test's domain; ``ros2``:
    more of that section's keys)."""
    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": "ros2:/camera/image_raw", "fps": 20.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"enabled": False}, generation={"max_new_tokens": 8, "temperature": 0.0}, monitor={"backend": "cpu"},
        ros2={"enabled": True, "domain_id": domain, "interface": "lo", "peers": ["127.0.0.1"], "multicast": False,
              **(ros2 or {})},
        **sections)


@contextlib.contextmanager
def _running(config: EdgeKVConfig):
    """The daemon of ``config`` in a thread, ready: yields (daemon, its output); stopped after."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    out = io.StringIO()
    daemon = Daemon(config, DaemonOptions(no_stdin=True, no_server=True, quiet=True), out=out)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        assert daemon.ready.wait(120), out.getvalue()
        yield daemon, out
    finally:
        daemon.stop.event.set()
        thread.join(60)
    assert not thread.is_alive()


def test_daemon_answers_a_robot_over_ros2_from_what_it_saw(tmp_path):
    """The robot streams a synthetic:events video as sensor_msgs/Image at 10 Hz, then asks on
    /edgekv/input_query; the daemon (the shipped toy) answers on /edgekv/output what the ground truth says,
    streams the same answer on /edgekv/output_stream, gives it as JSON with its evidence on /edgekv/output_json
    and the frame it looked at on /edgekv/output_evidence (sensor_msgs/CompressedImage, stamped with the wall time
    it was seen at), and publishes its status as JSON once a second."""
    from edgekv.toy.questions import answer_of
    from edgekv.toy.quiz import make_quiz

    scene = open_source(SCENE).scene
    quiz = make_quiz(scene.events, 3, seed=scene.seed)
    assert scene.events and len(quiz) == 3
    domain = _domain()
    with _running(_robot_config(domain)) as (daemon, out):
        started = time.time()
        # the quiz, then the first question again as a JSON request (the last 100 s, two evidence pairs), then a
        # request that names no question
        requests = [json.dumps({"question": quiz[0].question, "last_s": 100, "evidence": 2}), '{"question": 3}']
        robot = Robot(tmp_path, domain, "--spec", SCENE,
                      *[a for text in [qa.question for qa in quiz] + requests for a in ("--ask", text)])
        try:
            result = robot.result(timeout=180)
        finally:
            robot.stop()
        frames = {seen["pair"]: daemon.keyframe_jpeg(seen["pair"])
                  for item in map(json.loads, result["json"]) for seen in item["evidence"]}
    assert not result["errors"], (result["errors"], out.getvalue())
    *answered, again, refused = result["answers"]
    assert [answer_of(a) for a in answered] == [qa.answer for qa in quiz], (result["answers"], out.getvalue())
    assert answer_of(again) == quiz[0].answer and refused.startswith("error: question: the question's text is req")
    assert "".join(result["tokens"]) == "".join(result["answers"][:-1])  # the streamed pieces make up the answers
    status = [json.loads(s) for s in result["status"]]
    assert status[-1]["stream_state"] == "running" and status[-1]["cache"]["cache_capacity_tokens"] == 640
    assert status[-1]["cache"]["frames"] >= 30 and status[-1]["ros2"]["questions"] == 4
    assert status[-1]["ros2"]["malformed"] == 1
    assert status[-1]["source"]["topic"] == "/camera/image_raw" and status[-1]["source"]["corrupt"] == 0
    assert "ROS 2: questions on /edgekv/input_query, answers on /edgekv/output" in out.getvalue()
    # the answer as JSON, with the pair it attended most (ros2.evidence: 1) and when that pair was seen
    *answers, json_again, json_refused = [json.loads(item) for item in result["json"]]
    assert [item["question"] for item in answers + [json_again]] == [qa.question for qa in quiz + [quiz[0]]]
    assert [item["answer"] for item in answers + [json_again]] == result["answers"][:-1]
    assert all(not item["error"] for item in answers + [json_again])
    assert json_refused["answer"] is None and json_refused["error"].startswith("question: the question's text")
    assert len(json_again["evidence"]) == 2 and json_again["evidence"][0] == answers[0]["evidence"][0]
    for item in answers:
        (seen,) = item["evidence"]
        assert 0 <= seen["pair"] < 20 and seen["t"] == pytest.approx(seen["pair"] * 0.2, abs=0.11)  # 10 fps, 2 a pair
        assert started <= seen["unix"] <= time.time() and seen["frame"] == f"/frame.jpg?pair={seen['pair']}"
    # the frame of that pair, as the daemon serves it, stamped with that wall time
    assert len(result["evidence"]) == len(quiz) + 1 and status[-1]["ros2"]["evidence_images"] == len(quiz) + 1
    for item, image in zip(answers + [json_again], result["evidence"]):
        seen = item["evidence"][0]
        assert image["format"] == "jpeg" and image["frame_id"] == ""
        assert bytes.fromhex(image["data"]) == frames[seen["pair"]] and frames[seen["pair"]][:2] == b"\xff\xd8"
        assert image["sec"] * 10**9 + image["nanosec"] == round(seen["unix"] * 1e9)


def test_alerts_reach_the_robot_over_ros2_with_their_keyframe(tmp_path):
    """A standing question (alerts.rules) turns yes while the robot's camera shows a green circle: the alert comes on
    /edgekv/alerts as JSON and its keyframe on /edgekv/alert_image (sensor_msgs/CompressedImage), stamped with the
    wall time its evidence pair was seen at; the bytes are the alert's keyframe, as the API serves it."""
    domain = _domain()
    rules = [{"name": "green", "question": "Was there a green circle?", "cooldown_s": 0}]
    with _running(_robot_config(domain, alerts={"rules": rules})) as (daemon, out):
        started = time.time()
        robot = Robot(tmp_path, domain, "--spec", SCENE, "--alerts", "1")
        try:
            result = robot.result(timeout=180)
        finally:
            robot.stop()
        events = list(daemon.alert_bus.recent)
    assert not result["errors"], (result["errors"], out.getvalue())
    (first, *_), (image, *_) = result["alerts"], result["alert_images"]
    alert = json.loads(first)
    assert alert["type"] == "edgekv.alert" and alert["name"] == "green" and alert["p_yes"] >= 0.5
    event = next(e for e in events if e.id == alert["id"])
    assert alert["evidence_pair"] == event.evidence_pair and 10 <= event.evidence_pair <= 16  # the circle's pairs
    assert started <= alert["evidence_unix"] <= alert["raised_unix"] <= time.time()
    assert bytes.fromhex(image["data"]) == event.keyframe_jpeg and image["format"] == "jpeg"
    assert image["sec"] * 10**9 + image["nanosec"] == round(alert["evidence_unix"] * 1e9)
    assert "alerts on /edgekv/alerts (keyframes on /edgekv/alert_image)" in out.getvalue()


def test_a_robot_forgets_a_stretch_over_ros2_only_where_it_is_allowed(tmp_path):
    """ros2.accept_forget: a forget request on /edgekv/input_forget removes the stretch from the cache (the result on
    /edgekv/output_forget, as the HTTP API's); a request that does not check is answered naming what is wrong;
    without accept_forget nothing listens on the topic."""
    domain = _domain()
    requests = ['{"from": 0, "to": 0.9}', '{"last_s": -1}', "forget it all", '{"from": 1}']
    with _running(_robot_config(domain, ros2={"accept_forget": True})) as (daemon, out):
        robot = Robot(tmp_path, domain, "--spec", SCENE, *[a for request in requests for a in ("--forget", request)])
        try:
            result = robot.result(timeout=180)
        finally:
            robot.stop()
        held = sorted(daemon.session.pair_times.values())
        counts = dict(daemon.ros2.counts)
    assert not result["errors"], (result["errors"], out.getvalue())
    done, negative, prose, half = [json.loads(text) for text in result["forgotten"]]
    # pairs 0-4 at 0.2 s a pair (fewer where the busy machine dropped frames, latest frame wins) gone from the cache
    assert done["from"] == 0.0 and done["to"] == 0.9 and 1 <= done["pairs"] <= 5 and done["cache_slots"] > 0, done
    assert held and held[0] > 0.9
    assert negative["error"].startswith("last_s: must be > 0") and prose["error"].startswith("not JSON")
    assert half["error"].startswith("from and to are required")
    assert counts["forgets"] == 1 and counts["forgets_refused"] == 3
    assert "forget requests on /edgekv/input_forget" in out.getvalue()
    with _running(_robot_config(_domain())) as (daemon, out):  # the default: no forget topics at all
        assert daemon.ros2.forget_in is None and daemon.ros2.forget_out is None
        assert "input_forget" not in out.getvalue()


def test_two_cameras_answer_their_own_robots_over_ros2(tmp_path):
    """video.sources with two ROS 2 cameras on one model: each camera reads its own image topic and answers on
    its own namespace (/edgekv/front/..., /edgekv/back/...), about what it saw (two robots, two scenes)."""
    from edgekv.apps.daemon.cameras import CameraSet
    from edgekv.apps.daemon.loop import DaemonOptions
    from edgekv.toy.questions import answer_of
    from edgekv.toy.quiz import make_quiz

    scenes = {"front": SCENE, "back": SCENE.replace("seed=2", "seed=5")}
    quizzes = {}
    for name, spec in scenes.items():
        scene = open_source(spec).scene
        quizzes[name] = make_quiz(scene.events, 2, seed=scene.seed)
    domain = _domain()
    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": [{"name": name, "source": f"ros2:/{name}/image_raw"} for name in scenes], "fps": 20.0,
               "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 1280, "text_reserve_tokens": 64},
        server={"enabled": False}, generation={"max_new_tokens": 8, "temperature": 0.0}, monitor={"backend": "cpu"},
        ros2={"enabled": True, "domain_id": domain, "interface": "lo", "peers": ["127.0.0.1"], "multicast": False})
    out = io.StringIO()
    cameras = CameraSet(config, DaemonOptions(no_stdin=True, no_server=True, quiet=True), out=out)
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    robots = {}
    try:
        assert cameras.ready.wait(120), out.getvalue()
        for name, spec in scenes.items():
            (tmp_path / name).mkdir()
            robots[name] = Robot(tmp_path / name, domain,
                                 "--spec", spec, "--topic", f"/{name}/image_raw", "--namespace", f"/edgekv/{name}",
                                 *[a for qa in quizzes[name] for a in ("--ask", qa.question)])
        results = {name: robot.result(timeout=180) for name, robot in robots.items()}
    finally:
        for robot in robots.values():
            robot.stop()
        cameras.stop.event.set()
        thread.join(60)
    for name, result in results.items():
        assert not result["errors"], (name, result["errors"], out.getvalue())
        assert [answer_of(a) for a in result["answers"]] == [qa.answer for qa in quizzes[name]], (name, out.getvalue())
        assert json.loads(result["status"][-1])["source"]["topic"] == f"/{name}/image_raw"
        # each camera's answers name it, and its evidence frames carry its name as their frame_id
        assert [json.loads(item)["camera"] for item in result["json"]] == [name] * len(quizzes[name])
        assert result["evidence"] and all(image["frame_id"] == name for image in result["evidence"])
        assert all(json.loads(item)["evidence"][0]["frame"].endswith(f"&camera={name}") for item in result["json"])
    assert "[back] ROS 2: questions on /edgekv/back/input_query" in out.getvalue()
