"""The daemon's HTTP API (FastAPI on uvicorn, in its own thread).

    POST /v1/chat/completions   OpenAI-compatible; answers about the live stream; ``stream: true`` = SSE
    GET  /v1/models             the one model this daemon serves
    GET  /healthz               liveness (never needs the token)
    GET  /metrics               Prometheus text: ingest fps, frame ms, cache tokens/capacity/bytes, ...
    GET  /                      status page: latest frame, which patches the cache keeps, figures, a question box
    GET  /frame.jpg             the latest ingested frame
    GET  /v1/edgekv/status      figures + the kept-patch map as JSON (the page polls it)

Binds 127.0.0.1 by default. With a token (``server.token`` or the env var ``server.token_env``) every
route but /healthz needs ``Authorization: Bearer <token>``. Request bodies over
``server.max_request_bytes`` get 413, ``max_tokens`` over ``server.max_new_tokens`` gets 400, and a full
question queue gets 503. Questions are queued to the daemon's main loop, which answers them between
frame pairs while the capture keeps running.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import queue
import socket
import threading
import time
import uuid
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations here
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from edgekv.apps.camera import Question


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def parse_chat_request(body: Any, max_new_tokens_limit: int, default_max_new_tokens: int) -> dict:
    """Validate an OpenAI chat request; returns question, max_new_tokens, temperature, top_p, stream."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list")
    question = None
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            question = _message_text(message.get("content"))
            break
    if not question or not question.strip():
        raise ApiError(400, "no user message with text content: ask a question about the stream")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_new_tokens))
    if max_tokens is None:
        max_tokens = default_max_new_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
    if max_tokens > max_new_tokens_limit:
        raise ApiError(400, f"max_tokens={max_tokens} exceeds this server's limit of {max_new_tokens_limit}")
    temperature = body.get("temperature", 0.0)
    top_p = body.get("top_p", 1.0)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ApiError(400, f"{name} must be a number, got {value!r}")
    return {"question": question.strip(), "max_new_tokens": max_tokens,
            "temperature": 0.0 if temperature is None else float(temperature),
            "top_p": 1.0 if top_p is None else float(top_p), "stream": bool(body.get("stream", False))}


def _message_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in ("image_url", "input_image", "video_url"):
                raise ApiError(400, "this server answers about its live camera: send text only")
        return "\n".join(parts)
    return None


# ---------------------------------------------------------------------------------------------- metrics
def prometheus_text(daemon) -> str:
    stats = daemon.session.stats()
    snap = daemon.monitor.snapshot() if daemon.monitor else {}
    capture = daemon.sampler.stats() if daemon.sampler else {}
    elapsed = max(time.monotonic() - daemon.started, 1e-9)
    metrics = [
        ("edgekv_frames_total", "counter", "frames ingested", stats["frames"]),
        ("edgekv_frame_pairs_total", "counter", "frame pairs prefilled", stats["frame_pairs"]),
        ("edgekv_frames_rejected_total", "counter", "frames refused as bad input", stats["frames_rejected"]),
        ("edgekv_frames_dropped_total", "counter", "frames the capture dropped (latest frame wins)",
         capture.get("frames_dropped", 0)),
        ("edgekv_ingest_fps", "gauge", "frames ingested per second since start", stats["frames"] / elapsed),
        ("edgekv_frame_pair_ingest_ms", "gauge", "last frame pair's ingest time", stats["ingest_ms_last"]),
        ("edgekv_cache_tokens", "gauge", "slots in use", stats["cache_tokens"]),
        ("edgekv_cache_capacity_tokens", "gauge", "the hard cap M", stats["cache_capacity_tokens"]),
        ("edgekv_cache_capacity_bytes", "gauge", "bytes allocated for the cache", stats["cache_capacity_bytes"]),
        ("edgekv_compressions_total", "counter", "cache compressions", stats["compressions"]),
        ("edgekv_compression_ms_total", "counter", "time spent compressing", stats["compression_ms_total"]),
        ("edgekv_questions_total", "counter", "questions answered", stats["questions"]),
        ("edgekv_answer_tokens_total", "counter", "answer tokens generated", stats["answer_tokens"]),
        ("edgekv_process_rss_bytes", "gauge", "process resident memory", (snap.get("process_rss_mb") or 0) * 2**20),
        ("edgekv_process_peak_rss_bytes", "gauge", "process peak resident memory", (snap.get("peak_rss_mb") or 0) * 2**20),
        ("edgekv_ram_used_bytes", "gauge", "system memory in use", (snap.get("ram_used_mb") or 0) * 2**20),
    ]
    optional = [
        ("edgekv_power_watts", "gauge", "board power", snap.get("power_w")),
        ("edgekv_energy_joules_total", "counter", "energy since start", snap.get("energy_j")),
        ("edgekv_joules_per_frame", "gauge", "energy per ingested frame", snap.get("j_per_frame")),
        ("edgekv_joules_per_answer_token", "gauge", "energy per answer token", snap.get("j_per_token")),
        ("edgekv_gpu_load_percent", "gauge", "GPU load", snap.get("gpu_load_pct")),
    ]
    lines = []
    for name, kind, help_text, value in metrics + [m for m in optional if m[3] is not None]:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(value):.6g}"]
    return "\n".join(lines) + "\n"


