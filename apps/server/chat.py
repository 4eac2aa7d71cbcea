"""``POST /v1/chat/completions``: a question about the live stream, answered whole or streamed (SSE).

The event loop never blocks: a question is handed to the daemon with a non-blocking ``submit`` (a full
queue answers 503 at once) and its tokens and completion come back through ``call_soon_threadsafe``
(``AnswerHandoff``); no thread waits per request.

A streamed question that escalates (``"stream": true, "escalate": true``) sends no local token: its chunks are the
remote's, once it answered — up to ``escalate.timeout_s`` later. Its status and headers go as soon as the local answer
is done and the question waits on the remote (the escalator's ``on_escalating``), and an SSE comment line every
``KEEPALIVE_S`` until the remote answered: a client or proxy that gives up on a silent connection (the OpenAI SDK's
read timeout, nginx's ``proxy_read_timeout`` of 60 s) sees it alive; a comment is no event to an SSE parser (the
OpenAI SDK's ``SSEDecoder.decode`` drops a line starting with ":"; OpenRouter sends the same while a model thinks).
A client who leaves while it waits — whole answer or stream — cuts the exchange with the remote
(``Escalator.asker_left``): nobody would read the answer, and the questions behind it wait for the escalator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from edgekv.apps.controls import addressed
from edgekv.apps.questions import Question, evidence_item
from edgekv.apps.server.api import Api, JsonResponse, body_schema
from edgekv.apps.server.openai_chat import (
    ApiError,
    ChatCompletionRequest,
    ChatRequest,
    first_stop,
    held_back,
    parse_chat_request,
    safe_text,
)
from edgekv.session import WindowEmpty
from edgekv.session.wallclock import NoOneStretch, NothingSeen

log = logging.getLogger("edgekv.server")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
KEEPALIVE_S = 10.0  # between the comment lines of a stream waiting on the escalation server
KEEPALIVE = ": waiting for the escalation server\n\n"


def router(api: Api) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest.model_json_schema()),
              responses={200: {"description": "chat.completion, or text/event-stream chunks when stream is true"}})
    async def chat(request: Request):
        params = parse_chat_request(await api.body(request), api.limits)
        if params.images:  # a PNG with transparency made opaque, as the processor would (ms a picture: not here)
            images = await asyncio.get_running_loop().run_in_executor(None, _opaque_images, params.images)
            params = dataclasses.replace(params, images=images)
        cameras = getattr(api.daemon, "cameras", None) or {}
        if not cameras:  # one camera (video.source)
            if params.camera not in (None, "all"):
                raise ApiError(400, f"camera: this daemon watches one camera (no video.sources); got "
                                    f"{params.camera!r}", param="camera")
            return await answer_chat(api.daemon, params, api.limits.served_models[0], request.receive)
        if params.camera is None:  # "back: what ...", as typed at stdin or spoken: the camera named first
            params = _addressed(params, cameras)
        if params.camera not in (None, "all"):
            if params.camera not in cameras:
                raise ApiError(400, f"camera: {params.camera!r} is not one of {', '.join(cameras)} (or 'all')",
                               param="camera")
            return await answer_chat(cameras[params.camera], params, api.limits.served_models[0], request.receive)
        return await answer_every_camera(cameras, params, api.limits.served_models[0])

    return routes


def _opaque_images(images: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """Each image as the model should see it (apps/server/request_images.py); one whose header read well but that
    cannot be decoded (a WebP or GIF cut short) is a 400 naming it, before anything is queued."""
    from edgekv.apps.server.request_images import opaque

    out = []
    for index, data in enumerate(images):
        try:
            out.append(opaque(data))
        except ValueError as exc:
            raise ApiError(400, f"messages: image {index + 1} of the question: {safe_text(str(exc), 300)}",
                           param="messages", code="invalid_image") from None
    return tuple(out)


def _addressed(params: ChatRequest, cameras: dict) -> ChatRequest:
    """The question's camera when its text names one at its start (``back: ...``, "Back camera, ..."; the way
    stdin, ``--ask`` and the microphone route), that name taken off the question; else ``params`` as it is."""
    name, rest = addressed(params.question, cameras)
    if name is None:
        return params
    if not rest:
        raise ApiError(400, f"messages: the question names the camera {name} but asks it nothing", param="messages")
    return dataclasses.replace(params, question=rest, camera=name)


async def answer_every_camera(cameras: dict, params: ChatRequest, model_id: str) -> Response:
    """The question asked of each camera at once (each camera's loop answers its own); one answer listing
    them, ``edgekv.cameras`` holding each camera's figures. Streaming needs one camera. A camera that refused is
    listed with why; when every camera refused, the request is that error (each camera's reason in its message,
    the highest status: a 503 says to retry). It was a 200 whose content was "(no answer: ...)" for each camera —
    a window no camera holds, where one camera answers 400 ``window_empty``; a queue full or a daemon stopping
    (503) take the same path."""
    if params.stream:
        raise ApiError(400, "stream: a streamed answer comes from one camera; name it with \"camera\"",
                       param="camera")
    if params.answer_prefix:  # a listing of every camera's answer would not continue the reply it was given
        raise ApiError(400, "continue_final_message: a reply is continued by one camera; name it with \"camera\"",
                       param="camera")
    responses = await asyncio.gather(*(answer_chat(daemon, params, model_id) for daemon in cameras.values()),
                                     return_exceptions=True)
    if all(isinstance(response, ApiError) for response in responses):  # no camera answered: an error, not a 200
        worst = max(responses, key=lambda error: error.status)  # a 503 (stopping, busy) says to retry
        raise ApiError(worst.status, "; ".join(f"{name}: {error.message}" for name, error in zip(cameras, responses)),
                       kind=worst.kind, param=worst.param, code=worst.code, headers=worst.headers)
    lines, figures, usage = [], {}, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for name, response in zip(cameras, responses):
        if isinstance(response, ApiError):
            lines.append(f"{name}: (no answer: {response.message})")
            figures[name] = {"error": response.message}
            continue
        if isinstance(response, BaseException):
            raise response
        body = json.loads(response.body)
        lines.append(f"{name}: {body['choices'][0]['message']['content']}")
        figures[name] = body["edgekv"]
        for key in usage:
            usage[key] += body["usage"][key]
    return JsonResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "\n".join(lines)},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": usage, "edgekv": {"cameras": figures},
    })


async def answer_chat(daemon: Any, params: ChatRequest, model_id: str, receive: Any = None) -> Response:
    """Queue the question without blocking, wait for its first token (a refusal before it is a plain HTTP
    error: no stream has started), then stream the answer or return it whole. ``receive`` (the request's
    ASGI receive, its body already read) reports the client leaving: the question is then cancelled, so the
    daemon stops decoding at the next token (or never starts) instead of answering nobody."""
    if params.recall is True and not params.images and getattr(daemon.session, "recall", True) is None:
        # refused before it is queued, naming the field (it was the session's ValueError, a 400 without param, once
        # its turn came)
        raise ApiError(400, "recall: true needs an archive, and this daemon keeps none (set archive.dir in its "
                            "config)", param="recall")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, check_fits, daemon.session, params)  # tokenizing a long question takes ms
    handoff = AnswerHandoff(loop)
    question = Question(params.question, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                        top_p=params.top_p, on_token=handoff.on_token, source="http", done=handoff.done)
    question.seed = params.seed
    question.recall, question.history = params.recall, params.history
    question.window, question.window_last_s = params.window, params.window_last_s
    question.evidence = params.evidence
    question.answer_prefix = params.answer_prefix  # continue_final_message: the reply's start, continued
    question.window_unix = params.window_unix
    question.escalate, question.images, question.stream = params.escalate, params.images, params.stream
    question.image_details = params.image_details  # forwarded with the images when the question escalates
    if params.stream and params.escalate is True:  # its headers go once it waits on the remote (no token comes)
        question.on_escalating = lambda: handoff.post(_ESCALATING)
    submit(daemon, question)
    left = _AskerLeft(daemon, question)
    watcher = asyncio.ensure_future(_cancel_when_gone(receive, left)) if receive is not None else None
    try:
        first = await handoff.next()
        if first is _DONE and question.error is not None:
            raise answer_error(question.error)
        text = AnswerText(daemon.session.tokenizer, params.stop)
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if params.stream:
            events = _sse(first, handoff, question, text, params, completion_id, created, model_id, watcher, left)
            watcher = None  # the stream owns it now
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        item = first
        while item is not _DONE:  # (never _ESCALATING: only a stream asks for it)
            if params.stop:
                text.push(item)
            item = await handoff.next()
    finally:
        if watcher is not None:
            watcher.cancel()
    if question.error is not None:
        raise answer_error(question.error)
    answer = question.answer
    escalated = answer.escalated is not None
    content = (_remote_text(answer, params.stop) if escalated
               else text.sent + text.finish(answer.text) if params.stop else answer.text)
    return JsonResponse({
        "id": completion_id, "object": "chat.completion", "created": created,
        "model": answer.escalated if escalated else model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop" if escalated else text.finish_reason(answer), "logprobs": None}],
        "usage": _usage(answer, text.completion_tokens(answer)),
        "edgekv": _extension(answer, question),
    })


def _remote_text(answer: Any, stops: tuple[str, ...]) -> str:
    """An escalated answer's text (the remote's), ending before the request's first stop string as a local one does:
    the remote was not told the stop strings (``escalate:`` asks it for ``max_tokens`` of text)."""
    cut = first_stop(answer.text, stops)
    return answer.text if cut is None else answer.text[:cut]


def _escalation_said(answer: Any) -> bool:
    """Whether the answer has something to say about escalation (it went, or why it did not): a streamed answer
    then carries ``edgekv`` on its last chunk, as a whole one always does."""
    return answer is not None and (answer.escalated is not None or answer.escalation_note is not None)


def _extension(answer: Any, question: Question) -> dict:
    """edgekv's own figures beside an OpenAI answer: speed, confidence, escalation, and (when the request asked
    for ``evidence``) the frame pairs the question attended most with when each was seen."""
    out = {"ttft_s": answer.ttft_s, "decode_tok_s": answer.decode_tok_s, "video_tokens": answer.video_tokens,
           "confidence": answer.confidence, "evidence_pairs": list(answer.evidence),
           "escalated": answer.escalated is not None, "escalated_model": answer.escalated,
           "escalation_note": answer.escalation_note, "window_pairs": answer.window_pairs}
    if question.evidence:
        out["evidence"] = [evidence_item(*seen) for seen in question.evidence_seen]
    return out


_DONE = object()
_ESCALATING = object()  # the local answer is done and the question waits on the escalation server


class _AskerLeft:
    """What a client's leaving does: the question is cancelled (the daemon stops decoding it, or never starts), and
    its exchange with the escalation server, if in flight, is cut (``Escalator.asker_left``)."""

    def __init__(self, daemon: Any, question: Question) -> None:
        self.daemon, self.question = daemon, question

    def __call__(self) -> None:
        self.question.cancelled.set()
        escalator = getattr(self.daemon, "escalator", None)
        if escalator is not None and hasattr(escalator, "asker_left"):
            escalator.asker_left(self.question)


class _DoneSignal(threading.Event):
    """``Question.done`` for an HTTP question: setting it (from the main loop) also wakes the handler."""

    def __init__(self, handoff: "AnswerHandoff") -> None:
        super().__init__()
        self._handoff = handoff

    def set(self) -> None:
        super().set()
        self._handoff.post(_DONE)


class AnswerHandoff:
    """One question's answer tokens, then ``_DONE``, carried from the daemon's thread to the event loop
    with ``call_soon_threadsafe``: nothing waits in a thread, nothing blocks the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.done = _DoneSignal(self)

    def post(self, item: Any) -> None:  # any thread
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the server's loop is closed: nobody is waiting any more
            pass

    def on_token(self, token: int) -> None:  # the daemon's main loop
        self.post(token)

    async def next(self) -> Any:
        """The next token id, or ``_DONE``."""
        return await self.items.get()


