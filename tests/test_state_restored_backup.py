"""A ``state.dir`` put back from yesterday's backup (or a device that was off for a day) resumes that memory, the
day between said as what it likely is, and bounded to ``video.max_gap_s`` of stream time. Said as "a clock set
after the snapshot, e.g. by NTP" alone, it sent the owner of a restored backup to look for a clock fault."""

from __future__ import annotations

import shutil
import time

import numpy as np

import edgekv
from edgekv.config import StateSection
from edgekv.state import StateKeeper

DAY = 86_400.0


def test_yesterdays_backup_resumes_with_the_day_said_and_bounded(tiny_checkpoint, tmp_path):
    runtime = edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 84], "fps": 2.0},
        cache={"policy": "infinipot_v", "max_tokens": 120, "text_reserve_tokens": 40},
        engines={"engine_dir": str(tmp_path / "engines")})
    folder = tmp_path / "state"
    keeper = StateKeeper(StateSection(dir=str(folder)), say=lambda line: None)
    session = keeper.restore(runtime)
    for index in range(6):
        session.ingest(np.random.default_rng(index).integers(0, 256, (60, 80, 3), dtype=np.uint8), t=index / 2.0)
    keeper.snapshot(session)
    shutil.copytree(folder, tmp_path / "backup")  # yesterday's backup
    for index in range(6, 12):
        session.ingest(np.random.default_rng(index).integers(0, 256, (60, 80, 3), dtype=np.uint8), t=index / 2.0)
    keeper.snapshot(session)
    shutil.rmtree(folder)
    shutil.copytree(tmp_path / "backup", folder)  # put back, a day later

    said: list[str] = []
    keeper = StateKeeper(StateSection(dir=str(folder)), say=said.append, wall=lambda: time.time() + DAY)
    resumed = keeper.restore(runtime)
    assert resumed.counters.frames == 6
    gap = runtime.config.video.max_gap_s
    assert said[0] == (f"the snapshot was saved 24 h 0 min ago by the wall clock (the daemon was down that long, a "
                       f"backup of state.dir was put back, or the clock was set after the snapshot, e.g. by NTP on a "
                       f"board without an RTC battery): the memory continues 1 h 0 min after its last frame "
                       f"(video.max_gap_s={gap:g})")
    assert said[1].startswith("resumed 2 s of memory")
    assert keeper.stream_time(0.0) == resumed.clock.last_t + gap
