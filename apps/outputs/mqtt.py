"""The fleet over MQTT 5 (``fleet:`` in the config): each daemon announces itself to a broker, publishes its
alerts and status, and answers fleet questions; ``ask_fleet`` / ``edgekv ask --fleet`` asks every device at
once and gathers the answers.

The specification is OASIS "MQTT Version 5.0" (2019); section numbers below are its. Topics (``P`` is
``fleet.topic_prefix``, ``D`` the device id)::

    P/devices/D/status   retained  {"type": "edgekv.status", "state": "online" | "offline", "unix", "since",
                                    "every_s", "expires_s", stream, cache, ...}
    P/devices/D/alerts             AlertEvent.to_json("base64") + "device"
    P/fleet/ask                    a question to every device        (request: Response Topic + Correlation Data)
    P/devices/D/ask                a question to this device only
    P/fleet/forget                 a stretch to forget on every device (request, as a question; fleet.accept_forget)
    P/devices/D/forget             ... on this device only           -> {"type": "edgekv.fleet.forgot", device,
                                                                         camera, result | error}
    <Response Topic>               {"type": "edgekv.fleet.answer", device, camera, answer, evidence_t,
                                    evidence_unix (its wall time, or null), ttft_s, ...; with "frame": true
                                    evidence_jpeg_base64 (its frame, or null where the device keeps none)}

A fleet question is an MQTT 5 request (§4.10): JSON ``{"question": "...", "max_new_tokens": N, "camera": "back",
"last_s": S, "frame": true}`` (all but the question optional; ``last_s``: read only the last S seconds of each device's stream, on
its own clock — "did any camera see a person in the last five minutes?"; or ``"from"`` / ``"to"``, wall times as
ISO 8601 strings: what each device saw between them, by its own wall-clock map — "did any robot see the red box
between 10:00 and 10:05?"; stream seconds are each device's own and mean nothing to the fleet) published with a
Response Topic
(§3.3.2.3.5) and Correlation Data (§3.3.2.3.6). A device with several cameras (``video.sources``) asks the one
named, or each, and publishes one answer per camera, each naming its ``camera`` and listing every camera asked
(``cameras``), so that an asker knows how many to wait for. The device answers it through
``daemon.submit(Question(..., source="fleet"))`` like any other channel (so the fair share and the question queue's
bound hold) and publishes the answer to the Response Topic with the same Correlation Data. The answer carries its
evidence: the frame pair the question's tokens attend most over the cache (one probe
of the same question prefill the answer starts with, ``apps/questions.evidence_pair``) and that pair's stream time.

QoS and retain, and why:
- status: QoS 1, **retained**. The broker keeps each device's last status, so an asker that connects later
  learns at once who is in the fleet and who is online. QoS 1 because a lost "offline" would leave a dead
  device looking alive; a duplicate is harmless (a status is a last value, not an event). It is refreshed every
  ``status_every_s`` (its ``every_s``) and on each (re)connection (``since``: when this connection began).
- freshness: a device can vanish without its will ever firing (a broker restarted with persistence while the device
  was down, a retained status left by an older client, a half-open link the broker has not noticed yet), and its
  retained "online" would then make every asker wait out its timeout. So the "online" status carries a Message
  Expiry Interval (§3.3.2.3.3; ``expires_s``: ten refreshes, at least ``STATUS_KEPT_MIN_S``) and the broker drops
  it when it is not refreshed; and an asker takes a device whose status is older than two refreshes plus
  ``STATUS_STALE_GRACE_S`` as not answering (``stale_after_s``) instead of waiting for it. The age is the broker's
  own count (``expires_s`` less the expiry left when the broker hands the status on, §3.3.2.3.3), so no device's
  clock is trusted; a status of an older device (no ``every_s``) is aged by its ``unix`` on the asker's clock and
  taken as stale past ``LEGACY_STALE_S``; a status without ``unix`` is waited for as before. "offline" never
  expires: the fleet keeps knowing the devices that left.
- all statuses in: an asker cannot tell from MQTT itself when the broker has sent every retained status (they are
  sent "at the time of the subscribe", Retain Handling 0, §3.8.3.1, with no end marker, and nothing in §3.8.4 has
  them sent before the SUBACK), so with every device offline or stale it used to wait its whole timeout for an answer
  nobody could send. After each SUBACK it publishes a marker (QoS 1, empty, Correlation Data naming the connection)
  to its own reply topic and takes the marker's return as "every retained status delivered" only from a broker known
  to deliver a subscription's retained messages before anything published after its SUBACK: Mosquitto, which queues
  them on the session while it handles the SUBSCRIBE (eclipse/mosquitto ``src/handle_subscribe.c``,
  ``retain__queue`` before ``send__suback``; 2.0.11 writes them after the SUBACK, from that queue) and sends a
  session's queue in order. The broker says so with its own retained ``$SYS/broker/version`` ("mosquitto version
  ..."), subscribed last in the same SUBSCRIBE, which must come back before the marker on the same connection; then,
  if no device is online and fresh, the asker says so and returns at once (``FleetResult.nobody_online``). Last,
  because Mosquitto drops the retained messages past a full session queue (``max_queued_messages``, 1000, beyond the
  20 in flight: 480 of 1,500 statuses were never sent here), and then the version with them: no early answer from a
  fleet it could not deliver whole. Nothing else can say it: MQTT orders messages only per topic and publisher
  (§4.6 "Ordered Topic"), not a retained status against a later publication, on any topic or topic filter. HiveMQ
  sends retained messages only once the SUBACK is written, looked up asynchronously and in batches of at most 25
  (hivemq-community-edition ``IncomingSubscribeService`` adds ``SendRetainedMessagesListener`` to the SUBACK's write),
  and EMQX from a pool worker (``emqx_retainer``'s ``session.subscribed`` hook casts to
  ``emqx_retainer_dispatcher``, which sends them to the session, rate-limited by ``retainer.flow_control``): there a
  marker, even one on a topic the statuses' filter matches, can come back before an "online" status, so on those, on
  a Mosquitto without ``$SYS`` (``sys_interval 0``) or whose ACL keeps ``$SYS/broker/version`` from the asker, and
  wherever the marker is refused, the wait is as it was: until the answers or the timeout. Only the statuses at the
  marker decide: a device that goes offline or stale later (a broker restarting mid-wait fires every will) is waited
  for as before, since it may come back and answer the question asked again.
- last will (§3.1.2.5): the same topic, QoS 1, retained, ``"state": "offline"``: a device that vanishes without
  a DISCONNECT (power cut, link cut past the keep-alive) is marked offline by the broker, after
  ``will_delay_s`` (§3.1.3.2.2) so that a short blip does not flap. A clean stop publishes "offline" itself.
- alerts: QoS 1, not retained. At least once: an alert lost in a reconnect is worse than one seen twice (each
  carries its ``id`` to deduplicate). Retaining one would show a stale alert to every new subscriber as new.
- questions: QoS 1, not retained, with a Message Expiry Interval (§3.3.2.3.3) of the asker's timeout. A
  retained question would be asked again of every device at every reconnection; QoS 1 survives a retransmit
  on a flaky link and the device drops the duplicate (same Response Topic and Correlation Data). Each
  connection starts clean (§3.1.2.4): questions asked while a device was away are not kept for it (the asker
  has stopped waiting; it lists the device as silent instead). An asker that lost the broker mid-wait (a broker
  restart) subscribes again and asks again with a ``repeat`` User Property: a device that had already answered
  drops the duplicate question but sends its kept answer again (its last ``ANSWERS_KEPT`` requests'), as the first
  may have gone out while nobody was subscribed.
- answers: QoS 1, not retained (an answer is for the one asker who is listening on its Response Topic).
QoS 2 is nowhere: every message here is either idempotent or deduplicated, and its extra round trip would
cost every answer's latency.

Bounds: nothing queues without bound. ``offer`` (alerts, from the main loop) and finished answers go into this
output's own queue (``fleet.queue`` messages; when full the oldest waiting is dropped and counted), drained by
its thread while connected, at most ``WINDOW`` messages handed to paho and not yet acknowledged (PUBACK) at a
time; paho's own queue is capped a little above that (``max_queued_messages_set``), so a burst waits in the
bounded queue here instead of overflowing paho's. Questions enter the daemon's bounded question queue (a full queue answers
"busy"). A received payload over ``fleet.max_payload_bytes`` is dropped and counted; the device tells the
broker its Maximum Packet Size (§3.1.2.11.4) of 4x that plus 64 KiB, so anything larger never reaches its
memory (the broker discards it). While the broker is unreachable the daemon goes on ingesting and answering
locally; paho reconnects with exponential backoff (``fleet.reconnect_backoff_s``: first, doubling, max).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from edgekv.apps.outputs.alerts import AlertEvent, KeyframeRing, PairTimes
from edgekv.apps.questions import DaemonBusy, DaemonStopping, Question, QuestionRefused, printable
from edgekv.apps.wall_times import cli_window, wall_text, window_bounds
from edgekv.config import FleetSection, broker_address
from edgekv.seconds import real_seconds

log = logging.getLogger("edgekv.fleet")
PACKET_HEADROOM = 65536     # topic names and properties beside a payload
SEEN_KEPT = 256             # (response topic, correlation data) of recent questions: QoS 1 duplicates dropped
WINDOW = 20                 # messages handed to paho and not yet acknowledged (paho's default in-flight bound)
STOP_FLUSH_S = 2.0          # a clean stop waits this long for what is queued and the "offline" status
REQUEST_KEYS = ("question", "max_new_tokens", "camera", "last_s", "from", "to", "frame")
STATUS_STALE_GRACE_S = 10.0  # an online status older than two refreshes and this is a device gone (stale_after_s)
STATUS_KEPT_MIN_S = 300      # an online status not refreshed expires from the broker after at least this
LEGACY_STALE_S = 300.0       # an older device's status (no every_s, refreshed every 30 s by default): stale past this
ANSWERS_KEPT = 32            # requests whose answers a device keeps to send again when asked with "repeat"
REPEAT = ("edgekv", "repeat")  # the User Property of a request asked again after the asker lost the broker
MAX_EXPIRY_S = 2**32 - 1     # a Message Expiry Interval is a four-byte integer (§3.3.2.3.3)
BROKER_VERSION_TOPIC = "$SYS/broker/version"  # Mosquitto's retained version (the module's docstring, "all statuses in")
ORDERED_BROKER = b"mosquitto version "        # ... of a broker known to queue retained messages first


def status_expiry_s(every_s: float) -> int:
    """How long the broker keeps an "online" status that is not refreshed: ten refreshes, at least
    ``STATUS_KEPT_MIN_S``."""
    return min(MAX_EXPIRY_S, max(STATUS_KEPT_MIN_S, math.ceil(10 * every_s)))


def stale_after_s(every_s: float) -> float:
    """The age past which an "online" status refreshed every ``every_s`` is a device gone: two refreshes missed."""
    return 2 * every_s + STATUS_STALE_GRACE_S


class FleetError(RuntimeError):
    """The fleet cannot be reached or refused us (one line: what and why)."""


class FleetMessageError(ValueError):
    """A fleet message that cannot be answered; ``kind`` is the counter it is dropped under."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _paho():
    try:
        import paho.mqtt.client as mqtt
    except ImportError:
        raise FleetError("the fleet needs paho-mqtt (pip install 'edgekv[fleet]')") from None
    return mqtt