def kept_patch_map(session, recent_pairs: int = 4) -> dict:
    """Share of (layer, KV head) slots still holding each merged-grid cell of the last few frame pairs."""
    import torch

    from edgekv.cache import SlotKind

    if session.grid is None:
        return {"rows": 0, "cols": 0, "kept": []}
    cache, n = session.cache, session.cache.length
    rows, cols = session.grid
    latest = session.counters.frame_pairs - 1
    window = min(recent_pairs, latest + 1)
    mask = (cache.kind[:, :, :n] == int(SlotKind.VISION)) & (cache.frame[:, :, :n] > latest - window)
    cell = cache.row[:, :, :n].long() * cols + cache.col[:, :, :n].long()
    counts = torch.bincount(cell[mask].flatten(), minlength=rows * cols).float()
    share = counts / float(cache.num_layers * cache.kv_heads * max(window, 1))
    return {"rows": rows, "cols": cols, "pairs": window, "kept": share.view(rows, cols).tolist()}


# ---------------------------------------------------------------------------------------------- app
def build_app(daemon) -> FastAPI:
    cfg = daemon.config.server
    token = cfg.token or os.environ.get(cfg.token_env) or None
    model_id = f"edgekv/{daemon.config.model.path.rstrip('/').split('/')[-1] if daemon.config.model.path else 'model'}"
    app = FastAPI(title="edgekv", docs_url=None, redoc_url=None)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > cfg.max_request_bytes):
            return error(413, f"request body over {cfg.max_request_bytes} bytes")
        if token and request.url.path != "/healthz":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return error(401, "missing or wrong bearer token", "authentication_error")
        return await call_next(request)

    @app.get("/healthz")
    async def healthz():
        alive = daemon.session is not None
        return JSONResponse({"status": "ok" if alive else "starting", "frames": daemon.session.counters.frames
                             if alive else 0}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(daemon.created),
                                            "owned_by": "edgekv"}]}

    # sync handlers run in the threadpool: waiting for the session lock must not block the event loop
    @app.get("/metrics")
    def metrics():
        with daemon.lock:
            text = prometheus_text(daemon)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/edgekv/status")
    def status():
        with daemon.lock:
            stats = daemon.session.stats()
            heat = kept_patch_map(daemon.session)
        snap = daemon.monitor.snapshot() if daemon.monitor else {}
        return {"stats": stats, "monitor": snap, "kept": heat}

    @app.get("/frame.jpg")
    def frame():
        data = daemon.latest_jpeg()
        if data is None:
            return error(404, "no frame ingested yet")
        return Response(data, media_type="image/jpeg")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("edgekv.apps").joinpath("static/index.html").read_text()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await request.body()
        if len(raw) > cfg.max_request_bytes:
            return error(413, f"request body over {cfg.max_request_bytes} bytes")
        try:
            body = json.loads(raw or b"null")
            params = parse_chat_request(body, cfg.max_new_tokens, daemon.config.generation.max_new_tokens)
        except json.JSONDecodeError as exc:
            return error(400, f"the body is not valid JSON: {exc}")
        except ApiError as exc:
            return error(exc.status, exc.message, exc.kind)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        question = Question(params["question"], max_new_tokens=params["max_new_tokens"],
                            temperature=params["temperature"], top_p=params["top_p"], source="http",
                            on_token=lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t))
        try:
            daemon.submit(question, timeout=0.5)
        except queue.Full:
            return error(503, "too many questions waiting; try again shortly", "server_busy")
        done = asyncio.Event()
        threading.Thread(target=lambda: (question.done.wait(), loop.call_soon_threadsafe(done.set)),
                         daemon=True).start()
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if params["stream"]:
            return StreamingResponse(_sse(daemon, question, tokens, done, completion_id, created, model_id),
                                     media_type="text/event-stream")
        await done.wait()
        if question.error is not None:
            return error(400, str(question.error))
        answer = question.answer
        return {
            "id": completion_id, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                         "finish_reason": answer.finish_reason}],
            "usage": {"prompt_tokens": answer.prompt_tokens + answer.video_tokens,
                      "completion_tokens": len(answer.token_ids),
                      "total_tokens": answer.prompt_tokens + answer.video_tokens + len(answer.token_ids)},
            "edgekv": {"ttft_s": answer.ttft_s, "decode_tok_s": answer.decode_tok_s,
                       "video_tokens": answer.video_tokens},
        }

    return app


async def _sse(daemon, question, tokens, done, completion_id, created, model_id):
    def chunk(delta: dict, finish=None) -> str:
        return "data: " + json.dumps({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                      "model": model_id, "choices": [{"index": 0, "delta": delta,
                                                                      "finish_reason": finish}]}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    ids: list[int] = []
    sent = ""
    while True:
        getter = asyncio.ensure_future(tokens.get())
        waiter = asyncio.ensure_future(done.wait())
        finished, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in finished:
            waiter.cancel()
            ids.append(getter.result())
            text = daemon.session.tokenizer.decode(ids)
            if not text.endswith("\ufffd") and len(text) > len(sent):  # wait for whole UTF-8 characters
                yield chunk({"content": text[len(sent):]})
                sent = text
            continue
        getter.cancel()
        while not tokens.empty():
            ids.append(tokens.get_nowait())
        break
    if question.error is not None:
        yield "data: " + json.dumps({"error": {"message": str(question.error), "type": "invalid_request_error"}}) + "\n\n"
    else:
        text = question.answer.text
        if len(text) > len(sent):
            yield chunk({"content": text[len(sent):]})
        yield chunk({}, finish=question.answer.finish_reason)
    yield "data: [DONE]\n\n"


class ApiServer:
    """uvicorn in a thread on a socket bound up front (so port 0 works and the port is known)."""

    def __init__(self, daemon) -> None:
        import uvicorn

        cfg = daemon.config.server
        self.sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(build_app(daemon), log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="edgekv-http", daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
