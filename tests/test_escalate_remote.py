"""Escalation against a remote that misbehaves, and what may leave the device (apps/outputs/escalate.py): a fake
OpenAI server on loopback that trickles, floods, streams, echoes the question in its error, or holds its answer;
the privacy switch, a forget, an asker who left and a stop each keep a waiting escalation on the device."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from helpers_remote import answer_with, chat_body, remote_with  # noqa: F401 (a fixture)

from edgekv.apps.outputs.escalate import MAX_REPLY_BYTES, Escalation, Escalator
from edgekv.apps.questions import Question
from edgekv.config import EscalateSection
from edgekv.session.results import Answer

CHAT = chat_body("a red cup")
_answer = answer_with(CHAT)


def _held_then_answer(handler, remote) -> None:
    remote.release.wait(300)
    _answer(handler, remote)


def _escalator(url: str, timeout_s: float = 60, **section) -> Escalator:
    return Escalator(EscalateSection(url=url, model="big", timeout_s=timeout_s, **section), done=lambda q: None)


def _outcome(call, bound_s: float = 120):
    """``call()``'s result or exception, run in a thread and waited for up to ``bound_s`` (None: still running)."""
    out = []

    def run():
        try:
            out.append(("returned", call()))
        except Exception as exc:  # what the test asserts on
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    return out[0] if out else None


def test_a_remote_that_trickles_its_reply_is_cut_at_the_timeout(remote_with):
    """escalate.timeout_s was each read's: a server sending a byte every 0.2 s (never silent for the 1 s timeout)
    held the escalation thread — and every question queued behind it — as long as it went on. It is now the whole
    exchange's: cut, the local answer standing with the reason."""

    def trickle(handler, remote):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()  # no length: the body ends when the connection does
        while not remote.release.wait(0.2):
            handler.wfile.write(b" ")
            handler.wfile.flush()

    remote = remote_with(trickle)
    outcome = _outcome(lambda: _escalator(remote.url, timeout_s=1).ask_remote("What is on the table?", []))
    assert outcome is not None, "still reading a reply that never ends"
    kind, exc = outcome
    assert kind == "raised" and isinstance(exc, TimeoutError), outcome
    assert "escalate.timeout_s (1 s)" in str(exc)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "until-close"])
def test_a_reply_larger_than_any_answer_is_refused_unread(remote_with, declared):
    """The whole reply was read into memory: a remote answering 5 MiB (or 5 GiB) had it all held by the device."""
    size = MAX_REPLY_BYTES + 2**20

    def flood(handler, remote):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if declared:
            handler.send_header("Content-Length", str(size))
        handler.end_headers()
        chunk = b" " * 2**16
        for _ in range(size // len(chunk)):
            handler.wfile.write(chunk)

    remote = remote_with(flood)
    with pytest.raises(ValueError, match=f"{MAX_REPLY_BYTES}"):
        _escalator(remote.url).ask_remote("What is on the table?", [])


def test_a_remote_that_streams_its_answer_is_read_whole(remote_with):
    """A server that streams whatever was asked (server-sent chunks): the answer was "did not answer with a chat
    completion" though every word of it came."""

    def stream(handler, remote):
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        for piece in ("a ", "red ", "cup"):
            chunk = {"object": "chat.completion.chunk", "model": "big",
                     "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        handler.wfile.write(b"data: [DONE]\n\n")
        handler.close_connection = True

    remote = remote_with(stream)
    assert _escalator(remote.url).ask_remote("What is on the table?", []) == ("a red cup", "big")


@pytest.mark.parametrize("keyframes, sent", [(0, 0), (2, 2)])
def test_no_more_keyframes_leave_than_escalate_keyframes(remote_with, keyframes, sent):
    """The daemon hands over the frames the answer attended most — as many as the question asked evidence of, or,
    with none, the latest frame: ``escalate.keyframes: 0`` still sent a frame, and a question asking for 8 evidence
    pairs sent 8. At most ``escalate.keyframes`` go."""
    remote = remote_with(_answer)
    found = [bytes([0xFF, 0xD8, i]) for i in range(5)]
    _escalator(remote.url, keyframes=keyframes).ask_remote("What is on the table?", found)
    content = remote.bodies[0]["messages"][-1]["content"]
    assert [part["type"] for part in content] == ["text"] + ["image_url"] * sent


def _question(text: str = "Is Anna at the front door?") -> Question:
    question = Question(text, source="http", escalate=True)
    question.answer = Answer(text="no", token_ids=[3], ttft_s=0.1, decode_tok_s=10.0, confidence=0.4)
    return question


class _Finished:
    """The escalator's ``done``: the questions it finished, in order."""

    def __init__(self) -> None:
        self.questions: list[Question] = []
        self.cond = threading.Condition()

    def __call__(self, question: Question) -> None:
        with self.cond:
            self.questions.append(question)
            self.cond.notify_all()

    def wait(self, count: int, bound_s: float = 120) -> list[Question]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.questions) >= count, bound_s), self.questions
        return self.questions