class AnswerText:
    """Answer tokens -> text for the client: released only as whole characters, never the start of a stop
    string, and ending before the first stop string (OpenAI ``stop``; finish_reason ``stop``).

    ``StreamSession.ask`` has no stop hook, so after a stop string the daemon still decodes up to
    ``max_tokens``: a stream ends for the client at once (unless it asked for usage, which needs the
    answer's token counts), a non-streamed answer when the daemon is done."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stop_tokens: int | None = None  # tokens up to the one completing a stop string

    def push(self, token: int) -> str:
        if self.stop_tokens is not None:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        return "" if text.endswith("\ufffd") else self._release(text, final=False)  # wait for whole characters

    def finish(self, final_text: str) -> str:
        return "" if self.stop_tokens is not None else self._release(final_text, final=True)

    def _release(self, text: str, final: bool) -> str:
        cut = first_stop(text, self.stops)
        if cut is not None:
            self.stop_tokens = len(self.ids)
            end = cut
        else:
            end = len(text) if final else len(text) - held_back(text, self.stops)
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):end], text[:end]
        return piece

    def finish_reason(self, answer: Any) -> str:
        return "stop" if self.stop_tokens is not None else answer.finish_reason

    def completion_tokens(self, answer: Any) -> int:
        return self.stop_tokens if self.stop_tokens is not None else len(answer.token_ids)


def _usage(answer: Any, completion_tokens: int) -> dict:
    prompt = answer.prompt_tokens + answer.video_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def answer_error(error: Exception) -> ApiError:
    """The daemon's refusal of a question as an HTTP error: 503 for ``QuestionRefused`` (busy, stopping),
    400 for a question the session refused (ValueError; naming ``window`` when the window holds nothing, so a client
    sees which field to change), 500 for anything else (a bug)."""
    status = getattr(error, "status", None)
    if isinstance(status, int) and status >= 500:
        return ApiError(status, safe_text(str(error), 300), kind="server_error", code="server_unavailable",
                        headers={"retry-after": "1"})
    if isinstance(error, (WindowEmpty, NothingSeen)):  # the request was valid; its window holds nothing to read
        return ApiError(400, safe_text(str(error), 400), param="window", code="window_empty")
    if isinstance(error, NoOneStretch):  # a window by the clock on a stream without wall times, or lived twice
        return ApiError(400, safe_text(str(error), 400), param="window")
    if isinstance(error, ValueError):
        return ApiError(400, safe_text(str(error), 400))
    log.error("answering a question failed: %s", safe_text(repr(error), 300))
    return ApiError(500, f"the answer failed: {safe_text(str(error), 300)}", kind="server_error", code="answer_failed")


def check_fits(session: Any, request: ChatRequest) -> None:
    """Refuse (400 ``context_length_exceeded``), before it is queued and before any stream starts, only a
    question that cannot fit when its turn comes: more than the room the session always keeps for text
    (``cache.text_reserve_tokens``, and the retrieval reserve when it does not recall) and more than the room
    the video leaves now. What fits alone is queued, whatever another answer decoding right now holds in the
    cache (its question and answer tokens leave with it; counting them refused valid questions, issue 26).
    Reads no lock: the session's length before the answer in flight (``answerer.video_length``), if any."""
    ids = session.layout.question_suffix_ids(session.tokenizer, request.question, request.history)
    if request.answer_prefix:  # the reply's start, prefilled with the question (StreamSession.ask answer_prefix)
        ids = ids + session.tokenizer.encode_text(request.answer_prefix)
    recall = request.recall if request.recall is not None else getattr(session, "recall", None) is not None
    reserved = getattr(session, "recall_reserve", 0) if recall else 0
    need = len(ids) + request.max_new_tokens
    if need <= session.capacity - session.video_limit - reserved:
        return  # always fits: ingest never leaves less than this free
    answering = getattr(getattr(session, "answerer", None), "video_length", None)
    video = answering if answering is not None else session.cache.length
    room = session.capacity - video - reserved
    if need > room:
        told = (f"{len(ids)} tokens{' with its history' if request.history else ''}"
                f"{' and the assistant reply it continues' if request.answer_prefix else ''}")
        raise ApiError(400, f"the question ({told}) + max_tokens ({request.max_new_tokens}) exceed the "
                            f"{room} cache slots free for text (cache.text_reserve_tokens={session.text_reserve}); "
                            "shorten the question or lower max_tokens", param="messages",
                       code="context_length_exceeded")


