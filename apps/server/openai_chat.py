"""OpenAI chat-completions requests, checked strictly: bytes -> JSON -> ``ChatRequest``, or an ``ApiError``
that names the field (OpenAI's ``param``) and becomes a 4xx in OpenAI's error shape.

Bytes -> JSON is checked here by hand (strict UTF-8, no NaN, bounded depth, no lone UTF-16 surrogate
anywhere — ``"\\ud800"`` is valid JSON but not text, refused at the boundary so nothing the daemon prints
or tokenizes can meet one). JSON -> request is a pydantic model in strict mode (``ChatCompletionRequest``):
every field type-checked; fields this server cannot honour (tools, logprobs, n > 1, images) refused by name
instead of being silently ignored; unknown fields refused the way OpenAI refuses them ("Unrecognized request
argument supplied"). The same model is the request schema in ``/openapi.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from edgekv.apps.wall_times import window_bounds
from edgekv.tokenizer import MAX_TURNS
from edgekv.video.image_header import image_size

MAX_JSON_DEPTH = 32  # containers inside containers; a chat request needs 4
# Temperatures below this are greedy decoding (the limit of softmax(logits / T) as T -> 0): a float32
# division by a temperature near 1e-38 gives inf and NaN probabilities (found by the fuzz).
GREEDY_BELOW = 1e-6
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_IMAGES = 16
MAX_EVIDENCE = 8  # frame pairs an answer names as its evidence (edgekv's ``evidence``)
MAX_IMAGE_URL = 16 * 2**20
MAX_IMAGE_PIXELS = 4096 * 4096  # a request's image, decoded (a 4K frame is 8.3 Mpx)
SEED_RANGE = (-(2**63), 2**63 - 1)
TEXT_PART_TYPES = ("text", "input_text")
MEDIA_PART_TYPES = ("image_url", "input_image", "video_url", "input_audio", "file", "audio_url")
ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted only at their neutral value (None always is); anything else is refused as unsupported. Every parameter of
# OpenAI's chat completions (the SDK's ``CompletionCreateParams``) is either here or a field of ChatCompletionRequest
# (served, or accepted and ignored): only a name OpenAI does not know is "unrecognized" (tests/test_api_polish.py).
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "n": 1, "parallel_tool_calls": None,
           "top_logprobs": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
           "logit_bias": None, "audio": None, "prediction": None, "reasoning_effort": None, "service_tier": None,
           "web_search_options": None, "response_format": {"type": "text"}, "modalities": ["text"],
           "verbosity": "medium", "moderation": None}  # verbosity: OpenAI's default, the only length served


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error object. ASCII-escaped JSON: encodes whatever text the message quotes."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def safe_text(text: str, limit: int = 80) -> str:
    """``text`` fit to quote in an error message: cut to ``limit`` characters, lone surrogates escaped."""
    cut = text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(value: Any) -> str:
    """A short, safe description of a JSON value for an error message."""
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, int):
        digits = len(str(abs(value)))
        return f"the integer {value}" if digits <= 20 else f"an integer with {digits} digits"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {json.dumps(safe_text(value, 40))}"
    if value is None:
        return "null"
    return "a list" if isinstance(value, list) else "an object"


# ---------------------------------------------------------------------------------------------- bytes -> JSON
def parse_json_body(raw: bytes) -> Any:
    """Strict UTF-8 JSON with bounded depth and valid Unicode everywhere (keys included)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start}): send UTF-8 encoded JSON",
                       code="invalid_utf8") from None
    if not text.strip():
        raise ApiError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                       code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                       code="invalid_json") from None
    except ValueError as exc:  # Python refuses integers of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON here: {safe_text(str(exc))}",
                       code="invalid_json") from None
    check_structure(body)
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_structure(body: Any) -> None:
    """Depth at most ``MAX_JSON_DEPTH``; no lone surrogate in any string or key (refused naming its path)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, path or "body")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ApiError(400, f"{path or 'body'}: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                               param=path or None, code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_unicode(key, f"{path or 'body'} (a key)")
                    child = f"{path}.{key}" if path else key
                else:
                    child = f"{path}[{key}]"
                stack.append((item, child, depth + 1))


def _check_unicode(text: str, path: str) -> None:
    for index, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            where = safe_text(path, 60)
            raise ApiError(400, f"{where}: contains a lone UTF-16 surrogate (\\u{ord(char):04x} at character "
                                f"{index}), which is not text; send valid Unicode", param=where,
                           code="invalid_unicode")


# ---------------------------------------------------------------------------------------------- JSON -> request
STRICT = ConfigDict(extra="forbid", strict=True)


class TextPart(BaseModel):
    """One part of a message's content: text only (this server answers about its camera, not about images)."""

    model_config = STRICT
    type: Literal["text", "input_text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PART_TYPES:
            raise PydanticCustomError("unsupported_content", f"{kind} parts are not accepted: this server answers "
                                      "about its live camera, send text (or images as image_url data: URLs to a "
                                      "server with server.image_requests: true)")
        if kind not in TEXT_PART_TYPES or set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise PydanticCustomError("text_part", f'expected {{"type": "text", "text": "..."}}, got {describe(part)}')
        return part


class ImageUrl(BaseModel):
    model_config = STRICT
    url: str = Field(max_length=MAX_IMAGE_URL)
    detail: Literal["auto", "low", "high"] | None = None


_ASCII_WHITESPACE = {ord(c): None for c in "\t\n\f\r "}


class ImagePart(BaseModel):
    """An image as OpenAI sends it: ``{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,..."}}``.
    Only ``data:`` URLs: a device never fetches what a request points at. JPEG, PNG, WebP or a still GIF (OpenAI's
    four; an animated one is refused). ``detail`` changes nothing here: every image becomes one frame pair at
    ``video.resolution`` — the same vision tokens whether it says low, high or auto; it goes with the image to the
    escalation server when the question escalates (a big server spends fewer tokens on a "low" one)."""

    model_config = STRICT
    type: Literal["image_url"]
    image_url: ImageUrl

    def decoded(self) -> bytes:
        """The image's bytes. The base64 is read as a browser reads a ``data:`` URL (WHATWG "forgiving-base64"):
        line breaks and spaces are skipped — ``base64`` on the command line and MIME encoders wrap at 76 columns —
        and the ``=`` padding may be left off; scheme and media type in any case."""
        url = self.image_url.url
        head, _, data = url.partition(",")
        head = head.lower()
        if not head.startswith("data:image/") or not head.endswith(";base64") or not data:
            raise PydanticCustomError("unsupported_content", "image_url: only data:image/...;base64, URLs are "
                                      "accepted (nothing is fetched from the network)")
        import base64
        import binascii

        data = data.translate(_ASCII_WHITESPACE)
        if data.endswith("="):
            data = data[:-2] if data.endswith("==") else data[:-1]
        try:
            raw = base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
        except binascii.Error:
            raise PydanticCustomError("invalid_image", "image_url: the data: URL is not valid base64") from None
        from edgekv.apps.server.request_images import pillow_image_size

        try:
            size = image_size(raw) or pillow_image_size(raw)
        except ValueError as exc:
            raise PydanticCustomError("invalid_image", "image_url: {why}", {"why": str(exc)}) from None
        if size is None:
            raise PydanticCustomError("invalid_image", "image_url: not a JPEG, PNG, WebP or GIF (its header does not "
                                      "read as one)")
        if size[0] * size[1] > MAX_IMAGE_PIXELS:
            raise PydanticCustomError("invalid_image", f"image_url: a {size[0]} x {size[1]} image; at most "
                                      f"{MAX_IMAGE_PIXELS / 1e6:.1f} megapixels are decoded (it is resized to the "
                                      f"video grid anyway)")
        return raw


def _part_kind(part: Any) -> str:
    return "ImagePart" if isinstance(part, dict) and part.get("type") == "image_url" else "TextPart"


Part = Annotated[Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
                 Discriminator(_part_kind)]


# What an OpenAI reply's assistant message carries besides its text, and a tool message's link to its call: a client
# that keeps the conversation as the SDK dumps it (``messages.append(reply.choices[0].message.model_dump())``) sends
# them back with every question, at these values; anything else is refused by name (this server calls no tools).
REPLY_FIELDS = {"refusal": None, "annotations": [], "audio": None, "function_call": None, "tool_calls": []}


class Message(BaseModel):
    model_config = STRICT
    role: Literal[ROLES]
    content: str | list[Part] | None = Field(...)
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's (refused by its role: _history)
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    tool_calls: Any = None

    @field_validator(*REPLY_FIELDS, mode="before")
    @classmethod
    def _reply_field_unused(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = REPLY_FIELDS[info.field_name]
        if value is None or (value == neutral and type(value) is type(neutral)):
            return None
        taken = "null" if neutral is None else f"null or {json.dumps(neutral)}"
        raise PydanticCustomError("reply_field", f"only {taken} is accepted (this server makes no tool calls; an "
                                  f"earlier turn's text is its content), got {describe(value)}")

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[tuple[int, ImagePart]]:
        if not isinstance(self.content, list):
            return []
        return [(index, part) for index, part in enumerate(self.content) if isinstance(part, ImagePart)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


NonEmpty = Annotated[str, Field(min_length=1)]


Bound = Any  # stream seconds (a finite number) or a wall time (a string): checked by apps/wall_times.window_bounds


class TimeWindow(BaseModel):
    """edgekv: the stretch of the stream a question reads: ``{"from": t0, "to": t1}`` in stream seconds (as
    ``/v1/memory/forget`` takes them), or as wall times (strings: ``"2026-12-04T10:03:00+01:00"``, or ``"10:03"``
    in the device's local time; apps/wall_times.py), or ``{"last_s": seconds}`` (up to the newest frame when the
    answer starts)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    from_: Bound | None = Field(None, alias="from")
    to: Bound | None = None
    last_s: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_way(self) -> "TimeWindow":
        if self.last_s is not None:
            if self.from_ is not None or self.to is not None:
                raise PydanticCustomError("window", "give either from and to, or last_s, not both")
        elif self.from_ is None or self.to is None:
            raise PydanticCustomError("window", "from and to are required (stream seconds or wall times), or last_s")
        else:
            try:
                window_bounds(self.from_, self.to)
            except ValueError as exc:
                raise PydanticCustomError("window", "{why}", {"why": str(exc)}) from None
        return self

    def bounds(self) -> tuple[str, float, float] | None:
        """``("stream" | "wall", from, to)``, or None for ``last_s``."""
        return None if self.last_s is not None else window_bounds(self.from_, self.to)


class ChatCompletionRequest(BaseModel):
    """The request as this server reads it (and as ``/openapi.json`` documents it)."""

    messages: list[Message] = Field(min_length=1, description="the last message is the user's question about the "
                                    "stream (or, with continue_final_message, the start of the assistant's reply "
                                    "to it); the user and assistant messages before it are its conversation")
    model: str | None = Field(None, description="one of the served model names (GET /v1/models), or omitted")
    max_tokens: int | None = Field(None, ge=1, description="at most server.max_new_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    recall: bool | None = Field(None, description="edgekv: recall archived frame pairs first (null: archive.recall)")
    escalate: bool | None = Field(None, description="edgekv: send the question and the most relevant keyframes to "
                                                    "the escalation server (escalate: in the config)")
    camera: Annotated[str, Field(min_length=1, max_length=32)] | None = Field(
        None, description="edgekv: which camera of video.sources answers ('all': each, listed per camera; the "
                          "default with several cameras)")
    window: TimeWindow | None = Field(None, description="edgekv: read only the frame pairs of this stretch of the "
                                                        "stream ({from, to} stream seconds or wall times, or "
                                                        "{last_s})")
    continue_final_message: bool | None = Field(None, description=(
        "vLLM's: the last message is the start of the assistant's reply, which the model continues (a prefill); "
        "the answer's content is the continuation only"))
    add_generation_prompt: bool | None = Field(None, description="vLLM's: false (or left out) with "
                                           "continue_final_message; true (a new assistant turn) without it")
    evidence: int | None = Field(None, ge=0, le=MAX_EVIDENCE, description=(
        "edgekv: also name the frame pairs the question attended most (at most this many), each with its stream "
        "time and the wall time it was seen at, in the answer's edgekv.evidence"))
    # accepted and ignored: they change nothing about an answer
    user: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # accepted only at their neutral value or null (NEUTRAL: tools, logprobs, n, ...); anything else is refused
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _no_other_fields(self) -> "ChatCompletionRequest":
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL:
                raise PydanticCustomError("unrecognized_argument", "Unrecognized request argument supplied: {param}",
                                          {"param": safe_text(name)})
            neutral = NEUTRAL[name]
            same = value is None or (value == neutral and type(value) is type(neutral)) or (
                isinstance(neutral, int) and not isinstance(neutral, bool) and isinstance(value, (int, float))
                and not isinstance(value, bool) and value == neutral)
            if not same:
                taken = "null" if neutral is None else f"{json.dumps(neutral)} or null"
                raise PydanticCustomError("unsupported_parameter", "{param}: not supported by this server (only "
                                          f"{taken}), got {describe(value)}", {"param": name})
        return self


@dataclass(frozen=True)
class ChatRequest:
    question: str
    max_new_tokens: int
    temperature: float | None
    top_p: float | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    seed: int | None
    recall: bool | None = None  # edgekv extension: recall archived frame pairs (null: archive.recall)
    escalate: bool | None = None  # edgekv extension: ask the escalation server (null: by confidence)
    images: tuple[bytes, ...] = ()  # encoded images of the question (server.image_requests)
    image_details: tuple[str | None, ...] = ()  # each image's image_url.detail (None: not given), for escalation
    camera: str | None = None  # edgekv extension: the camera asked (video.sources), "all" or null
    history: tuple[tuple[str, str], ...] = ()  # the user and assistant turns before the question
    window: tuple[float, float] | None = None  # edgekv extension: the stretch read, stream seconds
    window_unix: tuple[float, float] | None = None  # edgekv extension: ... or wall times (seconds since the epoch)
    window_last_s: float | None = None  # edgekv extension: ... or the last seconds before the answer starts
    evidence: int = 0  # edgekv extension: name this many frame pairs attended most, with when they were seen
    answer_prefix: str = ""  # the final assistant message the model continues (continue_final_message)


@dataclass(frozen=True)
class ChatLimits:
    served_models: tuple[str, ...]  # the first is the name answers carry; any is accepted in a request
    max_new_tokens: int  # server.max_new_tokens: the most a request may ask for
    default_new_tokens: int  # generation.max_new_tokens: when the request does not say
    images: bool = False  # server.image_requests: questions may carry images (answered about those images)


def parse_chat_request(body: Any, limits: ChatLimits) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {describe(body)}")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if request.model is not None and request.model not in limits.served_models:
        raise ApiError(404, f"The model `{safe_text(request.model)}` does not exist: this server serves "
                            f"{', '.join(f'`{name}`' for name in limits.served_models)} (GET /v1/models)",
                       param="model", code="model_not_found")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    asked = getattr(request, name)
    if asked is not None and asked > limits.max_new_tokens:
        raise ApiError(400, f"{name}: must be an integer from 1 to {limits.max_new_tokens} (this server's limit, "
                            f"server.max_new_tokens), got {describe(asked)}", param=name)
    temperature = request.temperature
    prefix, messages = _prefill(request)
    images, details = _images(messages, limits)  # before the question: a refused image part names itself
    bounds = request.window.bounds() if request.window is not None else None
    if images and request.window is not None:
        raise ApiError(400, "window: a question with images is answered about its images, not the stream",
                       param="window")
    if images and request.evidence:
        raise ApiError(400, "evidence: a question with images is answered about its images; no frame of the stream "
                            "is its evidence", param="evidence")
    return ChatRequest(
        question=_question(messages), history=_history(messages), answer_prefix=prefix,
        window=bounds[1:] if bounds is not None and bounds[0] == "stream" else None,
        window_unix=bounds[1:] if bounds is not None and bounds[0] == "wall" else None,
        window_last_s=request.window.last_s if request.window else None, evidence=request.evidence or 0,
        max_new_tokens=asked if asked is not None else min(limits.default_new_tokens, limits.max_new_tokens),
        temperature=0.0 if temperature is not None and temperature < GREEDY_BELOW else temperature,
        top_p=request.top_p, stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        stop=(request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ()),
        seed=request.seed, recall=request.recall, escalate=request.escalate, images=images, image_details=details,
        camera=request.camera,
    )


def _prefill(request: ChatCompletionRequest) -> tuple[str, list[Message]]:
    """The start of the assistant's reply and the messages up to the question: with ``continue_final_message: true``
    the last message is an assistant message that the model continues (vLLM's prefill; ``StreamSession.ask``'s
    ``answer_prefix``), the user's question right before it; otherwise ``("", messages)``. A final assistant message
    is continued only when asked: vLLM (and OpenVINO's model server) read one sent without the flag as a finished turn
    and open a new one, Anthropic's API and llama.cpp's server continue it — the same request meaning two different
    answers, it is refused, naming the flag. Contradictions are refused naming the field: ``add_generation_prompt:
    true`` with the flag (vLLM refuses the pair too), ``add_generation_prompt: false`` without it (no turn opened for
    the model to answer in), an image or null content in the reply to continue."""
    messages = request.messages
    last = len(messages) - 1
    role = messages[last].role
    if not request.continue_final_message:
        if request.add_generation_prompt is False:
            raise ApiError(400, "add_generation_prompt: false opens no assistant turn for the model to answer in; it "
                                "goes with continue_final_message: true (continue a final assistant message)",
                           param="add_generation_prompt")
        if role == "assistant":
            raise ApiError(400, f"messages[{last}].role: the last message must be the user's question, got the "
                                "assistant's; to have the model continue that reply send continue_final_message: "
                                "true (and add_generation_prompt: false)", param=f"messages[{last}].role")
        return "", messages
    if request.add_generation_prompt:
        raise ApiError(400, "add_generation_prompt: cannot be true with continue_final_message: true (the final "
                            "assistant message is continued, no new assistant turn is opened); send false or leave "
                            "it out", param="add_generation_prompt")
    if role != "assistant":
        raise ApiError(400, f"messages[{last}].role: continue_final_message: true continues the assistant's reply, so "
                            f"the last message must be an assistant message, got {describe(role)}",
                       param=f"messages[{last}].role")
    if last == 0:
        raise ApiError(400, "messages: the assistant reply to continue must follow the user's question; there is "
                            "none before it", param="messages")
    if messages[last - 1].role != "user":
        raise ApiError(400, f"messages[{last - 1}].role: the assistant reply to continue (messages[{last}]) must "
                            f"follow the user's question, got {describe(messages[last - 1].role)}",
                       param=f"messages[{last - 1}].role")
    reply = messages[last]
    for index, _ in reply.images():
        at = f"messages[{last}].content[{index}]"
        raise ApiError(400, f"{at}: the assistant reply to continue (continue_final_message) is text only; an image "
                            "cannot start the model's reply", param=at, code="unsupported_content")
    if reply.content is None:
        raise ApiError(400, f"messages[{last}].content: null; the assistant reply to continue needs its text (\"\" "
                            "starts it empty)", param=f"messages[{last}].content")
    return reply.text() or "", messages[:last]


def _images(messages: list[Message], limits: ChatLimits) -> tuple[tuple[bytes, ...], tuple[str | None, ...]]:
    """The last message's images, decoded, and the ``detail`` each asked for (earlier turns' images are refused:
    their text is kept as the question's history, what they showed is not)."""
    found, details = [], []
    for i, message in enumerate(messages):
        for j, part in message.images():
            at = f"messages[{i}].content[{j}]"
            if not limits.images:
                raise ApiError(400, f"{at}: image_url parts are not accepted: this server answers about its live "
                                    "camera (server.image_requests: false); send text only", param=at,
                               code="unsupported_content")
            if i != len(messages) - 1:
                raise ApiError(400, f"{at}: images are taken from the question (the last message) only", param=at)
            try:
                found.append(part.decoded())
            except PydanticCustomError as exc:
                raise ApiError(400, f"{at}.{exc.message()}", param=at, code="unsupported_content") from None
            details.append(part.image_url.detail)
    if len(found) > MAX_IMAGES:
        raise ApiError(400, f"messages: {len(found)} images; at most {MAX_IMAGES}", param="messages")
    return tuple(found), tuple(details)


def _history(messages: list[Message]) -> tuple[tuple[str, str], ...]:
    """The conversation before the question: the earlier user and assistant messages' text, in order (the
    session renders them after the video as the chat template does: ``StreamSession.ask(history=...)``).
    System and developer messages are not among them: the system prompt is ``model.system_prompt``, in the
    cache since the stream began. A ``tool`` message is refused (this server calls no tools)."""
    turns = []
    for index, message in enumerate(messages[:-1]):
        if message.role == "tool":
            raise ApiError(400, f"messages[{index}].role: 'tool' messages answer tool calls, and this server "
                                "makes none", param=f"messages[{index}].role")
        if message.role in ("user", "assistant"):
            text = message.text() or ""
            if message.role == "user" and not text.strip():
                raise ApiError(400, f"messages[{index}].content: an earlier user turn with no text",
                               param=f"messages[{index}].content")
            turns.append((message.role, text))
    if len(turns) > MAX_TURNS:
        raise ApiError(400, f"messages: {len(turns)} earlier user and assistant turns; at most {MAX_TURNS}",
                       param="messages")
    return tuple(turns)


def _question(messages: list[Message]) -> str:
    """The question is the last message, which must come from the user; the turns before it are its history
    (``_history``)."""
    last = len(messages) - 1
    if messages[last].role != "user":
        raise ApiError(400, f"messages[{last}].role: the last message must be the user's question, got "
                            f"{describe(messages[last].role)}", param=f"messages[{last}].role")
    question = (messages[last].text() or "").strip()
    if not question:
        raise ApiError(400, f"messages[{last}].content: empty; ask a question about the stream",
                       param=f"messages[{last}].content")
    return question


def validation_error(exc: ValidationError) -> ApiError:
    """pydantic's first complaint as an OpenAI error naming the field the way OpenAI does (``messages[0].role``)."""
    errors = exc.errors(include_url=False)
    # A value that fits no member of a union is reported once per member; the member that got furthest
    # into the value says most.
    error = max(errors, key=lambda e: len([part for part in e["loc"] if not _union_tag(part)]))
    kind, message = error["type"], error["msg"]
    if kind in ("unrecognized_argument", "unsupported_parameter"):  # a whole-request check names its field
        return ApiError(400, message, param=error["ctx"]["param"], code=kind)
    param = _param(error["loc"])
    if kind == "extra_forbidden":
        return ApiError(400, f"{param}: unrecognized field", param=param)
    if kind not in ("unsupported_content", "text_part", "window", "reply_field"):  # these say what was wrong themselves
        message = TYPE_WORDS.get(kind) or f"{message[0].lower()}{message[1:]}"
        message = f"{message}, got {describe(error.get('input'))}"
    return ApiError(400, f"{param}: {message}", param=param, code=kind if kind == "unsupported_content" else None)


TYPE_WORDS = {"bool_type": "expected a boolean", "int_type": "expected an integer", "float_type": "expected a number",
              "string_type": "expected a string", "list_type": "expected a list", "dict_type": "expected an object",
              "model_type": "expected an object", "model_attributes_type": "expected an object"}


def _union_tag(part: Any) -> bool:
    """pydantic names the member of a union it tried (``str``, ``list[TextPart]``) inside an error's location."""
    return isinstance(part, str) and (part in ("str", "none") or "[" in part or part[:1].isupper()
                                      or part.startswith(("constrained-", "function-")))


def _param(loc: tuple) -> str:
    if loc and loc[0] == "stop":  # one string or a list of them: OpenAI names the field, not the item
        return "stop"
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _union_tag(part):
            out += f".{safe_text(part)}" if out else safe_text(part)
    return out or "body"


# ---------------------------------------------------------------------------------------------- stop strings
def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could still be the start of a stop string (not sent yet)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