def _running(url: str, finished: _Finished, **kwargs) -> Escalator:
    section = EscalateSection(url=url, model="big", timeout_s=120, queue=4)
    return Escalator(section, done=finished, **kwargs).start()


def test_a_failure_is_logged_without_the_remote_s_words(remote_with, caplog):
    """A server's error body can quote the request (a 422 naming the invalid input: the question): it went to the
    log whole, where privacy.log_text keeps the question out. The asker's note still has it."""

    def refuse(handler, remote):
        body = json.dumps({"detail": [{"msg": "bad", "input": remote.bodies[-1]["messages"][-1]["content"]}]})
        handler.send_response(422)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body.encode())

    remote, finished = remote_with(refuse), _Finished()
    escalator = _running(remote.url, finished)
    try:
        with caplog.at_level(logging.WARNING, "edgekv.escalate"):
            escalator.submit(Escalation(_question(), [b"\xff\xd8jpeg"], "asked"))
            (question,) = finished.wait(1)
    finally:
        escalator.stop()
    assert "HTTP 422" in question.answer.escalation_note and "Anna" in question.answer.escalation_note
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "HTTP 422" in logged and "Anna" not in logged


def test_nothing_leaves_while_the_privacy_switch_is_on(remote_with):
    """A paused daemon (POST /v1/privacy/pause) still answers about what it saw, and an escalation sent the
    keyframes off the device all the same. ``withheld`` names the pause: the local answer, the reason said."""
    remote, finished = remote_with(_answer), _Finished()
    paused = ["paused (privacy)"]
    escalator = _running(remote.url, finished, withheld=lambda: paused[0])
    try:
        escalator.submit(Escalation(_question(), [b"\xff\xd8jpeg"], "asked"))
        (question,) = finished.wait(1)
        assert remote.bodies == []
        assert question.answer.escalated is None and question.answer.text == "no"
        assert question.answer.escalation_note.startswith("not escalated: paused (privacy)")
        paused[0] = None  # resumed
        escalator.submit(Escalation(_question(), [b"\xff\xd8jpeg"], "asked"))
        assert finished.wait(2)[1].answer.escalated == "big" and len(remote.bodies) == 1
    finally:
        escalator.stop()


def test_a_forget_withdraws_what_waits_to_be_escalated(remote_with):
    """Escalations wait their turn behind a slow remote, each holding its question and keyframes; a forget came and
    went, and they were sent afterwards. Now what waits when a forget comes stays on the device."""
    remote, finished = remote_with(_held_then_answer), _Finished()
    escalator = _running(remote.url, finished)
    try:
        first, waiting = _question(), _question("Who was in the kitchen?")
        escalator.submit(Escalation(first, [b"\xff\xd8one"], "asked"))
        assert remote.arrived.acquire(timeout=120)  # the first is on the wire: it cannot be called back
        escalator.submit(Escalation(waiting, [b"\xff\xd8two"], "asked"))
        escalator.forget()
        remote.release.set()
        finished.wait(2)
    finally:
        escalator.stop()
    assert len(remote.bodies) == 1 and remote.bodies[0]["messages"][-1]["content"][0]["text"] == first.text
    assert first.answer.escalated == "big"
    assert waiting.answer.escalated is None and "a forget came while it waited" in waiting.answer.escalation_note


def test_an_asker_who_left_is_not_escalated_for(remote_with):
    remote, finished = remote_with(_held_then_answer), _Finished()
    escalator = _running(remote.url, finished)
    try:
        escalator.submit(Escalation(_question(), [], "asked"))
        assert remote.arrived.acquire(timeout=120)
        gone = _question("Who was in the kitchen?")
        escalator.submit(Escalation(gone, [b"\xff\xd8jpeg"], "asked"))
        gone.cancelled.set()  # the HTTP client disconnected while it waited
        remote.release.set()
        finished.wait(2)
    finally:
        escalator.stop()
    assert len(remote.bodies) == 1 and "the asker left" in gone.answer.escalation_note


