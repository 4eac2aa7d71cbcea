"""The status page (``/``, a login form first when a token is set) and its login and logout."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from edgekv.apps.server.api import Api, body_schema
from edgekv.apps.server.guard import AttemptLimiter, SessionCookies, too_many_attempts
from edgekv.apps.server.openai_chat import ApiError

PAGE_HEADERS = {
    "cache-control": "no-store", "x-content-type-options": "nosniff", "x-frame-options": "DENY",
    "content-security-policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
                               "'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
}


def router(api: Api) -> APIRouter:
    token, cookies = api.policy.token, api.policy.cookies
    attempts = api.policy.attempts or AttemptLimiter(api.cfg.login_attempts_per_minute)  # the bearer's bucket too
    routes = APIRouter()

    @routes.get("/", response_class=HTMLResponse)
    async def page(request: Request):
        name = "index.html" if request.state.edgekv_authenticated else "login.html"
        return HTMLResponse(api.pages[name], headers=PAGE_HEADERS)

    @routes.post("/v1/edgekv/login", status_code=204, openapi_extra=body_schema(
            {"type": "object", "properties": {"token": {"type": "string"}}, "required": ["token"]}),
            responses={429: {"description": "too many login attempts from this address (server.login_attempts_per_minute)"}})
    async def login(request: Request):
        if token is None:
            return Response(status_code=204)
        client = request.client.host if request.client is not None else "?"
        if not attempts.allow(client):  # checked before the token: a limited guesser learns nothing
            raise too_many_attempts(attempts, client)
        body = await api.body(request)
        given = body.get("token") if isinstance(body, dict) else None
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(401, "wrong token", kind="authentication_error", param="token", code="invalid_api_key")
        return Response(status_code=204, headers={"set-cookie": cookies.set_header(), "cache-control": "no-store"})

    @routes.post("/v1/edgekv/logout", status_code=204, openapi_extra={"requestBody": {"required": False, "content": {
        "application/json": {"schema": {"type": "object"}}}}})
    async def logout():
        clear = cookies.clear_header() if cookies is not None else SessionCookies("-").clear_header()
        return Response(status_code=204, headers={"set-cookie": clear})

    return routes
