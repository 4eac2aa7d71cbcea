"""Read-only routes: ``/healthz``, ``/v1/models``, ``/metrics``, ``/v1/edgekv/status`` (the status page's data:
figures, questions, the last alerts and the device's clock, in the one request the page makes each second) and
``/frame.jpg``.

What they serve is made at most every ``telemetry.FRESH_S`` (figures, the exposition, the frame's JPEG) and
served again meanwhile straight from the event loop. Making it needs the session lock (waited for at most a
quarter second: ``telemetry``) and CPU, so it runs in the thread pool, one at a time (``_refresh``): twenty
connections hammering these routes used to run twenty threads fighting the event loop for the GIL, and
``/healthz`` waited behind them (p99 125 ms; issue 26). ``/healthz`` itself is answered by the guard before
the app (``guard.RequestGuard``'s fast path) from lock-free reads; its route here is for the OpenAPI schema."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from edgekv.apps.server.alerts import page_alerts
from edgekv.apps.server.api import Api, JsonResponse
from edgekv.apps.server.openai_chat import ApiError, safe_text
from edgekv.apps.server.page import device_clock
from edgekv.apps.server.telemetry import Telemetry, camera_figures, stream_detail, stream_state


def router(api: Api) -> APIRouter:
    daemon, telemetry = api.daemon, api.telemetry
    routes = APIRouter()

    @routes.get("/healthz")
    @routes.get("/health")
    async def healthz(request: Request):
        status, payload = health(daemon)
        return JsonResponse(payload if request.state.edgekv_authenticated else public_health(payload),
                            status_code=status)

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

    refresh = asyncio.Lock()  # one refresh at a time in the thread pool; the others wait without a thread

    async def _refresh(fresh: bool, work: Callable[[], Any]) -> Any:
        if fresh:
            return work()
        async with refresh:
            return await run_in_threadpool(work)

    @routes.get("/metrics", response_class=Response, responses={200: {"content": {
        "text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {"schema": {"type": "string"}}}}})
    async def metrics(request: Request):
        accept = request.headers.get("accept")
        public = not request.state.edgekv_authenticated  # server.metrics_public, no token given: no stream state
        body, content_type = await _refresh(telemetry.exposition_fresh(accept, public),
                                            lambda: telemetry.exposition(accept, public))
        return Response(body, headers={"content-type": content_type})

    @routes.get("/v1/edgekv/status")
    async def status():
        payload = await _refresh(telemetry.snapshot_fresh(),
                                 lambda: status_payload(daemon, telemetry, auth=api.policy.token is not None))
        # the device's clock read now, not with the figures (served again for FRESH_S): the page's one request
        return JsonResponse({**payload, "clock": device_clock()}, headers={"cache-control": "no-store"})

    @routes.get("/frame.jpg", response_class=Response,
             responses={200: {"content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}}}})
    async def frame(camera: str | None = None, pair: int | None = None):
        source = daemon
        if camera is not None:  # video.sources: that camera's latest frame
            cameras = getattr(daemon, "cameras", None) or {}
            if camera not in cameras:
                raise ApiError(400, f"camera: {safe_text(camera)!r} is not one of this daemon's cameras "
                                    f"({', '.join(cameras) or 'it watches one: leave camera out'})", param="camera")
            source = cameras[camera]
        if pair is not None:  # an answer's evidence (edgekv.evidence[].frame): while the keyframe ring keeps it
            keyframe = getattr(source, "keyframe_jpeg", None)
            data = await run_in_threadpool(keyframe, pair) if callable(keyframe) else None
            if data is None:
                raise ApiError(404, f"frame pair {pair}: its frame is not kept (the last alerts.keyframe_pairs pairs' "
                                    f"are, in memory, and with archive.frames_mib older ones on disk while they fit; "
                                    f"the answer's evidence still gives its time)", code="frame_not_kept")
            return Response(data, media_type="image/jpeg", headers={"cache-control": "no-store"})
        cached = getattr(source, "jpeg_cached", None)
        data = await _refresh(bool(cached()) if callable(cached) else False, source.latest_jpeg)
        if data is None:
            raise ApiError(404, "no frame ingested yet", code="no_frame")
        return Response(data, media_type="image/jpeg", headers={"cache-control": "no-store"})

    return routes


def health(daemon: Any) -> tuple[int, dict]:
    """``/healthz``: 503 while starting and while the stream is stalled (frames come, none goes in: the memory
    stopped); 200 ``degraded`` with the reasons when something is wrong that does not stop it (a camera being
    reconnected, an archive on a full disk); 200 ``ok`` otherwise. Reads only the daemon's own flags and
    counters, never the session's lock, so it answers while an ingest or an answer runs. With several cameras
    (``video.sources``) every camera counts, each problem after its camera's name: the server is the first
    camera's, and a second camera that was never reached, or stalled, answered ``ok``."""
    session = daemon.session
    state = stream_state(daemon)
    cameras = getattr(daemon, "cameras", None) or {None: daemon}
    states = {name: stream_state(d) if d.session is not None else "starting" for name, d in cameras.items()}
    problems = camera_problems(cameras)
    if any(s == "starting" for s in states.values()):
        status, code = "starting", 503
    elif any(s == "stalled" for s in states.values()):
        status, code = "stalled", 503
    else:
        status, code = ("degraded" if problems else "ok"), 200
    payload = {"status": status, "frames": session.counters.frames if session is not None else 0,
               "stream_state": state}
    if len(cameras) > 1:
        payload["cameras"] = states
    details = []
    for name, d in cameras.items():
        if states[name] == "stalled":
            idle = getattr(getattr(d, "stall", None), "idle_s", lambda: None)()
            detail = (f"no frame ingested for {idle:.0f} s (frames refused: {d.session.counters.frames_rejected})"
                      if idle is not None else "no frame ingested")
            details.append(detail if name is None else f"camera {name}: {detail}")
    if details:
        payload["detail"] = "; ".join(details)
    if problems:
        payload["problems"] = problems
    return code, payload


