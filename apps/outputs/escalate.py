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
``MAX_REPLY_BYTES``, and ``stop`` cuts the exchange in flight — as ``asker_left`` does for the question whose asker
left (its HTTP client disconnected): the remote's answer would go to nobody, and the questions behind it wait.
What leaves the device is checked when its turn
comes, not when it was queued: nothing is sent while ``withheld`` names a reason (the privacy pause), after a
``forget`` that came while it waited, for an asker who left, or once the daemon stops — each of those questions
gets its local answer with the reason. The log names a failure without the remote's words (a server's error
body can quote the question back, and ``privacy.log_text`` is not ours to judge here).

A server that says it is busy (a rate limit's 429; a 503 with ``Retry-After``) is asked again after the wait it names
(0.5 s, 1 s for a 429 that names none), at most ``BUSY_TRIES`` times and only while that fits in ``escalate.timeout_s``.
A reply that streams (``text/event-stream``, or ``data:`` events under another content type) is read as SSE; one that
sent an error event mid-answer, or ended before ``[DONE]`` and any ``finish_reason``, is no answer.

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
import time
from collections.abc import Callable

from edgekv.apps.outputs.exchange import BadReply, Exchange
from edgekv.apps.outputs.proxy import Proxy, proxy_for

log = logging.getLogger("edgekv.escalate")
MAX_REPLY_BYTES = 4 * 2**20  # a chat completion of a few hundred tokens is a few KiB; a 256k-token one ~1 MiB
BUSY_TRIES = 3  # asks of a server that said it is busy (429, or 503 with Retry-After), within escalate.timeout_s
BUSY_BACKOFF_S = 0.5  # before asking again a 429 that did not say when


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
        self._asking: object | None = None  # the question whose exchange is (about to be) in flight
        self._pause = threading.Event()  # ends a wait before asking a busy server again (a stop, the asker left)
        self._thread = threading.Thread(target=self._run, name="edgekv-escalate", daemon=True)

    def start(self) -> "Escalator":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Cut the exchange in flight and answer every waiting question locally (the note says the daemon
        stopped): no asker is left waiting on a remote the daemon will not hear back from."""
        self._stopping.set()
        self._pause.set()
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

    def asker_left(self, question) -> None:
        """``question``'s asker left (any thread; after ``question.cancelled`` was set): its exchange, if in flight, is
        cut. One still waiting is withdrawn when its turn comes (``_kept_back``)."""
        with self._lock:
            if self._asking is question:
                self._pause.set()
                if self._in_flight is not None:
                    self._in_flight.abort("the asker left")

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
        except queue.Full:
            self.refused += 1
            return False
        # the asker may want to know that its answer now waits on the remote (a streamed chat sends its headers)
        escalating = escalation.question.on_escalating
        if callable(escalating):
            escalating()
        return True

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
            with self._lock:
                self._asking = question
                if not self._stopping.is_set():
                    self._pause.clear()
            try:
                text, model = self.ask_remote(question.text, job.keyframes, question.history,
                                              images=getattr(question, "images", ()),
                                              image_details=getattr(question, "image_details", ()),
                                              answer_prefix=getattr(question, "answer_prefix", ""))
                question.answer = dataclasses.replace(local, text=text, token_ids=[], escalated=model,
                                                      escalation_note=job.reason)
                self.sent += 1
            except Exception as exc:  # the remote is down, slow or wrong: the local answer stands
                if question.cancelled.is_set():  # cut by asker_left: nobody to tell, nothing went wrong
                    self.withdrawn += 1
                    log.info("escalation abandoned: the asker left")
                    question.answer = dataclasses.replace(local, escalation_note="escalation abandoned: the asker "
                                                                                 "left; the local answer stands")
                else:
                    self._failed(question, local, exc)
            finally:
                with self._lock:
                    self._asking = None
        job.keyframes = []  # what was seen is not kept here a moment longer than needed
        self.done(question)

    def _failed(self, question, local, exc: Exception) -> None:
        """The remote is down, slow or wrong: the local answer stands, the note saying why."""
        self.failed += 1
        note = f"escalation failed ({type(exc).__name__}: {exc}); the local answer stands"
        said = getattr(exc, "summary", None) or f"{type(exc).__name__}: {exc}"
        log.warning("escalation failed (%s); the local answer stands", said)
        question.answer = dataclasses.replace(local, escalation_note=note)

    def ask_remote(self, text: str, keyframes: list[bytes], history=(), images: tuple[bytes, ...] = (),
                   image_details: tuple[str | None, ...] = (), answer_prefix: str = "") -> tuple[str, str]:
        """The remote's answer and the model it names (OpenAI chat completions, not streamed); ``history``, the
        (role, text) turns the question came after, goes before it as the conversation's messages. At most
        ``escalate.keyframes`` frames of the camera go (0: none), whatever the caller found; ``images``, those the
        question itself carried (a chat request's, server.image_requests), go all of them: they are what it asks
        about, and the camera's own frames are what ``escalate.keyframes`` bounds. ``image_details``: the
        ``detail`` each of ``images`` came with (None: not given), sent with it — a big server honours it.
        ``answer_prefix`` (a chat's ``continue_final_message``): the start of the reply goes as the final assistant
        message with vLLM's ``continue_final_message: true, add_generation_prompt: false``, so the remote continues
        it as the local model did and its content is the continuation (vLLM, SGLang, another edgekv); a server that
        does not take the flag refuses it and the local answer stands, the note saying so."""
        section = self.section
        details = (tuple(image_details) + (None,) * len(images))[:len(images)]
        sent = [*zip(images, details), *((frame, None) for frame in keyframes[:section.keyframes])]
        content = [{"type": "text", "text": text}] + [_image_part(data, detail) for data, detail in sent]
        messages = [*({"role": role, "content": turn} for role, turn in history), {"role": "user", "content": content}]
        request = {"model": section.model, "max_tokens": section.max_tokens, "stream": False, "messages": messages}
        if answer_prefix:  # the remote continues the reply the local model continued
            messages.append({"role": "assistant", "content": answer_prefix})
            request.update(continue_final_message=True, add_generation_prompt=False)
        body = json.dumps(request).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        # a server that says it is busy (a rate limit's 429; a 503 saying when to come back) is asked again after
        # the Retry-After it named, as the OpenAI SDK does, while that fits in escalate.timeout_s
        deadline, busy = time.monotonic() + section.timeout_s, ""
        for attempt in range(1, BUSY_TRIES + 1):
            status, kind, location, raw, wait = self._post(body, headers, deadline - time.monotonic())
            if status != 429 and not (status == 503 and wait is not None):
                break
            if attempt == BUSY_TRIES:
                busy = f" (busy at each of {attempt} tries)"
                break
            pause = BUSY_BACKOFF_S * 2 ** (attempt - 1) if wait is None else wait
            if pause >= deadline - time.monotonic():
                busy = (f" (it asked to be asked again in {pause:g} s, past escalate.timeout_s, {section.timeout_s:g} s"
                        f"{f', after {attempt} tries' if attempt > 1 else ''})" if wait is not None else
                        f" (busy, too little of escalate.timeout_s, {section.timeout_s:g} s, left to ask again)")
                break
            if self._pause.wait(pause):
                raise RuntimeError("the daemon is stopping" if self._stopping.is_set() else "the asker left")
        url = section.url
        if 300 <= status < 400:
            raise RemoteRefused(f"HTTP {status} from {url}: it redirects to {location or 'no Location'} (not "
                                "followed: set escalate.url to the server's own address)", f"HTTP {status} from {url}")
        if status >= 400:
            detail = raw[:300].decode("utf-8", "replace")
            raise RemoteRefused(f"HTTP {status} from {url}{busy}: {detail}", f"HTTP {status} from {url}{busy}")
        if "text/event-stream" in kind or raw.lstrip()[:5] == b"data:":  # streamed whatever was asked (and said so
            return streamed_reply(raw, url, section.model)                # or not: text/plain, application/json)
        return chat_reply(raw, url, section.model)

    def _post(self, body: bytes, headers: dict[str, str], budget_s: float) -> tuple[int, str, str | None, bytes,
                                                                                   float | None]:
        """One POST to the server within ``budget_s`` (what is left of ``escalate.timeout_s``), cut by ``stop`` or
        ``asker_left``: (status, Content-Type, Location, body, Retry-After in seconds)."""
        section = self.section
        exchange = Exchange(section.url.rstrip("/") + "/chat/completions", self.context, section.timeout_s,
                            self.proxy, timeout_key="escalate.timeout_s", max_reply_bytes=MAX_REPLY_BYTES,
                            budget_s=budget_s)
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the daemon is stopping")
            if self._asking is not None and self._asking.cancelled.is_set():  # left before asker_left could cut it
                raise RuntimeError("the asker left")
            self._in_flight = exchange
        try:
            return (*exchange.post(body, headers), exchange.retry_after)
        finally:
            with self._lock:
                self._in_flight = None


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
    true``, whatever was asked): the deltas' text joined, and the model the chunks name. The events are read as the
    SSE spec has them (a ``data:`` field may span lines; comments and other fields skipped). ``BadReply`` for a stream
    that is not whole: one whose server sent an error event mid-answer (OpenAI's and vLLM's ``{"error": ...}``) —
    its text so far was taken as the big model's whole answer — or that ended before ``[DONE]`` and any
    ``finish_reason`` (the server went away mid-answer)."""
    pieces, model, ended = [], None, False
    for data in _sse_data(raw.decode("utf-8", "replace")):
        if data == "[DONE]":
            ended = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if isinstance(chunk, dict) and chunk.get("error"):
            error = chunk["error"]
            said = error.get("message") if isinstance(error, dict) else error
            raise BadReply(f"{url} streamed an error mid-answer: {str(said)[:200]!r}",
                           f"{url} streamed an error mid-answer")
        try:
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            delta = choice.get("delta") or {}
        except (KeyError, IndexError, TypeError, AttributeError):
            raise BadReply(f"{url} streamed something that is not a chat completion chunk: {data[:200]!r}",
                           f"{url} streamed something that is not a chat completion chunk") from None
        model = model or _model_of(chunk, None)
        ended = ended or bool(choice.get("finish_reason"))
        content = delta.get("content") if isinstance(delta, dict) else None
        if content:
            pieces.append(content if isinstance(content, str) else _text_of(content, url, "delta.content"))
    text = _text_of("".join(pieces), url, "the streamed deltas' content")
    if not ended:
        raise BadReply(f"{url} ended its stream before its end (no [DONE], no finish_reason) after "
                       f"{len(text)} characters: a part of an answer", f"{url} ended its stream mid-answer")
    return text, model or asked


def _sse_data(text: str):
    """Each server-sent event's data (its ``data:`` lines joined with newlines), in order; an event without data
    (a comment, a ping) is none."""
    lines: list[str] = []
    for line in text.splitlines():
        if not line:
            if lines:
                yield "\n".join(lines)
            lines = []
        elif line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    if lines:  # the last event, its blank line cut off
        yield "\n".join(lines)


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