# ---------------------------------------------------------------------------------------------- topics
@dataclass(frozen=True)
class FleetTopics:
    prefix: str = "edgekv"

    def status(self, device: str) -> str:
        return f"{self.prefix}/devices/{device}/status"

    def alerts(self, device: str) -> str:
        return f"{self.prefix}/devices/{device}/alerts"

    def ask_device(self, device: str) -> str:
        return f"{self.prefix}/devices/{device}/ask"

    @property
    def ask_all(self) -> str:
        return f"{self.prefix}/fleet/ask"

    def forget_device(self, device: str) -> str:
        return f"{self.prefix}/devices/{device}/forget"

    @property
    def forget_all(self) -> str:
        return f"{self.prefix}/fleet/forget"

    def is_forget(self, topic: str) -> bool:
        return topic == self.forget_all or (topic.startswith(f"{self.prefix}/devices/") and topic.endswith("/forget"))

    @property
    def statuses(self) -> str:
        return f"{self.prefix}/devices/+/status"

    def reply(self, token: str) -> str:
        return f"{self.prefix}/replies/{token}"

    def device_of_status(self, topic: str) -> str | None:
        head, tail = f"{self.prefix}/devices/", "/status"
        if topic.startswith(head) and topic.endswith(tail):
            device = topic[len(head):-len(tail)]
            return device if device and "/" not in device else None
        return None


# ---------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class FleetRequest:
    """A fleet question as it arrived: the text, its token bound, and where the answer goes."""

    question: str
    max_new_tokens: int | None
    response_topic: str
    correlation: bytes | None
    camera: str | None = None  # one camera of a device with several (None: each)
    last_s: float | None = None  # read only the last so many seconds of each stream (None: the whole memory)
    wall: tuple[float, float] | None = None  # ... or what each device saw between two wall times (epoch seconds)
    frame: bool = False  # also send the evidence pair's frame (a JPEG, base64) where the device keeps it


def response_topic_of(properties) -> str | None:
    """The message's Response Topic when it is one a client may publish to, else None."""
    topic = getattr(properties, "ResponseTopic", None) if properties is not None else None
    if not isinstance(topic, str) or not topic or any(c in topic for c in "+#\0"):
        return None
    return topic


def _request_body(payload: bytes, properties, max_bytes: int, keys: tuple, expected: str) -> tuple[dict, str]:
    """A fleet request's JSON object (only ``keys``) and its Response Topic; ``FleetMessageError`` (``oversized``,
    ``malformed``) naming what is wrong."""
    if len(payload) > max_bytes:
        raise FleetMessageError("oversized", f"payload of {len(payload)} bytes is over fleet.max_payload_bytes "
                                             f"({max_bytes})")
    response_topic = response_topic_of(properties)
    if response_topic is None:
        raise FleetMessageError("malformed", "no Response Topic (an MQTT 5 request names where its answer goes) "
                                             "or one with a wildcard")
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FleetMessageError("malformed", f"not JSON ({printable(str(exc), 120)})") from None
    except RecursionError:  # arrays or objects nested past the decoder's recursion: paho's thread must not die of it
        raise FleetMessageError("malformed", "not JSON (nested too deeply to decode)") from None
    if not isinstance(body, dict):
        raise FleetMessageError("malformed", f"expected {expected}, got {type(body).__name__}")
    unknown = sorted(set(body) - set(keys))
    if unknown:
        raise FleetMessageError("malformed", f"unknown key {printable(unknown[0], 60)!r} (known: {', '.join(keys)})")
    return body, response_topic


