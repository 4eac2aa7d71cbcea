"""What a long run must not grow: in-memory structures the daemon fills once per frame pair stay within their stated
bound however many pairs go by (fakes, thousands of iterations, no waiting). Found by a soak of the daemon with
everything on: figures per pair, not per hour, so a camera at a pair a second reaches them only after hours."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from edgekv.apps.outputs.alerts import KeyframeRing, PairTimes
from edgekv.apps.outputs.mqtt import SessionHost

FRAME = np.zeros((4, 4, 3), dtype=np.uint8)


def _traced_growth(fill) -> int:
    """Bytes the Python allocators (numpy's arrays included) hold more after ``fill()`` than before it."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = fill()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept is not None
    return after - before


def test_keyframe_ring_times_hold_their_stated_mebibyte():
    """``KeyframeRing.times`` keeps the last TIMES_KEPT pairs' times in 1 MiB, as its comment says (a dict of Python
    ints and floats took ~6 MiB at 65,536 pairs), and no more after three times as many pairs."""
    kept = KeyframeRing.TIMES_KEPT

    def fill() -> KeyframeRing:
        ring = KeyframeRing(2)
        for pair in range(kept):
            ring.add(pair, FRAME, pair * 0.5)
        return ring

    grown = _traced_growth(fill)
    assert grown <= (1 << 20) + (64 << 10), f"{grown / 2**20:.2f} MiB for {kept} pairs' times"

    ring = fill()

    def go_on() -> KeyframeRing:
        for pair in range(kept, 2 * kept):
            ring.add(pair, FRAME, pair * 0.5)
        return ring

    assert _traced_growth(go_on) < 64 << 10  # the arrays are reused, not grown
    for pair in range(2 * kept, 3 * kept):
        ring.add(pair, FRAME, pair * 0.5)
    assert len(ring.times) == kept and ring.times.nbytes == 16 * kept
    last = 3 * kept - 1
    assert ring.times.get(last) == last * 0.5 and ring.times[last - kept + 1] == (last - kept + 1) * 0.5
    assert ring.times.get(last - kept) is None and (last - kept) not in ring.times and last in ring.times
    assert list(ring.frames) == [last - 1, last]


def test_pair_times_behave_as_the_dict_the_daemon_calls():
    """What the daemon's forget and evidence lookups call (``get``, ``pop``, ``items``, ``[]``, ``in``) answer as the
    dict did, the oldest pair giving way to the newest past the capacity."""
    times = PairTimes(8)
    for pair in range(20):
        times[pair] = pair + 0.25
    assert len(times) == 8 and [p for p, _ in times.items()] == list(range(12, 20))
    assert times.get(11) is None and times.get(None) is None and times.get(3, -1.0) == -1.0
    with pytest.raises(KeyError):
        times[11]
    for pair, t in times.items():  # a forget walks the items and pops some while it goes
        if 14 <= t <= 16:
            assert times.pop(pair) == pair + 0.25
    assert times.pop(15) is None and times.pop(15, "gone") == "gone"
    assert len(times) == 6 and list(times) == times.keys() == [12, 13, 16, 17, 18, 19]
    assert times.values() == [12.25, 13.25, 16.25, 17.25, 18.25, 19.25]
    times[15] = 99.0  # a pair forgotten and seen again (a restored session going on) is held again
    times[19] = 19.5  # the same pair twice: one entry, the newest time
    assert len(times) == 7 and times[15] == 99.0 and times[19] == 19.5


def test_fleet_session_host_times_stay_bounded(monkeypatch):
    """A simulated fleet device (``SessionHost``: ``edgekv bench fleet``) kept every pair's time since its start in a
    dict, a float more per pair for as long as the bench ran; it keeps the last TIMES_KEPT now."""
    monkeypatch.setattr(KeyframeRing, "TIMES_KEPT", 1024)
    pairs = iter(range(1 << 30))
    session = SimpleNamespace(ingest=lambda frame, t, captured_unix=None: SimpleNamespace(pair_index=next(pairs)))
    host = SessionHost(session, "front")
    for index in range(10 * 1024):
        host.ingest(FRAME, t=index * 0.5)
    assert len(host.times) == 1024
    assert host.evidence_time(10 * 1024 - 1) == (10 * 1024 - 1) * 0.5
    assert host.evidence_time(9 * 1024 - 1) is None and host.evidence_time(None) is None


def test_metrics_name_each_family_once_with_persistent_memory():
    """With ``state.dir`` a scrape carried ``edgekv_snapshot_age_seconds`` twice: the memory's snapshot age and the age
    of the scrape's own figures, with two HELP texts; a reader by name (as tests/test_daemon_state.py's) kept the
    second, so it read a few microseconds where the memory's age was meant. Seen in the s95 soak's scrapes."""
    import queue
    import threading
    import time
    from collections import defaultdict

    from prometheus_client import parser

    from edgekv.apps.server.telemetry import Telemetry

    keeper = SimpleNamespace(enabled=True, written=3, failures=0, unchanged=1, written_at=100.0, clock=lambda: 107.5)
    daemon = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(path="builtin:toy")), state=keeper,
                             started=time.monotonic(), questions=queue.Queue(), stream_state="running", monitor=None,
                             sampler=None, session=None, lock=threading.RLock(), frames=None, fleet=None, cameras=None)
    telemetry = Telemetry(daemon)
    stats = defaultdict(int, policy="infinipot_v", vision_backend="torch", llm_backend="torch")
    telemetry.snapshot = lambda: {"stats": stats, "kept": {"rows": 0, "cols": 0, "kept": []}, "age_s": 0.25}
    body, _ = telemetry.exposition()
    text = body.decode()
    typed = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(typed) == len(set(typed)), sorted(name for name in typed if typed.count(name) > 1)
    families = {family.name: family for family in parser.text_string_to_metric_families(text)}
    assert families["edgekv_snapshot_age_seconds"].samples[0].value == 7.5
    assert families["edgekv_stats_age_seconds"].samples[0].value == 0.25
