"""A fake OpenAI-compatible server on loopback for the escalation tests (tests/test_escalate_*.py): each POST's JSON
body kept, each answered by a reply function the test gives."""

from __future__ import annotations

import http.server
import json
import threading

import pytest


def chat_body(content: str, model: str = "big") -> bytes:
    """An OpenAI chat completion's JSON whose one choice says ``content``."""
    return json.dumps({"model": model, "choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


def answer_with(body: bytes):
    """A reply function answering 200 with ``body`` (JSON)."""
    def answer(handler, remote) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


class Remote:
    """127.0.0.1 answering each POST with ``reply(handler, remote)``; keeps every request's JSON body."""

    def __init__(self, reply) -> None:
        self.bodies: list[dict] = []
        self.arrived = threading.Semaphore(0)  # one release per request received
        self.release = threading.Event()  # ends a reply held open
        remote = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                remote.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                remote.arrived.release()
                try:
                    reply(self, remote)
                except OSError:  # the escalator hung up: what it is for
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def remote_with():
    made = []

    def make(reply) -> Remote:
        made.append(Remote(reply))
        return made[-1]

    yield make
    for remote in made:
        remote.close()