def parse_request(payload: bytes, properties, max_bytes: int, max_new_tokens: int) -> FleetRequest:
    """Check a fleet question; raises ``FleetMessageError`` (kind ``oversized`` or ``malformed``) naming what is
    wrong."""
    body, response_topic = _request_body(payload, properties, max_bytes, REQUEST_KEYS, "a JSON object with a question")
    question = body.get("question")
    if not isinstance(question, str) or not question.strip():
        raise FleetMessageError("malformed", "question: expected a non-empty string, got "
                                             f"{printable(repr(question), 60)}")
    tokens = body.get("max_new_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or not 1 <= tokens <= max_new_tokens):
        raise FleetMessageError("malformed", f"max_new_tokens: expected an integer from 1 to {max_new_tokens}, "
                                             f"got {printable(repr(tokens), 60)}")
    camera = body.get("camera")
    if camera is not None and (not isinstance(camera, str) or not camera.strip()):
        raise FleetMessageError("malformed", f"camera: expected a camera's name, got {printable(repr(camera), 60)}")
    last_s = body.get("last_s")
    if last_s is not None and (isinstance(last_s, bool) or not isinstance(last_s, (int, float))
                               or not 0 < last_s < float("inf")):
        raise FleetMessageError("malformed", f"last_s: expected seconds > 0, got {printable(repr(last_s), 60)}")
    frame = body.get("frame", False)
    if not isinstance(frame, bool):
        raise FleetMessageError("malformed", f"frame: expected true or false, got {printable(repr(frame), 60)}")
    correlation = getattr(properties, "CorrelationData", None)
    return FleetRequest(question, tokens, response_topic, bytes(correlation) if correlation is not None else None,
                        camera, real_seconds(last_s) if last_s is not None else None, _wall_window(body), frame)


def _wall_window(body: dict) -> tuple[float, float] | None:
    """A fleet question's ``from`` / ``to``: wall times (ISO 8601 strings), both or neither, not with ``last_s``."""
    if "from" not in body and "to" not in body:
        return None
    if "last_s" in body:
        raise FleetMessageError("malformed", "give either from and to, or last_s, not both")
    t_from, t_to = body.get("from"), body.get("to")
    if not isinstance(t_from, str) or not isinstance(t_to, str):
        raise FleetMessageError("malformed", "from and to: expected two wall times (ISO 8601 strings such as "
                                             "\"2026-12-04T10:03:00+01:00\"); stream seconds are each device's own")
    try:
        _, start, end = window_bounds(t_from, t_to)
    except ValueError as exc:
        raise FleetMessageError("malformed", printable(str(exc), 200)) from None
    return start, end


FORGET_KEYS = ("from", "to", "last_s", "camera")
FORGETS_QUEUED = 4  # fleet forgets waiting for the forget thread; past it one is refused ("busy")


@dataclass(frozen=True)
class FleetForget:
    """A fleet forget as it arrived: ``Daemon.forget``'s keywords (``unix`` or ``last_s``) and where its result
    goes."""

    window: dict
    response_topic: str
    correlation: bytes | None
    camera: str | None = None


def parse_forget(payload: bytes, properties, max_bytes: int) -> FleetForget:
    """Check a fleet forget: ``{"from": ISO, "to": ISO}`` (wall times: what each device saw then, by its own clock)
    or ``{"last_s": S}`` (each device's last seconds), ``camera`` optional; ``FleetMessageError`` naming what is
    wrong."""
    body, response_topic = _request_body(payload, properties, max_bytes, FORGET_KEYS, "a JSON object")
    camera = body.pop("camera", None)
    if camera is not None and (not isinstance(camera, str) or not camera.strip()):
        raise FleetMessageError("malformed", f"camera: expected a camera's name, got {printable(repr(camera), 60)}")
    if any(not isinstance(body.get(key), str) for key in ("from", "to") if key in body):
        raise FleetMessageError("malformed", "from and to: expected two wall times (ISO 8601 strings such as "
                                             "\"2026-12-04T10:03:00+01:00\"); stream seconds are each device's own")
    from edgekv.apps.wall_times import forget_request

    try:
        window = forget_request(body)
    except ValueError as exc:
        raise FleetMessageError("malformed", printable(str(exc), 200)) from None
    correlation = getattr(properties, "CorrelationData", None)
    return FleetForget(window, response_topic, bytes(correlation) if correlation is not None else None, camera)


# ---------------------------------------------------------------------------------------------- hosts
class FleetHost(Protocol):
    """What answers a device's fleet questions: the daemon (``DaemonHost``) or a bare session (``SessionHost``)."""

    camera: str | None

    def submit(self, question: Question) -> None: ...   # never blocks; QuestionRefused when it cannot take it

    def status(self) -> dict: ...                      # stream and cache figures for the status message

    def evidence_time(self, pair: int | None) -> float | None: ...  # stream time of a frame pair

    # optional: ``cameras() -> dict[str, FleetHost]``, each camera of a device with several (``DaemonHost``);
    # ``wall_time(t) -> float | None``, the wall time a stream time was seen at (the session's wall-clock map)


def camera_name(source: int | str) -> str:
    """``video.source`` as a fleet may see it: a camera index, a file's name, a URL without its credentials."""
    import re

    head = str(source).partition("?")[0]  # a camera's mode (?width=...&fourcc=MJPG) is not its name
    if isinstance(source, int) or head.isdigit():
        return f"camera {head}"
    if head.startswith("/dev/"):
        return os.path.basename(head)  # /dev/video0, udev's /dev/v4l/by-id/usb-Logitech_...-video-index0
    text = re.sub(r"://[^/\s]*@", "://", str(source))  # user:password@ anywhere (a gst: pipeline's rtspsrc too)
    if "://" in text and not text.startswith(("gst:", "csi:")):
        from urllib.parse import urlsplit

        parts = urlsplit(text)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"
    if text.startswith(("synthetic:", "gst:", "csi:")):
        return text
    return os.path.basename(text.rstrip("/")) or text


class DaemonHost:
    """The camera daemon as a fleet host: questions through ``Daemon.submit``, figures read without its lock
    (plain counters; a status never waits for an answer to finish)."""

    def __init__(self, daemon, camera: str | None = None) -> None:
        self.daemon = daemon
        self.one_camera = camera is not None  # one camera's host among several: its own daemon, never split
        self.camera = camera or daemon.config.fleet.camera or camera_name(daemon.config.video.source)

    def cameras(self) -> dict[str, "DaemonHost"]:
        """Each camera's host by name where the daemon watches several (``video.sources``), else empty."""
        from edgekv.apps.controls import every_camera

        daemons = {} if self.one_camera else every_camera(self.daemon)
        return {name: DaemonHost(d, name) for name, d in daemons.items()} if len(daemons) > 1 else {}

    def submit(self, question: Question) -> None:
        self.daemon.submit(question)

    def status(self) -> dict:
        daemon, session = self.daemon, self.daemon.session
        out: dict[str, Any] = {"stream_state": daemon.stream_state, "stream_detail": daemon.stream_detail,
                               "questions_waiting": daemon.questions.qsize()}
        if session is not None:
            counters, cache = session.counters, session.cache
            out.update(frames=counters.frames, frame_pairs=counters.frame_pairs, questions=counters.questions,
                       compressions=counters.compressions, cache_tokens=cache.length,
                       cache_capacity_tokens=cache.capacity, cache_capacity_bytes=cache.capacity_bytes)
        cameras = self.cameras()
        if cameras:  # several: the figures above are the first camera's; each camera's by name
            out["cameras"] = {name: host.status() for name, host in cameras.items()}
        return out

    def evidence_time(self, pair: int | None) -> float | None:
        return self.daemon.seen(pair)[1] if pair is not None else None  # the cache's time, else the ring's

    def wall_time(self, t: float | None) -> float | None:
        return self.daemon.session.wall_time(t) if t is not None else None

    def evidence_jpeg(self, pair: int) -> bytes | None:
        keyframe = getattr(self.daemon, "keyframe_jpeg", None)
        return keyframe(pair) if callable(keyframe) else None

    def forget(self, **window) -> dict:
        """A fleet forget on this camera: ``Daemon.forget`` (cache, snapshots, archive, evidence frames, alerts)."""
        return self.daemon.forget(**window)


class SessionHost:
    """A fleet host without a daemon: one ``StreamSession`` whose questions are answered in a thread of its own
    (simulated devices: ``edgekv bench fleet``, tests). Sessions of one runtime share its model, so answers of
    hosts given the same ``model_lock`` run one at a time."""

    def __init__(self, session, camera: str, queue_size: int = 16, model_lock: threading.Lock | None = None) -> None:
        self.session, self.camera = session, camera
        self.questions: deque[Question] = deque()
        self.queue_size = queue_size
        self.times = PairTimes(KeyframeRing.TIMES_KEPT)  # evidence times of the last pairs (a dict grew a float a pair)
        self.stream_state = "running"
        self._lock = model_lock or threading.Lock()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="edgekv-fleet-host", daemon=True)

    def ingest(self, frame, t: float, captured_unix: float | None = None) -> None:
        with self._lock:
            result = self.session.ingest(frame, t=t, captured_unix=captured_unix)
        if result.pair_index is not None:
            self.times[result.pair_index] = t

    def start(self) -> "SessionHost":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(10)

    def submit(self, question: Question) -> None:
        with self._cond:
            if self._stop:
                raise DaemonStopping("this device is stopping")
            if len(self.questions) >= self.queue_size:
                raise DaemonBusy(f"{self.queue_size} questions are already waiting; try again shortly")
            self.questions.append(question)
            self._cond.notify()

    def status(self) -> dict:
        counters, cache = self.session.counters, self.session.cache
        return {"stream_state": self.stream_state, "frames": counters.frames, "frame_pairs": counters.frame_pairs,
                "questions": counters.questions, "cache_tokens": cache.length,
                "cache_capacity_tokens": cache.capacity, "cache_capacity_bytes": cache.capacity_bytes,
                "questions_waiting": len(self.questions)}

    def evidence_time(self, pair: int | None) -> float | None:
        return self.times.get(pair) if pair is not None else None

    def wall_time(self, t: float | None) -> float | None:
        return self.session.wall_time(t) if t is not None else None

    def forget(self, unix: tuple[float, float] | None = None, last_s: float | None = None, **stream) -> dict:
        """A fleet forget on this session's cache: every stretch it saw between two wall times, or its last
        seconds (a simulated device keeps nothing else)."""
        with self._lock:
            if unix is not None:
                stretches = self.session.wall_stretches(*unix)
            else:
                last = self.session.clock.last_t or 0.0
                stretches = [(last - last_s, last)] if last_s is not None else [(stream["t_from"], stream["t_to"])]
            removed = [self.session.forget(a, b) for a, b in stretches]
        pairs = sorted({p for r in removed for p in r.get("pairs", [])})
        for pair in pairs:
            self.times.pop(pair, None)
        return {"pairs": len(pairs), "stretches": [list(s) for s in stretches],
                "cache_tokens_freed": sum(r.get("tokens", 0) for r in removed),
                "cache_slots": sum(r.get("slots", 0) for r in removed)}

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.questions and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                question = self.questions.popleft()
            try:
                with self._lock:
                    # the evidence as the daemon names it: the pairs the answering token attended most
                    window = (self.session.wall_window(*question.window_unix) if question.window_unix is not None
                              else self.session.last_seconds(question.window_last_s)
                              if question.window_last_s is not None else None)
                    question.answer = self.session.ask(question.text, max_new_tokens=question.max_new_tokens,
                                                       temperature=question.temperature,
                                                       evidence=1 if question.evidence else 0, window=window)
                    if question.evidence and question.answer.evidence:
                        question.evidence_pair = question.answer.evidence[0]
            except Exception as exc:  # the asker gets the error; the device goes on
                question.error = exc
            finally:
                question.answered_at = time.time()
                question.done.set()


class _Done(threading.Event):
    """A question's ``done`` event that also hands the question to the fleet output when it is set (by the
    main loop, which must not wait: the callback only queues)."""

    def __init__(self, callback) -> None:
        super().__init__()
        self._callback = callback

    def set(self) -> None:
        super().set()
        try:
            self._callback()
        except Exception:  # an output's bug must not reach the main loop
            log.exception("fleet: answer not queued")


# ---------------------------------------------------------------------------------------------- the device
@dataclass
class _Outgoing:
    topic: str
    payload: bytes
    kind: str                      # alert | answer
    correlation: bytes | None = None


