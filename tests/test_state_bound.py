"""``state.max_mib`` bounds every byte under ``state.dir``, not the snapshots alone: the last alerts kept there
(``alert-events/``, 64 at most, each with its keyframe), the API's standing questions (``alerts.json``) and the
snapshot set aside count too. Two snapshots of a full cache and the files the keeper leaves alone must fit at the
start; the rest is the alerts', whose oldest go when the snapshots need the room — with real files written by the
alert log, as the daemon writes them."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest

import edgekv
from edgekv.apps.outputs import alert_log
from edgekv.apps.outputs.alert_log import EventLog
from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.config import StateSection
from edgekv.state import ALERT_EVENTS, StateKeeper, estimate_bytes


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint, tmp_path_factory):
    return edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 84], "fps": 2.0},
        cache={"policy": "statekv", "sinks": 8, "max_tokens": 120, "text_reserve_tokens": 40, "rebase_position": 40},
        engines={"engine_dir": str(tmp_path_factory.mktemp("engines"))})


def _frame(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, size=(60, 80, 3), dtype=np.uint8)


def _alert(index: int) -> AlertEvent:
    keyframe = np.random.default_rng(1000 + index).bytes(20_000)  # a keyframe's size, incompressible as a JPEG is
    return AlertEvent(f"e{index}", "alert-1", "door", "Is the door open?", None, 0.9, float(index), index,
                      float(index), 1_700_000_000.0 + index, keyframe)


def _used(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _full(runtime) -> int:
    return estimate_bytes(runtime.session())


def test_the_kept_alerts_and_the_snapshots_stay_within_state_max_mib_together(runtime, tmp_path):
    folder = tmp_path / "state"
    max_mib = (2 * _full(runtime) + 200_000) / 2**20  # two full snapshots, and room for a few alerts
    clock = _Clock()
    keeper = StateKeeper(StateSection(dir=str(folder), every_s=60.0, max_mib=max_mib), say=lambda line: None,
                         clock=clock)
    session = keeper.restore(runtime)
    (folder / "alerts.json").write_text('{"format": 1, "rules": []}')  # the API's standing questions
    events = EventLog(folder)
    written = 0
    for index in range(64):  # every kept alert the log allows, each a real file
        session.ingest(_frame(index), t=index / 2.0)
        events.save(_alert(index))
        if index % 8 == 7:
            clock.now += 61.0
        written += keeper.maybe_snapshot(session) is not None
        assert _used(folder) <= keeper.max_bytes, index
    assert written == 8 and len(keeper.generations()) == 2
    kept = [alert_log._event_id(p.name) for p in events.files()]
    assert 3 <= len(kept) < 64 and kept == [f"e{i}" for i in range(64 - len(kept), 64)]  # the newest ones
    assert keeper.alerts_removed == 64 - len(kept)
    assert (folder / "alerts.json").is_file()  # never removed
    assert [event.id for event in EventLog(folder).load()] == kept  # a restart lists what is kept
    resumed = StateKeeper(keeper.section, say=lambda line: None).restore(runtime)
    assert resumed.counters.frames == 64


def test_the_set_aside_snapshot_goes_before_the_kept_alerts(runtime, tiny_checkpoint, tmp_path):
    folder = tmp_path / "state"
    max_mib = (2 * _full(runtime) + 200_000) / 2**20
    section = StateSection(dir=str(folder), every_s=60.0, max_mib=max_mib)
    other = edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 84], "fps": 2.0},
        cache={"policy": "statekv", "sinks": 8, "max_tokens": 60, "text_reserve_tokens": 20, "rebase_position": 20},
        engines=dataclasses.asdict(runtime.config.engines))
    keeper = StateKeeper(section, say=lambda line: None)
    session = keeper.restore(other)
    for index in range(6):
        session.ingest(_frame(index), t=index / 2.0)
    keeper.snapshot(session)  # another deployment's memory: set aside at the next start
    keeper = StateKeeper(section, say=lambda line: None)
    session = keeper.restore(runtime)
    assert len(keeper.set_aside_files()) == 1
    events = EventLog(folder)
    for index in range(3):
        events.save(_alert(index))
        keeper.maybe_snapshot(session)
    assert len(keeper.set_aside_files()) == 1 and len(events.files()) == 3  # room for both yet
    index = 3
    while keeper.set_aside_files():
        events.save(_alert(index))
        keeper.maybe_snapshot(session)
        assert _used(folder) <= keeper.max_bytes
        index += 1
    assert keeper.alerts_removed == 0 and len(events.files()) == index  # no alert went while it was there


def test_the_start_counts_the_files_beside_the_snapshots_and_names_enough(runtime, tmp_path):
    """The bound is refused when two full snapshots do not fit beside the files already there (a damaged alerts.json
    set aside, 1 MiB), and the figure the refusal names is enough: a bound smaller than one snapshot said "raise
    state.max_mib to at least 0" of this toy's 0.33 MiB (rounded down)."""
    folder = tmp_path / "state"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"state.max_mib=0.1 cannot hold two snapshots of a full cache") as caught:
        StateKeeper(StateSection(dir=str(folder), max_mib=0.1), say=lambda line: None).restore(runtime)
    least = float(re.search(r"at least ([\d.]+)", str(caught.value)).group(1))
    assert least >= 2 * _full(runtime) / 2**20 and least > 0
    StateKeeper(StateSection(dir=str(folder), max_mib=least), say=lambda line: None).restore(runtime)

    (folder / "alerts.json.bad").write_bytes(b"x" * 2**20)
    with pytest.raises(ValueError, match=rf"beside the 1.00 MiB of other files in {re.escape(str(folder))}: raise "
                                         r"state.max_mib to at least ([\d.]+)") as caught:
        StateKeeper(StateSection(dir=str(folder), max_mib=least), say=lambda line: None).restore(runtime)
    more = float(re.search(r"at least ([\d.]+)", str(caught.value)).group(1))
    assert math.isclose(more, least + 1.0, abs_tol=0.11)
    StateKeeper(StateSection(dir=str(folder), max_mib=more), say=lambda line: None).restore(runtime)


def test_a_snapshot_with_no_room_is_not_written_and_says_what_takes_it(runtime, tmp_path):
    folder = tmp_path / "state"
    max_mib = (2 * _full(runtime) + 100_000) / 2**20
    keeper = StateKeeper(StateSection(dir=str(folder), max_mib=max_mib), say=lambda line: None)
    session = keeper.restore(runtime)
    for index in range(8):
        session.ingest(_frame(index), t=index / 2.0)
    assert keeper.snapshot(session) is not None
    (folder / "paused.json").write_bytes(b"x" * int(keeper.max_bytes))  # a file the keeper may not remove
    EventLog(folder).save(_alert(0))
    assert keeper.snapshot(session) is None
    assert re.fullmatch(r"[\d.]+ MiB needed \(this snapshot [\d.]+, the previous one [\d.]+, other files in state.dir "
                        r"[\d.]+\) exceeds state.max_mib=[\d.]+", keeper.last_error), keeper.last_error
    assert len(EventLog(folder).files()) == 1  # removing the alert would not have made the room: kept


def test_the_library_names_the_alert_logs_folder():
    assert ALERT_EVENTS == alert_log.FOLDER
