"""A bounded fuzz of the HTTP API on 127.0.0.1 (hypothesis): random methods, paths, headers and bodies
(chat-shaped JSON with wrong types and huge numbers, arbitrary JSON, deep nesting, raw bytes, lone
surrogates). Every response must be a status /openapi.json declares for the route (no 500, no
undeclared 5xx), every error an OpenAI error object, every stream complete, and the daemon alive at the
end. EDGEKV_FUZZ_EXAMPLES sets the number of requests (CI: a small run of a few seconds);
EDGEKV_FUZZ_REPORT=FILE writes the counts as JSON."""

from __future__ import annotations

import collections
import http.client
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_server import RunningDaemon, call, server_config

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

EXAMPLES = int(os.environ.get("EDGEKV_FUZZ_EXAMPLES", "120"))
KNOWN_PATHS = ["/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/", "/frame.jpg", "/v1/edgekv/status",
               "/v1/edgekv/login", "/v1/edgekv/logout", "/openapi.json"]
ROUTE_INDEPENDENT = {400, 401, 403, 404, 405, 408, 413, 415, 503}  # the guard and the router, on any path


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    config = server_config(tiny_checkpoint, max_new_tokens=2, queue_size=64, request_timeout_s=5.0)
    with RunningDaemon(config, tmp_path_factory.mktemp("fuzz") / "out.txt") as run:
        yield run


@pytest.fixture(scope="module")
def declared(running) -> dict[tuple[str, str], set[int]]:
    """(method, path template) -> the statuses /openapi.json declares."""
    status, _, body = call(running.port, "GET", "/openapi.json")
    assert status == 200
    spec = json.loads(body)
    routes = {}
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            routes[(method.upper(), path)] = {int(code) for code in operation["responses"]}
    # the schema does not list its own route (random draws of HEAD /openapi.json and HEAD /healthz -> 200 failed
    # this test on 2026-11-26 though nothing was wrong: HEAD is judged as GET below)
    routes[("GET", "/openapi.json")] = {200}
    return routes


def _statuses_for(declared: dict, method: str, path: str) -> set[int]:
    method = "GET" if method == "HEAD" else method  # HEAD may answer wherever GET does (RFC 9110 9.3.2)
    for (m, template), codes in declared.items():
        if m == method and (template == path or (template.endswith("{model}") and path.startswith(template[:-7])
                                                 and len(path) > len(template) - 7)):
            return codes | ROUTE_INDEPENDENT
    return ROUTE_INDEPENDENT  # unknown route or method: 404/405 and the guard's refusals only


# ---------------------------------------------------------------------------------------------- strategies
weird_text = st.lists(st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\x00", "<|im_end|>"])),
                      max_size=30).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.integers(), st.floats(allow_nan=False),
                    st.just(10**300), weird_text)
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=4) |
                           st.dictionaries(weird_text, children, max_size=4), max_leaves=12)
content = st.one_of(weird_text, st.just("What moved?"), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text", "x"]), "text": scalars}),
    json_values), max_size=3), scalars)
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", 5]),
                                           "content": content},
                                          optional={"name": scalars, "junk": json_values}), json_values)
chat_body = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(st.lists(message, min_size=1, max_size=3),
                          st.just([{"role": "user", "content": "What moved?"}]), json_values),
    "model": st.one_of(st.just("edgekv/ckpt"), weird_text, scalars),
    "max_tokens": st.one_of(st.integers(-3, 5), scalars), "max_completion_tokens": scalars,
    "temperature": st.one_of(st.floats(0, 2), scalars), "top_p": st.one_of(st.floats(0, 1), scalars),
    "stream": st.one_of(st.booleans(), scalars), "stop": st.one_of(st.lists(weird_text, max_size=5), scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "seed": scalars, "n": scalars, "user": scalars, "tools": json_values, "extra_field": json_values,
    "evidence": st.one_of(st.integers(-2, 10), scalars),
    "continue_final_message": st.one_of(st.booleans(), scalars),
    "add_generation_prompt": st.one_of(st.booleans(), scalars),
})