class FleetAgent:
    """One device in the fleet: connection, status, alerts (an ``AlertBus`` sink) and fleet questions."""

    def __init__(self, section: FleetSection, host: FleetHost, password: str | None = None,
                 device_id: str | None = None) -> None:
        if section.broker is None:
            raise FleetError("fleet.broker is not set")
        self.section, self.host, self._password = section, host, password
        self.device = device_id or section.device_id or socket.gethostname().split(".")[0]
        self.topics = FleetTopics(section.topic_prefix)
        self.broker_host, self.broker_port, self.tls = broker_address(section.broker)
        self.outbox: deque[_Outgoing] = deque()
        self.counts: dict[str, int] = dict.fromkeys(
            ("connects", "disconnects", "connect_refused", "connect_failed", "questions_received", "answered",
             "answer_errors", "refused_busy", "dropped_malformed", "dropped_oversized", "duplicates", "alerts_sent",
             "answers_sent", "status_sent", "outbox_dropped", "paho_queue_full", "forgets_received", "forgets_done",
             "forgets_refused", "twins_seen", "answers_resent", "status_echoed"), 0)
        # this process's mark in its status: a status under our device_id with another mark, stored by the broker
        # after ours was, is a second device configured with the same id (_on_status)
        self.instance, self._own_status_seen = uuid.uuid4().hex[:12], False
        self._forgets: deque = deque()  # (FleetForget, host, cameras asked) for the forget thread
        self._forget_thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.connected = threading.Event()
        self._seen: OrderedDict[tuple[str, bytes | None], None] = OrderedDict()
        # the answers sent to the last ANSWERS_KEPT requests, sent again to an asker that asks again ("repeat")
        self._sent: OrderedDict[tuple[str, bytes | None], list[_Outgoing]] = OrderedDict()
        self._since: float | None = None  # wall time this connection began (the status's "since")
        self._pending = 0
        self._refused = False  # the last CONNACK refused us (its disconnect is no news)
        self._unacked: set[int] = set()     # message ids handed to paho, no PUBACK yet (at most WINDOW)
        self._acked_early: set[int] = set()  # PUBACKs that came before publish() returned their id
        self._status_due = True
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._client = None
        self._thread = threading.Thread(target=self._run, name="edgekv-fleet", daemon=True)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "FleetAgent":
        mqtt = _paho()
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        section = self.section
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgekv-{self.device}",
                             protocol=mqtt.MQTTv5)
        client.max_inflight_messages_set(WINDOW)
        client.max_queued_messages_set(WINDOW + 4)  # the window, the status and the "offline" status on stop
        client.reconnect_delay_set(section.reconnect_backoff_s[0], section.reconnect_backoff_s[1])
        if section.username is not None:
            client.username_pw_set(section.username, self._password)
        if self.tls:
            client.tls_set(ca_certs=section.ca_file, certfile=section.cert_file, keyfile=section.key_file)
        will = Properties(PacketTypes.WILLMESSAGE)
        will.WillDelayInterval = section.will_delay_s
        client.will_set(self.topics.status(self.device), self._status_payload("offline", "connection lost (last will)"),
                        qos=1, retain=True, properties=will)
        client.on_connect, client.on_disconnect = self._on_connect, self._on_disconnect
        client.on_message, client.on_publish = self._on_message, self._on_publish
        client.on_connect_fail = self._on_connect_fail
        connect = Properties(PacketTypes.CONNECT)
        connect.SessionExpiryInterval = section.will_delay_s  # a will delay needs the session to outlive it
        connect.MaximumPacketSize = 4 * section.max_payload_bytes + PACKET_HEADROOM
        client.connect_async(self.broker_host, self.broker_port, keepalive=section.keepalive_s, clean_start=True,
                             properties=connect)
        self._client = client
        client.loop_start()
        self._thread.start()
        return self

    def stop(self, timeout: float = STOP_FLUSH_S) -> None:
        """Flush what waits (bounded), say "offline" (retained), disconnect."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.outbox and self.connected.is_set() and time.monotonic() < deadline:
                self._cond.wait(0.05)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        client = self._client
        if client is None:
            return
        if self.connected.is_set():
            info = client.publish(self.topics.status(self.device), self._status_payload("offline", "stopped"), qos=1,
                                  retain=True)
            try:
                info.wait_for_publish(max(0.1, deadline - time.monotonic()))
            except (ValueError, RuntimeError):
                pass  # not connected any more: the will says offline instead
        client.disconnect()
        client.loop_stop()

    # ------------------------------------------------------------------ alerts (an AlertBus sink)
    def offer(self, event: AlertEvent) -> None:
        body = {**event.to_json("base64"), "device": self.device}
        self._queue(_Outgoing(self.topics.alerts(self.device), json.dumps(body).encode(), "alert"))

    def _queue(self, item: _Outgoing, keep: bool = True) -> None:
        """Into the bounded outbox; an answer is also kept by its request (``keep``) to send again on a repeat."""
        with self._cond:
            if len(self.outbox) >= self.section.queue:
                self.outbox.popleft()
                self.counts["outbox_dropped"] += 1
            self.outbox.append(item)
            if keep and item.kind == "answer":
                key = (item.topic, item.correlation)
                self._sent.setdefault(key, []).append(item)
                self._sent.move_to_end(key)
                while len(self._sent) > ANSWERS_KEPT:
                    self._sent.popitem(last=False)
            self._cond.notify()

    # ------------------------------------------------------------------ paho callbacks (its network thread)
    def _on_connect(self, client, userdata, flags, reason, properties) -> None:
        if reason.is_failure:
            self._refused = True
            self.counts["connect_refused"] += 1
            self.last_error = f"broker {self.section.broker} refused the connection: {reason}"
            if self.counts["connect_refused"] == 1 or self.counts["connect_refused"] % 100 == 0:
                log.error("fleet: %s (refused %d time(s); retrying with backoff up to %g s)", self.last_error,
                          self.counts["connect_refused"], self.section.reconnect_backoff_s[1])
            return
        from paho.mqtt.subscribeoptions import SubscribeOptions

        self.counts["connects"] += 1
        self.last_error = None
        self._since = time.time()
        client.subscribe([(self.topics.ask_all, SubscribeOptions(qos=1)),
                          (self.topics.ask_device(self.device), SubscribeOptions(qos=1)),
                          (self.topics.forget_all, SubscribeOptions(qos=1)),  # answered "refused" unless accepted
                          (self.topics.forget_device(self.device), SubscribeOptions(qos=1)),
                          (self.topics.status(self.device), SubscribeOptions(qos=1))])  # a twin's status (_on_status)
        log.info("fleet: connected to %s as %s (connection %d)", self.section.broker, self.device,
                 self.counts["connects"])
        with self._cond:
            self.connected.set()
            self._status_due = True
            self._cond.notify()

    def _on_publish(self, client, userdata, mid, reason, properties) -> None:
        with self._cond:
            if mid in self._unacked:
                self._unacked.discard(mid)
            else:
                self._acked_early.add(mid)
            self._cond.notify_all()

    def _handed(self, info) -> bool:
        """Track a publish in the window; False when paho refused it (its queue full)."""
        if info.rc == _paho().MQTT_ERR_QUEUE_SIZE:
            self.counts["paho_queue_full"] += 1
            return False
        with self._cond:  # sent, or (the connection just went) kept by paho for the next one
            if info.mid in self._acked_early:
                self._acked_early.discard(info.mid)
            else:
                self._unacked.add(info.mid)
        return True

    def _on_connect_fail(self, client, userdata, error: str | None = None) -> None:
        """No connection at all (unreachable, refused at TCP, a TLS handshake that failed): paho retries. The error
        is set before the count goes up, so whoever watches the count reads this attempt's error."""
        self.last_error = error or f"cannot reach the broker {self.section.broker}"
        self.counts["connect_failed"] += 1
        if self.counts["connect_failed"] == 1 or self.counts["connect_failed"] % 100 == 0:
            log.warning("fleet: %s (%d attempt(s)); answering locally, retrying with backoff up to %g s",
                        self.last_error, self.counts["connect_failed"], self.section.reconnect_backoff_s[1])

    def _on_disconnect(self, client, userdata, flags, reason, properties) -> None:
        was = self.connected.is_set()
        self.connected.clear()
        refused, self._refused = self._refused, False
        if not was and not refused and not self._stop.is_set():
            # closed before a CONNACK: a TLS client certificate refused, ...
            self._on_connect_fail(client, userdata, f"the broker {self.section.broker} closed the connection before "
                                                    f"accepting it ({reason})")
        if was:
            self.counts["disconnects"] += 1
            if not self._stop.is_set():
                self.last_error = f"lost the broker {self.section.broker}: {reason}"
                log.warning("fleet: %s as %s; answering locally, reconnecting with backoff", self.last_error,
                            self.device)

    def _on_message(self, client, userdata, message) -> None:
        if message.topic == self.topics.status(self.device):
            self._on_status(message.payload)
            return
        if self.topics.is_forget(message.topic):
            self._on_forget(message)
            return
        self.counts["questions_received"] += 1
        try:
            request = parse_request(message.payload, message.properties, self.section.max_payload_bytes,
                                    self.section.max_new_tokens)
        except FleetMessageError as exc:
            self._refuse(exc, message)
            return
        if self._duplicate(request.response_topic, request.correlation):
            if _is_repeat(message.properties):
                self._send_again((request.response_topic, request.correlation))
            return
        named = self._named_hosts(request.camera, message)
        if named is None:
            return
        hosts, asked = named
        for host in hosts:
            self._ask(request, host, asked)

    def _send_again(self, key: tuple[str, bytes | None]) -> None:
        """An asker that lost the broker asks again: the answers already sent for it go out once more (the first
        may have reached the broker while the asker was not subscribed); an answer still being made goes out when
        it is done, as usual."""
        with self._cond:
            items = list(self._sent.get(key, ()))
        for item in items:
            self.counts["answers_resent"] += 1
            self._queue(item, keep=False)

    def _on_status(self, payload: bytes) -> None:
        """Our own status topic. Once the broker has sent back a status of ours, one from another process means
        another device uses our device_id (the MQTT client id): the broker then hands the connection back and
        forth between the two for ever, each disconnect looking like a network blip ("Unspecified error" from
        Mosquitto 2.0). Say what it is, once and then every 100th time. (Before ours came back, another's is the
        retained status of an earlier run of this device.)"""
        try:
            body = json.loads(payload) if payload else None
        except (ValueError, RecursionError):
            return
        instance = body.get("instance") if isinstance(body, dict) else None
        if instance == self.instance:
            self._own_status_seen = True
            self.counts["status_echoed"] += 1  # the broker holds our status: an asker that subscribes now sees it
        if instance in (None, self.instance) or not self._own_status_seen:
            return
        self.counts["twins_seen"] += 1
        self.last_error = (f"another client is online as device_id {self.device} (fleet.device_id must be unique per "
                           f"broker: it is the MQTT client id, and the broker keeps disconnecting one of the two)")
        if self.counts["twins_seen"] == 1 or self.counts["twins_seen"] % 100 == 0:
            log.error("fleet: %s", self.last_error)

    def _duplicate(self, response_topic: str, correlation: bytes | None) -> bool:
        """A QoS 1 retransmit of a request already taken (its Response Topic and Correlation Data): counted."""
        key = (response_topic, correlation)
        with self._cond:
            if key in self._seen:
                self.counts["duplicates"] += 1
                return True
            self._seen[key] = None
            while len(self._seen) > SEEN_KEPT:
                self._seen.popitem(last=False)
        return False

    def _on_forget(self, message) -> None:
        """A fleet forget (paho's thread): checked, then run by the forget thread, one at a time (a forget rewrites
        files: it must not hold up paho's keep-alives); refused where ``fleet.accept_forget`` is off."""
        self.counts["forgets_received"] += 1
        try:
            request = parse_forget(message.payload, message.properties, self.section.max_payload_bytes)
        except FleetMessageError as exc:
            self._refuse(exc, message)
            return
        if self._duplicate(request.response_topic, request.correlation):
            if _is_repeat(message.properties):
                self._send_again((request.response_topic, request.correlation))
            return
        reply = FleetRequest("", None, request.response_topic, request.correlation)
        if not self.section.accept_forget:
            self.counts["forgets_refused"] += 1
            self._queue(self._reply(reply, {"type": "edgekv.fleet.forgot", "error": "refused: this device does not "
                                            "take forgets from the fleet (fleet.accept_forget is off)"}))
            return
        named = self._named_hosts(request.camera, message)
        if named is None:
            return
        hosts, asked = named
        with self._cond:
            if len(self._forgets) >= FORGETS_QUEUED:
                self.counts["forgets_refused"] += 1
                self._queue(self._reply(reply, {"type": "edgekv.fleet.forgot",
                                                "error": f"busy: {FORGETS_QUEUED} forgets waiting"}))
                return
            self._forgets.extend((request, host, asked) for host in hosts)
            if self._forget_thread is None:
                self._forget_thread = threading.Thread(target=self._forget_loop, name="edgekv-fleet-forget",
                                                       daemon=True)
                self._forget_thread.start()
            self._cond.notify_all()

    def _forget_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._forgets:
                    self._cond.wait(0.5)
                    continue
                request, host, asked = self._forgets.popleft()
            reply = FleetRequest("", None, request.response_topic, request.correlation)
            body: dict[str, Any] = {"type": "edgekv.fleet.forgot"}
            try:
                body["result"] = json.loads(json.dumps(host.forget(**request.window), default=str))
                self.counts["forgets_done"] += 1
            except (ValueError, OSError) as exc:  # a window its clock cannot read; a file it could not rewrite
                self.counts["forgets_refused"] += 1
                body["error"] = printable(f"{'forget incomplete: ' if isinstance(exc, OSError) else ''}{exc}", 400)
            except QuestionRefused as exc:  # the daemon is stopping: nothing was forgotten, said as it is
                self.counts["forgets_refused"] += 1
                body["error"] = printable(str(exc), 400)
            except Exception as exc:  # anything else: said to the asker, and this thread goes on with the next
                log.exception("fleet: forget %s on %s failed", request.window, host.camera)
                self.counts["forgets_refused"] += 1
                body["error"] = printable(f"forget failed: {type(exc).__name__}: {exc}", 400)
            log.info("fleet: forget %s on %s: %s", request.window, host.camera,
                     body.get("error") or f"{body['result'].get('pairs')} pair(s)")
            self._queue(self._reply(reply, body, host, asked))

    def _named_hosts(self, camera: str | None, message) -> tuple[list, list | None] | None:
        """The hosts a request goes to and the cameras it names in each reply (None with one camera asked without a
        name); None, after refusing the message, for a camera this device does not have."""
        try:
            hosts = self._hosts(camera)
        except FleetMessageError as exc:
            self._refuse(exc, message)
            return None
        return hosts, [host.camera for host in hosts] if len(hosts) > 1 or camera is not None else None

    def _hosts(self, camera: str | None) -> list:
        """The hosts a question goes to: the camera it names, else each camera of the device (one: the host)."""
        cameras = self._cameras()
        if camera is None:
            return list(cameras.values()) or [self.host]
        if not cameras and camera == self.host.camera:
            return [self.host]
        if camera in cameras:
            return [cameras[camera]]
        known = ", ".join(cameras) if cameras else f"{self.host.camera} (this device watches one camera)"
        raise FleetMessageError("malformed", f"camera: {printable(camera, 60)!r} is not one of {known}")

    def _cameras(self) -> dict:
        """Each camera's host by name where the host has several (``DaemonHost.cameras``), else empty."""
        return getattr(self.host, "cameras", lambda: {})()

    def _ask(self, request: FleetRequest, host, asked: list | None) -> None:
        question = Question(request.question, max_new_tokens=request.max_new_tokens, temperature=0.0, source="fleet",
                            evidence=True, window_last_s=request.last_s,  # no token bound: generation.max_new_tokens
                            window_unix=request.wall)
        question.done = _Done(lambda: self._answered(question, request, host, asked))
        try:
            host.submit(question)
        except QuestionRefused as exc:
            self.counts["refused_busy"] += 1
            self._queue(self._reply(request, {"question": request.question, "error": str(exc)}, host, asked))
            return
        with self._cond:
            self._pending += 1

    def _refuse(self, exc: FleetMessageError, message) -> None:
        """A fleet message that cannot be answered: counted, logged (the first of a kind, then every 100th),
        and answered with the reason when it names where answers go."""
        name = f"dropped_{exc.kind}"
        self.counts[name] += 1
        if self.counts[name] == 1 or self.counts[name] % 100 == 0:
            log.warning("fleet: message on %s dropped: %s (%s so far)", printable(message.topic, 120), exc,
                        self.counts[name])
        topic = response_topic_of(message.properties)
        if topic is not None:
            correlation = getattr(message.properties, "CorrelationData", None)
            request = FleetRequest("", None, topic, bytes(correlation) if correlation is not None else None)
            self._queue(self._reply(request, {"error": f"{exc.kind}: {exc}"}))

    # ------------------------------------------------------------------ answers (the main loop's thread)
    def _answered(self, question: Question, request: FleetRequest, host=None, asked: list | None = None) -> None:
        answer = question.answer
        body: dict[str, Any] = {"question": question.text, "asked_unix": question.asked_at,
                                "answered_unix": question.answered_at}
        if question.error is not None or answer is None:
            self.counts["answer_errors"] += 1
            body["error"] = printable(str(question.error), 400)
        else:
            self.counts["answered"] += 1
            pair, asked_host = question.evidence_pair, host or self.host
            t = asked_host.evidence_time(pair)
            wall = getattr(asked_host, "wall_time", None)
            body.update(answer=answer.text, tokens=len(answer.token_ids), finish_reason=answer.finish_reason,
                        ttft_s=answer.ttft_s, evidence_pair=pair, evidence_t=t,
                        evidence_unix=wall(t) if wall is not None else None)
            if request.frame:  # the evidence frame where this device keeps it (its keyframe ring, its disk)
                jpeg = getattr(asked_host, "evidence_jpeg", lambda pair: None)(pair) if pair is not None else None
                body["evidence_jpeg_base64"] = base64.b64encode(jpeg).decode() if jpeg else None
        with self._cond:
            self._pending -= 1
        self._queue(self._reply(request, body, host, asked))

    def _reply(self, request: FleetRequest, body: dict, host=None, asked: list | None = None) -> _Outgoing:
        if host is not None:
            camera = host.camera
        else:  # a refusal before any camera was asked: the device's (no camera where it has several)
            camera = None if self._cameras() else self.host.camera
        body = {"type": "edgekv.fleet.answer", "device": self.device, "camera": camera, "instance": self.instance,
                **({"cameras": asked} if asked else {}), **body}
        return _Outgoing(request.response_topic, json.dumps(body).encode(), "answer", request.correlation)

    # ------------------------------------------------------------------ the sender
    def _run(self) -> None:
        next_status = 0.0
        while not self._stop.is_set():
            with self._cond:
                now = time.monotonic()
                room = len(self._unacked) < WINDOW
                if not self.connected.is_set() or (not (self.outbox and room) and not self._status_due
                                                   and now < next_status):
                    self._cond.wait(min(1.0, max(0.0, next_status - now)) if self.connected.is_set() else 1.0)
                    continue
                status_now = self._status_due or now >= next_status
                self._status_due = False
                item = self.outbox.popleft() if self.outbox and room else None
                self._cond.notify_all()  # stop() waits for the outbox to drain
            if status_now:
                self._publish_status()
                next_status = time.monotonic() + self.section.status_every_s
            if item is not None:
                self._send(item)

    def _send(self, item: _Outgoing) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        properties = Properties(PacketTypes.PUBLISH)
        properties.PayloadFormatIndicator = 1  # UTF-8 (§3.3.2.3.2)
        properties.ContentType = "application/json"
        if item.correlation is not None:
            properties.CorrelationData = item.correlation
        info = self._client.publish(item.topic, item.payload, qos=1, retain=False, properties=properties)
        if self._handed(info):
            self.counts["alerts_sent" if item.kind == "alert" else "answers_sent"] += 1

    def _publish_status(self) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        properties = Properties(PacketTypes.PUBLISH)  # not refreshed, the broker drops it (the module's docstring)
        properties.MessageExpiryInterval = status_expiry_s(self.section.status_every_s)
        info = self._client.publish(self.topics.status(self.device), self._status_payload("online"), qos=1,
                                    retain=True, properties=properties)
        if self._handed(info):
            self.counts["status_sent"] += 1

    def _status_payload(self, state: str, reason: str | None = None) -> bytes:
        import edgekv

        body: dict[str, Any] = {"type": "edgekv.status", "device": self.device, "state": state,
                                "camera": self.host.camera, "version": edgekv.__version__, "unix": time.time(),
                                "instance": self.instance}
        if reason is not None:
            body["reason"] = reason
        if state == "online":
            every = self.section.status_every_s
            body.update(since=self._since, every_s=every, expires_s=status_expiry_s(every))
            try:
                body.update(self.host.status())
            except Exception as exc:  # a status must not stop the sender
                body["status_error"] = printable(str(exc), 200)
            body["fleet"] = {name: self.counts[name] for name in ("connects", "questions_received", "answered",
                                                                  "dropped_malformed", "dropped_oversized")}
        return json.dumps(body).encode()

    def stats(self) -> dict:
        with self._cond:
            waiting, pending = len(self.outbox), self._pending
        return {"broker": self.section.broker, "device": self.device, "connected": self.connected.is_set(),
                "last_error": self.last_error, "waiting": waiting, "questions_pending": pending, **self.counts}