def submit(daemon: Any, question: Question) -> None:
    """Hand the question to the daemon without blocking; a refusal (full queue, stopping) is a 503."""
    try:
        daemon.submit(question, timeout=0)
    except queue.Full as exc:
        raise ApiError(503, f"{daemon.questions.maxsize} questions are already waiting (server.queue_size); "
                            "retry shortly", kind="server_error", code="server_busy",
                       headers={"retry-after": "1"}) from exc
    except Exception as exc:
        if getattr(exc, "status", None) == 503:
            raise answer_error(exc) from exc
        raise


async def _cancel_when_gone(receive: Any, left: _AskerLeft) -> None:
    """Call ``left`` when the client disconnects (the next ASGI message after the body is ``http.disconnect``);
    cancelled itself once the answer is sent."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            left()
            return


async def _sse(first: Any, handoff: AnswerHandoff, question: Question, text: AnswerText, params: ChatRequest,
               completion_id: str, created: int, model_id: str, watcher: "asyncio.Future | None" = None,
               left: "_AskerLeft | None" = None):
    """The answer as server-sent events — first, for a question waiting on the escalation server, a comment line
    at once and one every ``KEEPALIVE_S`` until it answered; when the stream ends early (the client left), the
    question is cancelled so that the daemon stops decoding it and its escalation is cut."""
    finished = False
    waiting = None
    try:
        if first is _ESCALATING:
            yield KEEPALIVE  # the headers, and a first sign of life, now
            waiting = asyncio.ensure_future(handoff.next())
            while not (await asyncio.wait({waiting}, timeout=KEEPALIVE_S))[0]:
                yield KEEPALIVE
            first = waiting.result()
        async for event in _sse_events(first, handoff, question, text, params, completion_id, created, model_id):
            yield event
        finished = True
    finally:
        if waiting is not None and not waiting.done():
            waiting.cancel()
        if not finished and not question.done.is_set():
            if left is not None:
                left()
            else:
                question.cancelled.set()
        if watcher is not None:
            watcher.cancel()


async def _sse_events(first: Any, handoff: AnswerHandoff, question: Question, text: AnswerText,
                      params: ChatRequest, completion_id: str, created: int, model_id: str):
    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload) + "\n\n"

    # an escalated stream (``"escalate": true``) starts when the remote has answered (no local token goes out):
    # its chunks name the remote's model, as the whole answer does
    remote = question.answer.escalated if first is _DONE and question.answer is not None else None
    if remote is not None:
        model_id = remote

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return event({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    item = first
    while item is not _DONE:
        piece = text.push(item)
        if piece:
            yield chunk({"content": piece})
        if text.stop_tokens is not None and not params.include_usage:
            break  # the client has all it will get; the daemon finishes the answer on its own
        item = await handoff.next()
    if item is _DONE and question.error is not None:  # failed mid-answer: the status line is long gone
        error = answer_error(question.error)
        yield event({"error": {"message": error.message, "type": error.kind, "param": None, "code": error.code}})
    else:
        answer = question.answer
        tail = (_remote_text(answer, params.stop) if remote is not None
                else text.finish(answer.text) if answer is not None else "")
        if tail:
            yield chunk({"content": tail})
        reason = "stop" if text.stop_tokens is not None or remote is not None else answer.finish_reason
        # the evidence asked for, and what escalation did, ride on the last chunk (a client ignores a key it does not
        # know); a stream cut at a stop string ends before the answer is whole, and without it
        whole = answer is not None and question.done.is_set()
        said = question.evidence or _escalation_said(answer)
        yield chunk({}, reason, **({"edgekv": _extension(answer, question)} if said and whole else {}))
        if params.include_usage:
            yield event({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                         "model": model_id, "choices": [], "usage": _usage(answer, text.completion_tokens(answer))})
    yield "data: [DONE]\n\n"
