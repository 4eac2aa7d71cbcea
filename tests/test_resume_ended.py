"""``Daemon.resume()`` after the stream has ended does not open the source again: a recording read to its end (before
a restart, with the pause kept across it, or in this run) reads no more, so reopening it only decoded the file to its
end in the capture thread for nothing (and a camera's light would come on for nothing). Said once, with why."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

from helpers_wait import until

from edgekv.config import EdgeKVConfig

# 16 frames at 8 fps sampled at 4 fps: 8 frames in
CLIP = "synthetic:events?size=112x112&fps=8&frames=16&rate=0.3&seed=3"


def _config(root: Path) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": CLIP, "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"enabled": False}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2},
        state={"dir": str(root / "state"), "every_s": 3600})


def _daemon(config: EdgeKVConfig, out: io.StringIO, **options):
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    return Daemon(config, DaemonOptions(no_stdin=True, quiet=True, no_server=True, **options), out=out)


def _opens(monkeypatch) -> list[str]:
    """The sources opened from now on by the daemon's loop module."""
    import edgekv.apps.daemon.loop as loop

    opened: list[str] = []
    real = loop.open_video_source

    def counted(config):
        opened.append(config.video.source)
        return real(config)

    monkeypatch.setattr(loop, "open_video_source", counted)
    return opened


def _serving(config: EdgeKVConfig, out: io.StringIO):
    daemon = _daemon(config, out)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    assert daemon.ready.wait(120), out.getvalue()
    return daemon, thread


def test_a_pause_kept_across_a_restart_after_the_recording_ended_resumes_without_reopening_it(tmp_path, monkeypatch):
    config = _config(tmp_path)
    first = io.StringIO()
    assert _daemon(config, first, exit_at_end=True).run() == 0, first.getvalue()
    assert "stream ended: the source ended after 8 frames" in first.getvalue()
    (tmp_path / "state" / "paused.json").write_text(json.dumps({"reason": "privacy switch", "since_unix": 0}))

    out = io.StringIO()
    daemon, thread = _serving(config, out)
    try:
        assert daemon.paused == "privacy switch, kept across the restart"
        opened = _opens(monkeypatch)
        assert daemon.resume()
        assert daemon.paused is None and not (tmp_path / "state" / "paused.json").exists()
        assert until(daemon.stream_ended.is_set, 120)
        assert opened == []  # not reopened: nothing would go in
        assert daemon.session.counters.frames == 8
    finally:
        daemon.stop.event.set()
        thread.join(60)
    assert not thread.is_alive()
    text = out.getvalue()
    said = ("s paused; the stream has ended (the recording was read to its end before the restart): the source is not "
            "opened again, questions are answered about what was seen")
    assert text.count(said) == 1, text


def test_a_recording_that_ended_in_this_run_is_not_reopened_by_a_resume(tmp_path, monkeypatch):
    out = io.StringIO()
    daemon, thread = _serving(_config(tmp_path), out)
    try:
        assert until(daemon.stream_ended.is_set, 120), out.getvalue()
        assert daemon.pause("privacy switch")
        opened = _opens(monkeypatch)
        assert daemon.resume()
        assert opened == [] and daemon.paused is None
        assert not daemon.resume()  # once: no longer paused
    finally:
        daemon.stop.event.set()
        thread.join(60)
    assert not thread.is_alive()
    assert out.getvalue().count("the stream has ended (the source ended): the source is not opened again") == 1