def _is_repeat(properties) -> bool:
    """A request asked again by an asker that lost the broker meanwhile (its ``REPEAT`` User Property)."""
    return REPEAT in (getattr(properties, "UserProperty", None) or []) if properties is not None else False


def preflight(section: FleetSection, environ=os.environ) -> str | None:
    """What can be checked before the daemon starts: paho installed, the password's variable set, TLS files
    readable. Returns the password (or None); raises ``FleetError`` naming the key."""
    _paho()
    password = None
    if section.password_env is not None:
        password = environ.get(section.password_env)
        if password is None:
            raise FleetError(f"fleet.password_env: the environment variable {section.password_env} is not set")
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(section, name)
        if path is not None and not os.access(path, os.R_OK):
            raise FleetError(f"fleet.{name}: cannot read {path}")
    return password


# ---------------------------------------------------------------------------------------------- the asker
@dataclass(frozen=True)
class FleetAnswer:
    device: str
    camera: str | None
    answer: str | None
    evidence_pair: int | None
    evidence_t: float | None
    ttft_s: float | None
    latency_s: float              # from publishing the question to receiving this answer
    error: str | None = None
    device_s: float | None = None  # the device's own time: queued + answered
    raw: dict = field(default_factory=dict, repr=False)
    evidence_unix: float | None = None  # the wall time the evidence was seen at (None: the device keeps none)
    evidence_jpeg: bytes | None = field(default=None, repr=False)  # its frame, when asked for and the device has it


