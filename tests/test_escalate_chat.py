"""Escalation as the chat API's user sees it (apps/server/chat.py, apps/daemon/loop.py ``_escalate``): a streamed
escalated answer names the remote's model and says what escalation did, as a whole answer does; a question with its
own images escalates with those images; ``"escalate": true`` on a daemon without an escalation server says so; and a
question's image may be a WebP or a non-animated GIF (apps/server/request_images.py), as OpenAI's API takes."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

from helpers_server import RunningDaemon, call, server_config  # noqa: E402
from helpers_remote import answer_with, chat_body, remote_with  # noqa: E402,F401 (a fixture)

CHAT = chat_body("a red cup. STOP then more")
_answer = answer_with(CHAT)


def _fail(handler, remote) -> None:
    handler.send_response(503)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _events(raw: bytes) -> list[dict]:
    lines = [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def _ask(port: int, content, **fields) -> tuple[int, bytes]:
    status, _, raw = call(port, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields},
                          timeout=300)
    return status, raw


def _config(tiny_checkpoint, url: str | None, **server):
    config = server_config(tiny_checkpoint, request_timeout_s=60.0, **server)
    return config.with_overrides(escalate={"url": url, "model": "big", "timeout_s": 120, "keyframes": 1})


def test_a_streamed_escalated_answer_names_the_remote_s_model_and_says_it_was_escalated(tiny_checkpoint, tmp_path,
                                                                                        remote_with):
    """A streamed answer (``"stream": true, "escalate": true``) carried the remote's text under the local model's
    name, and no word of the escalation; the whole answer said both. Now each chunk names the remote's model and the
    last carries ``edgekv`` (escalated, the note), and a stop string cuts the remote's text the same in both."""
    remote = remote_with(_answer)
    with RunningDaemon(_config(tiny_checkpoint, remote.url), tmp_path / "out.txt") as run:
        status, raw = _ask(run.port, "What is on the table?", escalate=True)
        assert status == 200, raw
        whole = json.loads(raw)
        status, raw = _ask(run.port, "What is on the table?", escalate=True, stream=True,
                           stream_options={"include_usage": True})
        assert status == 200, raw
        events = _events(raw)
        status, raw = _ask(run.port, "What is on the table?", escalate=True, stop=["STOP"])
        cut_whole = json.loads(raw)
        status, raw = _ask(run.port, "What is on the table?", escalate=True, stop=["STOP"], stream=True)
        cut_events = _events(raw)
    assert whole["model"] == "big" and whole["edgekv"]["escalated"] is True
    assert whole["choices"][0]["message"]["content"] == "a red cup. STOP then more"
    assert {event["model"] for event in events} == {"big"}
    text = "".join(event["choices"][0]["delta"].get("content", "") for event in events if event["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    last = [event for event in events if event["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["edgekv"]["escalated"] is True and last["edgekv"]["escalated_model"] == "big"
    assert last["edgekv"]["escalation_note"] == whole["edgekv"]["escalation_note"] == "asked"
    assert cut_whole["choices"][0]["message"]["content"] == "a red cup. "
    cut_text = "".join(event["choices"][0]["delta"].get("content", "") for event in cut_events if event["choices"])
    assert cut_text == "a red cup. " and {event["model"] for event in cut_events} == {"big"}


def test_a_streamed_answer_whose_escalation_failed_says_why(tiny_checkpoint, tmp_path, remote_with):
    remote = remote_with(_fail)
    with RunningDaemon(_config(tiny_checkpoint, remote.url), tmp_path / "out.txt") as run:
        status, raw = _ask(run.port, "What is on the table?", escalate=True, stream=True)
    assert status == 200, raw
    events = _events(raw)
    last = events[-1]
    assert last["edgekv"]["escalated"] is False and "HTTP 503" in last["edgekv"]["escalation_note"]
    (model,) = {event["model"] for event in events}
    assert model != "big"  # the local model's answer, under its name


@pytest.mark.parametrize("stream", [False, True])
def test_escalate_true_without_an_escalation_server_says_so(tiny_checkpoint, tmp_path, stream):
    """``"escalate": true`` on a daemon with no ``escalate.url`` was answered locally with nothing saying the
    escalation asked for never happened."""
    with RunningDaemon(_config(tiny_checkpoint, None), tmp_path / "out.txt") as run:
        status, raw = _ask(run.port, "What is on the table?", escalate=True, stream=stream)
    assert status == 200, raw
    ext = _events(raw)[-1]["edgekv"] if stream else json.loads(raw)["edgekv"]
    assert ext["escalated"] is False
    assert ext["escalation_note"] == "not escalated: this daemon has no escalation server (escalate.url is null)"


def _image(kind: str, rgba: np.ndarray, **save) -> dict:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, kind, **save)
    data = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind.lower()};base64,{data}", "detail": "low"}}


