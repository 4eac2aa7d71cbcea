"""An RTSP camera for tests/test_rtsp_camera.py: GStreamer's RTSP server (gst-rtsp-server) serving live H.264 at
rtsp://127.0.0.1:PORT/cam, what most IP cameras serve (RTP over RTSP; FFmpeg, through OpenCV, asks for interleaved
TCP).

Run by Debian's /usr/bin/python3 (python3-gi and the GStreamer typelibs are Debian packages the project's own
Python cannot import):

    /usr/bin/python3 tests/rtsp_camera_server.py PORT          # serves until killed; prints "ready PORT"
    /usr/bin/python3 tests/rtsp_camera_server.py --check       # exit 0 if everything needed is here, else 1 and why

Each client gets its own pipeline (a camera's encoder per session is what FFmpeg sees either way), 320x240 at 25 fps,
a key frame every 10 frames so a client that connects mid-stream decodes within a second."""

from __future__ import annotations

import sys

WIDTH, HEIGHT, FPS = 320, 240, 25
PATH = "/cam"
LAUNCH = (f"( videotestsrc is-live=true pattern=smpte ! video/x-raw,width={WIDTH},height={HEIGHT},framerate={FPS}/1 "
          "! videoconvert ! x264enc tune=zerolatency speed-preset=ultrafast key-int-max=10 "
          "! video/x-h264,profile=constrained-baseline ! rtph264pay name=pay0 pt=96 config-interval=1 )")
ELEMENTS = ("videotestsrc", "videoconvert", "x264enc", "rtph264pay")
PACKAGES = ("python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good "
            "gstreamer1.0-plugins-ugly")


def _load():
    """(Gst, GstRtspServer, GLib) or a string saying what is missing."""
    try:
        import gi

        gi.require_version("Gst", "1.0")
        gi.require_version("GstRtspServer", "1.0")
        from gi.repository import GLib, Gst, GstRtspServer
    except (ImportError, ValueError) as exc:
        return f"cannot import GStreamer's RTSP server through PyGObject ({type(exc).__name__}: {exc})"
    Gst.init(None)
    missing = [name for name in ELEMENTS if Gst.ElementFactory.find(name) is None]
    if missing:
        return f"GStreamer elements missing: {', '.join(missing)}"
    return Gst, GstRtspServer, GLib


def main(argv: list[str]) -> int:
    loaded = _load()
    if isinstance(loaded, str):
        print(f"{loaded}; apt-get install {PACKAGES}", flush=True)
        return 1
    if argv == ["--check"]:
        print("ok", flush=True)
        return 0
    if len(argv) != 1 or not argv[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    _, GstRtspServer, GLib = loaded
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(argv[0])
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(LAUNCH)
    factory.set_shared(False)
    server.get_mount_points().add_factory(PATH, factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{argv[0]}", flush=True)
        return 1
    print(f"ready {server.get_bound_port()}", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
