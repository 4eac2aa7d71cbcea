"""ROS 2 camera messages -> frames (edgekv/video/ros_images.py): every encoding against an independent
reference (the fourcc byte orders, OpenCV's own conversions), padded rows, compressed images, the errors
that name what is wrong, and the stamp clock (exact times, bounded gaps on jumps)."""

from __future__ import annotations

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")
pytest.importorskip("rosbags", reason="rosbags is not installed (pip install 'edgekv[ros2]')")

from edgekv.video.ros_images import (  # noqa: E402
    COMPRESSED,
    IMAGE,
    StampClock,
    decode_cdr,
    frame_from_message,
    stamp_ns,
    typestore,
)
from edgekv.video.rosbag import encode_message  # noqa: E402
from edgekv.video.sources import CorruptFrame, open_source  # noqa: E402


@pytest.fixture(scope="module")
def frame() -> np.ndarray:
    frame, _ = next(iter(open_source("synthetic:events?size=112x112&fps=2&frames=4&seed=2")))
    return frame


def _image(data: np.ndarray, encoding: str, step: int | None = None, height: int | None = None,
           width: int | None = None, bigendian: int = 0):
    store = typestore()
    T, H = store.types["builtin_interfaces/msg/Time"], store.types["std_msgs/msg/Header"]
    return store.types[IMAGE](header=H(stamp=T(sec=5, nanosec=250), frame_id="cam"), height=height or data.shape[0],
                              width=width or data.shape[1], encoding=encoding, is_bigendian=bigendian,
                              step=step or data.strides[0], data=np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def _header():
    store = typestore()
    return store.types["std_msgs/msg/Header"](stamp=store.types["builtin_interfaces/msg/Time"](sec=1, nanosec=2),
                                              frame_id="cam")


def _roundtrip(message, msgtype: str) -> np.ndarray:
    """Serialized with rosbags, decoded the way the ros2: and rosbag: sources decode what they receive."""
    raw = bytes(typestore().serialize_cdr(message, msgtype))
    return frame_from_message(decode_cdr(raw, msgtype), msgtype)


def test_rgb_bgr_and_alpha_encodings_give_the_frame_back_exactly(frame):
    assert np.array_equal(_roundtrip(_image(frame, "bgr8"), IMAGE), frame)
    assert np.array_equal(_roundtrip(_image(frame[:, :, ::-1], "rgb8"), IMAGE), frame)
    assert np.array_equal(_roundtrip(_image(frame[:, :, ::-1], "RGB8"), IMAGE), frame)  # case is not meaning
    alpha = np.full(frame.shape[:2] + (1,), 7, np.uint8)
    assert np.array_equal(_roundtrip(_image(np.concatenate([frame, alpha], 2), "bgra8"), IMAGE), frame)
    assert np.array_equal(_roundtrip(_image(np.concatenate([frame[:, :, ::-1], alpha], 2), "rgba8"), IMAGE), frame)


def test_padded_rows_are_cut_to_the_width(frame):
    padded = np.zeros((112, 112 * 3 + 16), np.uint8)
    padded[:, :336] = frame.reshape(112, 336)
    decoded = _roundtrip(_image(padded, "bgr8", step=352, width=112), IMAGE)
    assert np.array_equal(decoded, frame)


def test_mono_encodings_repeat_grey_in_every_channel(frame):
    grey = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    decoded = _roundtrip(_image(grey, "mono8"), IMAGE)
    assert decoded.shape == (112, 112, 3) and all(np.array_equal(decoded[:, :, c], grey) for c in range(3))
    wide = grey.astype(np.uint16) * 256 + 99  # the high byte carries the grey level
    assert np.array_equal(_roundtrip(_image(wide.astype("<u2"), "mono16"), IMAGE)[:, :, 0], grey)
    assert np.array_equal(_roundtrip(_image(wide.astype(">u2"), "mono16", bigendian=1), IMAGE)[:, :, 1], grey)


# the colour each letter of a Bayer pattern name samples, as image_encodings.hpp's names read (top-left 2x2 block,
# row by row): BGR channel indices
_BAYER_CHANNEL = {"b": 0, "g": 1, "r": 2}


def _mosaic(bgr: np.ndarray, pattern: str) -> np.ndarray:
    """A raw Bayer frame sampled from ``bgr`` by hand: pixel (y, x) keeps the channel its place in the pattern names."""
    out = np.empty(bgr.shape[:2], bgr.dtype)
    for index, letter in enumerate(pattern):
        dy, dx = divmod(index, 2)
        out[dy::2, dx::2] = bgr[dy::2, dx::2, _BAYER_CHANNEL[letter]]
    return out


@pytest.mark.parametrize("pattern", ["rggb", "bggr", "gbrg", "grbg"])
def test_bayer_mosaics_are_demosaiced_in_the_pattern_their_encoding_names(frame, pattern):
    """A flat colour sampled through each pattern comes back that colour (a pattern read as another swaps red and
    blue or mixes green in); a smooth scene comes back close to itself; the 16-bit twins (either byte order) read
    as their high bytes."""
    flat = np.zeros((16, 16, 3), np.uint8)
    flat[:] = (30, 120, 220)  # B, G, R
    decoded = _roundtrip(_image(_mosaic(flat, pattern), f"bayer_{pattern}8"), IMAGE)
    assert np.abs(decoded[2:-2, 2:-2].astype(int) - (30, 120, 220)).max() <= 1, (pattern, decoded[8, 8])
    for other in {"rggb", "bggr", "gbrg", "grbg"} - {pattern}:
        misread = _roundtrip(_image(_mosaic(flat, pattern), f"bayer_{other}8"), IMAGE)
        assert np.abs(misread[2:-2, 2:-2].astype(int) - (30, 120, 220)).max() > 40, (pattern, other)
    smooth = cv2.GaussianBlur(frame, (9, 9), 3)
    back = _roundtrip(_image(_mosaic(smooth, pattern), f"bayer_{pattern}8"), IMAGE)
    assert np.abs(back[4:-4, 4:-4].astype(int) - smooth[4:-4, 4:-4]).mean() < 3.0
    wide = _mosaic(smooth, pattern).astype(np.uint16) * 256 + 77
    for order, big in (("<u2", 0), (">u2", 1)):
        sixteen = _roundtrip(_image(wide.astype(order), f"bayer_{pattern}16", bigendian=big), IMAGE)
        assert np.array_equal(sixteen, back), order


def test_sixteen_bit_colour_encodings_read_their_high_bytes_in_either_byte_order(frame):
    wide = frame.astype(np.uint16) * 256 + 201  # the high byte carries the level
    alpha = np.full(frame.shape[:2] + (1,), 65535, np.uint16)
    for encoding, pixels in (("bgr16", wide), ("rgb16", wide[:, :, ::-1]),
                             ("bgra16", np.concatenate([wide, alpha], 2)),
                             ("rgba16", np.concatenate([wide[:, :, ::-1], alpha], 2))):
        for order, big in (("<u2", 0), (">u2", 1)):
            data = np.ascontiguousarray(pixels).astype(order)
            assert np.array_equal(_roundtrip(_image(data, encoding, bigendian=big), IMAGE), frame), (encoding, order)
    with_alpha = np.concatenate([frame, np.full(frame.shape[:2] + (1,), 9, np.uint8)], 2)
    assert np.array_equal(_roundtrip(_image(with_alpha, "8UC4"), IMAGE), frame)


def _planes_420(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y (h x w), U and V (h/2 x w/2) of ``frame`` by OpenCV's I420 conversion (three separate planes)."""
    h, w = frame.shape[:2]
    i420 = cv2.cvtColor(frame, cv2.COLOR_BGR2YUV_I420).reshape(-1)
    y = i420[:h * w].reshape(h, w)
    u = i420[h * w:h * w + h * w // 4].reshape(h // 2, w // 2)
    v = i420[h * w + h * w // 4:].reshape(h // 2, w // 2)
    return y, u, v


def test_nv12_nv21_and_nv24_read_as_the_v4l2_pixel_formats_lay_them_out(frame):
    """Built by hand from three separate planes (V4L2's pixfmt-yuv-planar: NV12 interleaves U,V after the Y plane,
    NV21 V,U; NV24 the same at full resolution), padded rows too; read against OpenCV's conversion of the same
    planes laid out as I420 (three planes), which shares none of the two-plane code."""
    h, w = frame.shape[:2]
    y, u, v = _planes_420(frame)
    reference = cv2.cvtColor(np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)]).reshape(h * 3 // 2, w),
                             cv2.COLOR_YUV2BGR_I420)
    for encoding, first, second in (("nv12", u, v), ("nv21", v, u)):
        chroma = np.stack([first, second], axis=2).reshape(h // 2, w)
        for step in (w, w + 16):
            pad = np.full((h * 3 // 2, step - w), 255, np.uint8)
            data = np.concatenate([np.concatenate([y, chroma]), pad], axis=1)
            decoded = _roundtrip(_image(data, encoding, step=step, height=h, width=w), IMAGE)
            assert np.array_equal(decoded, reference), (encoding, step)
    full_u, full_v = (np.repeat(np.repeat(plane, 2, 0), 2, 1) for plane in (u, v))  # 4:4:4 of the same samples
    nv24 = np.concatenate([y.reshape(-1), np.stack([full_u, full_v], 2).reshape(-1)]).reshape(3 * h, w)
    decoded = _roundtrip(_image(nv24, "nv24", step=w, height=h, width=w), IMAGE)
    assert np.abs(decoded.astype(int) - reference).max() <= 2  # fixed point (OpenCV) against float (NV24)
    grey = np.array([[50, 128, 128]], np.uint8)  # Y = 50, then U, V neutral: BT.601 limited range grey 40
    assert np.array_equal(_roundtrip(_image(grey, "nv24", step=1, height=1, width=1), IMAGE)[0, 0],
                          [round(255 / 219 * (50 - 16))] * 3)


def test_yuv422_is_uyvy_and_yuv422_yuy2_is_yuyv_as_image_encodings_hpp_says():
    """Built by hand from the fourcc definitions: one pixel pair with luma 50 and 200, neutral chroma 128.
    UYVY stores U Y0 V Y1, YUYV stores Y0 U Y1 V. Grey levels by ITU-R BT.601's limited range (what V4L2
    cameras send): 255 / 219 x (Y - 16) = 40 and 214. Read in the other byte order the pair comes out wrong."""
    uyvy = np.array([[[128, 50], [128, 200]]], np.uint8)  # U Y0 | V Y1
    yuyv = np.array([[[50, 128], [200, 128]]], np.uint8)  # Y0 U | Y1 V
    grey = [round(255 / 219 * (50 - 16)), round(255 / 219 * (200 - 16))]
    for encoding, data in (("yuv422", uyvy), ("uyvy", uyvy), ("yuv422_yuy2", yuyv), ("yuyv", yuyv)):
        decoded = _roundtrip(_image(data, encoding, step=4, width=2, height=1), IMAGE).astype(int)
        assert abs(decoded[0, 0] - grey[0]).max() <= 1 and abs(decoded[0, 1] - grey[1]).max() <= 1, (encoding, decoded)
    wrong = _roundtrip(_image(uyvy, "yuv422_yuy2", step=4, width=2, height=1), IMAGE).astype(int)
    assert abs(wrong[0, 0] - grey[0]).max() > 40


def test_yuv422_frames_round_trip_within_chroma_subsampling(frame):
    for encoding in ("yuv422", "yuv422_yuy2"):
        kind, message = encode_message(frame, encoding, stamp=1)
        decoded = _roundtrip(message, kind).astype(int)
        assert np.abs(decoded - frame).mean() < 3.0, encoding  # 4:2:2 halves the chroma, nothing else


def test_compressed_jpeg_and_png_and_image_transport_formats(frame):
    store = typestore()
    png = cv2.imencode(".png", frame)[1].reshape(-1)
    jpeg = cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].reshape(-1)
    reference = cv2.imdecode(jpeg, cv2.IMREAD_COLOR)
    for fmt, data, expected in (("png", png, frame), ("jpeg", jpeg, reference), ("", jpeg, reference),
                                ("bgr8; jpeg compressed bgr8", jpeg, reference), ("rgb8; png compressed bgr8", png, frame)):
        message = store.types[COMPRESSED](header=_header(), format=fmt, data=data)
        assert np.array_equal(_roundtrip(message, COMPRESSED), expected), fmt
    swapped = cv2.imencode(".png", frame[:, :, ::-1])[1].reshape(-1)  # an encoder fed RGB as if it were BGR
    message = store.types[COMPRESSED](header=_header(), format="rgb8; png compressed rgb8", data=swapped)
    assert np.array_equal(_roundtrip(message, COMPRESSED), frame)


@pytest.mark.parametrize("case, message", [
    ("encoding", "encoding '32FC1' is not supported"),
    ("truncated data", "(needs 37632): truncated"),
    ("step", "step 100 is less than width 112 x 3 bytes"),
    ("empty", "an empty image (0x0)"),
    ("odd yuv", "the width 3 is odd"),
    ("odd nv12", "shares a chroma sample among 2x2 pixels, but the image is 4x3 (odd)"),
    ("truncated nv12", "(needs 24): truncated"),
])
def test_bad_images_name_what_is_wrong(frame, case, message):
    if case == "encoding":
        bad = _image(np.zeros((4, 4, 4), np.float32).view(np.uint8).reshape(4, 4, 16), "32FC1", width=4)
    elif case == "truncated data":
        bad = _image(frame[:56], "bgr8", height=112)
    elif case == "step":
        bad = _image(frame, "bgr8", step=100)
    elif case == "empty":
        bad = _image(np.zeros((0, 0, 3), np.uint8), "bgr8", step=0, height=0, width=0)
    elif case == "odd nv12":
        bad = _image(np.zeros((6, 4), np.uint8), "nv12", width=4, height=3)
    elif case == "truncated nv12":
        bad = _image(np.zeros((4, 4), np.uint8), "nv12", width=4, height=4)  # the Y plane without its chroma
    else:
        bad = _image(np.zeros((1, 3, 2), np.uint8), "yuv422", step=6, width=3, height=1)
    with pytest.raises(CorruptFrame, match=message.replace("(", r"\(").replace(")", r"\)")):
        _roundtrip(bad, IMAGE)


def test_bad_compressed_images_and_bytes_are_refused(frame):
    store = typestore()
    jpeg = cv2.imencode(".jpg", frame)[1].reshape(-1)
    cases = [("jpeg", jpeg[: jpeg.size // 2], "cut off"), ("png", jpeg, "says png, but the data is a jpeg"),
             ("16UC1; compressedDepth", jpeg, "depth image"), ("webp", jpeg, "not jpeg or png"),
             ("jpeg", np.zeros(0, np.uint8), "no data"), ("jpeg", np.arange(40, dtype=np.uint8), "not a JPEG or PNG")]
    # a PNG declaring 30,000 x 30,000 (2.7 GB decoded), its IEND present: refused from its header, never decoded
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    bomb = (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
            + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))
    cases.append(("png", np.frombuffer(bomb, np.uint8), "the png declares 30000 x 30000, over the 67 megapixels"))
    headless = np.concatenate([jpeg[:2], np.frombuffer(b"\xff\xda\x00\x02", np.uint8), jpeg[2:]])  # scan first
    cases.append(("jpeg", headless, "the jpeg header does not read"))
    for fmt, data, message in cases:
        with pytest.raises(CorruptFrame, match=message):
            _roundtrip(store.types[COMPRESSED](header=_header(), format=fmt, data=data), COMPRESSED)
    raw = bytes(store.serialize_cdr(_image(frame, "bgr8"), IMAGE))
    for cut in (2, 30, len(raw) // 2, len(raw) - 1):  # a message cut anywhere: one clear error, never a crash
        with pytest.raises(CorruptFrame, match="shorter than its CDR header|malformed or truncated"):
            decode_cdr(raw[:cut], IMAGE)
    with pytest.raises(CorruptFrame, match="not plain CDR"):
        decode_cdr(b"\x00\x03" + raw[2:], IMAGE)  # PL_CDR_LE: parameter lists, not a ROS message
    xcdr2 = decode_cdr(b"\x00\x07" + raw[2:], IMAGE)  # PLAIN_CDR2 little-endian: the same layout for this message
    assert np.array_equal(frame_from_message(xcdr2, IMAGE), frame)


def test_stamp_clock_is_exact_and_turns_jumps_into_bounded_gaps():
    clock = StampClock("test", max_step_s=10.0)
    base = 1_700_000_000 * 10**9
    times = [clock(base + k * 100_000_000, arrival_ns=k * 100_000_000) for k in range(31)]
    assert times == [k / 10 for k in range(31)]  # bit-identical to index / fps
    # the stamping clock goes back an hour (a restarted simulator): time goes on by the arrival gap
    assert clock(base - 3600 * 10**9, arrival_ns=3_200_000_000) == pytest.approx(3.2)
    assert clock(base - 3600 * 10**9 + 100_000_000, arrival_ns=3_300_000_000) == pytest.approx(3.3)
    # a day ahead (NTP set the robot's clock) after a 2-minute silence: at most max_step_s of gap
    assert clock(base + 86400 * 10**9, arrival_ns=123_300_000_000) == pytest.approx(13.3)
    assert clock.jumps == 2
    # unset stamps (a driver that never fills the header) are timed by their arrival
    assert clock(None, arrival_ns=123_800_000_000) >= 13.3 and clock.unstamped == 1
    store = typestore()
    T, H = store.types["builtin_interfaces/msg/Time"], store.types["std_msgs/msg/Header"]
    assert stamp_ns(H(stamp=T(sec=0, nanosec=0), frame_id="")) is None
    assert stamp_ns(H(stamp=T(sec=2, nanosec=5), frame_id="")) == 2_000_000_005
