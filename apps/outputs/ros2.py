"""Questions and answers on ROS 2 topics (``ros2.enabled``): a thin adapter, topics in, topics out.

Topic names follow NVIDIA-AI-IOT/ros2_nanollm where it has one (``input_query`` in, ``output`` out, both
``std_msgs/msg/String``), under ``ros2.namespace`` (default ``/edgekv``):

==========================  =====  =======================================================================
``<ns>/input_query``        in     a question; handed to the daemon's ``submit`` like HTTP and voice ones.
                                   Text starting with ``{`` is a JSON request: ``question``, and any of
                                   ``last_s`` (the last seconds), ``from`` / ``to`` (stream seconds, or wall
                                   times as the HTTP API takes them), ``evidence`` (0-8), ``recall``
``<ns>/output``             out    the final answer, one message per question (``error: …`` when refused)
``<ns>/output_stream``      out    the answer as it is decoded, one piece of text per message
``<ns>/status``             out    JSON once per ``ros2.status_period_s``: stream state, cache figures,
                                   capture and topic counters
``<ns>/output_json``        out    the answer as JSON: ``question``, ``answer``, ``error``, ``camera`` and
                                   ``evidence`` — the ``ros2.evidence`` frame pairs the answer attended
                                   most, each with its stream seconds and the wall time it was seen at (the
                                   HTTP API's ``edgekv.evidence`` items)
``<ns>/output_evidence``    out    ``sensor_msgs/msg/CompressedImage``: the frame of the pair the answer
                                   attended most, JPEG, ``header.stamp`` the wall time it was seen at (zero
                                   where the daemon does not know it: a recording read as fast as it goes),
                                   ``header.frame_id`` the camera's name (empty with one camera); none where
                                   the frame is no longer kept (``alerts.keyframe_pairs``,
                                   ``archive.frames_mib``)
``<ns>/alerts``             out    each alert — a standing question (``alerts:``, ``POST /v1/alerts``)
                                   turned yes — as JSON (the webhooks' fields, the keyframe left out)
``<ns>/alert_image``        out    ``sensor_msgs/msg/CompressedImage``: that alert's keyframe, stamped with
                                   the wall time its evidence pair was seen at (else when it was raised)
``<ns>/input_forget``       in     with ``ros2.accept_forget`` only: ``{"last_s": S}`` or ``{"from": t0,
                                   "to": t1}`` (stream seconds, or wall times): that stretch removed from
                                   everything this camera keeps, as ``POST /v1/memory/forget``
``<ns>/output_forget``      out    what was forgotten (JSON: pairs, cache slots, archive, frames), or
                                   ``{"error": ...}`` naming what was wrong
==========================  =====  =======================================================================

For a question asked on ``input_query`` the evidence image and the JSON are published before the answer on
``output``, so a node that waits for ``output`` has the others in flight: a robot can look up where it was
(its odometry or map log) at the moment the answer points to, and show the frame.

All use ROS 2's default QoS (reliable, keep last 10, volatile; edgekv.video.ros2). Nothing here
blocks ingest: a question arrives in Cyclone DDS's listener thread and is queued with ``submit`` (which
never blocks); answer tokens are published from the main loop with a non-blocking keep-last write; the
final answers and the status go out from this channel's own thread. The answer of a question published
on ``input_query`` is the next message on ``output`` (questions are answered in arrival order).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from edgekv.apps.questions import Question, QuestionRefused, evidence_item, logs_text, printable

log = logging.getLogger("edgekv.ros2")
STATS_WAIT_S = 0.25  # the main loop holds the session lock for a whole step: wait this long, else reuse
ALERTS_QUEUED = 64  # alerts waiting for the channel's thread; past it the oldest is dropped and counted
FORGETS_QUEUED = 8  # forget requests waiting for the channel's thread; past it one is refused ("busy")


def check_ros2(settings: Any) -> None:
    """Before the model loads: the binding imports, the interface exists, the names are valid. Raises the
    ``SourceUnavailable`` / ``ValueError`` of ``edgekv.video.ros2`` with a one-line reason."""
    from edgekv.config import ROS2_TOPIC_KEYS
    from edgekv.video.ros2 import binding, cyclone_config, domain_id, resolve_name

    binding()
    domain_id(settings)
    cyclone_config(settings)
    for key in ROS2_TOPIC_KEYS:
        resolve_name(getattr(settings, key), settings.namespace)


REQUEST_KEYS = ("question", "last_s", "from", "to", "evidence", "recall")


def load_json(text: str) -> Any:
    """``json.loads``, with a text nested past the decoder's recursion limit a ``ValueError`` like any other bad
    JSON: its ``RecursionError`` got past the handlers of bad input (a traceback in the log, no error answer)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to decode") from None


