"""``POST /v1/voice/talk {"pressed": true|false}``: the push-to-talk button over HTTP (``voice.trigger:
push_to_talk`` with ``voice.push_to_talk: http``): a phone app, a web page or a hardware button's bridge
holds it while the wearer speaks."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from edgekv.apps.server.api import Api, JsonResponse, body_schema
from edgekv.apps.server.openai_chat import ApiError, validation_error


class Talk(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    pressed: bool


def router(api: Api) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/voice/talk", openapi_extra=body_schema(Talk.model_json_schema()))
    async def talk(request: Request):
        body = await api.body(request)
        try:
            wanted = Talk.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        button = getattr(api.daemon, "push_to_talk", None)
        if button is None or api.daemon.config.voice.push_to_talk != "http":
            raise ApiError(409, "push-to-talk over HTTP is off (voice.enabled, voice.trigger: push_to_talk, "
                                "voice.push_to_talk: http)", code="push_to_talk_off")
        button.set(wanted.pressed)
        return JsonResponse({"pressed": button.pressed.is_set()})

    return routes
