"""``edgekv ask QUESTION``: ask the daemon running on this machine (or at ``--url``) through its HTTP API
(``POST /v1/chat/completions``) and print the answer; ``--stream`` prints its tokens as they are decoded.
``edgekv ask --fleet`` asks every device over MQTT instead (apps/outputs/mqtt.py). Also the one HTTP client of the
other commands that talk to a running daemon (``edgekv forget``)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from edgekv.apps.questions import printable
from edgekv.apps.wall_times import cli_bound, cli_window, wall_text


def daemon_request(url: str, path: str, body: dict, token: str | None, timeout: float, context=None):
    """``POST url+path`` with ``body`` as JSON (``token`` as the bearer token when there is one; ``context``: the TLS
    of an ``https://`` daemon, ``apps/server/tls.py``); the open response. An HTTP error is a ``ValueError`` with the
    server's message, an unreachable daemon an ``OSError``."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    try:
        return urllib.request.urlopen(request, timeout=timeout, context=context)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ValueError(f"{url}: HTTP {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        from edgekv.apps.server.tls import tls_failure

        failure = tls_failure(exc.reason)
        if failure is not None:
            raise OSError(f"{url}: {failure}") from None
        raise OSError(f"{url}: the daemon is not reachable ({exc.reason}); is it running (edgekv serve / "
                      f"edgekv-camera), with its server on? --fleet asks the fleet over MQTT") from None
    except TimeoutError:
        raise OSError(f"{url}: no reply within {timeout:g} s (--timeout)") from None
    except (ConnectionError, http.client.HTTPException) as exc:  # reset, refused mid-way, a malformed status line
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        hint = ("; a daemon serving HTTPS (server.tls_cert_file) is asked at https://" if url.startswith("http:")
                else "; does it require a client certificate (server.tls_client_ca_file)? give --cert-file and "
                     "--key-file")
        raise OSError(f"{url}: the connection broke off ({why}){hint}") from None


def _not_an_answer(url: str, what: str) -> ValueError:
    return ValueError(f"{url}: {what}; is this an edgekv daemon's address (edgekv serve / edgekv-camera)?")


FAILED = "the answer failed: "  # how the daemon's error event of an answer that failed mid-stream begins


def _stream_answer(url: str, response, timeout: float) -> dict | None:
    """Prints the answer's tokens as the daemon's server-sent events bring them; returns the ``edgekv`` figures of
    its last chunk (where the request asked for them, else None). An ``error`` event (the answer
    failed mid-way: the status line was long sent) and a stream that ends before ``[DONE]`` are errors, as is a
    reply that is not an event stream."""
    kind = response.headers.get("content-type", "")
    if not kind.startswith("text/event-stream"):
        raise _not_an_answer(url, f"the reply is {kind or 'untyped'}, not an answer stream")
    done = printed = False
    extension = None
    try:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                done = True
                break
            try:
                chunk = json.loads(line[len("data:"):])
            except ValueError:
                raise _not_an_answer(url, f"a stream event that is not JSON ({line[:80]!r})") from None
            if not isinstance(chunk, dict):
                raise _not_an_answer(url, f"a stream event that is not an object ({line[:80]!r})")
            if "error" in chunk:
                error = chunk["error"]
                message = str(error.get("message") if isinstance(error, dict) else error)
                # the daemon's own message already says "the answer failed: ..." (apps/server/chat.answer_error)
                why = message.removeprefix(FAILED)
                raise ValueError(f"{url}: the answer failed on the way: {why}")
            if isinstance(chunk.get("edgekv"), dict):  # the last chunk's, when the request asked for evidence
                extension = chunk["edgekv"]
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                sys.stdout.write(piece)
                sys.stdout.flush()
                printed = printed or bool(piece)
    except TimeoutError:
        raise OSError(f"{url}: the answer stopped coming for {timeout:g} s (--timeout)") from None
    except (ConnectionError, http.client.HTTPException) as exc:
        raise OSError(f"{url}: the answer stream broke off ({type(exc).__name__})") from None
    finally:
        if printed:
            print()  # the answer so far ends its line, whatever comes after
    if not done:
        raise OSError(f"{url}: the daemon closed the stream before the answer ended (no [DONE])")
    return extension


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
    local.add_argument("--chat", action="store_true",
                       help="go on asking the lines typed after the question (or without one), each with the "
                            "conversation so far; an empty line ends it")
    local.add_argument("--last", type=float, metavar="SECONDS", default=None,
                       help="read only the last so many seconds of the stream (the chat API's window.last_s; with "
                            "--fleet, of each device's stream)")
    local.add_argument("--from", dest="t_from", type=cli_bound, metavar="T0", default=None,
                       help="read only the stream from T0 to --to: stream seconds (as edgekv forget takes them), or "
                            "wall times: 10:03 (today, local time), 2026-12-04T10:03:00+01:00 (with --fleet: wall "
                            "times, what each device saw then)")
    local.add_argument("--to", dest="t_to", type=cli_bound, metavar="T1", default=None, help="with --from")
    local.add_argument("--evidence", type=int, nargs="?", const=1, default=None, metavar="K",
                       help="after the answer, when it was seen: the K frame pairs (default 1, at most 8) the "
                            "question attended most, each with its wall time and stream time (the chat API's "
                            "evidence; --fleet answers always carry one)")


def daemon_target(config_path: str | None, token_env: str | None = None) -> tuple[str, str | None]:
    """The HTTP address of the daemon a config deploys (one bound to every address is asked on this machine) and
    its token: ``token_env``'s value when given, else the config's ``server.token`` or ``server.token_env``'s."""
    from edgekv.config import ServerSection, load_config

    server = load_config(config_path).server if config_path is not None else ServerSection()
    host = "127.0.0.1" if server.host in ("0.0.0.0", "", "::") else server.host
    token = os.environ.get(token_env) if token_env else server.token or os.environ.get(server.token_env)
    scheme = "https" if server.tls_cert_file is not None else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{server.port}", token or None


def daemon_certificate(config_path: str | None) -> str | None:
    """The certificate the daemon of this config serves over HTTPS (None: plain HTTP, or no config): the one
    certificate trusted when asking it through its config (apps/server/tls.py's ``client_context``)."""
    from edgekv.config import load_config

    return load_config(config_path).server.tls_cert_file if config_path is not None else None


def _tls_context(args: argparse.Namespace, pinned: str | None):
    """The TLS context of ``args.url`` (None for http://) from ``--ca-file`` / ``--cert-file`` / ``--key-file``."""
    from edgekv.apps.server.tls import client_context

    return client_context(args.url, getattr(args, "ca_file", None), getattr(args, "cert_file", None),
                          getattr(args, "key_file", None), pinned)


def question_window(last: float | None, t_from: float | None, t_to: float | None) -> dict | None:
    """``--last`` or ``--from``/``--to`` as the chat API's ``window`` (None: the whole memory); the daemon checks
    the numbers, this only that one way is given whole."""
    if last is not None and (t_from is not None or t_to is not None):
        raise ValueError("--last, or --from and --to, not both")
    if (t_from is None) != (t_to is None):
        raise ValueError("--from and --to go together (stream seconds or wall times)")
    if last is not None:
        return {"last_s": last}
    if t_from is None:
        return None
    t_from, t_to = cli_window(t_from, t_to)  # wall times read together, sent with this machine's UTC offset
    return {"from": t_from, "to": t_to}


MAX_FRAME_BYTES = 16 << 20  # an evidence frame fetched by --frames is read up to this (a JPEG of 4096 px is < 8 MiB)
CHAT_EXCHANGES = 8  # question-and-answer pairs ``--chat`` sends as the conversation (the daemon takes at most 64 turns)


def run(args: argparse.Namespace) -> int:
    """Prints the answer (``--json``: the whole chat.completion); exit 0 once answered. ``--chat``: goes on asking
    the lines typed after it, each with the conversation so far (``chat``)."""
    url, token = daemon_target(args.config, args.token_env)
    pinned = daemon_certificate(args.config) if args.url is None else None  # the daemon's own, on this machine
    args.url = args.url or url
    args.tls_context = _tls_context(args, pinned)
    body: dict = {}
    if args.max_new_tokens is not None:
        body["max_tokens"] = args.max_new_tokens
    if args.camera is not None:
        body["camera"] = args.camera
    window = question_window(args.last, args.t_from, args.t_to)
    if window is not None:
        body["window"] = window
    if getattr(args, "evidence", None) is not None:
        body["evidence"] = args.evidence  # the daemon checks the number (0-8) and names what was wrong
    frames = getattr(args, "frames", None)
    if frames is not None:  # the evidence frames saved here: the evidence is asked for (one pair unless --evidence)
        Path(frames).mkdir(parents=True, exist_ok=True)  # before asking: a folder that cannot be made is said first
        body.setdefault("evidence", 1)
    timeout = max(args.timeout, 1.0)
    if getattr(args, "chat", False):
        if args.stream or args.json:
            raise ValueError("--chat prints each answer when it is whole: without --stream or --json")
        return chat(args, token, body, timeout)
    if not args.question:
        raise ValueError("a question is needed (or --chat to type them one after another)")
    body["messages"] = [{"role": "user", "content": args.question}]
    if args.stream and not args.json:
        body["stream"] = True
        with daemon_request(args.url, "/v1/chat/completions", body, token, timeout, args.tls_context) as response:
            extension = _stream_answer(args.url, response, timeout)
        for line in evidence_lines(extension, args.url) + save_evidence_frames(args.url, token, extension, frames,
                                                                                timeout, args.tls_context):
            print(line)
        return 0
    result = _completion(args.url, body, token, timeout, args.tls_context)
    saved = save_evidence_frames(args.url, token, result.get("edgekv"), frames, timeout, args.tls_context)
    print(json.dumps(result, indent=2) if args.json else _content(args.url, result))
    if not args.json:
        for line in evidence_lines(result.get("edgekv"), args.url) + saved:
            print(line)
    return 0


def save_evidence_frames(url: str, token: str | None, extension, folder: str | None, timeout: float,
                         context=None) -> list[str]:
    """``--frames DIR``: each evidence frame the daemon still keeps fetched (``GET /frame.jpg?...``) and written to
    ``folder`` as ``pairN.jpg`` (``CAMERA-pairN.jpg`` with several cameras; names made safe: the daemon's text is not
    trusted); each evidence item gets its ``frame_file`` (None where none was saved). Lines to print: each file, or
    why a frame was not saved."""
    items = extension.get("evidence") if isinstance(extension, dict) else None
    if folder is None or not isinstance(items, list):
        return []
    lines = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item["frame_file"] = None
        pair, frame = item.get("pair"), item.get("frame")
        label = pair if isinstance(pair, int) and not isinstance(pair, bool) else "unknown"
        if not isinstance(frame, str) or not frame.startswith("/frame.jpg?"):
            lines.append(f"  frame of pair {printable(str(label), 40)}: no longer kept by the daemon, not saved")
            continue
        try:
            data = _get(url, frame, token, timeout, context)
        except (OSError, ValueError) as exc:
            lines.append(printable(f"  frame of pair {label}: not saved ({exc})"))
            continue
        if data[:2] != b"\xff\xd8":
            lines.append(f"  frame of pair {label}: not saved (the reply is not a JPEG)")
            continue
        camera = urllib.parse.parse_qs(urllib.parse.urlsplit(frame).query).get("camera", [""])[0]
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", camera)[:60].strip("._-")
        path = Path(folder) / f"{stem + '-' if stem else ''}pair{label}.jpg"
        path.write_bytes(data)
        item["frame_file"] = str(path)
        lines.append(printable(f"  frame of pair {label} saved: {path}"))
    return lines


def _get(url: str, path: str, token: str | None, timeout: float, context=None) -> bytes:
    """``GET url+path`` (the bearer token when there is one): the body; an HTTP error a ``ValueError``."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            data = response.read(MAX_FRAME_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
        raise OSError(f"{type(exc).__name__}") from None
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"larger than {MAX_FRAME_BYTES >> 20} MiB")
    return data


def evidence_lines(extension, url: str = "") -> list[str]:
    """The answer's evidence (the chat API's ``edgekv.evidence``) as lines to print under it: when each frame pair
    the question attended most was seen, by the wall clock where the daemon knows it and always in stream time, and
    the address of its frame while the daemon keeps it."""
    items = extension.get("evidence") if isinstance(extension, dict) else None
    if not isinstance(items, list):
        return []
    if not items:
        return ["  evidence: none (no frame pair of the stream was read for this answer)"]
    lines = []
    for item in items:
        if not isinstance(item, dict):
            continue
        pair, t, unix = item.get("pair"), item.get("t"), item.get("unix")
        try:
            when = f"seen {wall_text(unix)}, " if isinstance(unix, (int, float)) else ""
        except (OverflowError, OSError, ValueError):  # not a time this machine's clock can show
            when = ""
        stream = f"stream {t:.1f} s" if isinstance(t, (int, float)) else "stream time unknown"
        frame = item.get("frame")
        shown = f"; {url.rstrip('/')}{frame}" if isinstance(frame, str) and frame.startswith("/") else ""
        lines.append(printable(f"  evidence: {when}{stream} (frame pair {pair}{shown})"))  # the daemon's text
    return lines


def chat(args: argparse.Namespace, token: str | None, body: dict, timeout: float, lines=None) -> int:
    """A conversation from the shell: the question given (if any), then each line read from ``lines`` (stdin) is
    asked with the last ``CHAT_EXCHANGES`` questions and answers before it as its history ("And where did it go?");
    an empty line or the end of the input ends it. A question the daemon refuses is said and left out of the
    conversation; a daemon that cannot be reached ends it (exit 2, as for one question)."""
    lines = sys.stdin if lines is None else lines
    history: list[dict] = []
    pending = args.question
    while True:
        if pending is None:
            if sys.stdout.isatty():
                print("> ", end="", flush=True)
            line = lines.readline()
            if not line.strip():
                return 0
            pending = line.strip()
        question, pending = pending, None
        asked = {**body, "messages": [*history, {"role": "user", "content": question}]}
        try:
            result = _completion(args.url, asked, token, timeout, getattr(args, "tls_context", None))
            answer = _content(args.url, result)
        except ValueError as exc:  # refused (too long, a window of nothing held...): said, the chat goes on
            print(f"edgekv ask: {exc}", file=sys.stderr)
            continue
        saved = save_evidence_frames(args.url, token, result.get("edgekv"), getattr(args, "frames", None), timeout,
                                     getattr(args, "tls_context", None))
        print("\n".join([answer, *evidence_lines(result.get("edgekv"), args.url), *saved]), flush=True)
        history = [*history, {"role": "user", "content": question},
                   {"role": "assistant", "content": answer}][-2 * CHAT_EXCHANGES:]


def _completion(url: str, body: dict, token: str | None, timeout: float, context=None) -> dict:
    with daemon_request(url, "/v1/chat/completions", body, token, timeout, context) as response:
        try:
            return json.loads(response.read())
        except TimeoutError:
            raise OSError(f"{url}: no answer within {timeout:g} s (--timeout)") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise OSError(f"{url}: the answer broke off ({type(exc).__name__})") from None
        except ValueError:
            raise _not_an_answer(url, "the reply is not JSON") from None


def _content(url: str, result: dict) -> str:
    try:
        return result["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise _not_an_answer(url, "the reply is JSON but not a chat.completion") from None
