"""When was it seen? An answer's evidence over the chat API (``"evidence": K``): the K frame pairs the question attended
most, each with its stream time and the wall time it was seen at (the camera's clock map), on the answer whole and on
a streamed answer's last chunk; ``edgekv ask --evidence`` prints them under the answer. A recording read as fast as it
goes has no wall times: its evidence says so (null), and the stream time is still given."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import importlib.util
import io
import json

import cv2
import numpy as np
import pytest
from helpers_server import ended_daemon
from helpers_wait import let_go

ASK = {"messages": [{"role": "user", "content": "What moved?"}]}


def _limits(images: bool = False):
    from edgekv.apps.server.openai_chat import ChatLimits

    return ChatLimits(served_models=("edgekv",), max_new_tokens=16, default_new_tokens=4, images=images)


def test_the_request_names_a_bad_evidence_count():
    from edgekv.apps.server.openai_chat import MAX_EVIDENCE, ApiError, parse_chat_request

    assert parse_chat_request(ASK, _limits()).evidence == 0
    assert parse_chat_request({**ASK, "evidence": None}, _limits()).evidence == 0
    assert parse_chat_request({**ASK, "evidence": 3}, _limits()).evidence == 3
    assert parse_chat_request({**ASK, "evidence": MAX_EVIDENCE}, _limits()).evidence == MAX_EVIDENCE
    for bad in (MAX_EVIDENCE + 1, -1, True, 1.5, "2", [1]):
        with pytest.raises(ApiError) as refused:
            parse_chat_request({**ASK, "evidence": bad}, _limits())
        assert refused.value.status == 400 and refused.value.param == "evidence", (bad, refused.value.message)
    ok, png = cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    with_image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}
    assert parse_chat_request(with_image, _limits(images=True)).images  # an image question is taken ...
    with pytest.raises(ApiError) as refused:  # ... but has no frame of the stream to show
        parse_chat_request({**with_image, "evidence": 1}, _limits(images=True))
    assert refused.value.message.startswith("evidence: a question with images")


def _config(model_dir, keyframe_pairs: int = 32):
    from edgekv.config import EdgeKVConfig

    return EdgeKVConfig().with_overrides(
        model={"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=48", "fps": 8.0, "resolution": [56, 56]},
        cache={"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64}, server={"port": 0},
        monitor={"backend": "cpu"}, generation={"max_new_tokens": 2, "temperature": 0.0},
        alerts={"keyframe_pairs": keyframe_pairs})


def _streamed(port: int, body: dict) -> list[dict]:
    from helpers_server import call

    status, headers, raw = call(port, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw
    events = [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _ask_cli(argv: list[str]) -> str:
    from edgekv.apps.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["ask", *argv]) == 0
    return printed.getvalue()


def test_an_answer_says_when_its_evidence_was_seen(tiny_checkpoint, tmp_path):
    pytest.importorskip("fastapi")
    from helpers_server import call, chat, error_of

    from edgekv.apps.wall_times import wall_text

    with ended_daemon(_config(tiny_checkpoint), tmp_path / "out.txt", realtime=True) as daemon:
        port, session = daemon.server.port, daemon.session
        with daemon.lock:
            want = session.ask("What moved?", max_new_tokens=2, evidence=3)
            times = dict(session.pair_times)
            assert session.wall.anchors  # a paced source: each frame's wall time was kept
        assert len(want.evidence) == 3
        status, _, body = chat(port, "What moved?", max_tokens=2, evidence=3)
        assert status == 200, body
        got = json.loads(body)
        assert got["choices"][0]["message"]["content"] == want.text
        evidence = got["edgekv"]["evidence"]
        assert [item["pair"] for item in evidence] == list(want.evidence)  # most attended first
        for item in evidence:
            assert item["t"] == times[item["pair"]]
            assert item["unix"] == pytest.approx(session.wall_time(item["t"]), abs=1e-6)
            seen = dt.datetime.fromisoformat(item["seen"])
            assert seen.tzinfo is not None and seen.timestamp() == pytest.approx(item["unix"], abs=1e-3)
            # its frame, while the keyframe ring keeps it (24 pairs seen, the last 32 kept)
            assert item["frame"] == f"/frame.jpg?pair={item['pair']}"
            status, headers, jpeg = call(port, "GET", item["frame"])
            assert status == 200 and headers["content-type"] == "image/jpeg"
            ok, want_jpeg = cv2.imencode(".jpg", daemon.alerts.keyframes.frames[item["pair"]],
                                         [cv2.IMWRITE_JPEG_QUALITY, 85])
            assert jpeg == want_jpeg.tobytes()  # that pair's frame, no other
        for path in ("/frame.jpg?pair=100000", "/frame.jpg?pair=-1"):
            status, _, body = call(port, "GET", path)
            assert status == 404 and error_of(body)["code"] == "frame_not_kept", body
        status, _, body = call(port, "GET", "/frame.jpg?pair=one")
        assert status == 400 and "pair" in error_of(body)["message"], body
        status, _, body = chat(port, "What moved?", max_tokens=2)  # not asked: not given (nor computed)
        assert status == 200 and "evidence" not in json.loads(body)["edgekv"]
        # a window: the evidence is inside it
        ordered = sorted(times.values())
        window = {"from": ordered[3], "to": ordered[6]}
        status, _, body = chat(port, "What moved?", max_tokens=2, evidence=2, window=window)
        assert status == 200, body
        assert all(ordered[3] <= item["t"] <= ordered[6] for item in json.loads(body)["edgekv"]["evidence"])
        # streamed: the same evidence on the last chunk, and only there
        chunks = _streamed(port, {**ASK, "max_tokens": 2, "evidence": 3})
        finishing = [c["choices"][0]["finish_reason"] for c in chunks if "edgekv" in c]
        assert finishing == [got["choices"][0]["finish_reason"]]
        assert chunks[-1]["edgekv"]["evidence"] == evidence
        assert all("edgekv" not in c for c in _streamed(port, {**ASK, "max_tokens": 2}))
        # the CLI prints it under the answer, whole or streamed
        url = f"http://127.0.0.1:{port}"
        def line(item: dict) -> str:
            return (f"  evidence: seen {wall_text(item['unix'])}, stream {item['t']:.1f} s (frame pair {item['pair']}; "
                    f"{url}/frame.jpg?pair={item['pair']})")

        printed = _ask_cli(["What moved?", "--url", url, "--max-new-tokens", "2", "--evidence"]).splitlines()
        assert printed == [want.text, line(evidence[0])]
        printed = _ask_cli(["What moved?", "--url", url, "--max-new-tokens", "2", "--evidence", "3", "--stream"])
        assert printed.splitlines()[-3:] == [line(item) for item in evidence]
        assert "evidence" not in _ask_cli(["What moved?", "--url", url, "--max-new-tokens", "2"])
        # --frames DIR: each evidence frame still kept saved there, named by its pair, the same bytes as served
        folder = tmp_path / "frames" / "new"
        printed = _ask_cli(["What moved?", "--url", url, "--max-new-tokens", "2", "--evidence", "3", "--frames",
                            str(folder)]).splitlines()
        files = [folder / f"pair{item['pair']}.jpg" for item in evidence]
        assert printed == [want.text, *[line(item) for item in evidence],
                           *[f"  frame of pair {item['pair']} saved: {path}" for item, path in zip(evidence, files)]]
        assert [path.read_bytes() for path in files] == [call(port, "GET", item["frame"])[2] for item in evidence]
        one = json.loads(_ask_cli(["What moved?", "--url", url, "--max-new-tokens", "2", "--json", "--frames",
                                   str(tmp_path / "one")]))  # --frames alone asks for one pair's evidence
        (item,) = one["edgekv"]["evidence"]
        assert item["frame_file"] == str(tmp_path / "one" / f"pair{item['pair']}.jpg")
        assert item["pair"] == want.evidence[0]
        from edgekv.apps.cli import main

        with contextlib.redirect_stderr(io.StringIO()) as said:
            assert main(["ask", "What moved?", "--url", url, "--evidence", "9"]) == 2
        assert "HTTP 400" in said.getvalue() and "evidence" in said.getvalue()


def test_a_recording_has_evidence_in_stream_time_only(tiny_checkpoint, tmp_path):
    """... and a frame older than the keyframe ring's last pairs is not linked (nor served): its time still is."""
    pytest.importorskip("fastapi")
    from helpers_server import call, chat

    with ended_daemon(_config(tiny_checkpoint, keyframe_pairs=2), tmp_path / "out.txt", realtime=False) as daemon:
        port, session = daemon.server.port, daemon.session
        status, _, body = chat(port, "What moved?", max_tokens=2, evidence=8)
        assert status == 200, body
        evidence = json.loads(body)["edgekv"]["evidence"]
        item = evidence[0]
        assert item["t"] == session.pair_times[item["pair"]] and item["unix"] is None and item["seen"] is None
        last_two = sorted(session.pair_times)[-2:]
        assert len(evidence) == 8 and list(daemon.alerts.keyframes.frames) == last_two
        for each in evidence:
            assert (each["frame"] is not None) == (each["pair"] in last_two)
            assert call(port, "GET", f"/frame.jpg?pair={each['pair']}")[0] == (200 if each["frame"] else 404)
        printed = _ask_cli(["What moved?", "--url", f"http://127.0.0.1:{port}", "--max-new-tokens", "2",
                            "--evidence", "8"])
        (item,) = [each for each in evidence if each["frame"] is None][:1]  # not kept: a time, no address
        assert f"  evidence: stream {item['t']:.1f} s (frame pair {item['pair']})" in printed.splitlines()


