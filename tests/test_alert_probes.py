"""Alert outputs against receivers and files as they are found in a deployment: a webhook that redirects, one that
takes the alert and never ends its reply, a kept alert whose JSON reads but holds a field of another type, a rule
name with line breaks in the log."""

from __future__ import annotations

import http.server
import json
import logging
import math
import threading

import numpy as np
import pytest

from edgekv.apps.outputs.alert_log import EventLog
from edgekv.apps.outputs.alerts import AlertBus, AlertEngine, AlertEvent, KeyframeRing
from edgekv.apps.outputs.webhooks import WebhookSender
from edgekv.config import AlertRuleSection
from edgekv.session import YesNo
from helpers_mqtt import until


def _event(i: int = 0) -> AlertEvent:
    return AlertEvent(f"{i:016x}", "alert-1", "red", "Was there a red circle?", None, 0.9, 10.0 + i, 2, 9.5 + i,
                      1_800_000_000.0 + i, b"\xff\xd8jpeg", "pair 2")


class _Receiver:
    """127.0.0.1 answering each POST by ``reply(handler)``; records (method, path, body length)."""

    def __init__(self, reply) -> None:
        self.requests: list[tuple[str, str, int]] = []
        self.release = threading.Event()  # ends a reply held open
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                receiver.requests.append(("GET", self.path, 0))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append(("POST", self.path, len(body)))
                reply(self, receiver)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _redirect(handler, receiver) -> None:
    handler.send_response(302)
    handler.send_header("Location", "/moved")
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _taken_reply_never_ends(handler, receiver) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", "100")
    handler.end_headers()
    handler.wfile.write(b"ok")
    handler.wfile.flush()
    receiver.release.wait(60)


def test_a_redirecting_webhook_is_not_counted_as_delivered(caplog):
    """urllib followed the 302 with a GET without the body: the receiver answered 200 and the alert, counted sent,
    never arrived anywhere. Now the redirect is not followed and the log says where it points."""
    receiver = _Receiver(_redirect)
    sender = WebhookSender(receiver.url, timeout_s=60, retries=2).start()
    try:
        with caplog.at_level(logging.WARNING, "edgekv.webhooks"):
            sender.offer(_event())
            assert until(lambda: sender.sent + sender.failed == 1)
        assert sender.sent == 0 and sender.failed == 1 and sender.attempts == 1
        assert receiver.requests == [("POST", "/hook", receiver.requests[0][2])]  # no GET to /moved
        assert "HTTP 302 to /moved" in caplog.text
    finally:
        sender.stop()
        receiver.close()


def test_a_receiver_that_took_the_alert_and_never_ends_its_reply_gets_it_once():
    """A 2xx status is the receiver taking the alert: a reply body that never ends timed out, and the alert was
    POSTed again at every retry (three alerts for one event) and counted failed. Nor is the body waited for: a
    receiver dripping it within each read's timeout held the sender (the timeout here is longer than the wait)."""
    receiver = _Receiver(_taken_reply_never_ends)
    sender = WebhookSender(receiver.url, timeout_s=120, retries=2).start()
    try:
        sender.offer(_event())
        assert until(lambda: sender.sent + sender.failed == 1)
        assert sender.sent == 1 and sender.attempts == 1 and len(receiver.requests) == 1
    finally:
        sender.stop()
        receiver.close()


@pytest.mark.parametrize("field, value", [("p_yes", "0.9"), ("stream_t", "late"), ("raised_unix", math.nan),
                                          ("name", None), ("evidence_pair", 2.5), ("camera", 7),
                                          ("evidence_unix", True)])
def test_a_kept_alert_with_a_field_of_another_type_is_set_aside(tmp_path, field, value):
    """Such a file was listed after a restart, and every ``GET /v1/alerts/events`` (HTTP 500: ``round`` of a
    string) and every forget (a string compared with a stream time) failed while it was kept."""
    EventLog(tmp_path).save(_event(0))
    EventLog(tmp_path).save(_event(1))
    (damaged,) = [p for p in EventLog(tmp_path).files() if _event(1).id in p.name]
    doc = json.loads(damaged.read_bytes())
    doc[field] = value
    damaged.write_text(json.dumps(doc))
    log = EventLog(tmp_path)
    bus = AlertBus(log)  # a restart
    assert [e.id for e in bus.recent] == [_event(0).id] and log.set_aside == 1
    assert damaged.with_name(damaged.name + ".bad").exists()
    assert [e.to_json()["id"] for e in bus.recent] == [_event(0).id]
    assert bus.forget(0.0, 100.0) == 1


def test_a_rule_name_cannot_write_lines_into_the_log(caplog):
    """The API takes any name: written as it is, a line break in it forged log lines after the alert's."""
    class Yes:
        def probe(self, question):
            return YesNo(0.9, {0: 1.0}, 1.0)

    ring = KeyframeRing(2)
    ring.add(0, np.zeros((8, 8, 3), np.uint8), 0.0)
    engine = AlertEngine([AlertRuleSection(question="Was there a red circle?", name="red\nERROR forged line")],
                         AlertBus(), ring)
    (rule,) = engine.list()
    with caplog.at_level(logging.INFO, "edgekv.alerts"):
        assert engine.evaluate(rule, Yes(), 0) is not None
    (record,) = [r for r in caplog.records if r.getMessage().startswith("alert ")]
    assert "\n" not in record.getMessage()


