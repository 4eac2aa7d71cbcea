"""The last alerts outlive a restart (apps/outputs/alert_log.py): ``GET /v1/alerts/events`` and the keyframe links
an SSE client or a notification holds were empty after every restart while the memory came back."""

from __future__ import annotations

import dataclasses
import errno
import json
import os

import pytest

from edgekv.apps.outputs.alert_log import EventLog
from edgekv.apps.outputs.alerts import AlertBus, AlertEvent

JPEG = b"\xff\xd8\xff\xe0 a keyframe \xff\xd9"


def event(i: int, stream_t: float = 10.0, keyframe: bytes | None = JPEG) -> AlertEvent:
    return AlertEvent(f"{i:016x}", "alert-1", "purple", "Was there a purple triangle?", "front", 0.9,
                      stream_t + i, 60 + i, stream_t + i - 0.5, 1_800_000_000.0 + i, keyframe, f"frame pair {60 + i}")


class Sink:
    def __init__(self) -> None:
        self.got: list[AlertEvent] = []

    def offer(self, e: AlertEvent) -> None:
        self.got.append(e)


def test_alerts_are_listed_and_their_keyframes_served_again_after_a_restart(tmp_path):
    bus = AlertBus(EventLog(tmp_path))
    for i in range(3):
        bus.publish(event(i, keyframe=None if i == 1 else JPEG))
    again = AlertBus(EventLog(tmp_path))  # a restart
    assert [e.to_json("base64") for e in again.recent] == [e.to_json("base64") for e in bus.recent]
    assert again.event(event(2).id).keyframe_jpeg == JPEG and again.event(event(1).id).keyframe_jpeg is None
    assert len(list((tmp_path / "alert-events").iterdir())) == 3


def test_only_the_last_alerts_are_kept_on_disk(tmp_path):
    bus = AlertBus(EventLog(tmp_path, keep=2))
    for i in range(5):
        bus.publish(event(i))
    assert [e.id for e in EventLog(tmp_path, keep=2).load()] == [event(3).id, event(4).id]
    assert len(list((tmp_path / "alert-events").iterdir())) == 2


def test_forgetting_a_window_removes_its_alerts_from_disk(tmp_path):
    bus = AlertBus(EventLog(tmp_path))
    for i in range(4):
        bus.publish(event(i, stream_t=10.0 * (i + 1)))  # raised at t 10, 21, 32, 43
    assert bus.forget(20.0, 33.0) == 2
    assert [e.stream_t for e in AlertBus(EventLog(tmp_path)).recent] == [10.0, 43.0]


def test_kept_alerts_are_sealed_and_a_missing_key_stops_the_start(tmp_path):
    pytest.importorskip("cryptography")
    from edgekv.privacy import Key, KeyRing, SealError

    old, new = Key(b"\x01" * 32, "old"), Key(b"\x02" * 32, "new")
    AlertBus(EventLog(tmp_path, KeyRing(old))).publish(event(0))
    (path,) = (tmp_path / "alert-events").iterdir()
    data = path.read_bytes()
    assert data.startswith(b"EDGEKV-SEALBLOB") and b"purple" not in data and b"a keyframe" not in data
    with pytest.raises(SealError, match="sealed with key"):
        AlertBus(EventLog(tmp_path, KeyRing(new)))
    with pytest.raises(SealError, match="has no key"):
        AlertBus(EventLog(tmp_path))
    assert path.read_bytes() == data  # left as it is
    rotated = EventLog(tmp_path, KeyRing(new, [old]))
    assert [p.name for p in rotated.needs_reseal()] == [path.name] and rotated.reseal() == 1
    assert rotated.reseal() == 0  # edgekv rekey, a second time: nothing left to do
    (kept,) = AlertBus(EventLog(tmp_path, KeyRing(new))).recent
    assert kept.id == event(0).id and kept.keyframe_jpeg == JPEG


def test_a_damaged_file_is_set_aside_and_the_others_read(tmp_path, caplog):
    bus = AlertBus(EventLog(tmp_path))
    for i in range(3):
        bus.publish(event(i))
    first, second, _ = sorted((tmp_path / "alert-events").iterdir())
    crashed = tmp_path / "alert-events" / f".{first.name}.tmp-4242"  # a write killed before its rename
    crashed.write_bytes(first.read_bytes()[:7])
    first.write_bytes(first.read_bytes()[:20])  # cut short
    second.write_text(json.dumps({"format": 1, "id": 7}))  # a field missing, the id not a string
    log = EventLog(tmp_path)
    assert [e.id for e in AlertBus(log).recent] == [event(2).id] and log.set_aside == 2
    assert sorted(p.name for p in (tmp_path / "alert-events").glob("*.bad")) == sorted(
        [first.name + ".bad", second.name + ".bad"])
    assert "does not read" in caplog.text and not crashed.exists()


