"""OpenAI chat-completions requests, checked strictly: bytes -> JSON -> ``ChatRequest``, or an ``ApiError``
that names the field (OpenAI's ``param``) and becomes a 4xx in OpenAI's error shape.

Every field of the request is type-checked; fields this server cannot honour (tools, logprobs, n > 1,
images) are refused by name instead of being silently ignored, and unknown fields are refused the way
OpenAI refuses them ("Unrecognized request argument supplied"). Text must be valid Unicode: a lone
UTF-16 surrogate (``"\\ud800"``, valid JSON but not text) is refused here, at the boundary, so nothing
the daemon prints or tokenizes can meet one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

MAX_JSON_DEPTH = 32  # containers inside containers; a chat request needs 4
# Temperatures below this are greedy decoding (the limit of softmax(logits / T) as T -> 0): a float32
# division by a temperature near 1e-38 gives inf and NaN probabilities (found by the fuzz).
GREEDY_BELOW = 1e-6
MAX_STOP_STRINGS = 4  # OpenAI's limit
SEED_RANGE = (-(2**63), 2**63 - 1)
TEXT_PART_TYPES = ("text", "input_text")
MEDIA_PART_TYPES = ("image_url", "input_image", "video_url", "input_audio", "file", "audio_url")
ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted and ignored: they change nothing about an answer.
IGNORED = {"user": str, "store": bool, "metadata": dict, "prompt_cache_key": str, "safety_identifier": str}
# Accepted only at their neutral value (None always is); anything else is refused as unsupported.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "n": 1, "parallel_tool_calls": None,
           "top_logprobs": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
           "logit_bias": None, "audio": None, "prediction": None, "reasoning_effort": None, "service_tier": None,
           "web_search_options": None, "response_format": {"type": "text"}, "modalities": ["text"]}
SUPPORTED = ("messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream",
             "stream_options", "stop", "seed", "recall")


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


@dataclass(frozen=True)
class ChatLimits:
    served_model: str
    max_new_tokens: int  # server.max_new_tokens: the most a request may ask for
    default_new_tokens: int  # generation.max_new_tokens: when the request does not say


def parse_chat_request(body: Any, limits: ChatLimits) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {describe(body)}")
    for name, value in body.items():
        _check_field(name, value)
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise ApiError(400, f"model: expected a string, got {describe(model)}", param="model")
        if model != limits.served_model:
            raise ApiError(404, f"The model `{safe_text(model)}` does not exist: this server serves "
                                f"`{limits.served_model}` (GET /v1/models)", param="model", code="model_not_found")
    stream = _optional(body, "stream", bool, "a boolean", False)
    options = _optional(body, "stream_options", dict, "an object", None)
    if options is not None and not stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    include_usage = False
    if options is not None:
        for key, value in options.items():
            if key not in ("include_usage", "include_obfuscation"):
                raise ApiError(400, f"stream_options.{safe_text(key)}: unrecognized option",
                               param=f"stream_options.{safe_text(key)}")
            if value is not None and not isinstance(value, bool):
                raise ApiError(400, f"stream_options.{key}: expected a boolean, got {describe(value)}",
                               param=f"stream_options.{key}")
        include_usage = bool(options.get("include_usage"))
    return ChatRequest(
        question=_question(body.get("messages")),
        max_new_tokens=_max_tokens(body, limits),
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        stream=stream, include_usage=include_usage, stop=_stop(body.get("stop")), seed=_seed(body.get("seed")),
        recall=_optional(body, "recall", bool, "a boolean", None),
    )


def _check_field(name: str, value: Any) -> None:
    if name in SUPPORTED:
        return
    if name in IGNORED:
        if value is not None and not isinstance(value, IGNORED[name]):
            raise ApiError(400, f"{name}: expected {IGNORED[name].__name__}, got {describe(value)}", param=name)
        return
    if name in NEUTRAL:
        neutral = NEUTRAL[name]
        same = value is None or (value == neutral and type(value) is type(neutral)) or (
            isinstance(neutral, int) and not isinstance(neutral, bool) and isinstance(value, (int, float))
            and not isinstance(value, bool) and value == neutral)
        if not same:
            raise ApiError(400, f"{name}: not supported by this server (only {json.dumps(neutral)} or null), got "
                                f"{describe(value)}", param=name, code="unsupported_parameter")
        return
    raise ApiError(400, f"Unrecognized request argument supplied: {safe_text(name)}", param=safe_text(name),
                   code="unrecognized_argument")


def _optional(body: dict, name: str, kind: type, kind_name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"{name}: expected {kind_name}, got {describe(value)}", param=name)
    return value


def _max_tokens(body: dict, limits: ChatLimits) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return min(limits.default_new_tokens, limits.max_new_tokens)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limits.max_new_tokens:
        raise ApiError(400, f"{name}: must be an integer from 1 to {limits.max_new_tokens} (this server's limit, "
                            f"server.max_new_tokens), got {describe(value)}", param=name)
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"{name}: must be a number in {span}, got {describe(value)}", param=name)
    return float(value)


def _temperature(body: dict) -> float | None:
    value = _number(body, "temperature", 0.0, 2.0, low_open=False)
    return 0.0 if value is not None and value < GREEDY_BELOW else value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: expected a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty "
                            f"strings, got {describe(value)}", param="stop")
    return tuple(stops)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise ApiError(400, f"seed: expected a 64-bit integer, got {describe(value)}", param="seed")
    return value


def _question(messages: Any) -> str:
    """The question is the last message, which must come from the user; earlier turns are checked, not used
    (the stream itself is the context)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages: expected a non-empty list of messages, got {describe(messages)}",
                       param="messages")
    texts = [_message_text(message, f"messages[{i}]") for i, message in enumerate(messages)]
    last = len(messages) - 1
    if messages[last]["role"] != "user":
        raise ApiError(400, f"messages[{last}].role: the last message must be the user's question, got "
                            f"{describe(messages[last]['role'])}", param=f"messages[{last}].role")
    question = (texts[last] or "").strip()
    if not question:
        raise ApiError(400, f"messages[{last}].content: empty; ask a question about the stream",
                       param=f"messages[{last}].content")
    return question