@dataclass(frozen=True)
class FleetResult:
    question: str
    answers: list[FleetAnswer]
    silent: list[str]              # online (their retained status) and no answer within the timeout
    offline: list[str]             # known to the broker, their last status "offline"
    elapsed_s: float
    stale: dict[str, float] = field(default_factory=dict)  # "online" but not refreshed: device -> the status's age (s)
    twins: list[str] = field(default_factory=list)  # device ids answered from two processes (one id, two devices)
    broker_lost: list[str] = field(default_factory=list)  # the broker lost during the wait: when, why, when back
    nobody_online: bool = False  # every retained status was in and none online and fresh: not waited for

    def to_json(self) -> dict:
        return {"question": self.question, "elapsed_s": self.elapsed_s, "nobody_online": self.nobody_online,
                "silent": self.silent,
                "offline": self.offline, "stale": [{"device": name, "status_age_s": age}
                                                   for name, age in sorted(self.stale.items())],
                "twins": self.twins, "broker_lost": self.broker_lost,
                "answers": [{"device": a.device, "camera": a.camera, "answer": a.answer, "error": a.error,
                             "evidence_pair": a.evidence_pair, "evidence_t": a.evidence_t,
                             "evidence_unix": a.evidence_unix, "ttft_s": a.ttft_s,
                             "latency_s": a.latency_s, "device_s": a.device_s} for a in self.answers]}


@dataclass
class FleetConnection:
    """How an asker reaches the broker (the asking side of a ``fleet:`` section)."""

    broker: str
    topic_prefix: str = "edgekv"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    connect_timeout_s: float = 10.0


def ask_fleet(question: str, connection: FleetConnection | str, timeout_s: float = 10.0, device: str | None = None,
              max_new_tokens: int | None = None, camera: str | None = None, last_s: float | None = None,
              wall: tuple[str, str] | None = None, frame: bool = False) -> FleetResult:
    """Ask every device (or one, ``device``) one question and gather the answers that arrive within ``timeout_s``;
    ``camera`` asks that camera of devices with several (the others answer that they have no such camera).

    The question goes out once (QoS 1, Message Expiry = the timeout) with a fresh Response Topic and
    Correlation Data; the retained statuses say which devices are online. Gathering ends at the timeout, or
    as soon as every device known to be online has answered, for every camera it asked (a device with several
    cameras answers once per camera, each answer listing the cameras asked), or at once when every retained status
    is in and none is online and fresh (``FleetResult.nobody_online``; known only of a broker that says it delivers
    retained messages first: Mosquitto, the module's docstring, "all statuses in"). Raises ``FleetError`` when the
    broker cannot be reached or refuses the credentials."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question: expected a non-empty string, got {question!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout: must be > 0 s, got {timeout_s}")
    if camera is not None and not camera.strip():
        raise ValueError(f"camera: expected a camera's name, got {camera!r}")
    conn = FleetConnection(connection) if isinstance(connection, str) else connection
    body: dict[str, Any] = {"question": question}
    if max_new_tokens is not None:
        body["max_new_tokens"] = max_new_tokens
    if camera is not None:
        body["camera"] = camera
    if last_s is not None:
        body["last_s"] = last_s
    if wall is not None:
        body["from"], body["to"] = wall
    if frame:
        body["frame"] = True
    return _fleet_request(conn, "ask", body, question, timeout_s, device)


def forget_fleet(connection: "FleetConnection | str", timeout_s: float = 10.0, device: str | None = None,
                 camera: str | None = None, last_s: float | None = None,
                 wall: tuple[str, str] | None = None) -> FleetResult:
    """Ask every device (or one, ``device``) to forget a stretch — what each saw between two wall times (``wall``,
    ISO 8601), or its last ``last_s`` seconds — and gather what each removed (``FleetAnswer.raw["result"]``) or why
    it did not (``error``: a device where ``fleet.accept_forget`` is off answers "refused"), as ``ask_fleet`` does."""
    if (wall is None) == (last_s is None):
        raise ValueError("forget: give a wall-time window (from and to) or last_s, one of them")
    conn = FleetConnection(connection) if isinstance(connection, str) else connection
    body: dict[str, Any] = {"last_s": last_s} if last_s is not None else {"from": wall[0], "to": wall[1]}
    if camera is not None:
        body["camera"] = camera
    what = f"forget the last {last_s:g} s" if last_s is not None else f"forget {wall[0]} to {wall[1]}"
    return _fleet_request(conn, "forget", body, what, timeout_s, device)


@dataclass(frozen=True)
class StatusSeen:
    """A device's retained status as an asker read it: its state, how old it was on arrival (None: it does not say)
    and the age past which its device is taken as gone (the module's docstring, "freshness")."""

    state: str
    age_s: float | None
    stale_after_s: float
    received: float  # time.monotonic() on arrival

    def age(self, now: float) -> float | None:
        return None if self.age_s is None else self.age_s + (now - self.received)

    def stale(self, now: float) -> bool:
        age = self.age(now)
        return self.state == "online" and age is not None and age > self.stale_after_s

    def stale_in(self, now: float) -> float:
        """Seconds until this status goes stale (inf: never, being offline or ageless)."""
        age = self.age(now)
        return math.inf if self.state != "online" or age is None else self.stale_after_s - age


def read_status(payload: bytes, properties, received: float, now_unix: float) -> StatusSeen | None:
    """A status message (retained or live) as ``StatusSeen``; None for an empty (cleared) one or one that is not a
    status. A status of this version is aged by the broker (``expires_s`` less the Message Expiry left); an older
    device's by its ``unix`` on this machine's clock."""
    try:
        body = json.loads(payload) if payload else None
    except (ValueError, RecursionError):
        body = None
    state = body.get("state") if isinstance(body, dict) else None
    if state not in ("online", "offline"):
        return None
    every = _finite_or_none(body.get("every_s"))
    versioned = every is not None and every > 0  # a status of this version says how often it is refreshed
    limit = stale_after_s(every) if versioned else LEGACY_STALE_S
    expires, left = body.get("expires_s"), getattr(properties, "MessageExpiryInterval", None)
    if versioned and _whole(expires) and _whole(left):
        return StatusSeen(state, float(max(0, expires - left)), limit, received)
    sent = _finite_or_none(body.get("unix"))
    return StatusSeen(state, max(0.0, now_unix - sent) if sent is not None else None, limit, received)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fleet_request(conn: "FleetConnection", kind: str, body: dict, what: str, timeout_s: float,
                   device: str | None) -> FleetResult:
    """One MQTT 5 request to the fleet (``kind`` "ask" or "forget": its topics) and the replies gathered (the
    module's docstring; ``ask_fleet``'s)."""
    if device is not None and (not device or any(c in device for c in "/+#\0")):
        raise ValueError(f"device: one MQTT topic level (no '/', '+', '#'), got {device!r}")
    mqtt = _paho()
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    try:
        host, port, tls = broker_address(conn.broker)
    except ValueError as exc:
        raise ValueError(f"broker: {exc}") from None
    topics = FleetTopics(conn.topic_prefix)
    gathering = _Gathering(topics, device, uuid.uuid4().hex)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgekv-ask-{gathering.token[:12]}",
                         protocol=mqtt.MQTTv5)
    client.on_connect, client.on_subscribe = gathering.on_connect, gathering.on_subscribe
    client.on_message, client.on_disconnect = gathering.on_message, gathering.on_disconnect
    client.reconnect_delay_set(0.25, 2.0)  # a broker that restarts mid-wait is back within the wait
    if conn.username is not None:
        client.username_pw_set(conn.username, conn.password)
    if tls:
        _tls_set(client, conn)
    try:
        client.connect(host, port, keepalive=max(5, int(timeout_s) + 5), clean_start=True)
    except (OSError, ValueError) as exc:
        hint = (f"; is {host}:{port} a TLS listener (mqtt:// for a plain one)?"
                if tls and isinstance(exc, (ConnectionResetError, ssl_error())) and "VERIFY" not in str(exc) else "")
        where = "" if f":{port}" in conn.broker else f" ({host}:{port})"
        raise FleetError(f"cannot reach the broker {conn.broker}{where}: {exc}{hint}") from None
    client.loop_start()
    try:
        gathering.connected_or_raise(conn, tls)  # paho's thread subscribes on each connection (on_connect)
        if not gathering.subscribed.wait(conn.connect_timeout_s):
            raise FleetError(f"the broker {conn.broker} did not confirm the subscriptions")
        properties = Properties(PacketTypes.PUBLISH)
        properties.ResponseTopic = gathering.reply_topic
        properties.CorrelationData = gathering.correlation
        properties.MessageExpiryInterval = max(1, math.ceil(timeout_s))
        properties.PayloadFormatIndicator = 1
        properties.ContentType = "application/json"
        topic = ((topics.ask_device(device) if device is not None else topics.ask_all) if kind == "ask" else
                 (topics.forget_device(device) if device is not None else topics.forget_all))
        started = gathering.send(client, topic, json.dumps(body), properties, timeout_s)
        gathering.wait(started + timeout_s)
        return gathering.result(what, started)
    finally:
        client.disconnect()
        client.loop_stop()


def ssl_error() -> type:
    import ssl

    return ssl.SSLError


