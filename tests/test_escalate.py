"""Escalation (issue 30 §3): a question sent with ``"escalate": true`` is answered by a second edgekv server —
a real OpenAI-compatible server on loopback, standing in for the big model, that takes images
(``server.image_requests``) — from the keyframes the local answer attended most; the second server stopped ->
the local answer with the reason; the confidence threshold decides by itself when asked nothing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from edgekv.config import EdgeKVConfig

pytest.importorskip("fastapi")
LOCAL = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # a purple triangle at pair 60
REMOTE = "synthetic:events?size=112x112&fps=2&frames=100000&seed=7&rate=0.05&noise=3"


def _config(source: str, **sections) -> EdgeKVConfig:
    base = dict(model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
                video={"source": source, "fps": 2.0, "resolution": [112, 112]},
                cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
                generation={"max_new_tokens": 4}, monitor={"backend": "cpu"})
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return EdgeKVConfig().with_overrides(**base)


def _ask(port: int, question: str, **fields) -> dict:
    from helpers_server import call

    status, _, raw = call(port, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": question}], "max_tokens": 4, **fields})
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.slow
def test_escalation_to_a_second_server_by_request_by_confidence_and_when_it_is_gone(tmp_path):
    from helpers_server import RunningDaemon, ended_daemon

    remote_config = _config(REMOTE, server={"port": 0, "image_requests": True, "max_request_bytes": 4 * 2**20,
                                            "served_model_name": ["big-model"]})
    remote = RunningDaemon(remote_config, tmp_path / "remote.txt").__enter__()
    try:
        local_config = _config(LOCAL, server={"port": 0},
                               escalate={"url": f"{remote.base}/v1", "model": "big-model", "keyframes": 4,
                                         "timeout_s": 120})
        with ended_daemon(local_config, tmp_path / "local.txt") as local:  # all 80 pairs in, the triangle among them
            port = local.server.port

            plain = _ask(port, "Which shape was purple?", escalate=False)
            assert plain["edgekv"]["escalated"] is False and plain["model"] != "big-model"
            assert plain["choices"][0]["message"]["content"].strip() == "triangle"

            asked = _ask(port, "Which shape was purple?", escalate=True)
            ext = asked["edgekv"]
            assert ext["escalated"] is True and ext["escalated_model"] == "big-model" and asked["model"] == "big-model"
            assert ext["escalation_note"] == "asked"
            # the remote saw only the keyframes: the pair with the triangle was among those sent
            assert 60 in ext["evidence_pairs"]
            assert asked["choices"][0]["message"]["content"].strip() == "triangle"
            assert remote.daemon.image_session.counters.frame_pairs >= 1  # answered about the images, not its stream
            assert local.escalator.sent == 1

            # confidence alone: escalated exactly when the local answer is less sure than the threshold
            questions = ["Which shape was purple?", "What color was the cross?", "Was there a red square?",
                         "How many times did the circle appear?"]
            confidence = {q: _ask(port, q, escalate=False)["edgekv"]["confidence"] for q in questions}
            threshold = sorted(confidence.values())[len(questions) // 2]
            local.escalator.section = dataclasses.replace(local.escalator.section, confidence_below=threshold)
            outcomes = []
            for q in questions:
                ext = _ask(port, q)["edgekv"]
                assert ext["escalated"] is (confidence[q] < threshold), (q, confidence[q], threshold)
                outcomes.append(ext["escalated"])
            assert True in outcomes and False in outcomes, confidence  # the threshold split them

            remote.stop()
            gone = _ask(port, "Which shape was purple?", escalate=True)
            ext = gone["edgekv"]
            assert ext["escalated"] is False and "escalation failed" in ext["escalation_note"]
            assert gone["choices"][0]["message"]["content"].strip() == "triangle"  # the local answer stands
    finally:
        remote.__exit__(None, None, None)


def test_a_server_without_image_requests_refuses_images(tiny_checkpoint, tmp_path):
    from helpers_server import RunningDaemon, call, server_config

    part = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}
    with RunningDaemon(server_config(tiny_checkpoint), tmp_path / "out.txt") as run:
        status, _, raw = call(run.port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}]})
        assert status == 400
        error = json.loads(raw)["error"]
        assert error["code"] == "unsupported_content" and error["param"] == "messages[0].content[1]"
        status, _, raw = call(run.port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": [
                                  {"type": "image_url", "image_url": {"url": "https://example.com/x.jpg"}}]}]})
        assert status == 400


def test_a_request_image_is_sized_from_its_header_before_it_is_decoded(tiny_checkpoint, tmp_path):
    """A server that takes images (and a raised server.max_request_bytes, as they need) decoded whatever came: a
    2.6 MB PNG of zeros declaring 30,000 x 30,000 is 2.7 GB decoded, enough to kill the daemon on an 8 GB board and
    its memory with it. Now the header is read first: over 4096 x 4096, or not a JPEG or PNG (OpenCV would decode
    any of its formats), is a 400 naming the part; the images a user sends are answered as before."""
    import base64
    import struct
    import zlib

    import cv2
    import numpy as np
    from helpers_server import RunningDaemon, call, server_config

    from edgekv.video.image_header import image_size

    def png_header(width, height):  # the signature and IHDR of a PNG that declares this size (no pixels follow)
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))

    frame = np.full((90, 160, 3), 128, np.uint8)
    encoded = {ext: cv2.imencode(ext, frame, params)[1].tobytes()
               for ext, params in ((".jpg", []), (".png", []), (".bmp", []))}
    progressive = cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    assert image_size(encoded[".jpg"]) == image_size(encoded[".png"]) == image_size(progressive) == (160, 90)
    assert image_size(encoded[".bmp"]) is None and image_size(b"\xff\xd8\xff") is None and image_size(b"") is None
    assert image_size(png_header(30000, 30000)) == (30000, 30000)

    def part(data, kind="png"):
        return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{base64.b64encode(data).decode()}"}}

    config = server_config(tiny_checkpoint).with_overrides(server={"image_requests": True,
                                                                   "max_request_bytes": 4 * 2**20})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        def ask(image):
            return call(run.port, "POST", "/v1/chat/completions", {"max_tokens": 2, "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}]})

        for image, message in ((part(png_header(30000, 30000) + bytes(1000)), "a 30000 x 30000 image; at most 16.8 "
                                                                              "megapixels are decoded"),
                               (part(encoded[".bmp"], "bmp"), "not a JPEG, PNG, WebP or GIF")):
            status, _, raw = ask(image)
            assert status == 400, raw
            error = json.loads(raw)["error"]
            assert message in error["message"] and error["param"] == "messages[0].content[0]", error
        for data, kind in ((encoded[".jpg"], "jpeg"), (encoded[".png"], "png"), (progressive, "jpeg")):
            status, _, raw = ask(part(data, kind))
            assert status == 200, raw