def test_an_alerts_line_holds_no_question_where_privacy_keeps_text_out_of_the_log(caplog):
    """privacy.log_text off (a key configured): answers and questions were kept out of the log, but an alert's line
    named its rule by its question (a user's text when the API added it; the name is the question when unnamed)."""
    class Yes:
        def probe(self, question):
            return YesNo(0.9, {0: 1.0}, 1.0)

    ring = KeyframeRing(2)
    ring.add(0, np.zeros((8, 8, 3), np.uint8), 0.0)
    engine = AlertEngine([AlertRuleSection(question="Is Anna at the front door?")], AlertBus(), ring, log_text=False)
    (rule,) = engine.list()
    with caplog.at_level(logging.INFO, "edgekv.alerts"):
        assert engine.evaluate(rule, Yes(), 0) is not None
    (record,) = [r for r in caplog.records if r.getMessage().startswith("alert ")]
    assert "Anna" not in record.getMessage() and rule.id in record.getMessage()


def _chat_reply(body: bytes):
    def reply(handler, receiver) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return reply


def _escalator(url: str):
    from edgekv.apps.outputs.escalate import Escalator
    from edgekv.config import EscalateSection

    return Escalator(EscalateSection(url=url.rsplit("/", 1)[0] + "/v1", model="big", timeout_s=30), done=lambda q: None)


@pytest.mark.parametrize("body, why", [
    (b'{"model": "big", "choices": [{"message": {"role": "assistant", "content": null}}]}', "answered without text"),
    (b'{"object": "error", "message": "model not found"}', "did not answer with a chat completion"),
    (b'<html>gateway</html>', "did not answer with a chat completion"),
])
def test_an_escalation_reply_without_an_answer_is_a_failure_naming_the_server(body, why):
    """A null content was taken as the answer: the question was answered "None", marked escalated; other shapes
    failed as a bare ``KeyError: 'choices'``. Now each is a failure (the local answer stands) saying what came."""
    receiver = _Receiver(_chat_reply(body))
    try:
        with pytest.raises(ValueError, match=why) as raised:
            _escalator(receiver.url).ask_remote("What is on the table?", [b"\xff\xd8jpeg"])
        assert "127.0.0.1" in str(raised.value)
    finally:
        receiver.close()


def test_an_escalation_reply_of_text_parts_is_their_text():
    receiver = _Receiver(_chat_reply(b'{"model": "big", "choices": [{"message": {"content": '
                                     b'[{"type": "text", "text": "a red "}, {"type": "text", "text": "cup"}]}}]}'))
    try:
        assert _escalator(receiver.url).ask_remote("What is on the table?", []) == ("a red cup", "big")
    finally:
        receiver.close()


def test_an_escalation_server_that_redirects_is_named_not_followed():
    """urllib followed the 302 with a GET without the question, and the note said "HTTP 405" of that GET."""
    receiver = _Receiver(_redirect)
    try:
        with pytest.raises(RuntimeError, match="HTTP 302 .* redirects to /moved"):
            _escalator(receiver.url).ask_remote("What is on the table?", [])
        assert [method for method, _, _ in receiver.requests] == ["POST"]
    finally:
        receiver.close()


def _read_only(monkeypatch, where: str) -> None:
    """Every write, rename and unlink under ``where`` fails as on a file system remounted read-only (flash after
    errors): Linux answers EROFS even to unlinking a file that is not there."""
    import builtins
    import errno
    import os
    import pathlib

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_open, real_os_open, real_replace, real_unlink = builtins.open, os.open, os.replace, pathlib.Path.unlink
    monkeypatch.setattr(builtins, "open", lambda path, mode="r", *a, **k: refuse() if where in str(path) and (
        "w" in mode or "a" in mode) else real_open(path, mode, *a, **k))
    monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: refuse() if where in str(path) and flags & (
        os.O_WRONLY | os.O_RDWR) else real_os_open(path, flags, *a, **k))
    monkeypatch.setattr(os, "replace", lambda src, dst, **k: refuse() if where in str(src) else real_replace(src, dst))
    monkeypatch.setattr(pathlib.Path, "unlink", lambda self, missing_ok=False: refuse() if where in str(self)
                        else real_unlink(self, missing_ok))


def test_an_alert_raised_on_a_read_only_state_dir_still_goes_out(tmp_path, monkeypatch, caplog):
    """The clean-up of the temporary file raised EROFS out of ``EventLog.save``: ``AlertBus.publish`` raised before
    any output had the alert (SSE, webhooks, MQTT), and the daemon logged "not evaluated" — the alert was lost."""
    (tmp_path / "alert-events").mkdir()
    got: list[AlertEvent] = []
    log = EventLog(tmp_path)
    bus = AlertBus(log)
    bus.add(type("Sink", (), {"offer": lambda self, e: got.append(e)})())
    _read_only(monkeypatch, str(tmp_path))
    bus.publish(_event())
    assert [e.id for e in got] == [_event().id] and bus.event(_event().id) is not None
    assert log.write_errors == 1 and "Read-only file system" in caplog.text


def test_a_damaged_rule_file_on_a_read_only_state_dir_does_not_stop_the_start(tmp_path, monkeypatch, caplog):
    """"Never a reason not to start" (``RuleStore``): setting the damaged file aside raised EROFS out of the start."""
    from edgekv.apps.outputs.alerts import RuleStore

    (tmp_path / "alerts.json").write_text("{ damaged")
    _read_only(monkeypatch, str(tmp_path))
    with caplog.at_level(logging.WARNING, "edgekv.alerts"):
        engine = AlertEngine([AlertRuleSection(question="Was there a red circle?")], AlertBus(), KeyframeRing(2),
                             store=RuleStore(tmp_path))
    assert [state.source for state in engine.list()] == ["config"]
    assert "could not be set aside" in caplog.text
