"""Hard questions escalated to a bigger model (``escalate:`` in the config): an OpenAI-compatible server —
vLLM, SGLang, TensorRT-Edge-LLM's server, or another edgekv with ``server.image_requests: true`` — gets the
question and the ``escalate.keyframes`` frames the local answer attended most, as ``image_url`` parts (JPEG
``data:`` URLs). Never the KV cache: a cache is only meaningful to the model that wrote it. A question that carried
its own images (a chat request's, ``server.image_requests``) goes with those instead, all of them: they are what it
asks about.

When: the question asks (``"escalate": true`` on the chat API, ``Question.escalate``), or the local answer's
confidence — the geometric mean of its tokens' probabilities, ``Answer.confidence`` — is below
``escalate.confidence_below``. The local answer is always computed first (it is what the device knows, and
what is returned when the remote fails). A streamed chat only escalates when it asks (its local tokens would
already be on the wire otherwise).

It never blocks the stream: escalations run in a thread of their own, at most ``escalate.queue`` waiting or
in flight; the question is done when the remote answered (the answer's text replaced, ``escalated`` = the
model the remote named) or failed or timed out (the local answer, ``escalation_note`` saying why).

What the remote can cost the device is bounded: ``escalate.timeout_s`` is the whole exchange (a server that
trickles its reply a byte at a time is cut off at it, not at each silence: apps/outputs/exchange.py, which the alert
webhooks send through too), a reply is read up to
``MAX_REPLY_BYTES``, and ``stop`` cuts the exchange in flight. What leaves the device is checked when its turn
comes, not when it was queued: nothing is sent while ``withheld`` names a reason (the privacy pause), after a
``forget`` that came while it waited, for an asker who left, or once the daemon stops — each of those questions
gets its local answer with the reason. The log names a failure without the remote's words (a server's error
body can quote the question back, and ``privacy.log_text`` is not ours to judge here).

Through a proxy (``escalation_proxy``, by the rules of apps/outputs/proxy.py, which the alert webhooks follow too):
``escalate.proxy``, else the environment's ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``ALL_PROXY`` with ``NO_PROXY``
honoured, as curl and requests read them — a device on a network that reaches the outside only through one. An
``https://`` server is reached through a CONNECT tunnel, its certificate checked against its own name (the proxy sees
only where the tunnel goes); ``http://`` goes to the proxy as an absolute URL. Credentials in the proxy's URL go in
``Proxy-Authorization`` and nowhere else: not in a log, not in a note.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import queue
import threading
from collections.abc import Callable

from edgekv.apps.outputs.exchange import BadReply, Exchange
from edgekv.apps.outputs.proxy import Proxy, proxy_for

log = logging.getLogger("edgekv.escalate")
MAX_REPLY_BYTES = 4 * 2**20  # a chat completion of a few hundred tokens is a few KiB; a 256k-token one ~1 MiB


class RemoteRefused(RuntimeError):
    """The escalation server answered with an HTTP error (or a redirect, not followed). ``summary``: the same
    without the body it sent (what the log says)."""

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary


@dataclasses.dataclass
class Escalation:
    question: object   # apps.questions.Question, its local answer in .answer
    keyframes: list[bytes]
    reason: str
    forgets: int = 0   # Escalator.forgets when it was queued: a forget since withdraws it


class Escalator:
    def __init__(self, section, done: Callable[[object], None],
                 withheld: Callable[[], str | None] | None = None) -> None:
        """``withheld``: asked before each escalation is sent; a reason (the daemon paused by its privacy switch)
        keeps it on the device — the question gets its local answer, the reason in its note."""
        from edgekv.apps.server.tls import client_context

        self.section, self.done, self.withheld = section, done, withheld
        self.token = os.environ.get(section.api_key_env) if section.api_key_env else None
        # an https:// server of a private CA (another edgekv serving TLS): ValueError naming the key at start
        self.context = client_context(section.url, section.ca_file, section.cert_file, section.key_file,
                                      names=("escalate.ca_file", "escalate.cert_file", "escalate.key_file"))
        # a proxy URL that cannot be used (socks5://, https://, no host): ValueError naming where it came from
        self.proxy = escalation_proxy(section.url, section.proxy)
        if self.proxy is not None:
            log.info("escalations go through the proxy %s (%s)", self.proxy, self.proxy.source)
        self.jobs: queue.Queue[Escalation | None] = queue.Queue(maxsize=section.queue)
        self.sent = self.failed = self.refused = self.withdrawn = 0
        self.forgets = 0  # forgets so far (``forget``)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._in_flight: Exchange | None = None
        self._thread = threading.Thread(target=self._run, name="edgekv-escalate", daemon=True)

    def start(self) -> "Escalator":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Cut the exchange in flight and answer every waiting question locally (the note says the daemon
        stopped): no asker is left waiting on a remote the daemon will not hear back from."""
        self._stopping.set()
        with self._lock:
            if self._in_flight is not None:
                self._in_flight.abort("the daemon is stopping")
        try:
            self.jobs.put_nowait(None)
        except queue.Full:  # the thread is busy with the one just cut: it finds the flag next
            pass
        self._thread.join(timeout)

    def forget(self) -> None:
        """A forget (``POST /v1/memory/forget``): what waits to be escalated is not sent — its keyframes and its
        question may be of the window. What is already on the wire cannot be called back."""
        with self._lock:
            self.forgets += 1

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
        with self._lock:
            escalation.forgets = self.forgets
        if self._stopping.is_set():
            return False
        try:
            self.jobs.put_nowait(escalation)
            return True
        except queue.Full:
            self.refused += 1
            return False

    def stats(self) -> dict:
        return {"escalations_sent": self.sent, "escalations_failed": self.failed,
                "escalations_refused": self.refused, "escalations_withdrawn": self.withdrawn,
                "escalations_waiting": self.jobs.qsize()}

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            self._escalate(job)
        while True:  # stopping: what still waits is answered locally
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._escalate(job)

    def _kept_back(self, job: Escalation) -> str | None:
        """Why this escalation must not leave the device now, or None."""
        if self._stopping.is_set():
            return "the daemon is stopping"
        if job.forgets != self.forgets:
            return "a forget came while it waited; nothing of it left the device"
        if job.question.cancelled.is_set():
            return "the asker left"
        why = self.withheld() if self.withheld is not None else None
        return f"{why}; nothing of it left the device" if why else None

    def _escalate(self, job: Escalation) -> None:
        question, local = job.question, job.question.answer
        why = self._kept_back(job)
        if why is not None:
            self.withdrawn += 1
            question.answer = dataclasses.replace(local, escalation_note=f"not escalated: {why}")
        else:
            try:
                text, model = self.ask_remote(question.text, job.keyframes, question.history,
                                              images=getattr(question, "images", ()),
                                              image_details=getattr(question, "image_details", ()))
                question.answer = dataclasses.replace(local, text=text, token_ids=[], escalated=model,
                                                      escalation_note=job.reason)
                self.sent += 1
            except Exception as exc:  # the remote is down, slow or wrong: the local answer stands
                self.failed += 1
                note = f"escalation failed ({type(exc).__name__}: {exc}); the local answer stands"
                said = getattr(exc, "summary", None) or f"{type(exc).__name__}: {exc}"
                log.warning("escalation failed (%s); the local answer stands", said)
                question.answer = dataclasses.replace(local, escalation_note=note)
        job.keyframes = []  # what was seen is not kept here a moment longer than needed
        self.done(question)

    def ask_remote(self, text: str, keyframes: list[bytes], history=(), images: tuple[bytes, ...] = (),
                   image_details: tuple[str | None, ...] = ()) -> tuple[str, str]:
        """The remote's answer and the model it names (OpenAI chat completions, not streamed); ``history``, the
        (role, text) turns the question came after, goes before it as the conversation's messages. At most
        ``escalate.keyframes`` frames of the camera go (0: none), whatever the caller found; ``images``, those the
        question itself carried (a chat request's, server.image_requests), go all of them: they are what it asks
        about, and the camera's own frames are what ``escalate.keyframes`` bounds. ``image_details``: the
        ``detail`` each of ``images`` came with (None: not given), sent with it — a big server honours it."""
        section = self.section
        details = (tuple(image_details) + (None,) * len(images))[:len(images)]
        sent = [*zip(images, details), *((frame, None) for frame in keyframes[:section.keyframes])]
        content = [{"type": "text", "text": text}] + [_image_part(data, detail) for data, detail in sent]
        body = json.dumps({"model": section.model, "max_tokens": section.max_tokens, "stream": False,
                           "messages": [*({"role": role, "content": turn} for role, turn in history),
                                        {"role": "user", "content": content}]}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        exchange = Exchange(section.url.rstrip("/") + "/chat/completions", self.context, section.timeout_s,
                            self.proxy, timeout_key="escalate.timeout_s", max_reply_bytes=MAX_REPLY_BYTES)
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the daemon is stopping")
            self._in_flight = exchange
        try:
            status, kind, location, raw = exchange.post(body, headers)
        finally:
            with self._lock:
                self._in_flight = None
        url = section.url
        if 300 <= status < 400:
            raise RemoteRefused(f"HTTP {status} from {url}: it redirects to {location or 'no Location'} (not "
                                "followed: set escalate.url to the server's own address)", f"HTTP {status} from {url}")
        if status >= 400:
            detail = raw[:300].decode("utf-8", "replace")
            raise RemoteRefused(f"HTTP {status} from {url}: {detail}", f"HTTP {status} from {url}")
        if "text/event-stream" in kind:  # a server that streams whatever was asked
            return streamed_reply(raw, url, section.model)
        return chat_reply(raw, url, section.model)


def escalation_proxy(url: str, configured: str | None, environ: dict[str, str] | None = None) -> Proxy | None:
    """The proxy the escalation server ``url`` is reached through (``escalate.proxy``, else the environment's:
    apps/outputs/proxy.py ``proxy_for``); a ``ValueError`` naming where an unusable one was set."""
    return proxy_for(url, configured, "escalate.proxy", environ)


def _image_part(data: bytes, detail: str | None) -> dict:
    """An ``image_url`` content part of ``data`` as a ``data:`` URL, with its ``detail`` when one was given."""
    url = f"data:{_media_type(data)};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail is not None else {})}}


def _media_type(data: bytes) -> str:
    """A ``data:`` URL's media type from the image's signature (the keyframes are JPEG; a question's own image is
    JPEG or PNG, a WebP or GIF having become PNG on its way in: apps/server/request_images.py)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return "image/jpeg"


def chat_reply(raw: bytes, url: str, asked: str) -> tuple[str, str]:
    """The answer of a chat completion's body (``choices[0].message.content``, a string or a list of text parts)
    and the model it names (else ``asked``). ``BadReply`` (a ``ValueError``) naming ``url`` and what it sent
    instead: a null content was taken as the answer "None", a body of another shape failed as a bare
    ``KeyError: 'choices'``."""
    try:
        reply = json.loads(raw)
        content = reply["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        snippet = raw[:200].decode("utf-8", "replace")
        raise BadReply(f"{url} did not answer with a chat completion (no choices[0].message.content): {snippet!r}",
                       f"{url} did not answer with a chat completion") from None
    return _text_of(content, url, "choices[0].message.content"), _model_of(reply, asked)


def streamed_reply(raw: bytes, url: str, asked: str) -> tuple[str, str]:
    """The answer of a server that streamed it (server-sent ``chat.completion.chunk`` events, as with ``"stream":
    true``, whatever was asked): the deltas' text joined, and the model the chunks name."""
    pieces, model = [], None
    for line in raw.decode("utf-8", "replace").splitlines():
        data = line[5:].strip() if line.startswith("data:") else None
        if not data or data == "[DONE]":
            continue
        try:
            chunk = json.loads(data)
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise BadReply(f"{url} streamed something that is not a chat completion chunk: {data[:200]!r}",
                           f"{url} streamed something that is not a chat completion chunk") from None
        model = model or _model_of(chunk, None)
        content = delta.get("content") if isinstance(delta, dict) else None
        if content:
            pieces.append(content if isinstance(content, str) else _text_of(content, url, "delta.content"))
    return _text_of("".join(pieces), url, "the streamed deltas' content"), model or asked


def _text_of(content, url: str, where: str) -> str:
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content:  # what the text says is the big model's to judge, not ours
        raise BadReply(f"{url} answered without text ({where}: {json.dumps(content)[:80]})",
                       f"{url} answered without text")
    return content


def _model_of(reply, asked: str | None) -> str | None:
    model = reply.get("model") if isinstance(reply, dict) else None
    return str(model) if model else asked
