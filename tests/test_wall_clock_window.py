"""Windows by the wall clock ("what happened between 10:03 and 10:05?", "forget 14:00 to 14:10"): the session's
map from stream time to wall time (edgekv/session/wallclock.py) — anchors only where the offset moves, a clock set
forward joins, a clock set back makes a window ambiguous and it is refused naming the stretches, kept in snapshots —
the API's and the CLI's wall times (apps/wall_times.py), and the daemon end to end: a question and a forget by wall
time read and remove what the same window in stream seconds does."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
import threading
import time

import numpy as np
import pytest
from helpers_server import call, ended_daemon

import edgekv
from edgekv.session.wallclock import MAX_ANCHORS, TOLERANCE_S, NothingSeen, WallClock

BASE = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def _clock(*observations) -> WallClock:
    wall = WallClock()
    for stream_t, unix in observations:
        wall.observe(stream_t, unix)
    return wall


def test_anchors_are_kept_only_where_the_offset_moves():
    wall = _clock(*((t * 0.5, BASE + t * 0.5 + 0.01 * (t % 3)) for t in range(100)))  # capture jitter of 20 ms
    assert wall.anchors == [(0.0, BASE)]
    wall.observe(50.0, BASE + 50.0 + TOLERANCE_S + 0.5)  # a drift past the tolerance: a new anchor
    assert len(wall.anchors) == 2 and wall.unix_of(49.5) == BASE + 49.5 and wall.unix_of(60.0) == BASE + 61.5
    assert wall.unix_of(-1.0) is None  # before the first anchor: no wall time
    with pytest.raises(ValueError, match="captured_unix=nan"):
        wall.observe(51.0, float("nan"))
    for _ in range(MAX_ANCHORS + 5):
        wall.observe(wall.anchors[-1][0] + 1.0, BASE + 10 * len(wall.anchors) + wall.dropped * 10)
    assert len(wall.anchors) == MAX_ANCHORS and wall.dropped > 0
    weeks = WallClock()  # a full map of realistic numbers stays within a snapshot manifest's allowance (64 KiB)
    for i in range(MAX_ANCHORS + 3):
        weeks.observe(1e7 + i * 2000.123456789, BASE + 1e7 + i * 2000.123456789 + (i % 2) * 1.7 + i * 1e-3)
    assert len(weeks.anchors) == MAX_ANCHORS and len(json.dumps(weeks.state())) < 60_000


def test_a_wall_window_maps_to_the_stream_time_seen_in_it():
    wall = _clock((0.0, BASE), (100.0, BASE + 100.0))
    assert wall.window(BASE + 10, BASE + 20, last_t=100.0) == (10.0, 20.0)
    assert wall.window(BASE - 50, BASE + 20, last_t=100.0) == (0.0, 20.0)  # clipped to what was seen
    assert wall.window(BASE + 90, BASE + 500, last_t=100.0) == (90.0, 100.0)
    with pytest.raises(NothingSeen, match="nothing of this stream was seen between"):
        wall.window(BASE + 200, BASE + 300, last_t=100.0)
    with pytest.raises(ValueError, match="is after to"):
        wall.window(BASE + 20, BASE + 10, last_t=100.0)
    with pytest.raises(ValueError, match="no frame of this stream has a wall-clock time"):
        WallClock().window(BASE, BASE + 1, last_t=5.0)


def test_a_clock_set_forward_joins_and_a_clock_set_back_is_refused_naming_the_stretches():
    # NTP stepped the clock forward an hour at stream second 60: one stretch of stream time across the step
    forward = _clock((0.0, BASE), (60.0, BASE + 60.0 + 3600.0))
    assert forward.window(BASE + 30, BASE + 3600 + 90, last_t=120.0) == (30.0, 90.0)
    with pytest.raises(NothingSeen):  # the hour the step skipped: nothing was seen in it
        forward.window(BASE + 70, BASE + 3000, last_t=120.0)
    # set back 30 s at stream second 60: 10:00:40 happened twice
    back = _clock((0.0, BASE), (60.0, BASE + 60.0 - 30.0))
    assert back.unix_of(59.0) == BASE + 59.0 and back.unix_of(61.0) == BASE + 31.0
    with pytest.raises(ValueError, match=r"matches 2 separate stretches .*set back.*stream seconds "
                                         r"35.000..45.000, 65.000..75.000"):
        back.window(BASE + 35, BASE + 45, last_t=120.0)
    assert back.window(BASE + 62, BASE + 80, last_t=120.0) == (92.0, 110.0)  # after the overlap: one stretch


def test_the_map_survives_its_state_and_refuses_a_damaged_one():
    wall = _clock((0.0, BASE), (60.0, BASE + 90.0))
    again = WallClock()
    again.load_state(json.loads(json.dumps(wall.state())))
    assert again.anchors == wall.anchors and again.window(BASE + 95, BASE + 100, 80.0) == (65.0, 70.0)
    again.load_state(None)  # a snapshot written before the map
    assert again.anchors == []
    with pytest.raises(ValueError, match="stream-time order"):
        again.load_state({"anchors": [[5.0, BASE], [1.0, BASE]]})


def test_frames_without_wall_times_after_wall_timed_ones_have_none():
    """A memory kept from a live camera, then fed a recording read as fast as it goes: the recording's frames must
    not take the live run's last offset (they were seen at no wall time: the anchor ``None``), a window after the
    live run finds nothing of them, and a later wall-timed frame starts a map of its own again."""
    wall = _clock((0.0, BASE), (30.0, BASE + 30.0))
    wall.observe_none(40.0)
    wall.observe_none(41.0)  # one anchor for the whole stretch
    assert wall.anchors == [(0.0, BASE), (40.0, None)]
    assert wall.unix_of(35.0) == BASE + 35.0 and wall.unix_of(40.0) is None and wall.unix_of(500.0) is None
    assert wall.span(last_t=500.0) == (BASE, BASE + 40.0)
    assert wall.window(BASE + 30, BASE + 400, last_t=500.0) == (30.0, 40.0)  # the live run's end, no more
    with pytest.raises(NothingSeen, match="wall times kept span .* to .*"):
        wall.window(BASE + 100, BASE + 400, last_t=500.0)  # extrapolated, the recording's pairs 100-400 were "seen"
    wall.observe(600.0, BASE + 7200.0)  # a live camera again, two hours later by the clock
    assert wall.anchors[-1] == (600.0, BASE + 6600.0) and wall.unix_of(610.0) == BASE + 7210.0
    assert wall.stretches(BASE, BASE + 8000, last_t=620.0) == [(0.0, 40.0), (600.0, 620.0)]
    again = WallClock()
    again.load_state(json.loads(json.dumps(wall.state())))  # JSON null: a snapshot keeps the stretch's lack
    assert again.anchors == wall.anchors and again.unix_of(45.0) is None
    empty = WallClock()
    empty.observe_none(3.0)  # nothing known yet: nothing to say
    assert empty.anchors == []
    with pytest.raises(ValueError, match="finite"):
        again.load_state({"anchors": [[0.0, BASE], [1.0, float("nan")]]})


# --------------------------------------------------------------------------------------- wall times as written
def test_wall_times_as_people_write_them(monkeypatch):
    from edgekv.apps.wall_times import cli_bound, cli_window, parse_wall_time, window_bounds

    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        assert parse_wall_time("2027-01-15T08:00:00Z") == BASE
        assert parse_wall_time("2027-01-15T09:00:00+01:00") == BASE
        assert parse_wall_time("2027-01-15 09:00") == BASE  # no offset: local time (Berlin, UTC+1 in January)
        now = BASE + 3 * 3600  # 12:00 in Berlin
        assert parse_wall_time("09:00", now=now) == BASE  # a time of day: today ...
        assert parse_wall_time("13:00", now=now) == BASE + 4 * 3600 - 86400  # ... or yesterday, never to come
        assert parse_wall_time("11:59:30.5", now=now) == now - 29.5
        for bad in ("25:00", "9h", "", "2027-13-01T00:00", "x" * 100):
            with pytest.raises(ValueError):
                parse_wall_time(bad, now=now)
        assert cli_bound(" 2027-01-15T09:00:00") == "2027-01-15T09:00:00"  # checked, kept as typed ...
        sent = cli_window(cli_bound("2027-01-15T09:00:00"), cli_bound("09:30"))  # ... and read together when sent
        assert sent == ("2027-01-15T09:00:00+01:00", "2027-01-15T09:30:00+01:00")  # with this machine's offset
        assert parse_wall_time(sent[0]) == BASE
        assert cli_bound("12.5") == 12.5 and cli_window(1.0, 2.5) == (1.0, 2.5)
        with pytest.raises(ValueError, match="not a wall time"):
            cli_bound("tea time")
        assert window_bounds(1, 2.5) == ("stream", 1.0, 2.5)
        assert window_bounds("2027-01-15T08:00:00Z", "2027-01-15T08:00:10Z") == ("wall", BASE, BASE + 10)
        with pytest.raises(ValueError, match="both in stream seconds"):
            window_bounds(1, "10:00")
        # a window's times of day are read together: at 12:00, "11:30 to 12:30" is the half hour under way ...
        assert window_bounds("11:30", "12:30", now=now) == ("wall", now - 1800, now + 1800)
        assert window_bounds("13:00", "14:00", now=now) == ("wall", BASE + 4 * 3600 - 86400, BASE + 5 * 3600 - 86400)
        at_midnight = BASE + 15 * 3600 + 300  # 00:05 in Berlin: "23:50 to 00:10" runs across midnight
        assert window_bounds("23:50", "00:10", now=at_midnight) == ("wall", at_midnight - 900, at_midnight + 300)
        # ... a time-of-day "to" follows a dated "from", a time-of-day "from" precedes a dated "to"
        assert window_bounds("2027-01-14T23:00:00+01:00", "01:00", now=now) == ("wall", BASE - 10 * 3600,
                                                                                 BASE - 8 * 3600)
        assert window_bounds("20:00", "2027-01-14T22:00:00+01:00", now=now) == ("wall", BASE - 13 * 3600,
                                                                                 BASE - 11 * 3600)
        # a forget reads a night across midnight, but not a day: "12:30 to 11:00" typed at 12:48 for "11:00 to 12:30"
        # read as 22.5 hours and forgot everything since 12:30 (a question may read it: nothing is lost)
        assert window_bounds("23:50", "00:10", now=at_midnight, forget=True)[1:] == (at_midnight - 900,
                                                                                      at_midnight + 300)
        assert window_bounds("22:00", "06:00", now=now, forget=True)[1:] == (now - 14 * 3600, now - 6 * 3600)
        later = now + 48 * 60
        assert window_bounds("12:30", "11:00", now=later)[1:] == (now + 1800, now + 1800 + 22.5 * 3600)
        with pytest.raises(ValueError, match=r"from 12:30 to 11:00 runs 22.5 hours, to 11:00 the next day: not "
                                             r"forgotten \(did you mean from 11:00 to 12:30\?\)"):
            window_bounds("12:30", "11:00", now=later, forget=True)
        with pytest.raises(ValueError, match=r"from 12:30 to 11:00 runs 2\d.5 hours"):  # edgekv forget (the hours: DST)
            cli_window("12:30", "11:00", forget=True)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_the_chat_window_takes_wall_times():
    from edgekv.apps.server.openai_chat import ApiError, ChatLimits, parse_chat_request

    limits = ChatLimits(served_models=("edgekv",), max_new_tokens=16, default_new_tokens=4)
    ask = {"messages": [{"role": "user", "content": "What moved?"}]}
    request = parse_chat_request({**ask, "window": {"from": "2027-01-15T08:00:00Z", "to": "2027-01-15T08:05:00Z"}},
                                 limits)
    assert request.window is None and request.window_unix == (BASE, BASE + 300) and request.window_last_s is None
    for window, message in (({"from": "10:00", "to": 5}, "window: from and to: give both in stream seconds"),
                            ({"from": "tea time", "to": "10:00"}, "window: from: 'tea time': not a wall time"),
                            ({"from": "2027-01-15T08:05:00Z", "to": "2027-01-15T08:00:00Z"}, "window: from (2027")):
        with pytest.raises(ApiError) as refused:
            parse_chat_request({**ask, "window": window}, limits)
        assert refused.value.message.startswith(message), refused.value.message


# --------------------------------------------------------------------------------------------- the session
def _session(model_dir):
    rt = edgekv.Runtime.from_pretrained(model_dir, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [56, 56], "fps": 2.0},
                                        cache={"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64},
                                        generation={"max_new_tokens": 4})
    return rt, rt.session()


def test_a_session_answers_and_forgets_by_the_wall_clock_and_keeps_its_map(tiny_checkpoint, tmp_path):
    rt, session = _session(tiny_checkpoint)
    rng = np.random.default_rng(5)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(24)]
    for i, frame in enumerate(frames):  # 12 pairs stamped 0 .. 11 s; the wall clock set back 4 s at pair 6
        session.ingest(frame, t=i / 2.0, captured_unix=BASE + i / 2.0 - (4.0 if i >= 12 else 0.0))
    with pytest.raises(ValueError, match="captured_unix='noon'"):
        session.ingest(frames[0], t=12.0, captured_unix="noon")
    assert session.counters.frames == 24 and session.counters.frames_rejected == 1  # refused before any change
    assert session.wall.anchors == [(0.0, BASE), (6.0, BASE - 4.0)]
    assert session.wall_time(2.0) == BASE + 2.0 and session.wall_time(8.0) == BASE + 4.0
    window = session.wall_window(BASE, BASE + 1.9)
    assert window == (0.0, 1.9)
    by_wall = session.ask("What moved?", window=window)
    assert by_wall.window_pairs == 2  # pairs stamped 0 and 1 s
    assert by_wall.token_ids == session.ask("What moved?", window=(0.0, 1.9)).token_ids
    assert session.wall_window(BASE + 6.5, BASE + 7.5) == (10.5, 11.5)  # seen only after the step back
    with pytest.raises(ValueError, match=r"separate stretches .* stream seconds 2.000..4.000, 6.000..8.000"):
        session.wall_window(BASE + 2.0, BASE + 4.0)  # seen before the step back and again after it
    snapshot = tmp_path / "s.ekv"
    session.save(snapshot)
    restored = rt.restore(snapshot)
    assert restored.wall.anchors == session.wall.anchors
    assert restored.wall_window(BASE, BASE + 1.9) == (0.0, 1.9)
    restored.reset()
    assert restored.wall.anchors == []


# --------------------------------------------------------------------------------------------- the daemon
def _config(model_dir, **video):
    from edgekv.config import EdgeKVConfig

    return EdgeKVConfig().with_overrides(
        model={"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=48", "fps": 8.0, "resolution": [56, 56], **video},
        cache={"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64}, server={"port": 0},
        monitor={"backend": "cpu"}, generation={"max_new_tokens": 2, "temperature": 0.0})


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).isoformat()


def test_the_daemon_answers_and_forgets_by_the_wall_clock(tiny_checkpoint, tmp_path):
    """A paced source (frames sampled as a camera's are): each frame's wall time is kept; a chat question and a
    forget given wall times (ISO 8601 strings) read and remove what the same stretch in stream seconds does, the CLI
    sends its --from / --to as wall times, and a stretch seen at no wall time is said, not an error."""
    pytest.importorskip("fastapi")
    from helpers_server import call, chat, error_of

    from edgekv.apps.cli import main
    from edgekv.apps.wall_times import parse_wall_time

    with ended_daemon(_config(tiny_checkpoint), tmp_path / "out.txt", realtime=True) as daemon:
        port, session = daemon.server.port, daemon.session
        with daemon.lock:
            times = sorted(session.pair_times.values())
            assert len(times) >= 8 and session.wall.anchors  # the frames' wall times were kept
            first, last = _iso(session.wall_time(times[2])), _iso(session.wall_time(times[6]))
            window = session.wall_window(parse_wall_time(first), parse_wall_time(last))
            assert window[0] <= times[2] and window[1] >= times[6]  # the wall times map back onto those pairs
            want = session.ask("What moved?", max_new_tokens=2, window=window)
        assert want.window_pairs >= 5
        status, _, body = chat(port, "What moved?", max_tokens=2, window={"from": first, "to": last})
        assert status == 200, body
        got = json.loads(body)
        assert got["edgekv"]["window_pairs"] == want.window_pairs
        assert got["choices"][0]["message"]["content"] == want.text
        before = _iso(session.wall_time(times[0]) - 3600)
        status, _, body = chat(port, "What moved?", max_tokens=2, window={"from": before, "to": _iso(BASE * 2)})
        assert status == 200 and json.loads(body)["edgekv"]["window_pairs"] == len(times)  # clipped to what was seen
        status, _, body = chat(port, "What moved?", window={"from": "tea time", "to": last})
        assert status == 400 and "not a wall time" in error_of(body)["message"]
        # forget by the clock: the same pairs as that stretch in stream seconds
        held = [t for t in times if window[0] <= t <= window[1]]
        status, _, body = call(port, "POST", "/v1/memory/forget", {"from": first, "to": last})
        assert status == 200, body
        result = json.loads(body)
        assert (result["from"], result["to"], result["pairs"]) == (window[0], window[1], len(held))
        assert result["wall"] == {"from": parse_wall_time(first), "to": parse_wall_time(last)}
        assert not [t for t in session.pair_times.values() if window[0] <= t <= window[1]]
        status, _, body = call(port, "POST", "/v1/memory/forget", {"from": _iso(BASE * 2), "to": _iso(BASE * 2 + 60)})
        assert status == 200 and json.loads(body)["pairs"] == 0 and "nothing of this stream was seen" in json.loads(
            body)["note"]
        status, _, body = call(port, "POST", "/v1/memory/forget", {"from": 3.0, "to": "10:00"})
        assert status == 400 and "both in stream seconds" in error_of(body)["message"]
        printed = tmp_path / "cli.txt"
        end = session.wall_time(times[-1])
        with open(printed, "w") as sink, contextlib.redirect_stdout(sink):
            assert main(["forget", "--url", f"http://127.0.0.1:{port}", "--from",
                         dt.datetime.fromtimestamp(end - 0.3).isoformat(), "--to",
                         dt.datetime.fromtimestamp(end + 60).isoformat()]) == 0
        assert printed.read_text().startswith("forgot t=") and " (seen " in printed.read_text()
        assert times[-1] not in session.pair_times.values()


def test_a_recording_read_as_fast_as_it_goes_has_no_wall_times(tiny_checkpoint, tmp_path):
    pytest.importorskip("fastapi")
    from helpers_server import chat, error_of

    with ended_daemon(_config(tiny_checkpoint), tmp_path / "out.txt", realtime=False) as daemon:
        assert daemon.session.wall.anchors == [] and daemon.session.pair_times
        status, _, body = chat(daemon.server.port, "What moved?", window={"from": _iso(BASE), "to": _iso(BASE + 9)})
        assert status == 400 and "no frame of this stream has a wall-clock time" in error_of(body)["message"]
        status, _, body = chat(daemon.server.port, "What moved?", max_tokens=2, window={"from": 0, "to": 2})
        assert status == 200, body  # stream seconds, as before


def test_the_wall_times_outlive_a_restart(tiny_checkpoint, tmp_path):
    """``state.dir``: the map is in every snapshot, so a restarted daemon still finds what its first run saw by the
    clock, and maps its own new frames too."""
    pytest.importorskip("fastapi")
    from edgekv.apps.wall_times import parse_wall_time

    config = _config(tiny_checkpoint).with_overrides(state={"dir": str(tmp_path / "state"), "every_s": 3600})
    with ended_daemon(config, tmp_path / "first.txt", realtime=True) as first:
        with first.lock:
            seen = sorted(first.session.pair_times.values())
            anchors = list(first.session.wall.anchors)
            stretch = _iso(first.session.wall_time(seen[1])), _iso(first.session.wall_time(seen[4]))
            window = first.session.wall_window(*map(parse_wall_time, stretch))
    assert anchors and window[0] <= seen[1] and window[1] >= seen[4]
    # another recording: the one read to its end is not read again (a restart goes on where the memory stopped)
    config = config.with_overrides(video={"source": config.video.source + "&seed=1"})
    with ended_daemon(config, tmp_path / "second.txt", realtime=True) as second:
        with second.lock:
            session = second.session
            assert session.restored_from is not None and session.wall.anchors[:len(anchors)] == anchors
            assert session.wall_window(*map(parse_wall_time, stretch)) == window  # the first run's stretch
            newest = max(session.pair_times.values())
            assert newest > seen[-1] and session.wall_time(newest) > session.wall_time(seen[-1])


def test_a_recording_fed_to_a_live_runs_memory_is_seen_at_no_wall_time(tiny_checkpoint, tmp_path):
    """The probe of 2026-12-05: a daemon's memory from a paced (live) run, restarted on a recording read as fast as
    it goes. The recording's pairs had the live run's last offset, an evidence line said "seen 04:05" at 01:53 and a
    forget by that time would have removed them; now they have no wall time, and the live run's stretch keeps its."""
    pytest.importorskip("fastapi")
    config = _config(tiny_checkpoint).with_overrides(state={"dir": str(tmp_path / "state"), "every_s": 3600})
    with ended_daemon(config, tmp_path / "first.txt", realtime=True) as first:
        with first.lock:
            live = sorted(first.session.pair_times.values())
            live_unix = first.session.wall_time(live[-1])
    assert live_unix is not None
    # another recording: the one read to its end is not read again (a restart goes on where the memory stopped)
    config = config.with_overrides(video={"source": config.video.source + "&seed=1"})
    with ended_daemon(config, tmp_path / "second.txt", realtime=False) as second:
        with second.lock:
            session = second.session
            replayed = sorted(t for t in session.pair_times.values() if t > live[-1])
            assert session.restored_from is not None and replayed
            assert all(session.wall_time(t) is None for t in replayed)
            assert session.wall_time(live[-1]) == live_unix
            assert session.wall.anchors[-1][1] is None
            with pytest.raises(NothingSeen):  # the time the recording was read in: nothing was seen then
                session.wall_window(live_unix + 60.0, live_unix + 3600.0)


class _SetBack:
    """A wall clock that NTP sets back after ``after`` readings, to the first reading: the time since then is lived
    twice (the daemon reads it once a sampled frame)."""

    def __init__(self, after: int) -> None:
        self.after, self.readings, self.first, self.step = after, 0, None, None

    def __call__(self) -> float:
        now = time.time()
        self.readings += 1
        if self.first is None:
            self.first = now
        if self.readings > self.after:
            if self.step is None:
                self.step = now - self.first
            return now - self.step
        return now


def test_a_forget_by_the_clock_removes_every_stretch_the_clock_lived_twice(tiny_checkpoint, tmp_path):
    """The wall clock set back mid-stream: a question about the doubled minute is refused naming both stretches of
    stream time; a forget of it removes both (the wearer's side), says which, and nothing else."""
    pytest.importorskip("fastapi")
    from helpers_server import call, chat, error_of

    from helpers_server import daemon_args

    from edgekv.apps.daemon.loop import Daemon
    from edgekv.apps.wall_times import parse_wall_time

    clock = _SetBack(after=12)
    with open(tmp_path / "out.txt", "w") as out:
        daemon = Daemon(_config(tiny_checkpoint), daemon_args(realtime=True), out=out)
        daemon.wall_clock = clock
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        try:
            assert daemon.ready.wait(120) and daemon.stream_ended.wait(300), "the stream did not end"
            session, port = daemon.session, daemon.server.port
            with daemon.lock:
                assert len(session.wall.anchors) >= 2 and clock.step is not None  # the step back was seen
                overlap = min(clock.step, session.wall_time(session.clock.last_t) - clock.first)
                u0, u1 = (parse_wall_time(_iso(clock.first + share * overlap)) for share in (0.1, 0.6))
                stretches = session.wall_stretches(u0, u1)
                held = {p for p, t in session.pair_times.items() if any(a <= t <= b for a, b in stretches)}
            assert len(stretches) == 2 and stretches[0][1] < stretches[1][0]
            status, _, body = chat(port, "What moved?", max_tokens=2, window={"from": _iso(u0), "to": _iso(u1)})
            assert status == 400 and "matches 2 separate stretches" in error_of(body)["message"]
            status, _, body = call(port, "POST", "/v1/memory/forget", {"from": _iso(u0), "to": _iso(u1)})
            assert status == 200, body
            result = json.loads(body)
            assert [tuple(s) for s in result["stretches"]] == stretches and result["pairs"] == len(held)
            assert not held & set(session.pair_times) and session.pair_times  # both gone, the rest kept
        finally:
            daemon.stop.event.set()
            thread.join(60)
    assert "forgot t=" in (tmp_path / "out.txt").read_text()


def test_forgetting_the_last_seconds_goes_by_the_wall_clock(tiny_checkpoint, tmp_path):
    """A live camera that went dark (its source ended, or the privacy switch) an hour ago: "forget the last minute"
    forgot its last minute before that, by the stream's own clock, and kept nothing less. It goes by the clock on the
    wall; and frames of the window still waiting to go in (sampled while an answer ran) are dropped with it."""
    pytest.importorskip("fastapi")
    with ended_daemon(_config(tiny_checkpoint), tmp_path / "out.txt", realtime=True) as daemon:
        session = daemon.session
        with daemon.lock:
            end = session.wall_time(session.clock.last_t)
            held = dict(session.pair_times)
        assert end is not None and len(held) >= 8
        daemon.wall_clock = lambda: end + 3600.0
        result = daemon.forget(last_s=60)
        assert result["pairs"] == 0 and "nothing of this stream was seen" in result["note"]
        assert session.pair_times == held  # nothing it saw an hour ago went
        daemon.wall_clock = lambda: end + 1.0  # a second after its last frame: the last 2 s
        with daemon.lock:
            ((low, high),) = session.wall_stretches(end - 1.0, end + 1.0)
            gone = session.pairs_in(low, high)
        assert 0 < len(gone) < len(held)
        result = daemon.forget(last_s=2)
        assert result["pairs"] == len(gone) and result["wall"] == {"from": end - 1.0, "to": end + 1.0}
        assert set(session.pair_times) == set(held) - set(gone)
        # the privacy switch, then frames of the window waiting in the backlog: they go, later ones stay
        assert daemon.pause("test")
        frame = np.zeros((120, 160, 3), np.uint8)
        last_t = session.clock.last_t
        for step, wall in enumerate([end + 0.5, end + 0.9, end + 5.0]):
            daemon.backlog.push(frame, last_t + 1 + step, wall, bounded=False)
        daemon.wall_clock = lambda: end + 2.0
        daemon.forget(last_s=1.5)
        assert len(daemon.backlog) == 1 and daemon.backlog.pop()[2] == end + 5.0
        daemon.backlog.push(frame, 10_000.0, None, bounded=False)  # a window in stream seconds
        daemon.backlog.push(frame, 20_000.0, None, bounded=False)
        daemon.forget(daemon._stream_time(10_000.0) - 1, daemon._stream_time(10_000.0) + 1)
        assert len(daemon.backlog) == 1 and daemon.backlog.pop()[1] == 20_000.0
        # "the last 10**400 s" (a JSON integer past float64): all of it, not a 500 from OverflowError
        status, _, body = call(daemon.server.port, "POST", "/v1/memory/forget", raw=b'{"last_s": 1' + b"0" * 400 + b"}")
        assert status == 200 and json.loads(body)["pairs"] == len(held) - len(gone) and not session.pair_times, body


def test_numbers_past_float64_in_a_window_are_refused_or_read_not_an_overflow():
    """A window bound or ``last_s`` written as a 401-digit JSON integer: ``math.isfinite`` raised OverflowError
    (HTTP 500; on the fleet, an exception in the MQTT client's thread). Now read as float64's largest value."""
    from edgekv.apps.outputs.mqtt import _finite_or_none
    from edgekv.apps.wall_times import WindowError, forget_request, window_bounds

    huge = 10**400
    assert forget_request({"last_s": huge}) == {"last_s": sys.float_info.max}
    assert forget_request({"from": 0, "to": huge}) == {"t_from": 0.0, "t_to": sys.float_info.max}
    assert window_bounds(-huge, 5) == ("stream", -sys.float_info.max, 5.0)
    with pytest.raises(WindowError, match="last_s: must be > 0"):
        forget_request({"last_s": -huge})
    assert _finite_or_none(huge) == sys.float_info.max and _finite_or_none(float("nan")) is None