def test_a_full_disk_costs_the_file_never_the_alert(tmp_path, monkeypatch, caplog):
    sink, log = Sink(), EventLog(tmp_path)
    bus = AlertBus(log)
    bus.add(sink)
    real_open = os.open

    def full(path, flags, *args, **kwargs):
        if "alert-events" in str(path) and flags & os.O_WRONLY:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    bus.publish(event(0))
    monkeypatch.setattr(os, "open", real_open)
    assert [e.id for e in sink.got] == [event(0).id] and bus.event(event(0).id) is not None  # it went out
    assert log.write_errors == 1 and "No space left" in caplog.text
    assert not [p for p in (tmp_path / "alert-events").iterdir()]  # no temporary file left behind
    bus.publish(event(1))  # the disk has room again
    assert [e.id for e in EventLog(tmp_path).load()] == [event(1).id]


def test_a_forget_while_an_alert_is_being_written_leaves_no_file(tmp_path):
    """The alert is in the list before its file is written: a forget in between found no file to remove, and the
    file written after it brought the forgotten alert back at the next start. The write now happens under the
    list's lock, so the forget waits for it. Here the write waits (2 s at most) for the forget to be done: with
    the forget waiting on the write instead, the bound passes and the forget then removes the file."""
    import threading

    forgotten = threading.Event()

    class SlowLog(EventLog):
        def save(self, e):
            forgotten.wait(2.0)
            super().save(e)

    bus = AlertBus(SlowLog(tmp_path))
    writer = threading.Thread(target=bus.publish, args=(event(0, stream_t=30.0),))
    writer.start()
    while bus.event(event(0, stream_t=30.0).id) is None and writer.is_alive():  # the alert is listed
        writer.join(0.01)
    forget = threading.Thread(target=lambda: (bus.forget(0.0, 100.0), forgotten.set()))
    forget.start()
    writer.join(30)
    forget.join(30)
    assert not writer.is_alive() and not forget.is_alive()
    assert list(bus.recent) == [] and EventLog(tmp_path).load() == []


def test_the_daemon_refuses_to_start_on_kept_alerts_it_cannot_open(tmp_path, capsys):
    """As for a snapshot sealed with a key this deployment lacks: the start stops, naming the file, which is left."""
    pytest.importorskip("cryptography")
    pytest.importorskip("fastapi")
    import io

    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.config import EdgeKVConfig
    from edgekv.privacy import Key, KeyRing

    EventLog(tmp_path, KeyRing(Key(b"\x01" * 32, "old"))).save(event(0))
    (path,) = (tmp_path / "alert-events").iterdir()
    sealed = path.read_bytes()
    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:events?size=112x112&fps=2&frames=4&seed=9&rate=0", "fps": 2.0,
               "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64}, server={"port": 0},
        monitor={"backend": "cpu"}, state={"dir": str(tmp_path)})
    out = io.StringIO()
    assert Daemon(config, DaemonOptions(no_stdin=True, quiet=True, exit_at_end=True), out=out).run() == 2
    assert f"cannot start: {path}: sealed (encrypted) and this deployment has no key" in capsys.readouterr().err
    assert path.read_bytes() == sealed


def test_an_alert_raised_after_the_clock_was_set_back_is_kept_as_the_newest(tmp_path):
    """Files were named by the wall time they were raised at: once the clock was set back (NTP stepping a clock that
    ran fast, a board without an RTC battery), a new alert sorted first, and past ``keep`` it was the one deleted, at
    once; a restart listed the old alerts and not it. Files written before (named by time alone) read as older."""
    folder = tmp_path / "alert-events"
    folder.mkdir()
    first = event(0)
    (folder / f"{int(first.raised_unix * 1000):015d}-{first.id}.evt").write_text(  # as the first files were named
        json.dumps({"format": 1, **{k: v for k, v in vars(first).items() if k != "keyframe_jpeg"}}))
    log = EventLog(tmp_path, keep=3)
    assert [e.id for e in log.load()] == [first.id]
    for i in (1, 2):
        log.save(event(i))
    back = dataclasses.replace(event(3), raised_unix=event(3).raised_unix - 86_400.0)  # a day "before", by the clock
    log.save(back)
    assert [e.id for e in EventLog(tmp_path, keep=3).load()] == [event(1).id, event(2).id, back.id]
    assert log.forget([back.id, event(1).id]) == 2 and [e.id for e in EventLog(tmp_path).load()] == [event(2).id]