def _picture() -> np.ndarray:
    """rgba: [64, 96, 4]: a red square, the rest transparent black."""
    rgba = np.zeros((64, 96, 4), np.uint8)
    rgba[16:48, 24:72] = (220, 30, 30, 255)
    return rgba


def test_a_question_with_images_escalates_with_those_images(tiny_checkpoint, tmp_path, remote_with):
    """A question with its own images and ``"escalate": true`` was answered locally, never escalated, and nothing
    said so. The images are what it asks about: they go to the remote (all of them, whatever escalate.keyframes
    bounds the camera's frames to), and no frame of the camera with them."""
    remote = remote_with(_answer)
    config = _config(tiny_checkpoint, remote.url, image_requests=True, max_request_bytes=4 * 2**20)
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        status, raw = _ask(run.port, [{"type": "text", "text": "What is red?"}, _image("PNG", _picture()),
                                      _image("WEBP", _picture(), lossless=True)], escalate=True)
    assert status == 200, raw
    body = json.loads(raw)
    assert body["model"] == "big" and body["edgekv"]["escalated"] is True
    (sent,) = remote.bodies
    parts = sent["messages"][-1]["content"]
    assert [part["type"] for part in parts] == ["text", "image_url", "image_url"]  # keyframes: 1 bounds the camera
    assert parts[0]["text"] == "What is red?"
    assert all(part["image_url"]["url"].startswith("data:image/png;base64,") for part in parts[1:])


def test_webp_and_still_gif_are_answered_and_an_animated_gif_is_refused(tiny_checkpoint, tmp_path):
    """WebP and GIF images were refused ("not a JPEG or PNG"); OpenAI's API takes both (a GIF not animated)."""
    from PIL import Image

    frames = [Image.fromarray(_picture(), "RGBA"), Image.fromarray(np.roll(_picture(), 5, axis=1), "RGBA")]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    animated = {"type": "image_url", "image_url": {
        "url": "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()}}
    config = server_config(tiny_checkpoint, request_timeout_s=60.0, image_requests=True, max_request_bytes=2**20)
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        outcomes = {name: _ask(run.port, [_image(kind, _picture(), **save), {"type": "text", "text": "What is red?"}])
                    for name, kind, save in (("webp", "WEBP", {"quality": 80}), ("gif", "GIF", {}))}
        refused = _ask(run.port, [{"type": "text", "text": "What is red?"}, animated])
        assert run.daemon.image_session.counters.frame_pairs >= 1
    for name, (status, raw) in outcomes.items():
        assert status == 200, (name, raw)
    status, raw = refused
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == "messages[0].content[1]" and "an animated GIF (2 frames)" in error["message"]


@pytest.mark.parametrize("kind, save", [("WEBP", {"lossless": True}), ("GIF", {})])
def test_a_webp_or_gif_s_transparency_is_white_as_the_processor_sees_it(kind, save):
    """OpenCV's decode would drop a WebP's alpha and keep the black under it; the image goes on as an opaque PNG,
    composited onto white as the processor's convert_to_rgb does."""
    import cv2
    from PIL import Image

    from edgekv.apps.server.request_images import opaque, pillow_image_size

    buffer = io.BytesIO()
    Image.fromarray(_picture(), "RGBA").save(buffer, kind, **save)
    data = buffer.getvalue()
    assert pillow_image_size(data) == (96, 64)
    out = opaque(data)
    assert out[:8] == b"\x89PNG\r\n\x1a\n"
    bgr = cv2.imdecode(np.frombuffer(out, np.uint8), cv2.IMREAD_UNCHANGED)
    assert bgr.shape == (64, 96, 3)
    assert (bgr[0, 0] == 255).all() and (bgr[63, 95] == 255).all()  # transparent: white, not black
    assert abs(int(bgr[32, 48, 2]) - 220) <= 8 and bgr[32, 48, 0] < 60  # the red square (BGR), a GIF's palette near
    with pytest.raises(ValueError, match=f"a {'GIF' if kind == 'GIF' else 'WebP'} image Pillow cannot"):
        opaque(data[: len(data) // 2])
