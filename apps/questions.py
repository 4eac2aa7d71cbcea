"""A question on its way through the daemon, whichever channel asked it (stdin, ``--ask``, HTTP, voice),
and the refusals every channel maps to its own "try later" (HTTP: 503).

Also ``printable``: request text made safe for one terminal or log line.
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

_question_ids = itertools.count(1)


@dataclass
class Question:
    """A question waiting for the main loop; ``done`` is set when ``answer`` or ``error`` is filled.

    ``source`` says where it came from: ``cli`` (``--ask``), ``stdin``, ``http``, ``voice``. ``on_token``
    is called with each answer token id from the main loop's thread.
    """

    text: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    recall: bool | None = None  # recall archived frame pairs (None: archive.recall when an archive is set)
    escalate: bool | None = None  # ask the escalation server (None: when the local answer's confidence is low)
    images: tuple[bytes, ...] = ()  # encoded images to answer about instead of the stream (server.image_requests)
    # each image's OpenAI ``detail`` ("low", "high", "auto"; None: not given), by position in ``images``: it changes
    # nothing here (every image is one frame pair at video.resolution) but goes with the image when it escalates
    image_details: tuple[str | None, ...] = ()
    stream: bool = False  # its tokens go out as they come (a streamed chat): only escalated when it asks
    on_token: object = None
    on_escalating: object = None  # called (escalator's thread) once it waits on the escalation server
    source: str = "cli"
    evidence: bool | int = False  # also find the frame pair(s) the question attends most (``evidence_pair``, the
    # fleet's; a number K: the first K in ``evidence_seen``, a chat's ``evidence``)
    history: tuple = ()  # the conversation before it, (role, text) turns (a chat's earlier messages)
    answer_prefix: str = ""  # the start of the assistant's reply, continued by the model (its answer: the rest)
    window: tuple[float, float] | None = None  # read only the pairs stamped in it (stream seconds) ...
    window_unix: tuple[float, float] | None = None  # ... or seen between two wall times (each camera's own map) ...
    window_last_s: float | None = None  # ... or in the last seconds of the stream when it is answered
    answer: object = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)  # the asker left: stop at the next token
    id: int = field(default_factory=lambda: next(_question_ids))
    asked_at: float = field(default_factory=time.time)
    answered_at: float | None = None
    evidence_pair: int | None = None
    evidence_seen: tuple = ()  # (pair, stream seconds or None, wall time or None) of each pair asked for, most first


def evidence_item(pair: int, t: float | None, unix: float | None, kept: bool = False,
                  camera: str | None = None) -> dict:
    """One evidence pair as the API gives it: its index, stream seconds, wall time (seconds since the epoch) and
    the same as ISO 8601 with the daemon's UTC offset (a time the daemon does not know is null), and where its
    frame can be fetched while the daemon keeps it (the keyframe ring, the evidence frames on disk; else null)."""
    time.tzset()  # the zone the device is in now (C keeps the one it read first: a wearer who flew)
    seen = (datetime.datetime.fromtimestamp(unix).astimezone().isoformat(timespec="milliseconds")
            if unix is not None else None)
    frame = f"/frame.jpg?pair={pair}" + (f"&camera={urllib.parse.quote(camera)}" if camera else "") if kept else None
    return {"pair": pair, "t": t, "unix": unix, "seen": seen, "frame": frame}


class QuestionRefused(Exception):
    """The daemon will not answer this question now; nothing is wrong with it (HTTP: 503)."""

    status = 503


class DaemonBusy(QuestionRefused, queue.Full):
    """``server.queue_size`` questions are already waiting: retry shortly. (A ``queue.Full`` too.)"""


class DaemonStopping(QuestionRefused):
    """The daemon is shutting down (SIGTERM): it takes no new question and refuses the queued ones."""


class AskerLeft(QuestionRefused):
    """The asker disconnected (an HTTP client closed its connection): the answer was stopped, or never begun."""


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def printable(text: str, limit: int | None = 400) -> str:
    """``text`` made safe for one terminal or log line: newlines, terminal escape sequences, lone
    surrogates and every other non-printable character become backslash escapes (and a backslash
    itself doubles), so request text can neither crash an encoder nor forge a line like ``A: …``.
    Longer than ``limit`` characters: cut, saying how long it was."""
    if limit is not None and len(text) > limit:
        return printable(text[:limit], None) + f"… ({len(text)} characters)"
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def logs_text(daemon) -> bool:
    """``privacy.log_text`` of ``daemon``'s config (True for a stand-in without one): may its log hold the text of
    questions and answers?"""
    privacy = getattr(getattr(daemon, "config", None), "privacy", None)
    return privacy.logs_text() if privacy is not None else True
