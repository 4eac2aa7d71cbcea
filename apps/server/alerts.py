"""Standing questions over HTTP (apps/outputs/alerts.py):

    POST   /v1/alerts                         {"question": "Was there a red circle?", "every_pairs": 2, ...} -> 201 rule
    GET    /v1/alerts                         the rules, each with its verdict, P(yes), evaluations and alerts fired
    DELETE /v1/alerts/{id}
    GET    /v1/alerts/events                  the last alerts (JSON)
    GET    /v1/alerts/events/{id}/keyframe.jpg
    GET    /v1/alerts/stream                  Server-Sent Events: one ``event: alert`` per alert as it is raised

With several cameras (``video.sources``) a rule is one camera's, evaluated over its cache: ``"camera": "back"``
adds it there, no camera (or ``"all"``) adds one to every camera, as a config rule without one (201 with the list
of them); each rule says its camera and its id names it (``back-alert-1``). The list, the events and the SSE
stream hold every camera's.

The SSE stream is an output like the webhooks: each client has a bounded queue (``alerts.queue``) filled from
the daemon's thread with ``call_soon_threadsafe``; a slow client loses its oldest waiting alerts (each stream
says how many in a ``dropped`` field), never the daemon's time. A comment line every 15 s keeps proxies from
closing an idle stream. When the server stops, each stream ends (``end_streams``): uvicorn waited its graceful
timeout for streams that never end, then cancelled them, with a traceback for each in the daemon's log.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgekv.apps.server.api import Api, JsonResponse, body_schema
from edgekv.apps.server.openai_chat import ApiError, safe_text, validation_error

KEEPALIVE_S = 15.0
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class AlertRequest(BaseModel):
    """A standing question, as ``alerts.rules`` entries are written in the config."""

    model_config = ConfigDict(extra="forbid", strict=True)
    question: str = Field(min_length=1, max_length=2000, description="a yes/no question about the stream")
    name: str | None = Field(None, max_length=200)
    every_pairs: int | None = Field(None, ge=1)
    every_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    cooldown_s: float = Field(60.0, ge=0, allow_inf_nan=False)
    threshold: float = Field(0.5, gt=0, lt=1, allow_inf_nan=False)
    camera: str | None = Field(None, description="with video.sources: the camera to watch (default: every one)")
    window_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                   description="read only the last so many seconds (a question about now)")


class _SseClient:
    """One SSE stream's queue, fed from any thread; ``END`` offered ends the stream."""

    END = None

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self.loop, self.capacity = loop, capacity
        self.items: asyncio.Queue = asyncio.Queue()
        self.dropped = 0

    def offer(self, event) -> None:  # the daemon's thread
        try:
            self.loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the server's loop is closed
            pass

    def _put(self, event) -> None:  # the event loop
        if self.items.qsize() >= self.capacity:
            self.items.get_nowait()
            self.dropped += 1
        self.items.put_nowait(event)


def end_streams(daemon: Any) -> int:
    """End every open ``/v1/alerts/stream`` (any thread; the server is stopping): each sends what it holds and
    closes. Returns how many were told."""
    cameras = getattr(daemon, "cameras", None) or {None: daemon}
    clients = {id(sink): sink for d in cameras.values() if getattr(d, "alert_bus", None) is not None
               for sink in list(d.alert_bus.sinks) if isinstance(sink, _SseClient)}  # one client is on every bus
    for client in clients.values():
        client.offer(_SseClient.END)
    return len(clients)


PAGE_ALERTS = 10  # the status page's alerts view: the last so many


def page_alerts(daemon: Any, limit: int = PAGE_ALERTS) -> dict:
    """The status page's alerts view (``/v1/edgekv/status``'s ``alerts``): how many standing questions stand
    (``rules``) and the last ``limit`` alerts of every camera, newest first, as ``GET /v1/alerts/events`` gives them
    (kept ones of earlier runs included). No rules and no events while the daemon starts (nothing 503s)."""
    cameras = getattr(daemon, "cameras", None) or {None: daemon}
    engines = [d.alerts for d in cameras.values() if getattr(d, "alerts", None) is not None]
    events = sorted((e for engine in engines for e in list(engine.bus.recent)), key=lambda e: e.raised_unix,
                    reverse=True)
    return {"rules": sum(len(engine.list()) for engine in engines), "events": [e.to_json() for e in events[:limit]]}