def parse_request(text: str, evidence: int) -> dict:
    """A question as it came on ``input_query``: plain text, or (starting with ``{``) a JSON request with the
    ``REQUEST_KEYS``. Returns ``Question`` keywords (``question`` among them); ``ValueError`` naming what is wrong."""
    from edgekv.apps.wall_times import window_bounds

    if not text.startswith("{"):
        return {"question": text, "evidence": evidence}
    try:
        request = load_json(text)
    except ValueError as exc:
        raise ValueError(f"a request starting with '{{' is JSON, and this is not ({exc})") from None
    if not isinstance(request, dict):
        raise ValueError("a JSON request is an object")
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"{printable(unknown[0], 60)}: not a request key (they are {', '.join(REQUEST_KEYS)})")
    question = request.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question: the question's text is required (a non-empty string)")
    out = {"question": question.strip(), "evidence": request.get("evidence", evidence)}
    if isinstance(out["evidence"], bool) or not isinstance(out["evidence"], int) or not 0 <= out["evidence"] <= 8:
        raise ValueError("evidence: a whole number of frame pairs from 0 to 8, got "
                         f"{printable(repr(out['evidence']), 60)}")
    if "recall" in request:
        if not isinstance(request["recall"], bool):
            raise ValueError(f"recall: true or false, got {printable(repr(request['recall']), 60)}")
        out["recall"] = request["recall"]
    last_s = request.get("last_s")
    if last_s is not None:
        if "from" in request or "to" in request:
            raise ValueError("give either from and to, or last_s, not both")
        if isinstance(last_s, bool) or not isinstance(last_s, (int, float)) or not 0 < last_s < float("inf"):
            raise ValueError(f"last_s: seconds > 0, got {printable(repr(last_s), 60)}")
        out["window_last_s"] = float(last_s)
    elif "from" in request or "to" in request:
        if "from" not in request or "to" not in request:
            raise ValueError("from and to: both are required (stream seconds or wall times), or last_s")
        for name in ("from", "to"):
            value = request[name]
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"{name}: stream seconds (a number) or a wall time (a string), got "
                                 f"{printable(repr(value), 60)}")
        kind, start, end = window_bounds(request["from"], request["to"])
        out["window" if kind == "stream" else "window_unix"] = (start, end)
    return out