def _tls_set(client, conn: "FleetConnection") -> None:
    """TLS with the connection's files, each named when it cannot be read or used (an ``OSError`` without the
    file's name said nothing of which of three files was wrong)."""
    for name, path in (("ca_file", conn.ca_file), ("cert_file", conn.cert_file), ("key_file", conn.key_file)):
        if path is not None and not os.access(path, os.R_OK):
            raise FleetError(f"{name} (--{name.replace('_', '-')}): cannot read {path}")
    if (conn.cert_file is None) != (conn.key_file is None):
        raise FleetError("cert_file and key_file (--cert-file, --key-file): a client certificate needs both")
    try:
        client.tls_set(ca_certs=conn.ca_file, certfile=conn.cert_file, keyfile=conn.key_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError: not PEM, a key that does not match its certificate
        files = ", ".join(f"{name} {path}" for name, path in (("ca_file", conn.ca_file), ("cert_file", conn.cert_file),
                                                              ("key_file", conn.key_file)) if path is not None)
        raise FleetError(f"TLS files ({files or 'the system CAs'}) cannot be used: {exc}") from None


class _Gathering:
    """One fleet request's replies and the statuses around it, filled by paho's thread (``on_*``) and waited on by
    the asker (``wait``): the gathering ends at the deadline, or once every device whose status is online and fresh
    has answered for every camera it asked. A broker lost mid-wait is subscribed to again and asked again."""

    def __init__(self, topics: FleetTopics, device: str | None, token: str) -> None:
        self.topics, self.device, self.token = topics, device, token
        self.reply_topic, self.correlation = topics.reply(token), token.encode()
        self.lock = threading.Condition()
        self.statuses: dict[str, StatusSeen] = {}
        self.answers: dict[tuple[str, str | None], FleetAnswer] = {}  # (device, camera)
        self.expected: dict[str, set] = {}  # device -> the cameras it asked (several: one answer for each)
        self.twins: set[str] = set()
        self.connected: list = []  # each CONNACK's reason
        self.closed: list = []     # each disconnect's reason
        self.broker_lost: list[str] = []
        self.subscribed = threading.Event()
        self.sent_at = math.inf
        self.request: tuple | None = None  # (topic, payload, properties, expiry deadline) once sent
        self.marker_prefix = f"retained-end-{token}-".encode()  # the all-statuses-in marker's Correlation Data ...
        self.connection = 0  # ... ends in the number of the connection it was sent on (accepted connections so far)
        self.ordered_on = 0  # the connection on which the broker's retained version said it queues retained first
        self.statuses_in = False  # the marker came back after that: every retained status has been delivered
        self.nobody_online = False  # ... and none of them was online and fresh then

    def subscriptions(self) -> list:
        from paho.mqtt.subscribeoptions import SubscribeOptions

        # the broker's version last: Mosquitto queues each filter's retained messages in this order, and drops those
        # past a full queue (max_queued_messages), the version too then; refused by an ACL: no early answer, no more
        return [(self.topics.statuses, SubscribeOptions(qos=1)), (self.reply_topic, SubscribeOptions(qos=1)),
                (BROKER_VERSION_TOPIC, SubscribeOptions(qos=1))]

    def marker(self, connection: int) -> bytes:
        return self.marker_prefix + str(connection).encode()

    # ------------------------------------------------------------------ paho's thread
    def on_connect(self, client, userdata, flags, reason, properties) -> None:
        with self.lock:
            self.connected.append(reason)
            request = self.request
            if not reason.is_failure:
                self.connection += 1
            if request is not None and not reason.is_failure and self.broker_lost:
                self.broker_lost[-1] += f", back at {time.monotonic() - self.sent_at:.1f} s and asked again"
            self.lock.notify_all()
        if reason.is_failure:
            return
        # every connection subscribes, here on paho's thread: the first, and one back after losing the broker (before
        # the first SUBACK too: the asker is still waiting for it), whose clean start kept no subscription; the marker
        # goes after the SUBACK (on_subscribe). Back after the question went, the question and the marker may have
        # been lost with the broker: ask again (devices drop the duplicate and send their kept answers again)
        client.subscribe(self.subscriptions())
        if request is None:
            return
        topic, payload, again, expires = request
        again.MessageExpiryInterval = max(1, math.ceil(expires - time.monotonic()))
        if not _is_repeat(again):
            again.UserProperty = [REPEAT]  # paho adds to the User Properties already set
        client.publish(topic, payload, qos=1, properties=again)

    def on_subscribe(self, client, userdata, mid, reasons, properties) -> None:
        with self.lock:
            statuses_in = self.statuses_in
        self.subscribed.set()
        if not statuses_in:  # on each connection: one sent before the broker was lost may never come back
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            self.mark_retained_end(client, Properties(PacketTypes.PUBLISH))

    def on_disconnect(self, client, userdata, flags, reason, properties) -> None:
        with self.lock:
            self.closed.append(reason)
            if self.request is not None:
                self.broker_lost.append(f"lost at {time.monotonic() - self.sent_at:.1f} s ({reason})")
            self.lock.notify_all()

    def on_message(self, client, userdata, message) -> None:
        now = time.monotonic()
        if message.topic == BROKER_VERSION_TOPIC:
            if message.retain and message.payload.startswith(ORDERED_BROKER):
                with self.lock:
                    self.ordered_on = self.connection
            return
        correlation = getattr(message.properties, "CorrelationData", None)
        if message.topic == self.reply_topic and isinstance(correlation, bytes) and \
                correlation.startswith(self.marker_prefix):
            with self.lock:
                # this connection's marker (paho may send an earlier one again after losing the broker), from a broker
                # that said before it that it queues retained messages first; the first such only
                if correlation == self.marker(self.connection) and self.ordered_on == self.connection and \
                        not self.statuses_in:
                    self.statuses_in, self.nobody_online = True, not self._waited_for(now)
                self.lock.notify_all()
            return
        if message.topic == self.reply_topic:
            self._on_answer(message, now)
            return
        name = self.topics.device_of_status(message.topic)
        if name is None or (self.device is not None and name != self.device):
            return
        seen = read_status(message.payload, message.properties, now, time.time())
        with self.lock:
            if seen is not None:
                self.statuses[name] = seen
            else:
                self.statuses.pop(name, None)  # a cleared (empty) retained status: the device left the fleet
            self.lock.notify_all()

    def _on_answer(self, message, now: float) -> None:
        if getattr(message.properties, "CorrelationData", None) != self.correlation:
            return  # not this question's
        try:
            body = json.loads(message.payload)
            name = str(body["device"])
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past the decoder
            log.warning("fleet: an answer that is not edgekv's JSON on %s", self.reply_topic)
            return
        if self.device is not None and name != self.device:
            return
        answer = FleetAnswer(name, _text_or_none(body.get("camera")), _text_or_none(body.get("answer")),
                             _pair_or_none(body.get("evidence_pair")), _finite_or_none(body.get("evidence_t")),
                             _finite_or_none(body.get("ttft_s")), now - self.sent_at,
                             _text_or_none(body.get("error")),
                             _device_seconds(body), body, _finite_or_none(body.get("evidence_unix")),
                             _jpeg_or_none(body.get("evidence_jpeg_base64")))
        asked = body.get("cameras")
        with self.lock:
            first = self.answers.setdefault((name, answer.camera), answer)
            instances = (first.raw.get("instance"), body.get("instance"))
            if first is not answer and None not in instances and instances[0] != instances[1]:
                self.twins.add(name)  # the same device id answered from two processes (a repeat is the same one)
            if isinstance(asked, list) and all(isinstance(c, str) for c in asked):
                self.expected.setdefault(name, set(asked))
            self.lock.notify_all()

    # ------------------------------------------------------------------ the asker's thread
    def connected_or_raise(self, conn: "FleetConnection", tls: bool) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: self.connected or self.closed, conn.connect_timeout_s):
                raise FleetError(f"the broker {conn.broker} did not answer the connection within "
                                 f"{conn.connect_timeout_s:g} s")
            if not self.connected:
                hint = ("; does it require a client certificate (--cert-file, --key-file)?"
                        if tls and conn.cert_file is None else
                        "; is it a TLS listener (mqtts://)?" if not tls else "")
                raise FleetError(f"the broker {conn.broker} closed the connection before accepting it "
                                 f"({self.closed[0]}){hint}")
            if self.connected[0].is_failure:
                raise FleetError(f"the broker {conn.broker} refused the connection: {self.connected[0]}")

    def mark_retained_end(self, client, properties) -> None:
        """Publish this connection's marker, whose return from a broker known to queue retained messages first says
        every retained status is in (the module's docstring, "all statuses in"); call it after the SUBACK."""
        with self.lock:
            properties.CorrelationData = self.marker(self.connection)
        client.publish(self.reply_topic, b"", qos=1, properties=properties)

    def send(self, client, topic: str, payload: str, properties, timeout_s: float) -> float:
        """Publish the request; returns when it went (the start of the wait)."""
        with self.lock:
            started = self.sent_at = time.monotonic()
            self.request = (topic, payload, properties, started + timeout_s)
        client.publish(topic, payload, qos=1, properties=properties)
        return started

    def _waited_for(self, now: float) -> set[str]:
        return {name for name, s in self.statuses.items() if s.state == "online" and not s.stale(now)}

    def _everyone_answered(self, now: float) -> bool:
        heard: dict[str, set] = {}
        for name, which in self.answers:
            heard.setdefault(name, set()).add(which)
        return (bool(self.answers) and self._waited_for(now) <= set(heard)
                and all(self.expected.get(name, set()) <= cameras for name, cameras in heard.items()))

    def wait(self, deadline: float) -> None:
        """Until everyone fresh answered or the deadline, or at once when no device was online and fresh once the
        retained statuses were in (``nobody_online``; a device that goes offline or stale later, or a broker lost
        mid-wait, is waited out as before: it may come back and answer the question asked again); woken by each
        message and when a status goes stale."""
        with self.lock:
            while True:
                now = time.monotonic()
                if self.nobody_online or self._everyone_answered(now) or now >= deadline:
                    return
                next_stale = min((s.stale_in(now) for s in self.statuses.values()), default=math.inf)
                self.lock.wait(min(deadline - now, max(0.01, next_stale)))

    def result(self, what: str, started: float) -> FleetResult:
        with self.lock:
            now = time.monotonic()
            got = sorted(self.answers.values(), key=lambda a: a.latency_s)
            devices = {name for name, _ in self.answers}
            quiet = {n: s for n, s in self.statuses.items() if n not in devices}
            silent = sorted(n for n, s in quiet.items() if s.state == "online" and not s.stale(now))
            stale = {n: round(s.age(now), 1) for n, s in sorted(quiet.items()) if s.stale(now)}
            offline = sorted(n for n, s in quiet.items() if s.state == "offline")
            return FleetResult(what, got, silent, offline, now - started, stale, sorted(self.twins),
                               list(self.broker_lost), self.nobody_online and not got)