def camera_problems(cameras: dict) -> list[str]:
    """Each camera's ``problems()`` (``{None: daemon}`` for one camera: its own, as they are), after its name."""
    out = []
    for name, d in cameras.items():
        own = getattr(d, "problems", None)
        if callable(own) and d.session is not None:
            out.extend(problem if name is None else f"camera {name}: {problem}" for problem in own())
    return out


def public_health(payload: dict) -> dict:
    """What ``/healthz`` tells a client without the token (when one is set): the status code and its word (``ok``,
    ``degraded``, ``starting``, ``stalled``), all a load balancer, a systemd or container health check or a fleet
    prober acts on. The rest says what the camera is doing — ``stream_state`` tells anyone on the network when the
    wearer paused it (privacy), ``frames`` how long it has watched, ``problems`` paths and errors of the disk — and
    is given with the token (a bearer header or the page's cookie)."""
    return {"status": payload["status"]}


def health_response(daemon: Any, full: bool = True) -> tuple[int, bytes]:
    """``health`` as (status, JSON bytes), for the guard's fast path; ``full``: the client is authenticated (or
    no token is set), else ``public_health``."""
    status, payload = health(daemon)
    return status, JsonResponse(payload if full else public_health(payload)).body


def status_payload(daemon: Any, telemetry: Telemetry, auth: bool) -> dict:
    snap = telemetry.snapshot()
    last = telemetry.last_answer or {}
    own = getattr(daemon, "status", None)
    info = dict(own()) if callable(own) else {"questions_waiting": daemon.questions.qsize()}
    info.update(stream_state=stream_state(daemon), stream_detail=stream_detail(daemon))
    info["problems"] = camera_problems(getattr(daemon, "cameras", None) or {None: daemon})
    return {
        "stats": snap["stats"], "kept": snap["kept"], "snapshot_age_s": snap["age_s"],
        "monitor": telemetry.monitor(), "capture": telemetry.capture(), "daemon": info,
        "rates": {"ingest_fps": telemetry.ingest_fps(), "ttft_s": last.get("ttft_s"),
                  "decode_tok_s": last.get("decode_tok_s")},
        "series": telemetry.series_for_page(), "questions": recent_questions(daemon, telemetry), "auth": auth,
        "cameras": camera_figures(daemon.cameras) if getattr(daemon, "cameras", None) else None,
        "alerts": page_alerts(daemon),
    }


def recent_questions(daemon: Any, telemetry: Telemetry, limit: int = 20) -> list[dict]:
    """Finished questions from every channel, newest first: the daemon's own record when it keeps one
    (``recent_questions()``), else what ``Telemetry.question_answered`` saw."""
    own = getattr(daemon, "recent_questions", None)
    items = list(own()) if callable(own) else list(telemetry.answered)
    keys = ("source", "question", "answer", "error", "asked_at", "ttft_s", "decode_tok_s", "tokens", "finish_reason")
    return [{k: item.get(k) for k in keys} for item in reversed(items[-limit:])]
