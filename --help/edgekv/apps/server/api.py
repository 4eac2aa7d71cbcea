"""What the HTTP routers share: the ``Api`` handle (daemon, telemetry, access policy, limits, pages), JSON
responses that never fail to encode, and OpenAI error responses."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from edgekv.apps.server.guard import AccessPolicy, read_body
from edgekv.apps.server.openai_chat import ApiError, ChatLimits, parse_json_body
from edgekv.apps.server.telemetry import Telemetry

def _finite(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither); containers are walked."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class JsonResponse(Response):
    """ASCII-escaped JSON (encodes any text, lone surrogates included) with non-finite floats as null."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), allow_nan=False, separators=(",", ":")).encode()


def error_response(error: ApiError) -> Response:
    return Response(error.body(), status_code=error.status, media_type="application/json", headers=error.headers)


def body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@dataclass(frozen=True)
class Api:
    """What the route handlers share."""

    daemon: Any
    telemetry: Telemetry
    policy: AccessPolicy
    limits: ChatLimits
    pages: dict[str, str]

    @property
    def cfg(self) -> Any:
        return self.daemon.config.server

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(self.daemon.created), "owned_by": "edgekv"}

    async def body(self, request: Request) -> Any:
        return parse_json_body(await read_body(request, self.cfg.max_request_bytes, self.cfg.request_timeout_s))
