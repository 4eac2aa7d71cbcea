"""Probes of a running daemon with several cameras (``video.sources``, apps/daemon/cameras.py), as a user with two
cameras on one device runs it: what the HTTP API says of the camera that is not the first (its server's), what a
start that cannot happen names, and where the memory of a camera no longer listed lies. Each found a bug."""

from __future__ import annotations

import json

import pytest

from edgekv.config import EdgeKVConfig
from helpers_cameras import MjpegCamera, wait_for
from helpers_cameras import running_cameras as _running

FRONT = "synthetic:events?size=112x112&fps=2&frames=100000&seed=1&rate=0.08"
BACK = "synthetic:events?size=112x112&fps=2&frames=6&seed=7&rate=0.08"


def _config(tmp_path, sources: list[dict], **extra) -> EdgeKVConfig:
    sections = dict(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": sources, "fps": 2.0, "resolution": [112, 112], "stream_timeout_s": 2.0,
               "reconnect_backoff_s": [0.05, 0.2]},
        cache={"policy": "infinipot_v", "max_tokens": 1280, "text_reserve_tokens": 64},
        state={"dir": str(tmp_path / "state"), "every_s": 3600}, monitor={"backend": "cpu"},
        server={"port": 0}, generation={"max_new_tokens": 2, "temperature": 0.0})
    sections.update(extra)
    return EdgeKVConfig().with_overrides(**sections)


def test_healthz_counts_every_camera_not_only_the_one_serving_it(tmp_path, monkeypatch):
    """Probe: front synthetic, back an MJPEG camera not up yet. ``/healthz`` said ``ok`` (and the status page's
    ``problems`` nothing) while back was never reached: only the first camera's daemon, which runs the server, was
    read. A stalled back answered 200 ``ok`` too, where one camera answers 503."""
    pytest.importorskip("fastapi")
    from helpers_server import call

    camera = MjpegCamera()
    try:
        config = _config(tmp_path, [{"name": "front", "source": FRONT}, {"name": "back", "source": camera.url}])
        with _running(config, tmp_path, realtime=True) as cameras:
            front, back = cameras.daemons["front"], cameras.daemons["back"]
            port = front.server.port
            assert wait_for(lambda: back.stream_state == "reconnecting" and front.stream_state == "running", 60)
            status, _, body = call(port, "GET", "/healthz")
            health = json.loads(body)
            assert status == 200 and health["status"] == "degraded", body
            assert health["cameras"] == {"front": "running", "back": "reconnecting"}
            assert any(p.startswith("camera back: video source not reached yet") for p in health["problems"]), body
            status, _, body = call(port, "GET", "/v1/edgekv/status")
            assert any(p.startswith("camera back: ") for p in json.loads(body)["daemon"]["problems"]), body

            camera.power_on()
            assert wait_for(lambda: back.stream_state == "running" and back.session.counters.frames > 0, 60)
            status, _, body = call(port, "GET", "/healthz")
            assert status == 200 and json.loads(body)["status"] == "ok", body
            monkeypatch.setattr(back.stall, "stalled", lambda: True)  # frames come to back, none goes in
            assert wait_for(lambda: back.stream_state == "stalled", 60)
            status, _, body = call(port, "GET", "/healthz")
            health = json.loads(body)
            assert status == 503 and health["status"] == "stalled", body
            assert health["detail"].startswith("camera back: no frame ingested for"), body
    finally:
        camera.close()


def test_a_camera_that_cannot_start_is_named(tmp_path, capsys):
    """Probe: back's ``source`` a file that is not there. The start was refused with ``video.source: video source
    '...': no such video file``: a key this config does not have, and not which camera's it was."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet

    missing = tmp_path / "gone.mp4"
    config = _config(tmp_path, [{"name": "front", "source": FRONT}, {"name": "back", "source": str(missing)}])
    cameras = CameraSet(config, daemon_args(), out=open(tmp_path / "out.txt", "w"))
    assert cameras.run() == 2
    err = capsys.readouterr().err
    assert "cannot start: video.sources[1] (back): video.source: " in err and str(missing) in err, err
    assert cameras.daemons["front"].session is None  # refused before the model loaded


def test_the_memory_of_a_renamed_or_removed_camera_is_said_where_it_lies(tmp_path):
    """Probe: two cameras run and stop, then start again with front renamed door (and an archive of a camera since
    removed). door started empty ("no snapshot in state.dir/door") and nothing said that state.dir/front holds the
    memory it had under its old name, kept and never read."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet

    front = {"name": "front", "source": BACK.replace("seed=7", "seed=3")}
    back = {"name": "back", "source": BACK}
    for sources in ([front, back], [{**front, "name": "door"}, back]):
        (tmp_path / "archive" / "side").mkdir(parents=True, exist_ok=True)
        (tmp_path / "archive" / "side" / "seg-00000001.ekva").write_bytes(b"\0" * 1024)
        config = _config(tmp_path, sources, server={"enabled": False}, archive={"dir": str(tmp_path / "archive")})
        cameras = CameraSet(config, daemon_args(exit_at_end=True, max_frames=2, realtime=False),
                            out=open(tmp_path / "out.txt", "w"))
        assert cameras.run() == 0
    out = (tmp_path / "out.txt").read_text()
    assert "[door] no snapshot in" in out and list((tmp_path / "state" / "front").glob("snapshot-*.ekv")), out
    said = [line for line in out.splitlines() if "which video.sources no longer lists" in line]
    assert [line.split(" holds ")[0] for line in said] == [f"state.dir: {tmp_path / 'state' / 'front'}",
                                                          f"archive.dir: {tmp_path / 'archive' / 'front'}",
                                                          f"archive.dir: {tmp_path / 'archive' / 'side'}"], out
    assert "a camera named 'front'" in said[0] and "give the camera that name again" in said[0]
    assert not any("[back]" in line or "'back'" in line for line in said)


def test_a_question_every_camera_refuses_is_an_error_not_an_answer(tmp_path):
    """Probe: ``{"window": {"from": 100, "to": 200}}`` asked of both cameras, neither holding that stretch. The reply
    was 200, ``"front: (no answer: window 100-200 s: ...)"`` as the assistant's content and no token used, where one
    camera answers 400 ``window_empty``. One camera that answers keeps the reply a 200 listing the other's
    refusal."""
    pytest.importorskip("fastapi")
    from helpers_server import call

    config = _config(tmp_path, [{"name": "front", "source": BACK.replace("seed=7", "seed=3")},
                                {"name": "back", "source": BACK.replace("frames=6", "frames=40")}])
    with _running(config, tmp_path, realtime=False) as cameras:
        front, back = cameras.daemons["front"], cameras.daemons["back"]
        assert wait_for(lambda: front.stream_state == back.stream_state == "ended", 120)
        port = front.server.port
        ask = {"messages": [{"role": "user", "content": "Was there a red circle?"}], "max_tokens": 2}
        status, _, body = call(port, "POST", "/v1/chat/completions", {**ask, "window": {"from": 100, "to": 200}})
        assert status == 400, body
        error = json.loads(body)["error"]
        assert error["code"] == "window_empty" and error["param"] == "window", body
        assert error["message"].startswith("front: window 100-200 s") and "; back: window 100-200 s" in error["message"]
        status, _, body = call(port, "POST", "/v1/chat/completions", {**ask, "window": {"from": 10, "to": 15}})
        assert status == 200, body  # back holds 10-15 s, front (3 s of video) nothing
        lines = json.loads(body)["choices"][0]["message"]["content"].splitlines()
        assert lines[0].startswith("front: (no answer: window 10-15 s") and lines[1] in ("back: yes", "back: no")
