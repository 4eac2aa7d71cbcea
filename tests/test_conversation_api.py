"""A conversation and a stretch of time over the chat API: the user and assistant messages before the question
are its history,
rendered after the video as the chat template renders earlier turns (``StreamSession.ask(history=...)``; the
parity with transformers over the template is in test_session.py). A ``tool`` message is refused by name, a
history too long for the text reserve is refused before it is queued, and an escalated question carries its
conversation to the bigger model. ``window`` ({from, to} stream seconds or {last_s}) limits what the
question reads (tests/test_question_window.py checks the session's side)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from edgekv.config import EdgeKVConfig

pytest.importorskip("fastapi")
SOURCE = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # a purple triangle at pair 60
TURNS = [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "Which shape was purple?"},
         {"role": "assistant", "content": "triangle"}]


def _config(**sections) -> EdgeKVConfig:
    base = dict(model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
                video={"source": SOURCE, "fps": 2.0, "resolution": [112, 112]},
                cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
                generation={"max_new_tokens": 4}, monitor={"backend": "cpu"}, server={"port": 0})
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return EdgeKVConfig().with_overrides(**base)


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """A daemon whose stream has ended (all 80 pairs in): its answers no longer depend on when they are asked."""
    from helpers_server import ended_daemon

    with ended_daemon(_config(), tmp_path_factory.mktemp("conversation") / "out.txt") as daemon:
        yield daemon

def _chat(port: int, messages: list[dict], **fields) -> tuple[int, dict]:
    from helpers_server import call

    status, _, raw = call(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 4, **fields})
    return status, json.loads(raw)


def test_the_earlier_messages_are_the_questions_history(ended):
    session, question = ended.session, "What color was the cross?"
    status, body = _chat(ended.server.port, TURNS + [{"role": "user", "content": question}])
    assert status == 200, body
    history = [("user", "Which shape was purple?"), ("assistant", "triangle")]  # the system message is not a turn
    with ended.lock:
        direct = session.ask(question, max_new_tokens=4, history=history)
    assert body["choices"][0]["message"]["content"] == direct.text
    video = session.cache.length - session.prefix_tokens
    with_history = len(session.layout.question_suffix_ids(session.tokenizer, question, history))
    assert body["usage"]["prompt_tokens"] == direct.prompt_tokens + direct.video_tokens
    assert direct.prompt_tokens == with_history > len(session.layout.question_suffix_ids(session.tokenizer, question))
    assert direct.video_tokens >= video - session.prefix_tokens  # the whole cache was read


def test_a_tool_message_and_an_empty_earlier_question_are_refused_by_name(ended):
    port = ended.server.port
    status, body = _chat(port, [{"role": "tool", "content": "42"},
                                {"role": "user", "content": "Which shape was purple?"}])
    assert status == 400 and body["error"]["param"] == "messages[0].role" and "tool" in body["error"]["message"]
    status, body = _chat(port, [{"role": "user", "content": " "}, {"role": "assistant", "content": "ok"},
                                {"role": "user", "content": "Which shape was purple?"}])
    assert status == 400 and body["error"]["param"] == "messages[0].content"
    status, body = _chat(port, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] * 40
                         + [{"role": "user", "content": "Which shape was purple?"}])
    assert status == 400 and "80 earlier user and assistant turns; at most 64" in body["error"]["message"]


def test_a_history_longer_than_the_text_reserve_is_refused_before_it_is_queued(ended):
    long = [{"role": "user", "content": "purple " * 700}, {"role": "assistant", "content": "triangle"}]
    asked = ended.session.counters.questions
    status, body = _chat(ended.server.port, long + [{"role": "user", "content": "Which shape was purple?"}])
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "tokens with its history) + max_tokens (4) exceed" in body["error"]["message"]
    assert ended.session.counters.questions == asked  # never asked of the session


def test_an_escalated_question_carries_its_conversation():
    """The bigger model is asked with the same conversation: the earlier turns before the question."""
    from edgekv.apps.outputs.escalate import Escalator
    from edgekv.config import EscalateSection

    seen = []

    class Remote(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"model": "big", "choices": [{"message": {"role": "assistant", "content": "green"}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Remote)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        section = EscalateSection(url=f"http://127.0.0.1:{server.server_port}/v1", model="big", timeout_s=30)
        escalator = Escalator(section, done=lambda question: None)
        text, model = escalator.ask_remote("What color was the cross?", [b"\xff\xd8jpeg"],
                                           [("user", "Which shape was purple?"), ("assistant", "triangle")])
    finally:
        server.shutdown()
        thread.join(30)
    assert (text, model) == ("green", "big")
    messages = seen[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[:2] == [{"role": "user", "content": "Which shape was purple?"},
                            {"role": "assistant", "content": "triangle"}]
    assert messages[2]["content"][0] == {"type": "text", "text": "What color was the cross?"}


def test_a_window_limits_what_the_question_reads(ended):
    port, session = ended.server.port, ended.session
    ask = [{"role": "user", "content": "Which shape was purple?"}]
    status, body = _chat(port, ask, window={"from": 55, "to": 65})  # the purple triangle is at stream second 60
    assert status == 200 and body["choices"][0]["message"]["content"] == "triangle", body
    assert body["edgekv"]["window_pairs"] >= 1
    status, body = _chat(port, ask, window={"last_s": 10})
    assert status == 200, body
    now = session.clock.last_t
    with ended.lock:
        direct = session.ask("Which shape was purple?", max_new_tokens=4, window=(now - 10, now))
    assert body["choices"][0]["message"]["content"] == direct.text
    assert body["edgekv"]["window_pairs"] == direct.window_pairs <= 11
    status, body = _chat(port, ask)
    assert status == 200 and body["edgekv"]["window_pairs"] is None
    status, body = _chat(port, ask, window={"from": 100, "to": 200})
    assert status == 400 and "window 100-200 s: no frame pair of it is in the cache" in body["error"]["message"]


def test_edgekv_ask_takes_a_window(ended, capsys):
    from edgekv.apps.cli import main

    url = f"http://127.0.0.1:{ended.server.port}"
    assert main(["ask", "Which shape was purple?", "--url", url, "--from", "55", "--to", "65"]) == 0
    assert capsys.readouterr().out.strip() == "triangle"
    assert main(["ask", "Which shape was purple?", "--url", url, "--last", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["edgekv"]["window_pairs"] >= 1
    for bad, said in ((["--last", "5", "--from", "1", "--to", "2"], "--last, or --from and --to, not both"),
                      (["--from", "3"], "--from and --to go together"),
                      (["--from", "90", "--to", "99"], "window 90-99 s: no frame pair of it is in the cache"),
                      (["--fleet", "--from", "1", "--to", "5"], "--fleet --from / --to: wall times")):
        assert main(["ask", "Which shape was purple?", "--url", url, *bad] if "--fleet" not in bad
                    else ["ask", "Which shape was purple?", *bad]) == 2
        assert said in capsys.readouterr().err


def test_edgekv_ask_chat_keeps_the_conversation(ended, capsys, monkeypatch):
    """``edgekv ask --chat``: the question given, then each line typed, asked with the conversation so far; an
    empty line ends it; a refused question is said and left out of the conversation."""
    import io

    from edgekv.apps.cli import main

    url = f"http://127.0.0.1:{ended.server.port}"
    typed = io.StringIO("What color was the cross?\n" + "purple " * 700 + "\nHow many times did the cross appear?\n\n")
    monkeypatch.setattr("sys.stdin", typed)
    assert main(["ask", "Which shape was purple?", "--url", url, "--chat", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr()
    answers = printed.out.split()
    assert len(answers) == 3 and answers[0] == "triangle"
    assert "tokens with its history) + max_tokens (4) exceed" in printed.err  # the long line, refused, left out
    session = ended.session
    history = [("user", "Which shape was purple?"), ("assistant", "triangle")]
    with ended.lock:
        second = session.ask("What color was the cross?", max_new_tokens=4, history=history)
        history += [("user", "What color was the cross?"), ("assistant", second.text)]
        third = session.ask("How many times did the cross appear?", max_new_tokens=4, history=history)
    assert answers[1:] == [second.text, third.text]
    assert main(["ask", "--url", url, "--chat", "--stream"]) == 2
    assert "--chat prints each answer when it is whole" in capsys.readouterr().err
