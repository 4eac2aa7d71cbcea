"""The last alerts, kept under ``state.dir`` so that they outlive a restart as the memory does.

``GET /v1/alerts/events`` lists the last ``EVENTS_KEPT`` alerts and ``.../{id}/keyframe.jpg`` serves their
keyframes — the link an SSE client or a phone notification holds. Kept in memory only, both were gone after every
restart (a watchdog restart, a power cycle, an update) while the memory they were raised about came back. With
``state.dir`` each alert is written as it is raised to ``state.dir/alert-events/``, one small file an alert (its
JSON and keyframe; sealed with the ``privacy:`` key when one is set: an alert says what the device saw), the
oldest removed past ``EVENTS_KEPT``; a start reads them back. What ``POST /v1/forget`` drops goes from the folder
too. A file that does not read is set aside (``.bad``) and said; one sealed with a key this deployment lacks stops
the start, as a snapshot does. A failing disk costs the file, never the alert (logged and counted).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path

from edgekv.durable import replace_durably

log = logging.getLogger("edgekv.alerts")
FOLDER = "alert-events"
SUFFIX = ".evt"
FORMAT = 1
# What each field of a kept alert must be (``AlertEvent``'s, keyframe aside). A file that reads as JSON with a field
# of another type was listed, and then failed every ``GET /v1/alerts/events`` (``round`` of a string) and every
# forget (a string compared with a stream time) for as long as it was kept.
_TEXT, _NUMBER, _OPTIONAL_NUMBER = (str,), (int, float), (int, float, type(None))
FIELD_TYPES = {"id": _TEXT, "rule_id": _TEXT, "name": _TEXT, "question": _TEXT, "camera": (str, type(None)),
               "p_yes": _NUMBER, "stream_t": _OPTIONAL_NUMBER, "evidence_pair": (int, type(None)),
               "evidence_t": _OPTIONAL_NUMBER, "raised_unix": _NUMBER, "keyframe_note": _TEXT,
               "evidence_unix": _OPTIONAL_NUMBER}


def _check_fields(event) -> None:
    """``ValueError`` naming the first field of ``event`` that is not what an alert holds there."""
    for name, types in FIELD_TYPES.items():
        value = getattr(event, name)
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{name}: {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}: {value}")


_SEQUENCE = re.compile(r"s(\d+)-")


def _event_id(name: str) -> str:
    """The alert id in a kept file's name: ``s<sequence>-<ms>-<id>`` or the first files' ``<ms>-<id>``."""
    stem = name[:-len(SUFFIX)]
    return stem.split("-", 2)[2] if _SEQUENCE.match(stem) else stem.partition("-")[2]


class EventLog:
    """``state.dir/alert-events/``: one file an alert, at most ``keep``, named ``s<sequence>-<raised ms>-<id>`` in the
    order they were kept. Named by the wall time alone (as the first files were, ``<raised ms>-<id>``: read as older
    than any sequence-named one), an alert raised after the clock was set back sorted first, and past ``keep`` the
    newest alert was the one deleted, at once."""

    def __init__(self, folder: str | Path, keys=None, keep: int = 64) -> None:
        self.dir = Path(folder) / FOLDER
        self.keys = keys if keys is not None and keys.enabled else None  # edgekv.privacy.KeyRing
        self.keep = keep
        self.write_errors = 0
        self.set_aside = 0
        self._sequence: int | None = None  # the last file's, read from the folder at the first write

    def _path(self, event) -> Path:
        if self._sequence is None:
            numbers = [int(m.group(1)) for m in map(_SEQUENCE.match, (p.name for p in self.files())) if m]
            self._sequence = max(numbers, default=0)
        self._sequence += 1
        return self.dir / f"s{self._sequence:012d}-{int(event.raised_unix * 1000):015d}-{event.id}{SUFFIX}"

    def files(self) -> list[Path]:
        """The kept alerts' files, oldest first."""
        return sorted(self.dir.glob(f"*{SUFFIX}")) if self.dir.is_dir() else []

    def save(self, event) -> None:
        """Write ``event`` (temporary file, fsync, rename) and remove the oldest past ``keep``; a failing disk is
        logged and counted, never raised: the alert has gone out already."""
        try:
            self._write(event, self._path(event))
            for old in self.files()[:-self.keep]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            self.write_errors += 1
            log.warning("alerts: could not keep alert %s under %s (%s); it went out, and a restart will not list "
                        "it", event.id, self.dir, exc)

    def _write(self, event, path: Path) -> None:
        """``event``'s file ``path`` written whole or not at all; ``OSError`` when it could not be (the old file
        stays)."""
        from edgekv.privacy import seal_blob

        doc = {"format": FORMAT, **{f.name: getattr(event, f.name) for f in dataclasses.fields(event)
                                    if f.name != "keyframe_jpeg"}}
        if event.keyframe_jpeg is not None:
            doc["keyframe_jpeg_base64"] = base64.b64encode(event.keyframe_jpeg).decode()
        data = json.dumps(doc).encode()
        if self.keys is not None:
            data = seal_blob(self.keys, data)
        self.dir.mkdir(parents=True, exist_ok=True)
        replace_durably(path, data)

    def load(self) -> list:
        """The kept alerts, oldest first (``AlertEvent``s). ``SealError`` for a file sealed with a key this
        deployment lacks; a damaged one is set aside."""
        return [event for _, event in self._load()]

    def _load(self) -> list:
        """``load``'s alerts, each with its file: ``[(path, AlertEvent)]``."""
        from edgekv.apps.outputs.alerts import AlertEvent
        from edgekv.privacy import BLOB_MAGIC, SealError, open_blob, refuse_unknown_blob_key

        events = []
        names = {f.name for f in dataclasses.fields(AlertEvent)}
        if self.dir.is_dir():  # a write a crash cut short: never renamed, never read, removed at the next start
            for leftover in self.dir.glob(f".*{SUFFIX}.tmp-*"):
                leftover.unlink(missing_ok=True)
        for path in self.files()[-self.keep:]:
            try:
                data = path.read_bytes()
            except OSError as exc:
                self._aside(path, exc)
                continue
            sealed = data.startswith(BLOB_MAGIC)
            refuse_unknown_blob_key(self.keys, data, str(path))  # a key this deployment lacks: stop the start
            try:
                doc = json.loads(open_blob(self.keys, data, str(path)) if sealed else data)
                if doc.pop("format", None) != FORMAT:
                    raise ValueError(f"format, this edgekv reads {FORMAT}")
                jpeg = doc.pop("keyframe_jpeg_base64", None)
                event = AlertEvent(**{k: v for k, v in doc.items() if k in names},
                                   keyframe_jpeg=base64.b64decode(jpeg) if jpeg is not None else None)
                _check_fields(event)
            except (SealError, ValueError, TypeError, KeyError, AttributeError) as exc:  # cut short, damaged
                self._aside(path, exc)
                continue
            events.append((path, event))
        return events

    def _aside(self, path: Path, why: BaseException) -> None:
        self.set_aside += 1
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError:
            pass
        log.warning("alerts: %s does not read (%s); set aside as %s.bad", path, why, path.name)

    def forget(self, event_ids) -> int:
        """Remove the files of these alerts (``POST /v1/forget``); returns how many."""
        ids = set(event_ids)
        removed = 0
        for path in self.files():
            if _event_id(path.name) in ids:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def needs_reseal(self) -> list[Path]:
        """The kept alerts not sealed with the current key (``edgekv rekey``)."""
        from edgekv.privacy import blob_key_id

        if self.keys is None:
            raise ValueError("alerts: no current key to seal with")
        return [path for path in self.files() if blob_key_id(path.read_bytes()) != self.keys.current.id]

    def reseal(self) -> int:
        """Rewrite every kept alert sealed with the current key; returns how many were rewritten. A file that cannot
        be written is ``OSError`` (it stays as it was): through ``save``, which only logs, a full disk was counted
        as re-sealed and rekey said the old key could go while the alert stayed in the clear or under that key."""
        stale = {path.name for path in self.needs_reseal()}
        if not stale:
            return 0
        done = 0
        for path, event in self._load():
            if path.name in stale:
                self._write(event, path)  # under its own name: its place in the order stays
                done += 1
        return done