def _message_text(message: Any, at: str) -> str | None:
    if not isinstance(message, dict):
        raise ApiError(400, f"{at}: expected an object with role and content, got {describe(message)}", param=at)
    for key in message:
        if key not in ("role", "content", "name"):
            raise ApiError(400, f"{at}.{safe_text(key)}: unrecognized message field (role, content, name)",
                           param=f"{at}.{safe_text(key)}")
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{at}.role: expected one of {', '.join(ROLES)}, got {describe(role)}", param=f"{at}.role")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, f"{at}.name: expected a string, got {describe(name)}", param=f"{at}.name")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{at}.content: expected a string or a list of parts, got {describe(content)}",
                       param=f"{at}.content")
    return "\n".join(_part_text(part, f"{at}.content[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in MEDIA_PART_TYPES:
        raise ApiError(400, f"{at}: {kind} parts are not accepted: this server answers about its live camera, "
                            "send text only", param=at, code="unsupported_content")
    if kind not in TEXT_PART_TYPES or set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise ApiError(400, f"{at}: expected {{\"type\": \"text\", \"text\": \"...\"}}, got {describe(part)}",
                       param=at)
    return part["text"]


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


# ---------------------------------------------------------------------------------------------- schema
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"enum": list(TEXT_PART_TYPES)}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
    "role": {"enum": list(ROLES)}, "name": {"type": "string"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}}}
# The request as documented in /openapi.json (parse_chat_request is the check; this is its description).
CHAT_REQUEST_SCHEMA = {
    "type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE,
                     "description": "the last message is the user's question about the stream"},
        "model": {"type": "string", "description": "the served model's id (GET /v1/models), or omitted"},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "description": "at most server.max_new_tokens"},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1,
                                                                  "maxItems": MAX_STOP_STRINGS,
                                                                  "items": {"type": "string", "minLength": 1}},
                           {"type": "null"}]},
        "seed": {"type": ["integer", "null"], "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
        "n": {"enum": [1, None]}, "user": {"type": "string"},
    },
}
