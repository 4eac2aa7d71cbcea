"""A question's own images escalate with the ``detail`` each came with (OpenAI ``image_url.detail``: low, high,
auto): it changes nothing on the device (every image is one frame pair at video.resolution), but a big server spends
its vision tokens by it — a "low" image a fraction of a "high" one. It was dropped on the way (apps/questions.py
``Question.image_details``, apps/server/openai_chat.py, apps/server/chat.py, apps/outputs/escalate.py)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

from helpers_server import RunningDaemon, call, server_config  # noqa: E402
from helpers_remote import Remote, answer_with, chat_body  # noqa: E402

CHAT = chat_body("a red cup")
_answer = answer_with(CHAT)


def _png() -> bytes:
    from PIL import Image

    rgb = np.zeros((32, 48, 3), np.uint8)  # rgb: [32, 48, 3]
    rgb[8:24, 12:36] = (220, 30, 30)
    buffer = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _part(detail: str | None) -> dict:
    url = {"url": "data:image/png;base64," + base64.b64encode(_png()).decode()}
    return {"type": "image_url", "image_url": url if detail is None else {**url, "detail": detail}}


def test_the_chat_request_keeps_each_image_s_detail_in_order():
    from edgekv.apps.server.openai_chat import ChatLimits, parse_chat_request

    limits = ChatLimits(("edgekv",), 64, 16, images=True)
    content = [{"type": "text", "text": "What is red?"}, _part("high"), _part(None), _part("low"), _part("auto")]
    request = parse_chat_request({"messages": [{"role": "user", "content": content}]}, limits)
    assert len(request.images) == 4 and request.image_details == ("high", None, "low", "auto")
    text_only = parse_chat_request({"messages": [{"role": "user", "content": "What is red?"}]}, limits)
    assert text_only.images == () and text_only.image_details == ()


def test_ask_remote_sends_each_image_s_detail_and_none_for_the_camera_s_frames():
    from edgekv.apps.outputs.escalate import Escalator
    from edgekv.config import EscalateSection

    remote = Remote(_answer)
    try:
        escalator = Escalator(EscalateSection(url=remote.url, model="big", timeout_s=60, keyframes=1, proxy="direct"),
                              done=lambda question: None)
        image = _png()
        assert escalator.ask_remote("What is red?", [b"\xff\xd8jpeg"], images=(image, image),
                                    image_details=("low", None)) == ("a red cup", "big")
        assert escalator.ask_remote("What is red?", [b"\xff\xd8jpeg"], images=(image,)) == ("a red cup", "big")
    finally:
        remote.close()
    first, second = ([part["image_url"] for part in body["messages"][-1]["content"][1:]] for body in remote.bodies)
    assert [part.get("detail") for part in first] == ["low", None, None] and "detail" not in first[1]
    assert [url["url"][:22] for url in first] == ["data:image/png;base64,"] * 2 + ["data:image/jpeg;base64"]
    assert [part.get("detail") for part in second] == [None, None]  # none given: none sent (the server's default)


def test_a_question_s_images_escalate_with_their_detail(tiny_checkpoint, tmp_path):
    """Through the chat API: the remote gets each image with the detail it was asked with, in order."""
    remote = Remote(_answer)
    config = server_config(tiny_checkpoint, request_timeout_s=60.0, image_requests=True, max_request_bytes=4 * 2**20)
    config = config.with_overrides(escalate={"url": remote.url, "model": "big", "timeout_s": 120, "keyframes": 1,
                                             "proxy": "direct"})
    try:
        with RunningDaemon(config, tmp_path / "out.txt") as run:
            content = [{"type": "text", "text": "What is red?"}, _part("high"), _part(None), _part("low")]
            status, _, raw = call(run.port, "POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                   "escalate": True}, timeout=300)
    finally:
        remote.close()
    assert status == 200, raw
    assert json.loads(raw)["edgekv"]["escalated"] is True
    (sent,) = remote.bodies
    parts = sent["messages"][-1]["content"]
    assert [part["type"] for part in parts] == ["text", "image_url", "image_url", "image_url"]
    assert [part["image_url"].get("detail") for part in parts[1:]] == ["high", None, "low"]
    assert "detail" not in parts[2]["image_url"]
