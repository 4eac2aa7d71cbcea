"""A forget is noted on disk before it starts and struck off when every part is done, so one cut short is finished
at the next start.

``Daemon.forget`` removes a window from several files one after the other: the archive's segments (each rewritten
whole or not at all), the evidence frames, the alert files, then a new snapshot, and only then the older snapshots
are deleted. Power lost part way (a wearable's battery, a pulled plug, ``kill -9``, a watchdog restart) left the
older snapshot on disk, and the next start restored the forgotten window into the cache: a wearer told "forgotten"
(or told nothing, the connection gone) had it back. The journal is the write-ahead record a database keeps for the
same reason: the window, in the stream's own seconds, is written, fsynced and renamed into place before the first
file is touched; the start reads what is pending and does it again (a forget done twice removes nothing more) before
the camera's first frame goes in.

The journal holds times and stream ids, never what was seen: what a log line of the forget says already.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

from edgekv.durable import fsync_dir, replace_durably

log = logging.getLogger("edgekv.forget")


class ForgetJournal:
    """``forget-pending.json`` in ``folder``: a list of forgets begun and not yet done (none: no file)."""

    NAME = "forget-pending.json"

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.path = folder / self.NAME if folder is not None else None

    def pending(self) -> list[dict]:
        """The forgets noted and not struck off. A journal that cannot be read raises ``JournalError``, which names
        the file and what to do: the caller says it (a forget may be unfinished), never passes over it."""
        if self.path is None:
            return []
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise JournalError(f"{self.path} cannot be read ({exc}): a forget noted there may not be finished; "
                               "delete it once the window is forgotten again (edgekv forget)") from exc
        entries = data.get("pending") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not all(_valid(entry) for entry in entries):
            raise JournalError(f"{self.path} is not a forget journal edgekv wrote: a forget noted there may not be "
                               "finished; delete it once the window is forgotten again (edgekv forget)")
        return entries

    def add(self, stretches: list[tuple[float, float]], pad_s: float, archive_stream: str | None,
            frame_stream: str | None) -> dict:
        """Note a forget about to begin (written, fsynced, renamed over the journal). Raises OSError when it cannot
        be written: the caller goes on and says what a crash would leave."""
        entry = {"id": uuid.uuid4().hex, "stretches": [[float(a), float(b)] for a, b in stretches], "pad_s": pad_s,
                 "archive_stream": archive_stream, "frame_stream": frame_stream, "noted_unix": time.time()}
        try:
            entries = self.pending()
        except JournalError as exc:  # a damaged journal is replaced: what it held is said, never silently lost
            log.warning("forget: %s", exc)
            entries = []
        self._write(entries + [entry])
        return entry

    def done(self, entry_id: str) -> None:
        """Strike one forget off (the file goes with the last)."""
        entries = [entry for entry in self.pending() if entry["id"] != entry_id]
        if entries:
            self._write(entries)
        elif self.path is not None:
            self.path.unlink(missing_ok=True)
            fsync_dir(self.folder)

    def _write(self, entries: list[dict]) -> None:
        assert self.path is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        replace_durably(self.path, json.dumps({"pending": entries}).encode())


class JournalError(OSError):
    """The journal exists and cannot be read as one."""


def _valid(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        return False
    stretches = entry.get("stretches")
    if not isinstance(stretches, list) or not stretches:
        return False
    for stretch in stretches:
        if (not isinstance(stretch, list) or len(stretch) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in stretch)):
            return False
    return (isinstance(entry.get("pad_s"), (int, float)) and not isinstance(entry.get("pad_s"), bool)
            and all(isinstance(entry.get(key), (str, type(None))) for key in ("archive_stream", "frame_stream")))
