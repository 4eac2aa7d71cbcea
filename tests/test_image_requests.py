"""Images in chat requests (``server.image_requests``) as an OpenAI SDK user sends them: what the second session is
fed is what transformers' Qwen2.5-VL processor would be (``load_image``'s ``exif_transpose``, then
``convert_to_rgb``: transparency composited onto white), and ``data:`` URLs are read as a browser reads them."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    from helpers_server import RunningDaemon, server_config

    config = server_config(tiny_checkpoint).with_overrides(server={"image_requests": True,
                                                                   "max_request_bytes": 4 * 2**20})
    with RunningDaemon(config, tmp_path_factory.mktemp("images") / "out.txt") as run:
        yield run


@pytest.fixture
def fed(running, monkeypatch):
    """The frames the image session ingests, in order (one per image: each comes as a pair of equal frames)."""
    session, frames = running.daemon.image_session, []
    real = session.ingest

    def ingest(frame, *args, **kwargs):
        frames.append(frame.copy())
        return real(frame, *args, **kwargs)

    monkeypatch.setattr(session, "ingest", ingest)
    return frames


def _ask(port: int, *urls: str) -> tuple[int, dict]:
    from helpers_server import call

    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    status, _, raw = call(port, "POST", "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is in the picture?"}]}]})
    return status, json.loads(raw)


def _saved(image, kind: str = "PNG", **params) -> bytes:
    out = io.BytesIO()
    image.save(out, kind, **params)
    return out.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _transparent_images() -> dict[str, bytes]:
    """Transparency of each kind a PNG has, over colours a decoder that drops it shows (black, or noise)."""
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (48, 64, 4), dtype=np.uint8)
    rgba[..., 3] = 0
    rgba[12:36, 16:48, 3] = rng.integers(0, 256, (24, 32), dtype=np.uint8)  # a half-seen square, clear around it
    logo = np.zeros((48, 64, 3), np.uint8)
    logo[20:28] = (200, 40, 40)
    exif = Image.Exif()
    exif[0x0112] = 6  # the phone was held upright: shown turned 90 degrees clockwise
    import cv2

    rgba16 = cv2.imencode(".png", rgba[..., [2, 1, 0, 3]].astype(np.uint16) * 257)[1].tobytes()
    return {
        "rgba": _saved(Image.fromarray(rgba, "RGBA")),
        "grey+alpha": _saved(Image.fromarray(np.ascontiguousarray(rgba[..., [0, 3]]), "LA")),
        "palette+tRNS": _saved(Image.fromarray(logo).convert("P"), transparency=0),
        "rgb+tRNS": _saved(Image.fromarray(logo), transparency=(0, 0, 0)),
        "rgba 16-bit": rgba16,
        "rgba turned (eXIf)": _saved(Image.fromarray(rgba, "RGBA"), exif=exif.tobytes()),
    }


@pytest.mark.parametrize("name", list(_transparent_images()))
def test_a_transparent_png_is_seen_on_white_as_the_processor_sees_it(running, fed, name):
    """OpenCV's colour decode dropped the alpha and kept the colour under it: a logo on a transparent background
    reached the model on black (or on whatever the encoder left there), where transformers, vLLM and OpenAI show it
    on white. Now the frame fed is transformers' own RGB of the image, pixel for pixel, upright."""
    from PIL import ImageOps
    transforms = pytest.importorskip("transformers.image_transforms")

    data = _transparent_images()[name]
    status, body = _ask(running.port, _url(data))
    assert status == 200, body
    (frame,) = fed[::2]
    expected = transforms.convert_to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_numpy=True)
    assert frame.shape == expected.shape and np.array_equal(frame[..., ::-1], expected), name


def test_an_image_without_transparency_is_fed_as_it_came(running, fed):
    """A JPEG (never transparent; its EXIF orientation applied, as a phone photo is shown) and an opaque PNG."""
    import cv2

    rng = np.random.default_rng(4)
    photo = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 8
    jpeg = _saved(Image.fromarray(photo), "JPEG", exif=exif.tobytes())
    png = _saved(Image.fromarray(photo))
    status, body = _ask(running.port, _url(jpeg, "image/jpeg"), _url(png))
    assert status == 200, body
    shown, plain = fed[::2]
    assert shown.shape == (40, 30, 3)  # upright
    assert np.array_equal(shown, cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR))
    assert np.array_equal(plain[..., ::-1], photo)


def test_a_data_url_is_read_as_a_browser_reads_it(running, fed):
    """``base64`` on the command line wraps its output at 76 columns, MIME encoders too, and some clients leave the
    padding off: each was refused as "not valid base64" though a browser (WHATWG forgiving-base64) shows it."""
    png = _saved(Image.fromarray(np.full((20, 30, 3), 90, np.uint8)))
    encoded = base64.b64encode(png).decode()
    assert encoded.endswith("=")
    for url in ("data:image/png;base64," + base64.encodebytes(png).decode(),  # 76 columns, newline-terminated
                "data:image/png;base64," + encoded.rstrip("="),
                "DATA:Image/PNG;BASE64," + encoded):
        status, body = _ask(running.port, url)
        assert status == 200, (url[:40], body)
    assert len(fed) == 6
    for url, why in (("data:image/png;base64," + encoded[:-3] + "*" + encoded[-2:], "not valid base64"),
                     ("data:image/png;base64," + encoded[:8] + "-_" + encoded[10:], "not valid base64"),
                     ("https://example.com/cat.png", "only data:image/...;base64, URLs are accepted")):
        status, body = _ask(running.port, url)
        assert status == 400 and why in body["error"]["message"], body
        assert body["error"]["param"] == "messages[0].content[0]"
