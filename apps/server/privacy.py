"""The wearer's control over what the device keeps:

    POST /v1/privacy/pause     stop ingest and release the camera until resumed (the privacy switch)
    POST /v1/privacy/resume
    GET  /v1/privacy           {"paused": bool, "reason": ...}

Paused is also ``stream_state: paused`` on the status page, ``/healthz`` and ``/metrics``
(``edgekv_stream_state{state="paused"}``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from edgekv.apps.server.api import Api, JsonResponse
from edgekv.apps.server.openai_chat import ApiError


def router(api: Api) -> APIRouter:
    routes = APIRouter()
    daemon = api.daemon

    def state() -> dict:
        return {"paused": daemon.paused is not None, "reason": daemon.paused}

    def check() -> None:
        if not hasattr(daemon, "pause") or daemon.sampler is None:
            raise ApiError(503, "the stream is not running yet", kind="server_error", code="server_unavailable",
                           headers={"retry-after": "1"})

    @routes.get("/v1/privacy")
    async def current():
        return JsonResponse(state())

    @routes.post("/v1/privacy/pause")
    async def pause():
        check()
        await asyncio.get_running_loop().run_in_executor(None, daemon.pause, "privacy switch (API)")
        return JsonResponse(state())

    @routes.post("/v1/privacy/resume")
    async def resume():
        check()
        try:
            await asyncio.get_running_loop().run_in_executor(None, daemon.resume)
        except (OSError, ValueError) as exc:  # the camera could not be reopened: still paused, and why
            raise ApiError(503, f"could not reopen the video source: {exc}", kind="server_error",
                           code="source_unavailable") from None
        return JsonResponse(state())

    return routes
