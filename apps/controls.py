"""The wearer's controls on every camera: the privacy switch (pause / resume) and forget, from the HTTP API and
the voice. With several cameras (``video.sources``, apps/daemon/cameras.py) the daemon that serves the API and
hears the voice is the first camera's, and ``daemon.cameras`` holds every camera's daemon by name; a control that
reached the first camera alone would leave the others watching and remembering. So would a question typed on stdin
or spoken to the microphone that only the first camera answered: ``route`` sends it to the camera it names at its
start ("back: ...", "Back camera, ...") or to each. Here, below the rooms that call it (server, voice, daemon), so
that neither imports the daemon's."""

from __future__ import annotations

import re
from typing import Any

from edgekv.apps.questions import printable


def every_camera(daemon) -> dict:
    """The daemons the wearer's controls reach from ``daemon`` (the one that serves the API and hears the voice):
    every camera's by name with ``video.sources``, else ``daemon`` alone."""
    cameras = getattr(daemon, "cameras", None)
    return dict(cameras) if cameras else {getattr(daemon, "camera", None): daemon}


def addressed(text: str, names) -> tuple[str | None, str]:
    """The camera ``text`` names at its start, and the question after it: ``back: what ...`` (typed, ``--ask``),
    ``Back camera, what ...`` / ``On the back camera, what ...`` (spoken: faster-whisper capitalises and writes a
    comma or a full stop there; "camera" makes the punctuation optional). ``(None, text)`` when it names none."""
    names = sorted((str(name) for name in names if name), key=len, reverse=True)  # "front-left" before "front"
    if not names:
        return None, text
    found = re.match(r"\s*(?:(?:ask|on|in|from)\s+)?(?:the\s+)?(?P<name>" + "|".join(map(re.escape, names))
                     + r")(?:\s+camera\s*[:,.?]?|\s*[:,])\s*(?P<rest>.*)$", text, re.IGNORECASE | re.DOTALL)
    if found is None:
        return None, text
    name = next(n for n in names if n.lower() == found["name"].lower())
    rest = found["rest"].strip()
    return name, rest[:1].upper() + rest[1:]  # what follows the name starts the sentence


def route(daemon, text: str) -> list[tuple[Any, Any, str]]:
    """``(camera name, its daemon, question text)`` for each camera a question from ``daemon``'s stdin or
    microphone goes to: the one it names, else every camera (one camera: ``daemon`` itself, the text as it is).
    A camera's name with nothing after it ("back:") is refused (``ValueError``), not asked of every camera."""
    cameras = every_camera(daemon)
    if len(cameras) == 1:
        name, target = next(iter(cameras.items()))
        return [(name, target, text)]
    name, rest = addressed(text, cameras)
    if name is not None and not rest:
        raise ValueError(f"{printable(text, 80)!r} names the camera {name} but asks it nothing")
    if name is not None:
        return [(name, cameras[name], rest)]
    return [(name, target, text) for name, target in cameras.items()]


def privacy_state(daemon) -> dict:
    """``{"paused", "reason"}``: paused only when every camera is (a switch that left one watching is not off);
    with several cameras also each one's."""
    reasons = {name: d.paused for name, d in every_camera(daemon).items()}
    out: dict[str, Any] = {"paused": all(r is not None for r in reasons.values()),
                           "reason": next((r for r in reasons.values() if r is not None), None)}
    if len(reasons) > 1:
        out["cameras"] = {name: {"paused": r is not None, "reason": r} for name, r in reasons.items()}
    return out


def _each(daemon, act, errors: tuple = ()) -> dict:
    """``act(d)`` on every camera's daemon, by name. A camera whose step raises one of ``errors`` does not stop the
    others; the first such error is raised after them, naming its camera (as it was, with one camera)."""
    results, failed = {}, None
    for name, d in every_camera(daemon).items():
        try:
            results[name] = act(d)
        except errors as exc:
            failed = failed or (name, exc)
    if failed is not None:
        name, exc = failed
        if name is None:
            raise exc
        raise type(exc)(f"camera {name}: {exc}")
    return results


def pause_every(daemon, reason: str) -> bool:
    """The privacy switch: every camera stops ingest and releases its source. True if any was watching."""
    return any(_each(daemon, lambda d: d.pause(reason)).values())


def resume_every(daemon) -> bool:
    """Every paused camera reopens its source and goes on; one that cannot stays paused while the others resume
    (its error raised after them). True if any resumed."""
    return any(_each(daemon, lambda d: d.resume(), (OSError, ValueError)).values())


def forget_every(daemon, t_from: float | None = None, t_to: float | None = None, last_s: float | None = None,
                 unix: tuple[float, float] | None = None) -> dict:
    """``Daemon.forget`` on every camera (``last_s``: the last seconds by the wall clock, what each camera saw in
    them — by its own stream clock for a recording read as fast as it goes; ``unix``: what each camera saw between two
    wall times, by its own wall-clock map). One
    camera: its result. Several: the totals (``pairs``, ``cache_tokens_freed``, ``cache_slots``, ``archive``) and
    each camera's result under ``cameras``; a camera whose files could not be rewritten does not stop the others
    from forgetting."""
    results = _each(daemon, lambda d: d.forget(t_from, t_to, last_s=last_s, unix=unix), (OSError,))
    if len(results) == 1:
        return next(iter(results.values()))
    archives = [r["archive"] for r in results.values() if r.get("archive")]
    return {"pairs": sum(r["pairs"] for r in results.values()),
            "cache_tokens_freed": sum(r.get("cache_tokens_freed", 0) for r in results.values()),
            "cache_slots": sum(r["cache_slots"] for r in results.values()),
            "archive": ({"pairs": sum(a["pairs"] for a in archives), "bytes": sum(a["bytes"] for a in archives),
                         **({"frames": sum(a.get("frames", 0) for a in archives)}
                            if any("frames" in a for a in archives) else {})} if archives else None),
            "cameras": results}
