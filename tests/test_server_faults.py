"""What hostile or unlucky clients did to the API (issue 26, items 5, 6 and 8): a valid question refused while
another answer decodes; one host holding every connection slot; an SSE client that leaves while its answer
is still decoded to the end; a login form that takes guesses as fast as they come."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import edgekv
from edgekv.apps.server.chat import check_fits
from edgekv.apps.server.guard import PENDING_GRACE_S
from edgekv.apps.server.openai_chat import ApiError
from helpers_server import RunningDaemon, call, chat, connect, server_config

pytest.importorskip("fastapi")


def _wait_for(predicate, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------------------------------------- item 5
def test_a_question_that_fits_alone_is_not_refused_while_another_decodes(tiny_checkpoint):
    """Before: the check counted the answer in flight, so a question under the text reserve was refused
    "context too long" whenever another answer was decoding."""
    session = edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 56], "fps": 2.0},
        cache={"policy": "sliding_window", "max_tokens": 200, "text_reserve_tokens": 96}).session()
    rng = np.random.default_rng(0)
    for i in range(80):  # well past the cap: the video holds all it may (the text reserve stays free)
        session.ingest(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), t=i / 2.0)
    suffix = len(session.layout.question_suffix_ids(session.tokenizer, "What moved?"))
    fits_alone = SimpleNamespace(question="What moved?", max_new_tokens=96 - suffix, recall=None, history=(),
                                 answer_prefix="")
    never_fits = SimpleNamespace(question="What moved?", max_new_tokens=201 - suffix - session.prefix_tokens,
                                 recall=None, history=(), answer_prefix="")  # more than the cache holds beside the
    # system prompt
    check_fits(session, fits_alone)
    seen: list = []

    def on_token(_token: int) -> None:
        if not seen:
            try:
                check_fits(session, fits_alone)  # another answer is decoding right now
                seen.append("queued")
            except ApiError as exc:
                seen.append(exc.message)

    session.ask("Describe everything you saw, please.", max_new_tokens=8, on_token=on_token)
    assert seen == ["queued"], seen
    with pytest.raises(ApiError, match="context|exceed"):
        check_fits(session, never_fits)


def test_over_http_the_second_question_waits_for_the_first(tiny_checkpoint, tmp_path):
    config = server_config(tiny_checkpoint, max_new_tokens=96).with_overrides(cache={"max_tokens": 160})
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        daemon = running.daemon
        assert _wait_for(lambda: daemon.session.counters.compressions > 0)  # the video holds all it may
        ask, first_token, release = daemon.session.ask, threading.Event(), threading.Event()

        def blocking_ask(*args, on_token=None, **kwargs):
            def hold(token):
                if not first_token.is_set():
                    first_token.set()
                    release.wait(60)
                if on_token is not None:
                    on_token(token)
            return ask(*args, on_token=hold, **kwargs)

        daemon.session.ask = blocking_ask
        results = {}
        threading.Thread(target=lambda: results.setdefault("a", chat(running.port, "Tell me a long story.",
                                                                     max_tokens=48)), daemon=True).start()
        assert first_token.wait(60)
        daemon.session.ask = ask  # only the first answer holds
        worker = threading.Thread(target=lambda: results.setdefault("b", chat(running.port, "What moved?",
                                                                              max_tokens=80)), daemon=True)
        worker.start()
        assert _wait_for(lambda: "b" in results or daemon.questions.qsize() == 1)
        release.set()
        worker.join(60)
        assert results["b"][0] == 200, results["b"]


# ---------------------------------------------------------------------------------------------- item 6
def _from(host: str, port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(host, 0))
    sock.settimeout(10)
    return sock


def test_one_host_cannot_take_every_connection(tiny_checkpoint, tmp_path):
    """A slowloris from one host (127.0.0.2) opens connections and never finishes a request: past
    server.max_connections_per_client it is refused as it connects, and /healthz from another host is
    served (before: it held all the slots and /healthz waited for one)."""
    config = server_config(tiny_checkpoint, max_connections=6, max_connections_per_client=3,
                           request_timeout_s=30.0)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        held = []
        try:
            for _ in range(3):
                sock = _from("127.0.0.2", running.port)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
                held.append(sock)
            # a connection counts against its address once it has been sending its request this long (a burst
            # that sends at once never does): not a race, the server's clock has passed it when it accepts
            time.sleep(PENDING_GRACE_S + 0.2)
            extra = _from("127.0.0.2", running.port)
            answer = extra.recv(4096)
            extra.close()
            assert answer.startswith(b"HTTP/1.1 503") and b"max_connections_per_client" in answer, answer
            status, _, _ = call(running.port, "GET", "/healthz", timeout=10)
            assert status == 200
        finally:
            for sock in held:
                sock.close()


def test_clients_waiting_for_answers_do_not_count_against_their_host(tiny_checkpoint, tmp_path):
    """Every client behind a reverse proxy is 127.0.0.1: six chats sent at once from one address, all waiting
    for their answers, pass a per-client cap of 3 (only connections that keep sending a request count)."""
    config = server_config(tiny_checkpoint, max_connections_per_client=3, queue_size=16)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        daemon = running.daemon
        ask, release = daemon.session.ask, threading.Event()

        def held_ask(*args, **kwargs):
            release.wait(60)
            return ask(*args, **kwargs)

        daemon.session.ask = held_ask
        results: list = []
        threads = [threading.Thread(target=lambda i=i: results.append(chat(running.port, f"Question {i}?",
                                                                           max_tokens=2))) for i in range(6)]
        for thread in threads:  # at once: a burst of connections that each send their request right away
            thread.start()
        assert _wait_for(lambda: daemon.questions.qsize() + (daemon._current is not None) == 6), results
        release.set()
        for thread in threads:
            thread.join(60)
        assert [r[0] for r in results] == [200] * 6, results


def test_pollers_wait_their_turn_and_past_it_are_refused(tiny_checkpoint, tmp_path):
    """Before: twenty connections hammering /metrics, /v1/edgekv/status and /frame.jpg ran as fast as the
    machine could, and /healthz waited behind them (p99 125 ms). Now each address gets server.reads_per_second
    (bursts of twice that); a request over it waits its turn, and one that would wait too long is a 429."""
    config = server_config(tiny_checkpoint, reads_per_second=0.1)  # a burst of 1, then one every 10 s
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        assert call(running.port, "GET", "/metrics")[0] == 200
        status, headers, _ = call(running.port, "GET", "/v1/edgekv/status")
        assert status == 429 and 5 <= int(headers["retry-after"]) <= 10, headers
        assert call(running.port, "GET", "/healthz")[0] == 200  # never shaped
        assert call(running.port, "GET", "/v1/models")[0] == 200


def test_the_read_shaper_waits_instead_of_refusing_while_it_can():
    from edgekv.apps.server.guard import AttemptLimiter

    now = [0.0]
    shaper = AttemptLimiter(per_minute=60 * 2.0, burst=2, clock=lambda: now[0])  # 2 a second, bursts of 2
    assert [shaper.reserve("a", 1.0) for _ in range(4)] == [0.0, 0.0, 0.5, 1.0]
    assert shaper.reserve("a", 1.0) is None and shaper.reserve("b", 1.0) == 0.0
    now[0] += 1.0  # two more accrued: the debt of two is paid, the next one is due in half a second
    assert shaper.reserve("a", 1.0) == 0.5


# ---------------------------------------------------------------------------------------------- item 8
def test_an_sse_client_that_leaves_stops_its_answer(tiny_checkpoint, tmp_path):
    """Before: the answer was decoded to max_tokens for nobody (16 abandoned chats cost 3,200 tokens)."""
    config = server_config(tiny_checkpoint, max_new_tokens=200)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        daemon = running.daemon
        ask = daemon.session.ask
        tokens: list[int] = []

        def watched_ask(*args, on_token=None, **kwargs):
            def counting(token):
                tokens.append(token)
                if len(tokens) == 2:  # the client is gone by now; wait until the server noticed
                    question = daemon._current
                    _wait_for(lambda: getattr(question, "cancelled", threading.Event()).is_set(), 30)
                if on_token is not None:
                    on_token(token)
            return ask(*args, on_token=counting, **kwargs)

        daemon.session.ask = watched_ask
        body = json.dumps({"messages": [{"role": "user", "content": "Say a lot."}], "max_tokens": 200,
                           "stream": True}).encode()
        sock = connect(running.port)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:  # the stream started
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        sock.close()
        assert _wait_for(lambda: any(q.get("error") for q in daemon.recent_questions()), 60)
        record = daemon.recent_questions()[-1]
        assert "disconnected" in record["error"] and len(tokens) <= 3, (record, len(tokens))


def test_the_login_form_is_rate_limited(tiny_checkpoint, tmp_path):
    """Before: ~80 guesses a second (each failure slept 0.5 s, but guesses in parallel all ran)."""
    config = server_config(tiny_checkpoint, token="the-right-token", login_attempts_per_minute=6)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        results: list[tuple[int, dict]] = []

        def guess(word: str) -> None:
            status, headers, _ = call(running.port, "POST", "/v1/edgekv/login", {"token": word})
            results.append((status, headers))

        threads = [threading.Thread(target=guess, args=(f"guess-{i}",)) for i in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        statuses = sorted(status for status, _ in results)
        assert statuses.count(401) <= 6 and statuses.count(429) >= 14, statuses
        assert all(h.get("retry-after") for s, h in results if s == 429)
        status, _, _ = call(running.port, "POST", "/v1/edgekv/login", {"token": "the-right-token"})
        assert status == 429  # while limited even the right token is not checked: no oracle for guessers


def test_right_sign_ins_do_not_spend_the_guessers_bucket(tiny_checkpoint, tmp_path):
    """Ten sign-ins with the right token in a row (a page opened in several browsers), then the API with the right
    bearer token: all served. Before, the sixth sign-in and every request after it got 429 for a minute."""
    config = server_config(tiny_checkpoint, token="the-right-token", login_attempts_per_minute=6)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        for _ in range(10):
            assert call(running.port, "POST", "/v1/edgekv/login", {"token": "the-right-token"})[0] == 204
        assert call(running.port, "GET", "/v1/models", headers={"Authorization": "Bearer the-right-token"})[0] == 200


def test_a_refund_gives_back_one_attempt_and_never_more_than_the_burst():
    from edgekv.apps.server.guard import AttemptLimiter

    limiter = AttemptLimiter(per_minute=6, burst=3, clock=lambda: 0.0)
    for _ in range(10):  # right tokens: each attempt taken is given back
        assert limiter.allow("a")
        limiter.refund("a")
    limiter.refund("a")
    limiter.refund("b")  # nothing taken: nothing to give back, no bucket made
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]  # guesses still spend it


def test_the_login_limiter_refills_with_time():
    from edgekv.apps.server.guard import AttemptLimiter

    now = [0.0]
    limiter = AttemptLimiter(per_minute=6, burst=3, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b")  # per client
    assert limiter.retry_after("a") == pytest.approx(10.0)
    now[0] += 10.0
    assert limiter.allow("a") and not limiter.allow("a")
