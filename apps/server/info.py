"""Read-only routes: ``/healthz``, ``/v1/models``, ``/metrics``, ``/v1/edgekv/status`` (the status page's data)
and ``/frame.jpg``. Handlers that need the session lock are sync (they run in the thread pool) and wait for it
at most a quarter second (``telemetry``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from edgekv.apps.server.api import Api, JsonResponse
from edgekv.apps.server.openai_chat import ApiError, safe_text
from edgekv.apps.server.telemetry import Telemetry, stream_detail, stream_state


def router(api: Api) -> APIRouter:
    daemon, telemetry = api.daemon, api.telemetry
    routes = APIRouter()

    @routes.get("/healthz")
    @routes.get("/health")
    async def healthz():
        alive = daemon.session is not None
        return JsonResponse({"status": "ok" if alive else "starting",
                             "frames": daemon.session.counters.frames if alive else 0,
                             "stream_state": stream_state(daemon)}, status_code=200 if alive else 503)

    @routes.get("/version")
    async def version():
        import edgekv

        return JsonResponse({"version": edgekv.__version__})

    @routes.get("/v1/models")
    async def models():
        return JsonResponse({"object": "list", "data": [api.model_card(name) for name in api.limits.served_models]})

    @routes.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in api.limits.served_models:
            raise ApiError(404, f"The model `{safe_text(model)}` does not exist: this server serves "
                                f"{', '.join(f'`{name}`' for name in api.limits.served_models)}", param="model",
                           code="model_not_found")
        return JsonResponse(api.model_card(model))

    # sync handlers run in the thread pool: they may wait (briefly) for the session lock
    @routes.get("/metrics", response_class=Response, responses={200: {"content": {
        "text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {"schema": {"type": "string"}}}}})
    def metrics(request: Request):
        body, content_type = telemetry.exposition(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    @routes.get("/v1/edgekv/status")
    def status():
        return JsonResponse(status_payload(daemon, telemetry, auth=api.policy.token is not None),
                            headers={"cache-control": "no-store"})

    @routes.get("/frame.jpg", response_class=Response,
             responses={200: {"content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}}}})
    def frame():
        data = daemon.latest_jpeg()
        if data is None:
            raise ApiError(404, "no frame ingested yet", code="no_frame")
        return Response(data, media_type="image/jpeg", headers={"cache-control": "no-store"})

    return routes


def status_payload(daemon: Any, telemetry: Telemetry, auth: bool) -> dict:
    snap = telemetry.snapshot()
    last = telemetry.last_answer or {}
    own = getattr(daemon, "status", None)
    info = dict(own()) if callable(own) else {"questions_waiting": daemon.questions.qsize()}
    info.update(stream_state=stream_state(daemon), stream_detail=stream_detail(daemon))
    return {
        "stats": snap["stats"], "kept": snap["kept"], "snapshot_age_s": snap["age_s"],
        "monitor": telemetry.monitor(), "capture": telemetry.capture(), "daemon": info,
        "rates": {"ingest_fps": telemetry.ingest_fps(), "ttft_s": last.get("ttft_s"),
                  "decode_tok_s": last.get("decode_tok_s")},
        "series": telemetry.series_for_page(), "questions": recent_questions(daemon, telemetry), "auth": auth,
    }


def recent_questions(daemon: Any, telemetry: Telemetry, limit: int = 20) -> list[dict]:
    """Finished questions from every channel, newest first: the daemon's own record when it keeps one
    (``recent_questions()``), else what ``Telemetry.question_answered`` saw."""
    own = getattr(daemon, "recent_questions", None)
    items = list(own()) if callable(own) else list(telemetry.answered)
    keys = ("source", "question", "answer", "error", "asked_at", "ttft_s", "decode_tok_s", "tokens", "finish_reason")
    return [{k: item.get(k) for k in keys} for item in reversed(items[-limit:])]
