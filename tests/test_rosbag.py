"""Recorded ROS 2 bags (edgekv/video/rosbag.py): bags written with rosbags (MCAP and sqlite3) from a
synthetic:events stream read back frame for frame and time for time, ``edgekv bag``, bad bags and bad
messages refused or skipped by name, and ``edgekv-camera --quiz`` giving the same answers and score on a
bag as on the stream it was written from."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
pytest.importorskip("rosbags", reason="rosbags is not installed (pip install 'edgekv[ros2]')")

from edgekv.video.ros_images import IMAGE, STRING, typestore  # noqa: E402
from edgekv.video.rosbag import encode_message, write_bag  # noqa: E402
from edgekv.video.sources import CorruptFrame, EndOfStream, SourceUnavailable, iter_frames, open_source  # noqa: E402

SCENE = "synthetic:events?size=112x112&fps=2&frames=24&seed=2&rate=0.1"


def _frames(spec: str = SCENE) -> list:
    return list(iter_frames(spec))


@pytest.mark.parametrize("storage, encoding", [("mcap", "bgr8"), ("sqlite3", "rgb8"), ("mcap", "png")])
def test_a_bag_gives_back_the_stream_frame_for_frame_and_time_for_time(tmp_path, storage, encoding):
    expected = _frames()
    assert write_bag(expected, tmp_path / "bag", storage=storage, encoding=encoding, ground_truth=SCENE) == 24
    source = open_source(f"rosbag:{tmp_path / 'bag'}?topic=/camera/image_raw")
    got = list(source)
    assert [t for _, t in got] == [t for _, t in expected]  # header.stamp, exact to the nanosecond
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(got, expected))  # lossless encodings
    assert source.frames_skipped == 0 and source.stats()["frames"] == 24
    assert source.scene is not None and source.scene.events == open_source(SCENE).scene.events  # ground truth


@pytest.mark.parametrize("encoding", ["nv12", "bayer_rggb8"])
def test_a_bag_of_raw_sensor_encodings_reads_back_as_the_scene(tmp_path, encoding):
    """``edgekv bag --encoding nv12 | bayer_rggb8`` (the formats of hardware encoders and raw CSI sensors) and the
    rosbag: source that reads them: the stream comes back at its times; NV12 exactly as OpenCV's own 4:2:0 round
    trip of each frame (three planes, I420), the demosaiced mosaic (a third of the samples kept) close to the scene."""
    expected = _frames()
    assert write_bag(expected, tmp_path / "bag", encoding=encoding) == 24
    got = list(open_source(f"rosbag:{tmp_path / 'bag'}"))
    assert [t for _, t in got] == [t for _, t in expected]
    for (frame, _), (original, _) in zip(got, expected):
        if encoding == "nv12":
            i420 = cv2.cvtColor(cv2.cvtColor(original, cv2.COLOR_BGR2YUV_I420), cv2.COLOR_YUV2BGR_I420)
            assert np.array_equal(frame, i420)
        else:
            assert frame.shape == original.shape and np.abs(frame.astype(int) - original).mean() < 12.0


def test_a_bare_mcap_file_and_the_only_image_topic_need_no_topic_parameter(tmp_path):
    write_bag(_frames(), tmp_path / "run", topic="/front/image_raw/compressed", encoding="jpeg")
    source = open_source(f"rosbag:{tmp_path / 'run' / 'run.mcap'}")
    assert source.topic == "/front/image_raw/compressed" and len(list(source)) == 24
    with pytest.raises(FileExistsError):
        write_bag(_frames(), tmp_path / "run")


def _bag_with(tmp_path: Path, messages: list[tuple[str, str, bytes]], name: str = "bad") -> Path:
    """A bag written with rosbags directly: (topic, message type, serialized bytes) in order."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    store, path = typestore(), tmp_path / name
    with Writer(path, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
        connections = {}
        for index, (topic, msgtype, raw) in enumerate(messages):
            if topic not in connections:
                connections[topic] = writer.add_connection(topic, msgtype, typestore=store)
            writer.write(connections[topic], 1_700_000_000 * 10**9 + index * 500_000_000, raw)
    return path


def _serialized(frame, index: int, encoding: str = "bgr8") -> tuple[str, bytes]:
    kind, message = encode_message(frame, encoding, stamp=1_700_000_000 * 10**9 + index * 500_000_000)
    return kind, bytes(typestore().serialize_cdr(message, kind))


def test_bad_messages_in_a_bag_are_counted_skips_and_the_rest_is_read(tmp_path):
    frames = [frame for frame, _ in _frames()][:8]
    messages = []
    for index, frame in enumerate(frames):
        kind, raw = _serialized(frame, index)
        if index == 2:
            raw = raw[: len(raw) // 2]  # a message cut in half
        if index == 5:
            store = typestore()
            header = store.deserialize_cdr(raw, IMAGE).header
            raw = bytes(store.serialize_cdr(store.types[IMAGE](header=header, height=112, width=112, encoding="32FC1",
                                                               is_bigendian=0, step=448, data=np.zeros(112 * 448, np.uint8)),
                                            IMAGE))
        messages.append(("/camera/image_raw", kind, raw))
    source = open_source(f"rosbag:{_bag_with(tmp_path, messages)}")
    got, errors = [], []
    while True:
        try:
            got.append(source.read())
        except CorruptFrame as exc:
            errors.append(str(exc))
        except EndOfStream as end:
            assert end.reason == "eof"
            break
    assert len(got) == 6 and source.stats()["corrupt"] == 2
    assert "message 3: sensor_msgs/msg/Image: a malformed or truncated message" in errors[0]
    assert "message 6: sensor_msgs/msg/Image: encoding '32FC1' is not supported" in errors[1]
    kept = [0, 1, 3, 4, 6, 7]
    assert [t for _, t in got] == [k / 2 for k in kept]  # times from the stamps: the skipped leave their gap
    assert all(np.array_equal(f, frames[k]) for (f, _), k in zip(got, kept))


def test_bags_without_the_topic_or_of_another_type_are_refused_by_name(tmp_path):
    frame = _frames()[0][0]
    kind, raw = _serialized(frame, 0)
    text = bytes(typestore().serialize_cdr(typestore().types[STRING](data="hello"), STRING))
    path = _bag_with(tmp_path, [("/camera/image_raw", kind, raw), ("/chatter", STRING, text)])
    cases = [(f"rosbag:{path}?topic=/rear/image_raw", r"the bag has no topic /rear/image_raw \(image topics: "
                                                      r"/camera/image_raw\)"),
             (f"rosbag:{path}?topic=/chatter", r"/chatter carries std_msgs/msg/String, not sensor_msgs/msg/Image")]
    for spec, message in cases:
        with pytest.raises(SourceUnavailable, match=message):
            open_source(spec)
    only_text = _bag_with(tmp_path, [("/chatter", STRING, text)], name="text")
    with pytest.raises(SourceUnavailable, match="it has no Image or CompressedImage topic"):
        open_source(f"rosbag:{only_text}")
    two = _bag_with(tmp_path, [("/a/image", kind, raw), ("/b/image", kind, raw)], name="two")
    with pytest.raises(SourceUnavailable, match=r"name a topic with \?topic=/… \(image topics: /a/image, /b/image\)"):
        open_source(f"rosbag:{two}")
    with pytest.raises(ValueError, match="no such bag"):
        open_source(f"rosbag:{tmp_path / 'nothing'}")
    with pytest.raises(ValueError, match="unknown parameter 'topics'"):
        open_source(f"rosbag:{path}?topics=/x")


def test_a_cut_off_bag_file_is_one_clear_line(tmp_path):
    write_bag(_frames(), tmp_path / "cut")
    mcap = tmp_path / "cut" / "cut.mcap"
    with open(mcap, "r+b") as handle:
        handle.truncate(mcap.stat().st_size * 6 // 10)
    with pytest.raises(SourceUnavailable, match="not a readable ROS 2 bag .*the MCAP file is cut off") as caught:
        open_source(f"rosbag:{tmp_path / 'cut'}")
    assert "\n" not in str(caught.value)


def test_edgekv_bag_command_writes_a_bag_the_daemon_can_read(tmp_path, capsys):
    from edgekv.apps.cli import main

    out = tmp_path / "demo"
    assert main(["bag", SCENE, str(out), "--storage", "sqlite3", "--encoding", "yuv422_yuy2"]) == 0
    assert f"wrote 24 frames to {out} (sqlite3; /camera/image_raw: sensor_msgs/msg/Image, yuv422_yuy2); " \
           f"ground truth {SCENE}" in capsys.readouterr().out
    source = open_source(f"rosbag:{out}")
    got, expected = list(source), _frames()
    assert [t for _, t in got] == [t for _, t in expected] and source.ground_truth == SCENE
    assert max(np.abs(a.astype(int) - b).mean() for (a, _), (b, _) in zip(got, expected)) < 3.0  # 4:2:2 chroma
    assert main(["bag", SCENE, str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    copy = tmp_path / "copy"  # a bag from a bag keeps the ground truth
    assert main(["bag", f"rosbag:{out}", str(copy), "--frames", "10"]) == 0
    assert open_source(f"rosbag:{copy}").ground_truth == SCENE and len(list(open_source(f"rosbag:{copy}"))) == 10


@pytest.mark.parametrize("option, message", [
    (["--fps", "0"], "--fps must be a positive number of frames a second, got 0.0"),
    (["--fps", "nan"], "--fps must be a positive number of frames a second, got nan"),
    (["--topic", "camera image"], "--topic 'camera image' is not a ROS 2 topic name (only letters, digits"),
    (["--topic", "camera"], "--topic 'camera' is not a ROS 2 topic name (not absolute)"),
    (["--topic", "/2d/image"], "--topic '/2d/image' is not a ROS 2 topic name (a token may not start with a digit)"),
])
def test_edgekv_bag_refuses_a_bad_option_before_it_makes_the_bag(tmp_path, capsys, option, message):
    """A bad --fps was found only while sampling, after the bag's directory was made: the empty bag left behind
    made the corrected command fail as "already exists"; a topic with a space was written as it was, a bag no ROS 2
    tool could play."""
    from edgekv.apps.cli import main

    out = tmp_path / "bag"
    assert main(["bag", SCENE, str(out), *option]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_ctrl_c_or_a_failing_source_closes_the_bag_whole(tmp_path, monkeypatch, capsys):
    """Recording until Ctrl-C (a camera's usual end) left a bag without metadata.yaml, which no reader opens;
    now the frames before it are closed into a whole bag and `edgekv bag` says how many (exit 130). A source that
    fails mid-recording keeps them the same way and its error goes on."""
    import edgekv.video.rosbag as rosbag
    from edgekv.apps.cli import main
    from edgekv.video.sources import SourceError

    def cut(error, after=7):
        def frames(source, count, fps):
            for index, frame in enumerate(iter_frames(source, max_frames=count, fps=fps)):
                if index == after:
                    raise error
                yield frame
        return frames

    monkeypatch.setattr(rosbag, "_frames", cut(KeyboardInterrupt))
    out = tmp_path / "stopped"
    try:
        code = main(["bag", SCENE, str(out)])
    except KeyboardInterrupt:  # (not let through: it would end the test run itself)
        pytest.fail("the interrupt ended edgekv bag and the bag was left unreadable")
    assert code == 130 and "wrote 7 frames" in capsys.readouterr().out and (out / "metadata.yaml").exists()
    assert [t for _, t in open_source(f"rosbag:{out}")] == [t for _, t in _frames()[:7]]
    monkeypatch.setattr(rosbag, "_frames", cut(SourceError("the camera went away")))
    with pytest.raises(SourceError, match="went away"):
        rosbag.bag_main(type("Args", (), {"source": SCENE, "out": str(tmp_path / "failed"), "frames": None,
                                          "fps": None, "topic": "/camera/image_raw", "storage": "sqlite3",
                                          "encoding": "bgr8", "stamp_base": 1_700_000_000})())
    assert len(list(open_source(f"rosbag:{tmp_path / 'failed'}"))) == 7


def test_a_camera_records_until_ctrl_c(tmp_path, capsys):
    """A live source without --frames was refused ("say how many frames"); now it records until Ctrl-C, which
    closes the bag whole."""
    import edgekv.video.rosbag as rosbag
    from edgekv.video.sources import FrameSource

    class Camera(FrameSource):  # live, a new frame on every read
        def __init__(self):
            super().__init__("fake:camera", live=True)
            self.index = 0

        def read(self):
            self.index += 1
            return np.full((48, 64, 3), self.index % 256, np.uint8), self.index / 100.0

    def until_ctrl_c(frames, keys_after=5):
        for index, frame in enumerate(frames):
            if index == keys_after:
                frames.close()  # (the capture thread stopped, as the interrupt's unwinding does)
                raise KeyboardInterrupt
            yield frame

    with pytest.raises(rosbag.BagInterrupted) as stop:
        write_bag(until_ctrl_c(rosbag._frames(Camera(), None, 1000.0)), tmp_path / "camera")
    assert stop.value.written == 5 and "until Ctrl-C" in capsys.readouterr().err
    assert len(list(open_source(f"rosbag:{tmp_path / 'camera'}"))) == 5


def test_a_plain_bag_path_is_a_bag_and_a_missing_rosbags_is_one_line(tmp_path, monkeypatch):
    write_bag(_frames(), tmp_path / "run")
    for path in (tmp_path / "run", tmp_path / "run" / "run.mcap"):  # what eval/bench/dataset paths look like
        source = open_source(str(path))
        assert source.kind == "rosbag" and len(list(source)) == 24
    monkeypatch.setitem(sys.modules, "rosbags.rosbag2", None)
    with pytest.raises(SourceUnavailable, match=r"needs the rosbags package: pip install 'edgekv\[ros2\]'"):
        open_source(f"rosbag:{tmp_path / 'run'}")


def test_a_relative_bag_path_in_a_config_is_relative_to_the_file(tmp_path):
    from edgekv.config import load_config

    (tmp_path / "deploy.yaml").write_text('video: {source: "rosbag:bags/run1?topic=/camera/image_raw"}\n')
    assert load_config(tmp_path / "deploy.yaml").video.source == \
        f"rosbag:{(tmp_path / 'bags' / 'run1').resolve()}?topic=/camera/image_raw"


def test_bench_and_replay_helpers_read_bags_like_any_recorded_source(tmp_path):
    from edgekv.video.sources import looped_frames

    write_bag(_frames(), tmp_path / "bag")
    frames = list(looped_frames(f"rosbag:{tmp_path / 'bag'}", 30, fps=2.0))  # what `edgekv bench stream` reads
    assert len(frames) == 30 and [t for _, t in frames[:24]] == [k / 2 for k in range(24)]
    assert frames[24][1] == 12.0  # the second pass goes on in time


# ---------------------------------------------------------------------------------------------- the daemon
def _quiz_run(source: str) -> tuple[list[str], str]:
    """``edgekv-camera --quiz 10`` on the CPU demo's settings: the question/answer/grade lines and the score."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.config import load_config

    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "configs" / "cpu-demo.yaml").with_overrides(
        video={"source": source}, server={"enabled": False}, monitor={"backend": "cpu"})
    out = io.StringIO()
    assert Daemon(config, DaemonOptions(no_stdin=True, no_server=True, exit_at_end=True, quiet=True, quiz=10),
                  out=out).run() == 0
    text = out.getvalue()
    lines = [line for line in text.splitlines() if re.match(r"(Q \[quiz\]|A:|   model:)", line)]
    score = re.search(r"quiz: \d+/\d+ correct about .*", text)
    assert score, text
    return lines, score.group(0)


@pytest.mark.slow
def test_the_daemon_quiz_on_mcap_and_sqlite3_bags_equals_the_quiz_on_the_stream(tmp_path):
    """The CPU demo's stream (80 s, three events), its bags in both storages: the same ten questions, the same
    answers, the same score."""
    from edgekv.config import load_config

    root = Path(__file__).resolve().parents[1]
    spec = load_config(root / "configs" / "cpu-demo.yaml").video.source
    frames = _frames(spec)
    write_bag(frames, tmp_path / "mcap", storage="mcap", encoding="bgr8", ground_truth=spec)
    write_bag(frames, tmp_path / "sqlite3", storage="sqlite3", encoding="rgb8", ground_truth=spec)
    direct = _quiz_run(spec)
    assert len(direct[0]) == 30 and direct[1].startswith("quiz: ")
    assert _quiz_run(f"rosbag:{tmp_path / 'mcap'}") == direct
    assert _quiz_run(f"rosbag:{tmp_path / 'sqlite3'}?topic=/camera/image_raw") == direct


def test_a_bag_resumed_far_in_decodes_only_the_frames_it_hands_out(tmp_path, monkeypatch):
    """Issue: a paused bag was decoded frame by frame up to the resume point (1.6 ms a 640x480 JPEG: 3 minutes an hour
    of 30 fps). ``grab`` reads a message's header only; the time is the one reading every frame gives."""
    import edgekv.video.rosbag as rosbag
    from edgekv.video.sources import ResumedSource

    write_bag(_frames(), tmp_path / "run", encoding="jpeg")
    played = list(open_source(f"rosbag:{tmp_path / 'run'}"))
    decoded = []
    decode = rosbag.frame_from_message
    monkeypatch.setattr(rosbag, "frame_from_message", lambda *args: decoded.append(1) or decode(*args))
    resumed = ResumedSource(open_source(f"rosbag:{tmp_path / 'run'}"), played[20][1])
    got = [resumed.read() for _ in range(3)]
    assert len(decoded) == 3 and resumed.skipped == 20
    assert [t for _, t in got] == [t for _, t in played[20:23]]
    assert all(np.array_equal(frame, expected) for (frame, _), (expected, _) in zip(got, played[20:23]))
    assert resumed.source.stats()["messages"] == 23 and resumed.source.stats()["frames"] == 3


def test_a_bag_frame_that_does_not_decode_at_the_resume_point_is_counted(tmp_path):
    from edgekv.video.capture import CaptureThread
    from edgekv.video.sources import ResumedSource

    frames = [frame for frame, _ in _frames()][:6]
    messages = []
    for index, frame in enumerate(frames):
        kind, raw = _serialized(frame, index, "jpeg")
        if index == 3:  # the JPEG cut off: the header and the stamp read, the image does not
            store = typestore()
            message = store.deserialize_cdr(raw, kind)
            message.data = message.data[: len(message.data) // 2]
            raw = bytes(store.serialize_cdr(message, kind))
        messages.append(("/camera/image_raw/compressed", kind, raw))
    source = open_source(f"rosbag:{_bag_with(tmp_path, messages)}")
    capture = CaptureThread(ResumedSource(source, 1.5), lossless=True).start()
    try:
        taken = []
        while (item := capture.get(timeout=120)) is not None:
            taken.append(item[1])
    finally:
        capture.stop()
    assert taken == [2.0, 2.5] and capture.stats()["frames_corrupt"] == 1
    assert "message 4:" in capture.stats()["last_error"] and "cut off" in capture.stats()["last_error"]
