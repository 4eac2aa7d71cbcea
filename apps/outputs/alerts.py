"""Standing questions: yes/no questions evaluated over the live cache as the stream goes on, an alert on each
rising edge (no -> yes).

A rule (``alerts.rules`` in the config, or ``POST /v1/alerts``) is evaluated after every ``every_pairs``-th
frame pair, or at the first pair after ``every_s`` seconds (every pair by default): nothing changes in the
cache between pairs, so there is nothing new to evaluate. One evaluation is ``StreamSession.probe``: one
prefill of the question's tokens over the cache and the model's yes/no verdict at the first answer token
(P(yes) among its yes and no tokens); no answer token is decoded and the question's slots are dropped, so the
cache stays query-agnostic (DESIGN invariant 3). The daemon runs evaluations in its loop as answer steps, so
the fair share (``video.min_ingest_share``) bounds what they take from ingest.

A rule is "yes" once P(yes) passes ``threshold`` and falls back to "no" below ``threshold - 0.2`` (hysteresis:
a verdict near the line does not flicker into a burst of alerts). The no -> yes edge raises an ``AlertEvent`` —
the question, the stream time and wall time, the camera, P(yes), and a keyframe: the frame of the pair the
question attended most, when it is still among the last ``alerts.keyframe_pairs`` pairs (else the latest
frame, said so). A rule that fired stays quiet for ``cooldown_s``. The verdict starts at "no": a rule added
while the condition already holds fires at its first evaluation.

With ``state.dir`` (the memory kept over restarts) each rule's verdict and the wall time it last fired are kept
beside the API's rules (``RuleStore``, written at each edge): the memory comes back after a restart, and with a
"no" verdict every rule whose event it holds would fire again — after every watchdog restart, an alert about what
was already alerted. A restored rule goes on from its verdict, and its cool-down from the wall time it fired.

Events go to every output through ``AlertBus.publish``, which only puts them in each output's bounded queue.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgekv.config import AlertRuleSection, AlertsSection
from edgekv.durable import replace_durably
from edgekv.session import WindowEmpty

log = logging.getLogger("edgekv.alerts")
HYSTERESIS = 0.2
MAX_RULES = AlertsSection.max_rules  # the config's default
EVENTS_KEPT = 64


class AlertSink(Protocol):
    """An output: ``offer`` never blocks (a full queue drops and counts)."""

    def offer(self, event: "AlertEvent") -> None: ...


@dataclass(frozen=True)
class AlertEvent:
    id: str
    rule_id: str
    name: str
    question: str
    camera: str | None
    p_yes: float
    stream_t: float | None       # the stream time of the pair that raised it (seconds)
    evidence_pair: int | None    # the frame pair the question attended most
    evidence_t: float | None     # its stream time
    raised_unix: float
    keyframe_jpeg: bytes | None = field(default=None, repr=False)
    keyframe_note: str = ""
    evidence_unix: float | None = None  # the wall time the evidence pair was seen at (the session's clock map)

    def to_json(self, keyframe: str = "url") -> dict:
        """JSON for an output: ``keyframe`` "url" (the API's /v1/alerts/events/{id}/keyframe.jpg), "base64"
        (webhooks, MQTT: the receiver may not reach the API) or "none"."""
        out = {"type": "edgekv.alert", "id": self.id, "rule_id": self.rule_id, "name": self.name,
               "question": self.question, "camera": self.camera, "p_yes": round(self.p_yes, 4),
               "stream_t": self.stream_t, "evidence_pair": self.evidence_pair, "evidence_t": self.evidence_t,
               "evidence_unix": self.evidence_unix, "raised_unix": self.raised_unix,
               "keyframe_note": self.keyframe_note}
        if self.keyframe_jpeg is not None and keyframe == "url":
            out["keyframe_url"] = f"/v1/alerts/events/{self.id}/keyframe.jpg"
        elif self.keyframe_jpeg is not None and keyframe == "base64":
            import base64

            out["keyframe_jpeg_base64"] = base64.b64encode(self.keyframe_jpeg).decode()
        return out


@dataclass
class RuleState:
    """A rule and what its evaluations found."""

    rule: AlertRuleSection
    id: str
    source: str = "config"   # config | api
    verdict: bool = False
    p_yes: float | None = None
    evaluations: int = 0
    fired: int = 0
    last_pair: int | None = None
    last_eval: float | None = None    # monotonic
    last_fired: float | None = None   # monotonic
    last_fired_wall: float | None = None  # time.time(): what a restart carries the cool-down by (RuleStore)
    eval_ms_total: float = 0.0

    @property
    def key(self) -> str:
        """What the rule's saved verdict is found by after a restart: the API's rules by their id; the config's by
        what they ask (their ids follow the API's rules restored before them, so they can change)."""
        if self.source == "api":
            return self.id
        text = json.dumps(dataclasses.asdict(self.rule), sort_keys=True)
        return "config:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        return self.rule.name or self.rule.question

    def to_json(self) -> dict:
        rule = self.rule
        return {"id": self.id, "name": self.name, "question": rule.question, "every_pairs": rule.every_pairs,
                "every_s": rule.every_s, "cooldown_s": rule.cooldown_s, "threshold": rule.threshold,
                "camera": rule.camera, "window_s": rule.window_s, "source": self.source,
                "verdict": "yes" if self.verdict else "no",
                "p_yes": self.p_yes, "evaluations": self.evaluations, "fired": self.fired,
                "eval_ms_mean": self.eval_ms_total / self.evaluations if self.evaluations else None}


class PairTimes:
    """Frame pair -> stream time for the last ``capacity`` pairs, in two arrays allocated once (16 bytes a pair; a
    pair's slot is ``pair % capacity``, so a new pair takes the place of the one ``capacity`` pairs before it). A dict
    of Python ints and floats takes ~96 bytes a pair (6 MiB at 65,536, reached after 18 h at a pair a second, RSS
    growing all the while) and its oldest key costs a scan past the deleted ones. The dict calls the daemon makes
    (``get``, ``pop``, ``items``, ``[]``, ``in``) work as on a dict; any thread (a lock keeps a pair and its time
    together)."""

    _NONE = np.iinfo(np.int64).min  # an empty slot

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = int(capacity)
        self._pairs = np.full(self.capacity, self._NONE, dtype=np.int64)
        self._times = np.zeros(self.capacity, dtype=np.float64)
        self._count = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._pairs.nbytes + self._times.nbytes

    def __setitem__(self, pair: int, t: float) -> None:
        slot = int(pair) % self.capacity
        with self._lock:
            self._count += int(self._pairs[slot] == self._NONE)
            self._pairs[slot], self._times[slot] = int(pair), float(t)

    def get(self, pair: int | None, default: float | None = None) -> float | None:
        if pair is None:
            return default
        slot = int(pair) % self.capacity
        with self._lock:
            return float(self._times[slot]) if self._pairs[slot] == int(pair) else default

    def __getitem__(self, pair: int) -> float:
        t = self.get(pair)
        if t is None:
            raise KeyError(pair)
        return t

    def __contains__(self, pair: object) -> bool:
        return isinstance(pair, (int, np.integer)) and self.get(int(pair)) is not None

    def pop(self, pair: int, default: float | None = None) -> float | None:
        slot = int(pair) % self.capacity
        with self._lock:
            if self._pairs[slot] != int(pair):
                return default
            self._pairs[slot] = self._NONE
            self._count -= 1
            return float(self._times[slot])

    def items(self) -> list[tuple[int, float]]:
        """The (pair, time) held, oldest pair first (a copy: the caller may ``pop`` while walking it)."""
        with self._lock:
            held = np.flatnonzero(self._pairs != self._NONE)
            pairs, times = self._pairs[held], self._times[held]
        order = np.argsort(pairs, kind="stable")
        return [(int(p), float(t)) for p, t in zip(pairs[order], times[order])]

    def keys(self) -> list[int]:
        return [pair for pair, _ in self.items()]

    def values(self) -> list[float]:
        return [t for _, t in self.items()]

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        return iter(self.keys())


class KeyframeRing:
    """The last ``pairs`` ingested frames by frame pair (one frame each), and the last ``TIMES_KEPT`` pairs' stream
    times (what an answer's evidence time needs)."""

    TIMES_KEPT = 1 << 16  # 1 MiB of (pair, time), allocated once; older pairs' times come from the session

    def __init__(self, pairs: int) -> None:
        self.pairs = pairs
        self.frames: OrderedDict[int, np.ndarray] = OrderedDict()
        self.times = PairTimes(self.TIMES_KEPT)
        self.latest: tuple[int, np.ndarray] | None = None

    def add(self, pair: int, frame: np.ndarray, t: float) -> None:
        self.times[pair] = t
        self.latest = (pair, frame)
        if self.pairs:
            self.frames[pair] = frame
            while len(self.frames) > self.pairs:
                self.frames.popitem(last=False)

    def jpeg_of(self, pair: int) -> bytes | None:
        """That pair's frame as JPEG while the ring keeps it (any thread: one lookup, no iteration), else None."""
        frame = self.frames.get(pair)
        return _encoded(frame) if frame is not None else None

    def jpeg(self, pair: int | None) -> tuple[bytes | None, str]:
        if pair is not None and pair in self.frames:
            frame, note = self.frames[pair], f"frame pair {pair}, the one the question attended most"
        elif self.latest is not None:
            frame = self.latest[1]
            note = (f"latest frame (pair {self.latest[0]}); the pair attended most ({pair}) is older than the "
                    f"last {self.pairs} kept for keyframes" if pair is not None else f"latest frame (pair {self.latest[0]})")
        else:
            return None, "no frame yet"
        return _encoded(frame), note


def _encoded(frame) -> bytes | None:
    """A kept frame as the JPEG an alert, an escalation or an answer's evidence shows (quality 85)."""
    from edgekv.images import encode_jpeg

    try:
        return encode_jpeg(frame, 85)
    except ValueError:  # not a picture (an empty frame): no keyframe, as OpenCV's failed encode gave
        return None


class AlertBus:
    """Fan-out of events to the outputs, and the last ``EVENTS_KEPT`` events (for the API)."""

    def __init__(self, log=None) -> None:  # log: an EventLog (apps/outputs/alert_log.py; it imports this module)
        self.sinks: list[AlertSink] = []
        self.recent: deque[AlertEvent] = deque(maxlen=EVENTS_KEPT)
        self._lock = threading.Lock()
        # state.dir/alert-events (apps/outputs/alert_log.py): the last alerts, read back at a start
        self.log = log
        if log is not None:
            self.recent.extend(log.load())

    def add(self, sink: AlertSink) -> None:
        with self._lock:
            self.sinks.append(sink)

    def remove(self, sink: AlertSink) -> None:
        with self._lock:
            if sink in self.sinks:
                self.sinks.remove(sink)

    def publish(self, event: AlertEvent) -> None:
        with self._lock:
            self.recent.append(event)
            sinks = list(self.sinks)
            if self.log is not None:  # never raises: a failing disk costs the file, not the alert. Under the lock:
                self.log.save(event)  # a forget between the append and the file would leave the file behind
        for sink in sinks:
            try:
                sink.offer(event)
            except Exception:  # an output's bug must not stop the stream
                log.exception("alert output %r failed to take an alert", sink)

    def forget(self, t_from: float, t_to: float) -> int:
        """Drop the alerts (and their keyframes) raised about a forgotten window; returns how many."""
        with self._lock:
            kept = [e for e in self.recent if not (e.stream_t is not None and t_from <= e.stream_t <= t_to)
                    and not (e.evidence_t is not None and t_from <= e.evidence_t <= t_to)]
            gone = [e.id for e in self.recent if e not in kept]
            self.recent.clear()
            self.recent.extend(kept)
            if self.log is not None and gone:
                self.log.forget(gone)
        return len(gone)

    def event(self, event_id: str) -> AlertEvent | None:
        with self._lock:
            return next((e for e in self.recent if e.id == event_id), None)


class AlertEngine:
    """The standing questions of one stream (one camera): which are due, their verdicts, their alerts."""

    def __init__(self, rules: list[AlertRuleSection], bus: AlertBus, keyframes: KeyframeRing,
                 camera: str | None = None, clock=time.monotonic, max_rules: int = MAX_RULES,
                 store: "RuleStore | None" = None, check=None, wall=time.time, log_text: bool = True) -> None:
        self.bus, self.keyframes, self.camera, self.clock, self.wall = bus, keyframes, camera, clock, wall
        self.log_text = log_text  # privacy.log_text: an alert's line names its rule by id, not by its question
        self.check = check  # check(rule): ValueError when the question cannot be evaluated (too long for the cache)
        self.max_rules = max_rules  # alerts.max_rules: each is evaluated over the cache, and held, while it stands
        self.rules: dict[str, RuleState] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self.store = None  # set below, once the saved rules are back: restoring them does not write the file
        self.restored: list[RuleState] = []
        self.dropped: list[str] = []  # saved rules beyond max_rules at this start (said by the daemon)
        self.save_errors = 0
        for rule_id, rule in store.load() if store is not None else []:  # the API's rules keep their ids
            if len(self.rules) + len(rules) >= self.max_rules:
                self.dropped.append(rule_id)
                continue
            try:
                self.restored.append(self.add(rule, source="api", rule_id=rule_id))
            except ValueError as exc:  # no longer fits (cache.text_reserve_tokens lowered since): left out, said
                log.warning("alerts: saved standing question %s left out: %s", rule_id, exc)
                self.dropped.append(rule_id)
        numbers = [int(state.id.rpartition("-")[2]) for state in self.restored
                   if state.id.rpartition("-")[2].isdigit()]
        self._ids = itertools.count(max(numbers, default=0) + 1)  # an id is not given again to another rule
        for rule in rules:
            self.add(rule, source="config")
        self._resume(store.verdicts if store is not None else {})
        self.store = store
        if self.dropped:
            self._save()

    def _resume(self, saved: dict[str, dict]) -> None:
        """Each rule's verdict and cool-down as the last run left them (``RuleState.key``; module docstring)."""
        now_wall, now = self.wall(), self.clock()
        for state in self.list():
            entry = saved.get(state.key)
            if not entry:
                continue
            state.verdict = bool(entry.get("verdict", False))
            fired = entry.get("last_fired")
            if isinstance(fired, (int, float)):
                # a wall clock set back since makes it "just fired": the cool-down is at most one cool-down long
                state.last_fired_wall = float(fired)
                state.last_fired = now - min(max(now_wall - float(fired), 0.0), state.rule.cooldown_s + 1.0)

    def add(self, rule: AlertRuleSection, source: str = "api", rule_id: str | None = None) -> RuleState:
        """``rule`` as a standing question of this stream. With a ``camera`` (one of ``video.sources``) the rule
        is this camera's: it says so (a rule for every camera, ``camera`` unset, takes this one's name here) and
        its id is ``<camera>-alert-<n>``, unique across the cameras of one daemon. A rule the API adds
        (``source="api"``) is saved in the ``RuleStore`` at once, so it stands again after a restart."""
        rule.validate("alert")
        if self.check is not None:
            self.check(rule)
        if rule.camera is not None and self.camera is not None and rule.camera != self.camera:
            raise ValueError(f"alert.camera: {rule.camera!r} is not a camera of this daemon ({self.camera!r})")
        if self.camera is not None and rule.camera is None:
            rule = dataclasses.replace(rule, camera=self.camera)
        prefix = f"{self.camera}-" if self.camera is not None else ""
        with self._lock:
            if len(self.rules) >= self.max_rules:
                raise ValueError(f"alerts: {len(self.rules)} standing questions already"
                                 f"{f' on camera {self.camera}' if self.camera is not None else ''}, the most "
                                 f"alerts.max_rules allows ({self.max_rules}); delete one first (DELETE /v1/alerts/ID)")
            if rule_id is None or rule_id in self.rules:
                rule_id = next(i for i in (f"{prefix}alert-{n}" for n in self._ids) if i not in self.rules)
            state = RuleState(rule, id=rule_id, source=source)
            self.rules[state.id] = state
        if source == "api":
            self._save()
        return state

    def remove(self, rule_id: str) -> bool:
        with self._lock:
            state = self.rules.pop(rule_id, None)
        if state is not None and state.source == "api":
            self._save()
        return state is not None

    def _save(self) -> None:
        """The API's rules to the store (a failing disk is logged and counted: the rules stand until the stop)."""
        if self.store is None:
            return
        try:
            with self._save_lock:  # one writer at a time (one temporary file), each writing the rules as they are
                with self._lock:
                    every = list(self.rules.values())
                self.store.save([state for state in every if state.source == "api"],
                                {state.key: {"verdict": state.verdict, "last_fired": state.last_fired_wall}
                                 for state in every if state.verdict or state.last_fired_wall is not None})
        except OSError as exc:
            self.save_errors += 1
            log.warning("alerts: could not save the standing questions to %s (%s); they stand until the daemon "
                        "stops", self.store.path, exc)

    def list(self) -> list[RuleState]:
        with self._lock:
            return list(self.rules.values())

    def due(self, pair: int) -> list[RuleState]:
        """The rules to evaluate now that frame pair ``pair`` is in the cache."""
        now = self.clock()
        out = []
        for state in self.list():
            rule = state.rule
            if rule.every_pairs is not None:
                ready = (pair + 1) % rule.every_pairs == 0
            elif rule.every_s is not None:
                ready = state.last_eval is None or now - state.last_eval >= rule.every_s
            else:
                ready = True
            if ready and state.last_pair != pair:
                out.append(state)
        return out

    def evaluate(self, state: RuleState, session, pair: int) -> AlertEvent | None:
        """One evaluation of ``state``'s question over ``session`` (its lock taken by ``probe``); the alert if
        its verdict rose."""
        try:
            if state.rule.window_s is None:
                verdict = session.probe(state.rule.question)
            else:  # the last window_s seconds, up to the newest frame
                verdict = session.probe(state.rule.question, window=session.last_seconds(state.rule.window_s))
        except WindowEmpty:  # nothing of the window is held (a camera stalled or paused): the verdict stands
            state.last_pair, state.last_eval = pair, self.clock()
            return None
        now = self.clock()
        state.evaluations += 1
        state.eval_ms_total += verdict.ms
        state.p_yes, state.last_pair, state.last_eval = verdict.p_yes, pair, now
        threshold = state.rule.threshold
        rising = not state.verdict and verdict.p_yes > threshold
        if state.verdict and verdict.p_yes < threshold - HYSTERESIS:
            state.verdict = False
            self._save()  # an edge: what a restart goes on from
        elif rising:
            state.verdict = True
        if not rising:
            return None
        if state.last_fired is not None and now - state.last_fired < state.rule.cooldown_s:
            self._save()
            return None
        state.last_fired, state.last_fired_wall = now, self.wall()
        state.fired += 1
        self._save()
        (evidence,) = verdict.top_pairs(1) or (None,)
        jpeg, note = self.keyframes.jpeg(evidence)
        evidence_t = self._time_of(session, evidence)
        wall_time = getattr(session, "wall_time", None)  # the session's clock map: when the evidence was seen
        event = AlertEvent(uuid.uuid4().hex[:16], state.id, state.name, state.rule.question,
                           state.rule.camera or self.camera, verdict.p_yes, self.keyframes.times.get(pair), evidence,
                           evidence_t, time.time(), jpeg, note,
                           evidence_unix=wall_time(evidence_t) if wall_time is not None and evidence_t is not None
                           else None)
        if self.log_text:
            log.info("alert %r: %r (P(yes) %.2f at pair %d)", state.name, state.rule.question, verdict.p_yes, pair)
        else:  # a rule added through the API is a user's text, and its name may be the question itself
            log.info("alert on rule %s (P(yes) %.2f at pair %d; its question not logged: privacy.log_text)", state.id,
                     verdict.p_yes, pair)
        self.bus.publish(event)
        return event

    def _time_of(self, session, pair: int | None) -> float | None:
        if pair is None:
            return None
        held = getattr(session, "pair_times", {})
        return held.get(pair, self.keyframes.times.get(pair))

    def stats(self) -> dict[str, Any]:
        rules = self.list()
        evaluations = sum(r.evaluations for r in rules)
        return {"alert_rules": len(rules), "alert_evaluations": evaluations, "alerts_fired": sum(r.fired for r in rules),
                "alert_eval_ms_total": sum(r.eval_ms_total for r in rules)}


class RuleStore:
    """The standing questions the API added, in ``state.dir/alerts.json`` (one daemon's, one camera's), so that
    they stand again after a restart as the memory does: rewritten whole at each add and delete (temporary file,
    fsync, rename), ids kept (clients delete by id). With a ``privacy:`` key it is sealed with it (the questions
    say what the device watches for). A file that does not read is set aside (``alerts.json.bad``) and said, never
    a reason not to start; one sealed with a key this deployment does not have stops the start, as a snapshot
    does (``SealError``)."""

    NAME = "alerts.json"
    FORMAT = 1

    def __init__(self, folder: str | Path, keys=None) -> None:
        self.path = Path(folder) / self.NAME
        self.keys = keys if keys is not None and keys.enabled else None  # edgekv.privacy.KeyRing
        # Each rule's verdict and last alert as ``load`` found them (``RuleState.key`` -> {"verdict", "last_fired"}):
        # an optional key of the same format, which an edgekv before it leaves alone.
        self.verdicts: dict[str, dict] = {}

    def load(self) -> list[tuple[str, AlertRuleSection]]:
        from edgekv.privacy import BLOB_MAGIC, SealError, open_blob, refuse_unknown_blob_key

        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        if data.startswith(BLOB_MAGIC):
            refuse_unknown_blob_key(self.keys, data, str(self.path))  # a key this deployment lacks: stop the start
            try:
                data = open_blob(self.keys, data, str(self.path))
            except SealError as exc:  # cut short, or it does not authenticate: damaged
                return self._set_aside(exc)
        try:
            doc = json.loads(data)
            if doc.get("format") != self.FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, this edgekv reads {self.FORMAT}")
            out = []
            for item in doc["rules"]:
                rule = AlertRuleSection(**item["rule"])
                rule.validate(f"{self.path}: rule {item['id']}")
                out.append((str(item["id"]), rule))
            verdicts = doc.get("verdicts", {})
            if isinstance(verdicts, dict) and all(isinstance(v, dict) for v in verdicts.values()):
                self.verdicts = verdicts
            else:  # the rules read: they stand; the verdicts start at "no", as they did before they were kept
                log.warning("alerts: %s: its verdicts do not read (not an object of objects); the rules start at "
                            "'no'", self.path)
            return out
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self._set_aside(exc)

    def _set_aside(self, why: BaseException) -> list:
        aside = self.path.with_name(self.NAME + ".bad")
        try:
            os.replace(self.path, aside)
        except OSError as exc:  # a read-only state.dir: the damaged file stays, and is still no reason not to start
            log.warning("alerts: %s does not read (%s) and could not be set aside (%s); the API's standing questions "
                        "start empty", self.path, why, exc)
            return []
        log.warning("alerts: %s does not read (%s); set aside as %s, the API's standing questions start empty",
                    self.path, why, aside.name)
        return []

    def save(self, states: list[RuleState], verdicts: dict[str, dict] | None = None) -> None:
        """The API's rules (``states``) and every rule's verdict (``verdicts``, by ``RuleState.key``)."""
        from edgekv.privacy import seal_blob

        doc = {"format": self.FORMAT, "rules": [{"id": s.id, "rule": dataclasses.asdict(s.rule)} for s in states]}
        if verdicts:
            doc["verdicts"] = verdicts
        data = json.dumps(doc, indent=1).encode()
        if self.keys is not None:
            data = seal_blob(self.keys, data)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(self.path, data)

    def needs_reseal(self) -> bool:
        """The file is there and not sealed with the current key (in the clear, or under another key)."""
        from edgekv.privacy import blob_key_id

        if self.keys is None:
            raise ValueError("alerts: no current key to seal with")
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False
        return blob_key_id(data) != self.keys.current.id

    def reseal(self) -> bool:
        """Rewrite the file sealed with the current key (``edgekv rekey``); False when it already is, or absent."""
        if not self.needs_reseal():
            return False
        rules = self.load()
        if not self.path.exists():  # it did not read: set aside, nothing to seal
            return False
        self.save([RuleState(rule, id=rule_id, source="api") for rule_id, rule in rules], self.verdicts)
        return True