valid_chat = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
    "role": st.just("user"), "content": st.text(min_size=1, max_size=40).filter(str.strip)}), min_size=1, max_size=2)},
    optional={"max_tokens": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "stream": st.booleans(), "seed": st.integers(-(2**63), 2**63 - 1),
              "stop": st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=4),
              "evidence": st.integers(0, 8)})


@st.composite
def valid_requests(draw):
    """Requests that should succeed (so the fuzz reaches the answer path too)."""
    if draw(st.booleans()):
        body = draw(valid_chat)
        if body.get("stream") and draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
        if draw(st.booleans()):  # a reply to continue (vLLM's continue_final_message)
            body["messages"].append({"role": "assistant", "content": draw(st.text(max_size=20))})
            body["continue_final_message"] = True
        return "POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    path = draw(st.sampled_from(["/v1/models", "/healthz", "/metrics", "/", "/frame.jpg", "/v1/edgekv/status",
                                 "/openapi.json"]))
    return "GET", path, None, {}


@st.composite
def random_requests(draw):
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    path = draw(st.one_of(st.sampled_from(KNOWN_PATHS), st.sampled_from(KNOWN_PATHS).map(lambda p: p + "/x"),
                          st.text("abcdefghij/._-%~", min_size=1, max_size=20).map(lambda p: "/" + p),
                          weird_text.map(lambda t: "/v1/models/" + t.encode("utf-8", "replace").hex())))
    kind = draw(st.sampled_from(["chat", "chat", "json", "deep", "bytes", "none", "token"]))
    if kind == "chat":
        body = json.dumps(draw(chat_body)).encode()
    elif kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "deep":
        depth = draw(st.integers(1, 3000))
        body = b'{"messages":' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "bytes":
        body = draw(st.binary(max_size=200))
    elif kind == "token":
        body = json.dumps({"token": draw(scalars)}).encode()
    else:
        body = None
    headers = {}
    content_type = draw(st.sampled_from(["application/json", "application/json", "application/json; charset=utf-8",
                                         "text/plain", None]))
    if content_type:
        headers["Content-Type"] = content_type
    if draw(st.integers(0, 9)) == 0:
        headers["Origin"] = draw(st.sampled_from(["http://evil.example", "null", "http://127.0.0.1"]))
    if draw(st.integers(0, 9)) == 0:
        headers["Host"] = draw(st.sampled_from(["evil.example", "localhost", "[::1]"]))
    return method, path, body, headers


# ---------------------------------------------------------------------------------------------- the fuzz
def send(port: int, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_fuzz_the_api(running, declared):
    counts: collections.Counter = collections.Counter()
    undeclared: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(st.one_of(valid_requests(), random_requests()))
    def one(request):
        method, path, body, headers = request
        status, response_headers, data = send(running.port, method, path, body, headers)  # an exception = a crash
        counts[status] += 1
        allowed = _statuses_for(declared, method, path.split("?")[0])
        if status not in allowed and not (status == 200 and method != "HEAD"):
            undeclared.append(f"{method} {path} -> {status}")
        assert status < 500 or status in allowed, f"{method} {path} -> {status}: {data[:300]!r}"
        if status >= 400 and method != "HEAD":
            error = json.loads(data)["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
        if status == 200 and response_headers.get("content-type", "").startswith("text/event-stream"):
            assert data.endswith(b"data: [DONE]\n\n"), data[-200:]

    one()
    total = sum(counts.values())
    summary = {"requests": total, "by_status": dict(sorted(counts.items())), "undeclared": undeclared,
               "server_errors_5xx": sum(n for s, n in counts.items() if s >= 500)}
    print("fuzz:", json.dumps(summary))
    if os.environ.get("EDGEKV_FUZZ_REPORT"):
        with open(os.environ["EDGEKV_FUZZ_REPORT"], "w") as out:
            json.dump(summary, out, indent=2)
    assert not undeclared, undeclared[:10]
    assert counts[500] == 0
    assert running.thread.is_alive() and call(running.port, "GET", "/healthz")[0] == 200
    assert counts[200] > 0 and sum(n for s, n in counts.items() if 400 <= s < 500) > 0  # both sides were reached
