"""Standing questions across a restart: the memory comes back, and an alert about what it holds is not raised
again (apps/outputs/alerts.py, "With ``state.dir``"); the alerts raised before are listed again (alert_log.py).

Before, every rule restarted at "no": with the memory restored from ``state.dir``, a rule whose event the memory
still held rose at its first evaluation and alerted again — after every watchdog restart, power cycle or update,
one duplicate alert per rule. Each rule's verdict and the wall time it last fired are now kept beside the API's
rules in ``alerts.json`` (sealed with them), written at each edge.
"""

from __future__ import annotations

import json

import pytest

from edgekv.apps.outputs.alerts import AlertBus, AlertEngine, KeyframeRing, RuleStore
from edgekv.config import AlertRuleSection
from edgekv.session import YesNo

CONFIG_RULE = AlertRuleSection(question="Was there a purple triangle?", cooldown_s=60.0)


class Scripted:
    """A session whose probe returns the next scripted P(yes)."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def probe(self, question):
        return YesNo(self.values.pop(0), {3: 0.7}, 1.0)


class Clocks:
    """A monotonic clock that starts again at each 'boot' and a wall clock that goes on."""

    def __init__(self, wall: float) -> None:
        self.now, self.wall_now = 0.0, wall

    def boot(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall_now += seconds


def engine(folder, clocks: Clocks, keys=None) -> AlertEngine:
    return AlertEngine([CONFIG_RULE], AlertBus(), KeyframeRing(0), store=RuleStore(folder, keys),
                       clock=lambda: clocks.now, wall=lambda: clocks.wall_now)


def evaluate(engine_: AlertEngine, state, clocks: Clocks, *values: float) -> list[bool]:
    """One evaluation a second of each scripted P(yes): which raised an alert."""
    session, out = Scripted(*values), []
    for pair in range(len(values)):
        clocks.advance(1.0)
        out.append(engine_.evaluate(state, session, pair) is not None)
    return out


def test_a_restart_does_not_alert_again_for_what_the_memory_still_holds(tmp_path):
    clocks = Clocks(wall=1_000_000.0)
    first = engine(tmp_path, clocks)
    api = first.add(AlertRuleSection(question="Is the door open?", cooldown_s=60.0))
    config = next(state for state in first.list() if state.source == "config")
    assert evaluate(first, config, clocks, 0.1, 0.9) == [False, True]
    assert evaluate(first, api, clocks, 0.9) == [True]

    clocks.boot()  # a restart: the memory is back and still holds both events
    clocks.advance(120.0)  # past the cool-downs: only the verdict keeps them quiet
    second = engine(tmp_path, clocks)
    by_source = {state.source: state for state in second.list()}
    assert by_source["api"].id == api.id and by_source["config"].verdict and by_source["api"].verdict
    assert evaluate(second, by_source["config"], clocks, 0.95, 0.9) == [False, False]
    assert evaluate(second, by_source["api"], clocks, 0.9) == [False]
    # the event leaves the memory (the verdict falls), then a new one: an alert, as before the restart
    assert evaluate(second, by_source["config"], clocks, 0.1, 0.9) == [False, True]


def test_the_cool_down_goes_on_across_a_restart_by_the_wall_clock(tmp_path):
    clocks = Clocks(wall=2_000_000.0)
    first = engine(tmp_path, clocks)
    (rule,) = first.list()
    assert evaluate(first, rule, clocks, 0.9, 0.1) == [True, False]  # fired, then the event left: verdict "no"
    saved = json.loads((tmp_path / "alerts.json").read_text())
    assert saved["rules"] == [] and list(saved["verdicts"].values()) == [
        {"verdict": False, "last_fired": 2_000_001.0}]  # the config's rule: its verdict only, by what it asks

    clocks.boot()
    clocks.advance(10.0)  # 11 s after the alert
    second = engine(tmp_path, clocks)
    (rule,) = second.list()
    assert not rule.verdict
    assert evaluate(second, rule, clocks, 0.9) == [False]  # 12 s after the alert: within the 60 s cool-down
    assert evaluate(second, rule, clocks, 0.1) == [False]
    clocks.advance(50.0)
    assert evaluate(second, rule, clocks, 0.9) == [True]  # 64 s after: the cool-down is over


def test_a_wall_clock_set_back_holds_a_cool_down_at_most_once(tmp_path):
    clocks = Clocks(wall=3_000_000.0)
    first = engine(tmp_path, clocks)
    (rule,) = first.list()
    assert evaluate(first, rule, clocks, 0.9, 0.1) == [True, False]
    clocks.boot()
    clocks.wall_now -= 86_400.0  # the clock went back a day (no RTC battery, NTP not yet synced)
    second = engine(tmp_path, clocks)
    (rule,) = second.list()
    assert evaluate(second, rule, clocks, 0.9) == [False]  # taken as "just fired"
    assert evaluate(second, rule, clocks, 0.1) == [False]
    clocks.advance(60.0)
    assert evaluate(second, rule, clocks, 0.9) == [True]  # one cool-down later, not a day


def test_a_file_from_before_and_damaged_verdicts_read_as_no(tmp_path, caplog):
    clocks = Clocks(wall=4_000_000.0)
    (tmp_path / "alerts.json").write_text(json.dumps(
        {"format": 1, "rules": [{"id": "alert-1", "rule": {"question": "Is the door open?"}}]}))
    states = engine(tmp_path, clocks).list()
    assert [s.id for s in states if s.source == "api"] == ["alert-1"] and not any(s.verdict for s in states)
    (tmp_path / "alerts.json").write_text(json.dumps(
        {"format": 1, "rules": [{"id": "alert-1", "rule": {"question": "Is the door open?"}}], "verdicts": [1]}))
    states = engine(tmp_path, clocks).list()
    assert [s.id for s in states if s.source == "api"] == ["alert-1"] and not any(s.verdict for s in states)
    assert "verdicts do not read" in caplog.text and not (tmp_path / "alerts.json.bad").exists()


def test_the_verdicts_are_sealed_with_the_rules_and_kept_by_a_rekey(tmp_path):
    pytest.importorskip("cryptography")
    from edgekv.privacy import Key, KeyRing

    old, new = Key(b"\x01" * 32, "old"), Key(b"\x02" * 32, "new")
    clocks = Clocks(wall=5_000_000.0)
    first = engine(tmp_path, clocks, KeyRing(old))
    (rule,) = first.list()
    assert evaluate(first, rule, clocks, 0.9) == [True]
    data = (tmp_path / "alerts.json").read_bytes()
    assert data.startswith(b"EDGEKV-SEALBLOB") and b"verdict" not in data
    assert RuleStore(tmp_path, KeyRing(new, [old])).reseal()  # edgekv rekey
    clocks.boot()
    clocks.advance(120.0)
    (rule,) = engine(tmp_path, clocks, KeyRing(new)).list()
    assert rule.verdict


def test_the_daemon_restarted_on_its_memory_does_not_alert_again(tmp_path):
    """End to end with the shipped toy: a daemon with ``state.dir`` watches a stream in which a purple triangle
    appears and alerts once; it stops (its memory saved), starts again on the same state and watches an empty
    scene. The restored memory still holds the triangle — the rule's verdict stays "yes" — and no second alert is
    raised (before: one at the first evaluation)."""
    pytest.importorskip("fastapi")
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.config import EdgeKVConfig

    event_stream = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # triangle at pair 60
    empty_stream = "synthetic:events?size=112x112&fps=2&frames=40&seed=9&rate=0&noise=3"

    def run(source: str, out_name: str):
        config = EdgeKVConfig().with_overrides(
            model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
            video={"source": source, "fps": 2.0, "resolution": [112, 112]},
            cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
            server={"port": 0}, monitor={"backend": "cpu"}, state={"dir": str(tmp_path / "state")},
            alerts={"rules": [{"question": "Was there a purple triangle?", "every_pairs": 1, "name": "purple"}]})
        with open(tmp_path / out_name, "w") as log:
            daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True, exit_at_end=True), out=log)
            daemon.run()  # to the stream's end: its memory saved on the way out
        (rule,) = daemon.alerts.list()
        return rule, daemon

    first, daemon = run(event_stream, "first.txt")
    assert first.fired == 1 and first.verdict
    (raised,) = daemon.alert_bus.recent
    again, daemon = run(empty_stream, "second.txt")
    # the alert itself is listed again, its keyframe with it (state.dir/alert-events)
    (kept,) = daemon.alert_bus.recent
    assert kept.id == raised.id and kept.keyframe_jpeg == raised.keyframe_jpeg and kept.keyframe_jpeg[:2] == b"\xff\xd8"
    said = (tmp_path / "second.txt").read_text()
    assert "resumed 1 min of memory" in said  # the memory came back, and the rule's verdict with it (said)
    assert "standing questions resumed at 'yes'" in said and "purple" in said
    assert "1 alert(s) of earlier runs kept" in said
    # evaluated over the restored memory (how often: the fair share's call, frames waiting), which holds the triangle
    assert again.evaluations >= 1 and again.verdict and again.p_yes > again.rule.threshold
    assert again.fired == 0
