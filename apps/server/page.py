"""The status page (``/``, a login form first when a token is set), its scripts and styles, its login and logout.

Every script and style is a file under ``/static/`` and the Content-Security-Policy allows ``'self'`` only: no
inline script runs, so text that reached the page some other way (a question, an alert name) could not run as
one even if it were ever written as HTML. The login form's files need no token (the form is what a client
without one is shown); the page's need it as the page does.

The device's clock and time zone (``device_clock``) come with every ``/v1/edgekv/status`` the page polls (its
``clock``; ``GET /v1/edgekv/clock`` gives the same alone, for other clients). The wearer asks and forgets by the
device's clock ("forget from 14:00 to 14:10", evidence "seen at 14:03"), and the daemon reads such times in its
own zone; a phone in another zone (travel, a remote operator) showed times in the browser's zone, which the
device then read as other moments. The page shows every time as the device's clock showed it, with its offset."""

from __future__ import annotations

import datetime as dt
import hmac
import os
import time
import zoneinfo

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from edgekv.apps.server.api import Api, JsonResponse, body_schema
from edgekv.apps.server.guard import (
    PUBLIC_ASSETS,
    AttemptLimiter,
    SessionCookies,
    cookie_value,
    too_many_attempts,
)
from edgekv.apps.server.openai_chat import ApiError, safe_text
from edgekv.apps.wall_times import follow_local_zone

PAGE_HEADERS = {
    "cache-control": "no-store", "x-content-type-options": "nosniff", "x-frame-options": "DENY",
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
}
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
FILES = ("index.html", "login.html", "page.js", "page.css", *PUBLIC_ASSETS)  # read once, at start (app.build_app)


def router(api: Api) -> APIRouter:
    token, cookies = api.policy.token, api.policy.cookies
    attempts = api.policy.attempts or AttemptLimiter(api.cfg.login_attempts_per_minute)  # the bearer's bucket too
    routes = APIRouter()

    @routes.get("/", response_class=HTMLResponse)
    async def page(request: Request):
        name = "index.html" if request.state.edgekv_authenticated else "login.html"
        return HTMLResponse(api.pages[name], headers=PAGE_HEADERS)

    @routes.get("/static/{name}", response_class=Response, include_in_schema=False)
    async def asset(name: str):
        suffix = name[name.rfind("."):] if "." in name else ""
        if name not in FILES or suffix not in ASSET_TYPES:
            raise ApiError(404, f"Unknown request URL: GET /static/{safe_text(name)}", code="unknown_url")
        return Response(api.pages[name], headers={"content-type": ASSET_TYPES[suffix], "cache-control": "no-store"})

    @routes.get("/v1/edgekv/clock")
    async def clock():
        return JsonResponse(device_clock(), headers={"cache-control": "no-store"})

    @routes.post("/v1/edgekv/login", status_code=204, openapi_extra=body_schema(
            {"type": "object", "properties": {"token": {"type": "string"}}, "required": ["token"]}),
            responses={429: {"description": "too many login attempts from this address "
                                            "(server.login_attempts_per_minute)"}})
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
        attempts.refund(client)  # only guesses spend the bucket
        return Response(status_code=204, headers={"set-cookie": cookies.set_header(), "cache-control": "no-store"})

    @routes.post("/v1/edgekv/logout", status_code=204, openapi_extra={"requestBody": {"required": False, "content": {
        "application/json": {"schema": {"type": "object"}}}}})
    async def logout(request: Request):
        if cookies is None:
            return Response(status_code=204, headers={"set-cookie": SessionCookies("-").clear_header()})
        given = cookie_value(request.headers.get("cookie", ""))
        if given is not None:
            cookies.revoke(given)  # dead server-side: a copy of the cookie no longer opens anything
        return Response(status_code=204, headers={"set-cookie": cookies.clear_header(), "cache-control": "no-store"})

    return routes


def device_clock(now: float | None = None) -> dict:
    """The device's clock for the page: ``unix`` (now, by the device's clock, which may differ from the browser's),
    ``zone`` (its IANA name, which the browser formats any moment in, summer time included; ``null`` where the
    device's zone has none, e.g. a POSIX ``TZ`` rule), ``abbreviation`` and ``utc_offset_s`` (now: the page's
    fallback without a name). Read afresh each time: the zone may change while the daemon runs (a flight)."""
    follow_local_zone()
    now = time.time() if now is None else now
    local = dt.datetime.fromtimestamp(now).astimezone()
    return {"unix": now, "zone": local_zone_name(now), "abbreviation": local.tzname(),
            "utc_offset_s": round(local.utcoffset().total_seconds())}


HALF_YEAR_S = 182 * 86400


def local_zone_name(now: float) -> str | None:
    """This machine's time zone as an IANA name (``TZ``, else the ``/etc/localtime`` link, else ``/etc/timezone``),
    if that zone gives the offsets this process's clock does, now and half a year either side (its summer time);
    else ``None``."""
    tz = os.environ.get("TZ")
    if tz is not None:
        candidates = [tz[1:] if tz.startswith(":") else tz]
    else:
        candidates = [os.path.realpath("/etc/localtime")]
        try:
            with open("/etc/timezone", encoding="utf-8") as f:
                candidates.append(f.read().strip())
        except OSError:
            pass
    for name in candidates:
        name = name.partition("zoneinfo/")[2] if "zoneinfo/" in name else name
        name = name.removeprefix("posix/")  # Debian's copy of each zone; browsers know the plain name
        try:
            zone = zoneinfo.ZoneInfo(name)
        except (ValueError, OSError, zoneinfo.ZoneInfoNotFoundError):
            continue
        moments = (now - HALF_YEAR_S, now, now + HALF_YEAR_S)
        if all(dt.datetime.fromtimestamp(t, zone).utcoffset() == dt.datetime.fromtimestamp(t).astimezone().utcoffset()
               for t in moments):
            return name
    return None