def test_a_stop_answers_every_waiting_question_locally(remote_with):
    """At a stop the escalation in flight kept its thread until the remote answered or timed out (escalate.timeout_s,
    30 s by default), and the questions queued behind it were never finished: their askers waited on a daemon that
    was gone. Now the exchange is cut and each gets its local answer, the stop said."""
    remote, finished = remote_with(_held_then_answer), _Finished()
    escalator = _running(remote.url, finished)
    in_flight, queued = _question(), [_question(f"question {i}") for i in range(3)]
    escalator.submit(Escalation(in_flight, [], "asked"))
    assert remote.arrived.acquire(timeout=120)
    for question in queued:
        assert escalator.submit(Escalation(question, [], "asked"))
    escalator.stop(timeout=120)
    done = finished.wait(4)
    assert {q.id for q in done} == {q.id for q in [in_flight, *queued]}
    assert all(q.answer.escalated is None and q.answer.text == "no" for q in done)
    assert "the daemon is stopping" in in_flight.answer.escalation_note
    assert all(q.answer.escalation_note == "not escalated: the daemon is stopping" for q in queued)
    assert len(remote.bodies) == 1
    assert not escalator.submit(Escalation(_question(), [], "asked"))  # stopped: nothing more is queued


def test_the_daemon_withholds_escalations_while_paused_and_withdraws_them_at_a_forget(tiny_checkpoint, tmp_path):
    """The escalator's checks are the daemon's: its privacy pause is what ``withheld`` names, and its forget is what
    withdraws the waiting escalations (before, the daemon passed neither, and a paused daemon sent keyframes)."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=16", "fps": 8.0, "resolution": [56, 56]},
        cache={"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64}, server={"port": 0},
        escalate={"url": "http://127.0.0.1:9/v1", "model": "big"}, monitor={"backend": "cpu"})
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        escalator = daemon.escalator
        assert escalator.withheld() is None
        daemon.pause("privacy switch")
        assert "paused" in escalator.withheld()
        daemon.resume()
        assert escalator.withheld() is None
        before = escalator.forgets
        times = dict(daemon.session.pair_times)
        daemon.forget(times[2], times[2])
        assert escalator.forgets == before + 1


def test_an_escalation_sends_the_evidence_frames_kept_on_disk_never_the_latest_in_their_place(tiny_checkpoint,
                                                                                               tmp_path):
    """The pair a question attended most was older than the keyframe ring (alerts.keyframe_pairs): the latest frame
    went to the remote in its place, so a question about an hour ago was escalated with a picture of now. The
    evidence frames on disk (archive.frames_mib) give the right one; a pair kept nowhere sends nothing."""
    pytest.importorskip("fastapi")
    import dataclasses

    from helpers_server import ended_daemon, kept_config

    from edgekv.apps.questions import Question

    config = kept_config(tiny_checkpoint, tmp_path, alerts={"keyframe_pairs": 2},
                         escalate={"url": "http://127.0.0.1:9/v1", "model": "big"})
    sent = []

    class Capture:
        def reason(self, question, answer, streamed):
            return "asked"

        def submit(self, escalation):
            sent.append(escalation.keyframes)
            return True

    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        assert daemon.frames.flush()
        stream = daemon._frame_stream()
        old = daemon.frames.jpeg(stream, 3)
        assert old is not None and 3 not in daemon.alerts.keyframes.frames  # on disk only
        real, daemon.escalator = daemon.escalator, Capture()
        try:
            question = Question("What was red?")
            answer = daemon.session.ask("What was red?", max_new_tokens=1)
            for evidence, expected in (((3,), [old]), ((3, 3), [old]), ((), None)):
                question.answer = dataclasses.replace(answer, evidence=evidence)
                assert daemon._escalate(question)
                if expected is not None:
                    assert sent[-1] == expected
                else:  # no evidence at all: the latest frame, a question about now
                    assert len(sent[-1]) == 1 and sent[-1][0] != old
            daemon.frames.forget(0.0, 1e9, stream)  # kept nowhere now
            question.answer = dataclasses.replace(answer, evidence=(3,))
            assert daemon._escalate(question) and sent[-1] == []
        finally:
            daemon.escalator = real
