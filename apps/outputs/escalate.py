"""Hard questions escalated to a bigger model (``escalate:`` in the config): an OpenAI-compatible server —
vLLM, SGLang, TensorRT-Edge-LLM's server, or another edgekv with ``server.image_requests: true`` — gets the
question and the ``escalate.keyframes`` frames the local answer attended most, as ``image_url`` parts (JPEG
``data:`` URLs). Never the KV cache: a cache is only meaningful to the model that wrote it.

When: the question asks (``"escalate": true`` on the chat API, ``Question.escalate``), or the local answer's
confidence — the geometric mean of its tokens' probabilities, ``Answer.confidence`` — is below
``escalate.confidence_below``. The local answer is always computed first (it is what the device knows, and
what is returned when the remote fails). A streamed chat only escalates when it asks (its local tokens would
already be on the wire otherwise).

It never blocks the stream: escalations run in a thread of their own, at most ``escalate.queue`` waiting or
in flight; the question is done when the remote answered (the answer's text replaced, ``escalated`` = the
model the remote named) or failed or timed out (the local answer, ``escalation_note`` saying why).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

from edgekv.apps.outputs.webhooks import RefuseRedirect

log = logging.getLogger("edgekv.escalate")


@dataclasses.dataclass
class Escalation:
    question: object   # apps.questions.Question, its local answer in .answer
    keyframes: list[bytes]
    reason: str


class Escalator:
    def __init__(self, section, done: Callable[[object], None]) -> None:
        from edgekv.apps.server.tls import client_context

        self.section, self.done = section, done
        self.token = os.environ.get(section.api_key_env) if section.api_key_env else None
        # an https:// server of a private CA (another edgekv serving TLS): ValueError naming the key at start
        self.context = client_context(section.url, section.ca_file, section.cert_file, section.key_file,
                                      names=("escalate.ca_file", "escalate.cert_file", "escalate.key_file"))
        self.jobs: queue.Queue[Escalation | None] = queue.Queue(maxsize=section.queue)
        handlers = [RefuseRedirect()] + ([urllib.request.HTTPSHandler(context=self.context)] if self.context else [])
        self._opener = urllib.request.build_opener(*handlers)
        self.sent = self.failed = self.refused = 0
        self._thread = threading.Thread(target=self._run, name="edgekv-escalate", daemon=True)

    def start(self) -> "Escalator":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def reason(self, question, answer, streamed: bool) -> str | None:
        """Why this answer goes to the remote, or None."""
        if question.escalate is True:
            return "asked"
        if question.escalate is False or streamed or answer is None:
            return None
        threshold = self.section.confidence_below
        if threshold is not None and answer.confidence is not None and answer.confidence < threshold:
            return f"local confidence {answer.confidence:.2f} < escalate.confidence_below {threshold:g}"
        return None

    def submit(self, escalation: Escalation) -> bool:
        """Queue it; False (and the local answer stands) when ``escalate.queue`` escalations already wait."""
        try:
            self.jobs.put_nowait(escalation)
            return True
        except queue.Full:
            self.refused += 1
            return False

    def stats(self) -> dict:
        return {"escalations_sent": self.sent, "escalations_failed": self.failed,
                "escalations_refused": self.refused, "escalations_waiting": self.jobs.qsize()}

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            question, local = job.question, job.question.answer
            try:
                text, model = self.ask_remote(question.text, job.keyframes, question.history)
                question.answer = dataclasses.replace(local, text=text, token_ids=[], escalated=model,
                                                      escalation_note=job.reason)
                self.sent += 1
            except Exception as exc:  # the remote is down, slow or wrong: the local answer stands
                self.failed += 1
                note = f"escalation failed ({type(exc).__name__}: {exc}); the local answer stands"
                log.warning("%s", note)
                question.answer = dataclasses.replace(local, escalation_note=note)
            self.done(question)

    def ask_remote(self, text: str, keyframes: list[bytes], history=()) -> tuple[str, str]:
        """The remote's answer and the model it names (OpenAI chat completions, not streamed); ``history``, the
        (role, text) turns the question came after, goes before it as the conversation's messages."""
        section = self.section
        content = [{"type": "text", "text": text}] + [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}}
            for jpeg in keyframes]
        body = json.dumps({"model": section.model, "max_tokens": section.max_tokens, "stream": False,
                           "messages": [*({"role": role, "content": turn} for role, turn in history),
                                        {"role": "user", "content": content}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(section.url.rstrip("/") + "/chat/completions", data=body, headers=headers,
                                         method="POST")
        try:
            with self._opener.open(request, timeout=section.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                raise RuntimeError(f"HTTP {exc.code} from {section.url}: it redirects to "
                                   f"{exc.headers.get('Location', 'no Location')} (not followed: set escalate.url to "
                                   "the server's own address)") from None
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {exc.code} from {section.url}: {detail}") from None
        return chat_reply(raw, section.url, section.model)


def chat_reply(raw: bytes, url: str, asked: str) -> tuple[str, str]:
    """The answer of a chat completion's body (``choices[0].message.content``, a string or a list of text parts)
    and the model it names (else ``asked``). ``ValueError`` naming ``url`` and what it sent instead: a null
    content was taken as the answer "None", a body of another shape failed as a bare ``KeyError: 'choices'``."""
    try:
        reply = json.loads(raw)
        content = reply["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        snippet = raw[:200].decode("utf-8", "replace")
        raise ValueError(f"{url} did not answer with a chat completion (no choices[0].message.content): "
                         f"{snippet!r}") from None
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content:  # what the text says is the big model's to judge, not ours
        raise ValueError(f"{url} answered without text (choices[0].message.content: {json.dumps(content)[:80]})")
    return content, str(reply.get("model") or asked)