def test_the_fleet_refuses_evidence_it_always_gives():
    from edgekv.apps.cli import main

    with contextlib.redirect_stderr(io.StringIO()) as said:
        assert main(["ask", "--fleet", "What moved?", "--broker", "mqtt://127.0.0.1:1", "--evidence"]) == 2
    assert "--evidence: only without --fleet" in said.getvalue()


def test_evidence_frames_on_disk_outlive_the_ring_and_a_restart(tiny_checkpoint, tmp_path):
    """``archive.frames_mib``: a pair long gone from the keyframe ring (2 kept) is still shown for an answer's
    evidence, from disk, and after the daemon restarts from its snapshot (the same stream: the same pairs)."""
    pytest.importorskip("fastapi")
    from helpers_server import call, chat

    config = _config(tiny_checkpoint, keyframe_pairs=2).with_overrides(
        archive={"dir": str(tmp_path / "archive"), "when_full": "wait", "segment_mib": 0.25, "max_gib": 0.01,
                 "frames_mib": 1, "frames_px": 48},
        state={"dir": str(tmp_path / "state"), "every_s": 3600})
    with ended_daemon(config, tmp_path / "out.txt", realtime=False) as daemon:
        port = daemon.server.port
        assert daemon.frames.flush()
        held = sorted(daemon.session.pair_times)
        old = held[0]
        assert old not in daemon.alerts.keyframes.frames and len(held) == 24
        status, _, first = call(port, "GET", f"/frame.jpg?pair={old}")
        assert status == 200 and cv2.imdecode(np.frombuffer(first, np.uint8), cv2.IMREAD_COLOR).shape == (36, 48, 3)
        status, _, body = chat(port, "What moved?", max_tokens=2, evidence=8)
        assert status == 200 and all(item["frame"] for item in json.loads(body)["edgekv"]["evidence"])  # all on disk
        assert daemon.status()["frames"]["frames_kept"] == 24
        # how far back it remembers: the cache its own oldest pair, the archive and the pictures the stream's first
        reach = daemon.status()["reach"]
        assert reach["newest_t"] == max(daemon.session.pair_times.values()) and reach["archive_t"] == 0.0
        assert reach["cache_t"] == min(daemon.session.pair_times.values()) and reach["frames_t"] == 0.0
        assert reach["newest_unix"] is None  # a recording read as fast as it goes: no wall times
        if importlib.util.find_spec("prometheus_client") is not None:  # /metrics counts them
            metrics = call(port, "GET", "/metrics")[2].decode()
            assert "edgekv_evidence_frames_kept 24.0" in metrics
            assert "edgekv_evidence_frames_written_total 24.0" in metrics
            size = [line for line in metrics.splitlines() if line.startswith("edgekv_evidence_frames_file_bytes ")]
            assert size and 0 < float(size[0].split()[-1]) <= 2**20
        stream = daemon._frame_stream()
    # a stop past its budget (a loaded machine) closes the frames and the archive after run() returned: the restart
    # below found the archive folder still held and never started
    assert let_go(daemon)
    assert "evidence frames:" in (tmp_path / "out.txt").read_text()
    # pairs seen after the snapshot and before a kill -9: their frames went in, their archive records did not
    from edgekv.apps.daemon.frame_store import FrameStore

    after = np.full((36, 48, 3), 255, np.uint8)
    with FrameStore(tmp_path / "archive", max_bytes=2**20, px=48) as store:
        for pair in (len(held), len(held) + 1):
            assert store.submit(stream, pair, 100.0 + pair, None, after)
        assert store.flush()
        kept_after = store.jpeg(stream, len(held))
    # another recording after it (the one read to its end is not read again at a restart)
    config = config.with_overrides(video={"source": config.video.source + "&seed=1"})
    with ended_daemon(config, tmp_path / "out2.txt", realtime=False) as daemon:  # restored: the same stream, on
        assert "resumed 6 s of memory" in (tmp_path / "out2.txt").read_text()
        status, _, again = call(daemon.server.port, "GET", f"/frame.jpg?pair={old}")
        assert status == 200 and again == first
        # the new pairs are numbered after those (the first took number 24 again, and pair 24's frame was its own)
        assert min(p for p in daemon.session.pair_times if p >= len(held)) == len(held) + 2
        assert call(daemon.server.port, "GET", f"/frame.jpg?pair={len(held)}")[2] == kept_after


