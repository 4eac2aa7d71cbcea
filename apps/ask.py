"""``edgekv ask QUESTION``: ask the daemon running on this machine (or at ``--url``) through its HTTP API
(``POST /v1/chat/completions``) and print the answer; ``--stream`` prints its tokens as they are decoded.
``edgekv ask --fleet`` asks every device over MQTT instead (apps/outputs/mqtt.py). Also the one HTTP client of the
other commands that talk to a running daemon (``edgekv forget``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def daemon_request(url: str, path: str, body: dict, token: str | None, timeout: float):
    """``POST url+path`` with ``body`` as JSON (``token`` as the bearer token when there is one); the open
    response. An HTTP error is a ``ValueError`` with the server's message, an unreachable daemon an ``OSError``."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ValueError(f"{url}: HTTP {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise OSError(f"{url}: the daemon is not reachable ({exc.reason}); is it running (edgekv serve / "
                      f"edgekv-camera), with its server on? --fleet asks the fleet over MQTT") from None


def add_local_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of asking one daemon over HTTP (beside ``--fleet``'s)."""
    local = parser.add_argument_group("without --fleet: the daemon on this machine, over HTTP")
    local.add_argument("--url", default=None, help="the daemon's HTTP address (default: server.host:port of "
                                                   "--config, else http://127.0.0.1:8080)")
    local.add_argument("--token-env", default=None,
                       help="environment variable holding the daemon's token (default: --config's server.token or "
                            "server.token_env, else EDGEKV_TOKEN)")
    local.add_argument("--stream", action="store_true",
                       help="print the answer's tokens as they are decoded (one camera: --camera, or its name first)")


def daemon_target(config_path: str | None, token_env: str | None = None) -> tuple[str, str | None]:
    """The HTTP address of the daemon a config deploys (one bound to every address is asked on this machine) and
    its token: ``token_env``'s value when given, else the config's ``server.token`` or ``server.token_env``'s."""
    from edgekv.config import ServerSection, load_config

    server = load_config(config_path).server if config_path is not None else ServerSection()
    host = "127.0.0.1" if server.host in ("0.0.0.0", "", "::") else server.host
    token = os.environ.get(token_env) if token_env else server.token or os.environ.get(server.token_env)
    return f"http://{f'[{host}]' if ':' in host else host}:{server.port}", token or None


def run(args: argparse.Namespace) -> int:
    """Prints the answer (``--json``: the whole chat.completion); exit 0 once answered."""
    url, token = daemon_target(args.config, args.token_env)
    args.url = args.url or url
    body: dict = {"messages": [{"role": "user", "content": args.question}]}
    if args.max_new_tokens is not None:
        body["max_tokens"] = args.max_new_tokens
    if args.camera is not None:
        body["camera"] = args.camera
    timeout = max(args.timeout, 1.0)
    if args.stream and not args.json:
        body["stream"] = True
        with daemon_request(args.url, "/v1/chat/completions", body, token, timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                for choice in chunk.get("choices") or ():
                    sys.stdout.write((choice.get("delta") or {}).get("content") or "")
                    sys.stdout.flush()
        print()
        return 0
    with daemon_request(args.url, "/v1/chat/completions", body, token, timeout) as response:
        result = json.loads(response.read())
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(result["choices"][0]["message"]["content"])
    return 0