def router(api: Api) -> APIRouter:
    routes = APIRouter()
    daemon = api.daemon

    def engines() -> dict:
        """Each camera's standing questions by camera name (``video.sources``); one camera: {None: its}."""
        cameras = getattr(daemon, "cameras", None) or {None: daemon}
        if any(getattr(d, "alerts", None) is None for d in cameras.values()):
            raise ApiError(503, "standing questions are not running yet (the daemon is starting)",
                           kind="server_error", code="server_unavailable", headers={"retry-after": "1"})
        return {name: d.alerts for name, d in cameras.items()}

    def recent() -> list:
        """Every camera's last alerts, newest first."""
        events = [e for engine in engines().values() for e in list(engine.bus.recent)]
        return sorted(events, key=lambda e: e.raised_unix, reverse=True)

    @routes.post("/v1/alerts", status_code=201, openapi_extra=body_schema(AlertRequest.model_json_schema()))
    async def add(request: Request):
        body = await api.body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            wanted = AlertRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        from edgekv.config import AlertRuleSection, ConfigError

        found = engines()
        camera = wanted.camera
        if None in found:  # one camera (video.source)
            if camera not in (None, "all"):
                raise ApiError(400, f"camera: this daemon watches one camera (no video.sources); got "
                                    f"{safe_text(camera)!r}", param="camera")
            chosen = found
        elif camera in (None, "all"):  # as a config rule without a camera: one rule on every camera
            chosen = found
        elif camera in found:
            chosen = {camera: found[camera]}
        else:
            raise ApiError(400, f"camera: {safe_text(camera)!r} is not one of {', '.join(found)} (or 'all')",
                           param="camera")
        rule = AlertRuleSection(**{**wanted.model_dump(), "camera": None})  # each engine names its own camera
        try:
            rule.validate("alert")  # refused before any camera has it
            full = [engine for engine in chosen.values() if len(engine.list()) >= engine.max_rules]
            if full:  # (every camera takes it, or none: the check and the adds run in this one handler)
                full[0].add(rule)  # raises, naming the camera and alerts.max_rules
            states = [engine.add(rule) for engine in chosen.values()]
        except (ConfigError, ValueError) as exc:
            raise ApiError(400, safe_text(str(exc), 300)) from None
        if len(states) == 1:
            return JsonResponse(states[0].to_json(), status_code=201)
        return JsonResponse({"object": "list", "data": [state.to_json() for state in states]}, status_code=201)

    @routes.get("/v1/alerts")
    async def rules():
        return JsonResponse({"object": "list",
                             "data": [state.to_json() for engine in engines().values() for state in engine.list()]})

    @routes.delete("/v1/alerts/{rule_id}")
    async def remove(rule_id: str):
        found = [state for engine in engines().values() for state in engine.list() if state.id == rule_id]
        if not any(engine.remove(rule_id) for engine in engines().values()):
            raise ApiError(404, f"no standing question {safe_text(rule_id)!r}", param="id", code="alert_not_found")
        body = {"id": rule_id, "deleted": True}
        if found and found[0].source == "config":  # the API's own are gone for good (state.dir/alerts.json)
            body["note"] = "a rule of the config (alerts.rules): it stands again at the next start unless removed there"
        return JsonResponse(body)

    @routes.get("/v1/alerts/events")
    async def events():
        return JsonResponse({"object": "list", "data": [e.to_json() for e in recent()]})

    @routes.get("/v1/alerts/events/{event_id}/keyframe.jpg", response_class=Response,
                responses={200: {"content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}}}})
    async def keyframe(event_id: str):
        event = next((e for e in (engine.bus.event(event_id) for engine in engines().values()) if e is not None),
                     None)
        if event is None or event.keyframe_jpeg is None:
            raise ApiError(404, f"no keyframe for alert {safe_text(event_id)!r} (only the last alerts keep theirs)",
                           code="keyframe_not_found")
        return Response(event.keyframe_jpeg, media_type="image/jpeg", headers={"cache-control": "no-store"})

    @routes.get("/v1/alerts/stream", response_class=StreamingResponse,
                responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}})
    async def stream(request: Request):
        buses = [engine.bus for engine in engines().values()]  # every camera's alerts on one stream
        client = _SseClient(asyncio.get_running_loop(), daemon.config.alerts.queue)
        for bus in buses:
            bus.add(client)

        async def events():
            try:
                yield ": edgekv alerts\n\n"
                while True:
                    try:
                        event = await asyncio.wait_for(client.items.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        yield ": keep-alive\n\n"
                        continue
                    if event is _SseClient.END:  # the server stops
                        return
                    payload: dict[str, Any] = event.to_json("url")
                    payload["dropped"] = client.dropped
                    yield f"event: alert\nid: {event.id}\ndata: {json.dumps(payload)}\n\n"
            finally:
                for bus in buses:
                    bus.remove(client)

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    return routes