def test_the_cli_prints_a_hostile_daemons_evidence_safely():
    from edgekv.apps.ask import evidence_lines

    lines = evidence_lines({"evidence": [{"pair": 1, "t": 2.0, "unix": 1e300, "frame": "/frame.jpg?pair=1\x1b[31m"},
                                         "not an item", {"pair": "\n", "t": None, "unix": float("nan")}]}, "http://h")
    assert lines == ["  evidence: stream 2.0 s (frame pair 1; http://h/frame.jpg?pair=1\\x1b[31m)",
                     "  evidence: stream time unknown (frame pair \\n)"]  # escaped, no time it cannot show
    assert evidence_lines({"evidence": []}) == [
        "  evidence: none (no frame pair of the stream was read for this answer)"]
    from edgekv.apps.ask import save_evidence_frames

    hostile = {"evidence": [{"pair": "../../x", "frame": None}, {"pair": 2, "frame": "http://elsewhere/x.jpg"}, 7]}
    assert save_evidence_frames("http://h", None, hostile, "/nonexistent", 1.0) == [
        "  frame of pair unknown: no longer kept by the daemon, not saved",  # no path from the daemon's text
        "  frame of pair 2: no longer kept by the daemon, not saved"]  # only the daemon's own /frame.jpg is fetched
    assert hostile["evidence"][0]["frame_file"] is None
    assert save_evidence_frames("http://h", None, hostile, None, 1) == []
    assert evidence_lines(None) == evidence_lines({"evidence": "x"}) == evidence_lines([1]) == []