def _device_seconds(body: dict) -> float | None:
    asked, answered = _finite_or_none(body.get("asked_unix")), _finite_or_none(body.get("answered_unix"))
    return answered - asked if asked is not None and answered is not None else None


# ---------------------------------------------------------------------------------------------- edgekv ask
def add_ask_arguments(parser) -> None:
    parser.add_argument("question", nargs="?", default=None,
                        help="the question, e.g. 'Was there a red circle?' (optional with --chat)")
    parser.add_argument("--fleet", action="store_true",
                        help="ask every device of the fleet over MQTT (without it: the daemon at --url, over HTTP)")
    parser.add_argument("--broker", default=None, help="mqtt://host[:port] or mqtts://host[:port] "
                                                       "(default: fleet.broker of --config)")
    from edgekv.config_names import config_help, resolve_config

    parser.add_argument("--config", default=None, type=resolve_config,
                        help=config_help("a daemon's deployment: without --fleet its server: section gives the "
                                         "daemon's address, token and certificate; with it, its fleet: section the "
                                         "broker, topic prefix, credentials and TLS files"))
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for answers (default: 10 with --fleet, 120 for one daemon)")
    parser.add_argument("--device", default=None, help="ask this device only")
    parser.add_argument("--camera", default=None, help="ask this camera of devices with several (video.sources); "
                                                       "default: each")
    parser.add_argument("--topic-prefix", default=None, help="default: fleet.topic_prefix, else edgekv")
    parser.add_argument("--username", default=None)
    parser.add_argument("--password-env", default=None, help="environment variable holding the password")
    parser.add_argument("--ca-file", default=None,
                        help="the CA (PEM) that signed the broker's certificate (mqtts://), or without --fleet the "
                             "daemon's (an https:// --url; a self-signed certificate is its own CA)")
    parser.add_argument("--cert-file", default=None,
                        help="a client certificate (PEM) for a broker or daemon that requires one (with --key-file)")
    parser.add_argument("--key-file", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--frames", default=None, metavar="DIR",
                        help="save the answer's evidence frames in DIR: from the daemon here, each one it still "
                             "keeps as [CAMERA-]pairN.jpg (asks for --evidence, 1 by default); with --fleet, each "
                             "device's as DEVICE[-CAMERA]-pairN.jpg (a device keeps frames in its keyframe ring, and "
                             "on disk with archive.frames_mib)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.epilog = ("examples: edgekv ask 'Was there a red circle?' (the daemon here); edgekv ask --fleet 'Was there "
                     "a red circle?' --broker mqtt://broker.local:1883 --timeout 10")
    parser.set_defaults(func=run_ask)


def connection_from_args(args) -> FleetConnection:
    section = FleetSection()
    if args.config is not None:
        from edgekv.config import load_config

        section = load_config(args.config).fleet
    broker = args.broker or section.broker
    if broker is None:
        raise ValueError("--broker: give the broker's URL (mqtt://host:port), or --config with a fleet: section")
    password_env = args.password_env or section.password_env
    password = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if password is None:
            raise ValueError(f"--password-env: the environment variable {password_env} is not set")
    return FleetConnection(broker, args.topic_prefix or section.topic_prefix, args.username or section.username,
                           password, args.ca_file or section.ca_file, args.cert_file or section.cert_file,
                           args.key_file or section.key_file)


def run_ask(args) -> int:
    """``edgekv ask --fleet``: prints each answer, then the devices online that did not answer; exit 0 when
    at least one device answered, 1 when none did or every reply was a refusal (busy, no such camera, ...)."""
    wall = fleet_wall_window(args)
    connection = connection_from_args(args)
    frames = getattr(args, "frames", None)
    if frames is not None:
        Path(frames).mkdir(parents=True, exist_ok=True)  # before asking: a folder that cannot be made is said first
    try:
        result = ask_fleet(args.question, connection, 10.0 if args.timeout is None else args.timeout, args.device,
                           args.max_new_tokens, args.camera, getattr(args, "last", None), wall,
                           frame=frames is not None)
    except FleetError as exc:
        raise RuntimeError(str(exc)) from None
    saved = save_frames(result, frames) if frames is not None else None
    if args.json:
        out = result.to_json()
        for answer, item in zip(result.answers, out["answers"]):
            if saved is not None:
                item["frame_file"] = saved.get(id(answer))
        print(json.dumps(out, indent=2))
    else:
        print(format_result(result, saved))
    return 0 if any(a.error is None for a in result.answers) else 1


def save_frames(result: FleetResult, folder: str) -> dict[int, str]:
    """Each answer's evidence frame written to ``folder`` as ``DEVICE[-CAMERA]-pairN.jpg`` (names made safe for a
    file system: a device names itself); returns the path by answer (``id``)."""
    saved = {}
    for answer in result.answers:
        if answer.evidence_jpeg is None:
            continue
        parts = [answer.device] + ([answer.camera] if answer.camera else [])
        stem = "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", part)[:60].strip("._-") or "device" for part in parts)
        pair = answer.evidence_pair if isinstance(answer.evidence_pair, int) else "unknown"
        path = Path(folder) / f"{stem}-pair{pair}.jpg"
        path.write_bytes(answer.evidence_jpeg)
        saved[id(answer)] = str(path)
    return saved


def _jpeg_or_none(value) -> bytes | None:
    """A device's evidence frame (base64 of a JPEG), or None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    try:
        data = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return data if data[:2] == b"\xff\xd8" else None


def _text_or_none(value) -> str | None:
    """A text field of a device's answer (camera, answer, error), or None for anything else: a list there made the
    answer unhashable and ended the asker's network thread, a number broke the printed lines."""
    return value if isinstance(value, str) else None


def _pair_or_none(value) -> int | None:
    """A device's evidence pair index, or None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finite_or_none(value) -> float | None:
    """A number from a device's answer, or None for anything else (a device's reply is not trusted blindly)."""
    number = real_seconds(value)  # 10**400 too: no OverflowError
    return number if number is not None and math.isfinite(number) else None


def fleet_wall_window(args) -> tuple[str, str] | None:
    """``--from`` / ``--to`` of ``edgekv ask --fleet``: wall times only (each device's stream seconds are its own)."""
    t_from, t_to = getattr(args, "t_from", None), getattr(args, "t_to", None)
    if t_from is None and t_to is None:
        return None
    if t_from is None or t_to is None:
        raise ValueError("--from and --to go together")
    if not isinstance(t_from, str) or not isinstance(t_to, str):
        raise ValueError("--fleet --from / --to: wall times (10:03, 2026-12-04T10:03:00+01:00), not stream seconds: "
                         "each device's stream clock is its own")
    if getattr(args, "last", None) is not None:
        raise ValueError("--last, or --from and --to, not both")
    return cli_window(t_from, t_to)  # read together here, sent as ISO 8601 with this machine's UTC offset


def format_result(result: FleetResult, saved: dict[int, str] | None = None) -> str:
    """The answers as lines (``saved``: the evidence frame's file by answer, from ``save_frames``)."""
    lines = [f"Q: {printable(result.question)}"]
    for a in result.answers:
        where = f" ({printable(a.camera, 80)})" if a.camera else ""
        if a.error is not None:
            lines.append(f"  {printable(a.device, 60)}{where}: error: {printable(a.error)}")
            continue
        evidence = (f"evidence t={a.evidence_t:.1f} s (pair {a.evidence_pair})" if a.evidence_t is not None
                    else "evidence: unknown")
        if a.evidence_unix is not None:
            evidence += f", seen {wall_text(a.evidence_unix)}"
        if saved is not None and id(a) in saved:
            evidence += f", frame {printable(saved[id(a)], 200)}"
        elif saved is not None:
            evidence += ", no frame kept"
        ttft = f"ttft {a.ttft_s * 1e3:.0f} ms; " if a.ttft_s is not None else ""
        lines.append(f"  {printable(a.device, 60)}{where}: {printable(a.answer or '')}   [{evidence}; {ttft}"
                     f"answered in {a.latency_s:.2f} s]")
    return "\n".join(lines + [fleet_summary(result, f"{len(result.answers)} answer(s) in {result.elapsed_s:.2f} s")])


def fleet_summary(result: FleetResult, head: str) -> str:
    """The line after the answers: who did not answer and why it was not waited for, two devices under one id,
    and a broker lost during the wait (a device named silent may then have answered unheard)."""
    names = lambda items: ", ".join(printable(n, 60) for n in items) or "none"  # noqa: E731
    line = head + ("; no device is online with a fresh status, so none was waited for" if result.nobody_online else "")
    line += f"; online but silent: {names(result.silent)}"
    if result.stale:
        line += "; not answering: " + ", ".join(f"{printable(n, 60)} (status {age:.0f} s old)"
                                                for n, age in result.stale.items())
    line += f"; offline: {names(result.offline)}"
    if result.twins:
        line += (f"; answered from two devices under one id: {names(result.twins)} (fleet.device_id must be unique "
                 f"per broker)")
    if result.broker_lost:
        line += f"; the broker: {'; '.join(result.broker_lost)} (an answer sent meanwhile may be lost)"
    return line