class _TextPieces:
    """Answer token ids -> the text each one adds, released only as whole characters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


class Ros2Channel:
    def __init__(self, daemon: Any, settings: Any) -> None:
        from edgekv.video.ros2 import STRING, Ros2Graph, default_qos, resolve_name
        from edgekv.video.ros_images import COMPRESSED

        self.daemon, self.settings = daemon, settings
        self.names = {key: resolve_name(getattr(settings, key + "_topic"), settings.namespace)
                      for key in ("question", "answer", "token", "status", "json", "evidence", "alerts",
                                  "alert_image", "forget", "forget_result")}
        self.counts = {"questions": 0, "refused": 0, "malformed": 0, "answers": 0, "status": 0,
                       "evidence_images": 0, "alerts": 0, "alerts_dropped": 0, "forgets": 0, "forgets_refused": 0}
        self._forgets: deque = deque()  # checked forget requests (Daemon.forget keywords), run by this thread
        self._alerts: deque = deque()  # AlertEvents offered by the alert bus, published by this channel's thread
        self._pending: deque[Question] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._stats: dict | None = None
        self._stats_at = 0.0
        self.graph = Ros2Graph.acquire(settings)
        try:
            self.answers = self.graph.publisher(self.names["answer"])
            self.tokens = self.graph.publisher(self.names["token"])
            self.status_out = self.graph.publisher(self.names["status"])
            self.json_out = self.graph.publisher(self.names["json"])
            self.evidence_out = self.graph.publisher(self.names["evidence"], COMPRESSED)
            self.alerts_out = self.graph.publisher(self.names["alerts"])
            self.alert_image_out = self.graph.publisher(self.names["alert_image"], COMPRESSED)
            self.forget_out = self.forget_in = None
            if settings.accept_forget:  # nothing listens unless asked: anyone on the domain could publish one
                self.forget_out = self.graph.publisher(self.names["forget_result"])
                self.forget_in = self.graph.subscribe(self.names["forget"], STRING, default_qos(), self._forget_arrived)
            self.questions = self.graph.subscribe(self.names["question"], STRING, default_qos(), self._arrived)
        except BaseException:
            self.graph.release()
            raise
        self.thread = threading.Thread(target=self._run, name="edgekv-ros2", daemon=True)

    def describe(self) -> str:
        return (f"questions on {self.names['question']}, answers on {self.names['answer']} (tokens on "
                f"{self.names['token']}, JSON on {self.names['json']}, evidence frames on {self.names['evidence']}), "
                f"alerts on {self.names['alerts']} (keyframes on {self.names['alert_image']}), status on "
                f"{self.names['status']}"
                + (f", forget requests on {self.names['forget']} (results on {self.names['forget_result']})"
                   if self.settings.accept_forget else "") + f"; ROS domain {self.graph.domain_id}")

    def start(self) -> Ros2Channel:
        self.thread.start()
        bus = getattr(self.daemon, "alert_bus", None)
        if bus is not None:  # alerts go out on the alerts topic too
            bus.add(self)
        return self

    def stop(self) -> None:
        bus = getattr(self.daemon, "alert_bus", None)
        if bus is not None:
            bus.remove(self)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.questions.close()  # no more questions come in
        if self.forget_in is not None:
            self.forget_in.close()
        if self.thread.is_alive():
            self.thread.join(timeout=2.0)
        for publication in (self.answers, self.tokens, self.status_out, self.json_out, self.evidence_out,
                            self.alerts_out, self.alert_image_out, self.forget_out):
            if publication is not None:
                publication.close()
        self.graph.release()

    # ------------------------------------------------------------------ questions in (Cyclone DDS's listener thread)
    def _arrived(self, raw: bytes) -> None:
        from edgekv.video.ros2 import STRING
        from edgekv.video.ros_images import decode_cdr
        from edgekv.video.sources import CorruptFrame

        try:
            text = decode_cdr(raw, STRING).data.strip()
        except CorruptFrame as exc:
            self.counts["malformed"] += 1
            log.warning("%s: a malformed question skipped (%s)", self.names["question"], exc)
            return
        if not text:
            return
        pieces = _TextPieces(self.daemon.session.tokenizer)
        try:
            asked = parse_request(text, self.settings.evidence)
        except ValueError as exc:
            self.counts["malformed"] += 1
            refused = Question(text, source="ros2")
            self._publish(self.json_out, json.dumps(self.answer_json(refused, error=exc)))
            self._publish(self.answers, f"error: {exc}")
            log.warning("%s: a request refused (%s)", self.names["question"], printable(str(exc), 200))
            return
        text = asked.pop("question")
        question = Question(text, source="ros2", on_token=lambda token: self._token(pieces, token), **asked)
        try:
            self.daemon.submit(question)
        except QuestionRefused as exc:
            self.counts["refused"] += 1
            self._publish(self.json_out, json.dumps(self.answer_json(question, error=exc)))
            self._publish(self.answers, f"error: {exc}")
            log.warning("ROS 2 question not queued: %s", exc)
            return
        self.counts["questions"] += 1
        log.info("ROS 2 question: %s", printable(text) if logs_text(self.daemon)
                 else f"{len(text)} characters (privacy.log_text)")
        with self._cond:
            self._pending.append(question)
            self._cond.notify_all()

    def _forget_arrived(self, raw: bytes) -> None:  # Cyclone DDS's listener thread: checked here, run by ours
        from edgekv.apps.wall_times import WindowError, forget_request
        from edgekv.video.ros2 import STRING
        from edgekv.video.ros_images import decode_cdr
        from edgekv.video.sources import CorruptFrame

        try:
            text = decode_cdr(raw, STRING).data.strip()
            window = forget_request(load_json(text))
        except (CorruptFrame, ValueError) as exc:  # not CDR, not JSON, or a window that does not check
            self.counts["forgets_refused"] += 1
            why = str(exc) if isinstance(exc, (WindowError, CorruptFrame)) else f"not JSON ({exc})"
            self._publish(self.forget_out, json.dumps({"error": why}))
            log.warning("%s: a forget refused (%s)", self.names["forget"], printable(why, 200))
            return
        with self._cond:
            if len(self._forgets) >= FORGETS_QUEUED:  # a flood of requests does not queue without bound
                self.counts["forgets_refused"] += 1
                self._publish(self.forget_out, json.dumps({"error": f"busy: {FORGETS_QUEUED} forgets waiting"}))
                return
            self._forgets.append(window)
            self._cond.notify_all()

    def _forget(self, window: dict) -> None:
        """(This channel's thread.) The stretch removed from everything this camera keeps; the result published."""
        try:
            result = self.daemon.forget(**window)
        except ValueError as exc:  # a window this camera's clock cannot read (a recording has no wall times)
            self.counts["forgets_refused"] += 1
            self._publish(self.forget_out, json.dumps({"error": str(exc)}))
            return
        except OSError as exc:  # every part done, and a file that could not be rewritten named (as HTTP's 500)
            self.counts["forgets_refused"] += 1
            self._publish(self.forget_out, json.dumps({"error": f"forget incomplete: {exc}"}))
            return
        except QuestionRefused as exc:  # the daemon is stopping: nothing was forgotten (it ended this thread)
            self.counts["forgets_refused"] += 1
            self._publish(self.forget_out, json.dumps({"error": str(exc)}))
            return
        self.counts["forgets"] += 1
        self._publish(self.forget_out, json.dumps(result, default=str))

    def _token(self, pieces: _TextPieces, token: int) -> None:  # the daemon's main loop
        piece = pieces.push(token)
        if piece:
            self._publish(self.tokens, piece)

    # ------------------------------------------------------------------ answers and status out (this thread)
    def _run(self) -> None:
        period = self.settings.status_period_s
        next_status = time.monotonic()
        while True:
            with self._cond:
                if self._stopping:
                    return
                done = [q for q in self._pending if q.done.is_set()]
                if not done and not self._alerts and not self._forgets:
                    self._cond.wait(max(0.0, min(next_status - time.monotonic(), 0.05)))
                alerts, forgets = list(self._alerts), list(self._forgets)
                self._alerts.clear()
                self._forgets.clear()
            for question in done:
                self._pending.remove(question)
                self._answer(question)
            for event in alerts:
                self._alert(event)
            for window in forgets:
                self._forget(window)
            if time.monotonic() >= next_status:
                self._publish(self.status_out, json.dumps(self.status(), default=str))
                self.counts["status"] += 1
                next_status += period
                if next_status < time.monotonic():  # a stall: no burst of late status messages
                    next_status = time.monotonic() + period

    def _answer(self, question: Question) -> None:
        answered = question.answer is not None and question.error is None
        if answered and question.evidence_seen:
            self._evidence_image(question.evidence_seen[0])
        self._publish(self.json_out, json.dumps(self.answer_json(question)))
        if answered:
            self._publish(self.answers, question.answer.text)
            self.counts["answers"] += 1
        else:
            self._publish(self.answers, f"error: {question.error}")

    # ------------------------------------------------------------------ alerts (the alert bus's sink)
    def offer(self, event: Any) -> None:
        """An alert for the topics (any thread; never blocks: past ``ALERTS_QUEUED`` waiting, the oldest is dropped
        and counted)."""
        with self._cond:
            if len(self._alerts) >= ALERTS_QUEUED:
                self._alerts.popleft()
                self.counts["alerts_dropped"] += 1
            self._alerts.append(event)
            self._cond.notify_all()

    def _alert(self, event: Any) -> None:
        """(This channel's thread.) The keyframe on ``alert_image``, then the alert's JSON on ``alerts``."""
        if event.keyframe_jpeg is not None:
            stamp = event.evidence_unix if event.evidence_unix is not None else event.raised_unix
            try:
                self.alert_image_out.publish_image(event.keyframe_jpeg, round(stamp * 1e9), event.camera or "")
            except Exception as exc:  # a DDS error must not take the loop down
                log.warning("ROS 2 topic %s: publish failed (%s)", self.alert_image_out.topic, exc)
        self._publish(self.alerts_out, json.dumps(event.to_json(keyframe="none")))
        self.counts["alerts"] += 1

    def answer_json(self, question: Question, error: Exception | None = None) -> dict:
        """What goes on ``output_json`` for ``question`` (answered, failed, or refused with ``error``)."""
        error = error if error is not None else question.error
        answer = question.answer.text if question.answer is not None and error is None else None
        return {"question": question.text, "answer": answer, "error": None if error is None else str(error),
                "camera": getattr(self.daemon, "camera", None),
                "evidence": [evidence_item(*seen) for seen in question.evidence_seen] if answer is not None else []}

    def _evidence_image(self, seen: tuple) -> None:
        """The frame of the answer's first evidence pair on ``output_evidence``, when it is still kept."""
        pair, _t, unix, kept = seen[:4]
        data = self.daemon.keyframe_jpeg(pair) if kept else None
        if data is None:
            return
        stamp_ns = round(unix * 1e9) if unix is not None else 0
        try:
            self.evidence_out.publish_image(data, stamp_ns, getattr(self.daemon, "camera", None) or "")
            self.counts["evidence_images"] += 1
        except Exception as exc:  # a DDS error must not take the loop down
            log.warning("ROS 2 topic %s: publish failed (%s)", self.evidence_out.topic, exc)

    def _publish(self, publication: Any, text: str) -> None:
        try:
            publication.publish_text(text)
        except Exception as exc:  # a DDS error must not take the loop (or the listener thread) down
            log.warning("ROS 2 topic %s: publish failed (%s)", publication.topic, exc)

    def status(self) -> dict:
        """What goes on the status topic: the daemon's figures and the session's (at most ``STATS_WAIT_S`` old
        when the main loop is between steps, else the last ones taken), capture and topic counters."""
        daemon = self.daemon
        if daemon.session is not None and daemon.lock.acquire(timeout=STATS_WAIT_S):
            try:
                self._stats, self._stats_at = daemon.session.stats(), time.monotonic()
            finally:
                daemon.lock.release()
        stats = self._stats or {}
        keys = ("frames", "frame_pairs", "cache_tokens", "cache_capacity_tokens", "cache_capacity_bytes",
                "compressions", "tokens_evicted", "position_max", "questions", "answer_tokens")
        sampler = daemon.sampler
        capture = sampler.stats() if sampler is not None else {}
        source = getattr(sampler.capture.source, "stats", None) if sampler is not None else None
        return {
            "time": time.time(), **daemon.status(), "cache": {key: stats.get(key) for key in keys},
            "stats_age_s": round(time.monotonic() - self._stats_at, 3) if self._stats is not None else None,
            "capture": {key: capture.get(key) for key in ("frames_read", "frames_decoded", "frames_dropped",
                                                            "frames_corrupt", "reconnects", "ended", "last_error")},
            "source": source() if callable(source) else None, "ros2": dict(self.counts),
        }
