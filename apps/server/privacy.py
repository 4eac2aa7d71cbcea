"""The wearer's control over what the device keeps:

    POST /v1/privacy/pause     stop ingest and release the camera until resumed (the privacy switch)
    POST /v1/privacy/resume
    GET  /v1/privacy           {"paused": bool, "reason": ...}
    POST /v1/memory/forget     {"from": t0, "to": t1} or {"last_s": s}: a window of stream time removed from the
                               live cache, the snapshots and the archive (``Daemon.forget``); says how much.
                               ``from`` / ``to`` as strings are wall times ("10:03", "2026-12-04T10:03:00+01:00"):
                               what each camera saw between them (its wall-clock map)

With several cameras (``video.sources``) each of these reaches every camera: paused means every camera is (each
one's state under ``cameras``), and forget reports the totals and each camera's result.

Paused is also ``stream_state: paused`` on the status page, ``/healthz`` (with the token, when one is set: its
public answer says ``ok`` only, so the network does not learn when the camera was switched off) and ``/metrics``
(``edgekv_stream_state{state="paused"}``, also with the token only: ``server.metrics_public`` opens the other figures,
whose frame counters still stop while paused — as they do for a camera out of reach — so where that too must stay
private, keep ``/metrics`` behind the token)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from edgekv.apps.controls import every_camera, forget_every, pause_every, privacy_state, resume_every
from edgekv.apps.questions import QuestionRefused
from edgekv.apps.server.api import Api, JsonResponse
from edgekv.apps.server.openai_chat import ApiError, safe_text
from edgekv.apps.wall_times import WindowError, forget_request


def router(api: Api) -> APIRouter:
    routes = APIRouter()
    daemon = api.daemon

    def state() -> dict:
        return privacy_state(daemon)

    def check() -> None:
        if not hasattr(daemon, "pause") or any(d.sampler is None for d in every_camera(daemon).values()):
            raise ApiError(503, "the stream is not running yet", kind="server_error", code="server_unavailable",
                           headers={"retry-after": "1"})

    @routes.get("/v1/privacy")
    async def current():
        return JsonResponse(state())

    @routes.post("/v1/privacy/pause")
    async def pause():
        check()
        await asyncio.get_running_loop().run_in_executor(None, pause_every, daemon, "privacy switch (API)")
        return JsonResponse(state())

    @routes.post("/v1/privacy/resume")
    async def resume():
        check()
        try:
            await asyncio.get_running_loop().run_in_executor(None, resume_every, daemon)
        except (OSError, ValueError) as exc:  # the camera could not be reopened: still paused, and why
            raise ApiError(503, f"could not reopen the video source: {exc}", kind="server_error",
                           code="source_unavailable") from None
        return JsonResponse(state())

    @routes.post("/v1/memory/forget")
    async def forget(request: Request):
        body = await api.body(request)
        try:
            window = forget_request(body)
        except WindowError as exc:
            raise ApiError(400, safe_text(str(exc), 300), param=exc.param) from None
        if not hasattr(daemon, "forget"):
            raise ApiError(503, "this server has no memory to forget from", kind="server_error",
                           code="server_unavailable")
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                None, lambda: forget_every(daemon, **window))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except QuestionRefused as exc:  # shutting down: nothing was forgotten (a 500 "internal error" before)
            raise ApiError(503, safe_text(str(exc), 300), kind="server_error", code="server_unavailable",
                           headers={"retry-after": "1"}) from None
        except OSError as exc:  # a snapshot or archive rewrite failed: the cache is clean, the files are not yet
            raise ApiError(500, f"the window was removed from the live cache but not from every file: {exc}",
                           kind="server_error", code="forget_incomplete") from None
        return JsonResponse(result)

    return routes
