"""``edgekv-camera`` (and ``edgekv serve``): watch a camera, file, RTSP stream, GStreamer pipeline or
synthetic video and answer questions about anything seen so far, inside the hard cache cap.

This module holds what the daemon, the HTTP server and the voice loop share (``Question``, the
refusals a caller maps to HTTP 503, ``printable``) and the command line; ``edgekv.apps.daemon`` holds
the main loop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgekv.threads import prepare_process, threads_argument

RANDOM_WEIGHTS_NOTE = (
    "NOTE: {path} holds random weights (made by `edgekv make-tiny-checkpoint`): answers are meaningless text.\n"
    "      Point model.path at a real Qwen2.5-VL checkpoint directory for real answers."
)
_question_ids = itertools.count(1)


@dataclass
class Question:
    """A question waiting for the main loop; ``done`` is set when ``answer`` or ``error`` is filled.

    ``source`` says where it came from: ``cli`` (``--ask``), ``stdin``, ``http``, ``voice``. ``on_token``
    is called with each answer token id from the main loop's thread.
    """

    text: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    recall: bool | None = None  # recall archived frame pairs (None: archive.recall when an archive is set)
    on_token: object = None
    source: str = "cli"
    answer: object = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=lambda: next(_question_ids))
    asked_at: float = field(default_factory=time.time)
    answered_at: float | None = None


class QuestionRefused(Exception):
    """The daemon will not answer this question now; nothing is wrong with it (HTTP: 503)."""

    status = 503


class DaemonBusy(QuestionRefused, queue.Full):
    """``server.queue_size`` questions are already waiting: retry shortly. (A ``queue.Full`` too.)"""


class DaemonStopping(QuestionRefused):
    """The daemon is shutting down (SIGTERM): it takes no new question and refuses the queued ones."""


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def printable(text: str, limit: int | None = 400) -> str:
    """``text`` made safe for one terminal or log line: newlines, terminal escape sequences, lone
    surrogates and every other non-printable character become backslash escapes (and a backslash
    itself doubles), so request text can neither crash an encoder nor forge a line like ``A: …``.
    Longer than ``limit`` characters: cut, saying how long it was."""
    if limit is not None and len(text) > limit:
        return printable(text[:limit], None) + f"… ({len(text)} characters)"
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop finishes its current step and exits cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (tests, another app): the owner stops the loop through ``event``
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()


def is_random_checkpoint(model_dir: Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("edgekv_random_weights"))


def format_pair(result, stats: dict) -> str:
    return (
        f"pair {result.pair_index:5d}  ingest {result.ms:7.1f} ms (vision {result.vision_ms:6.1f}, prefill "
        f"{result.prefill_ms:6.1f}, compress {result.compression_ms:6.1f})  cache {stats['cache_tokens']}/"
        f"{stats['cache_capacity_tokens']} tokens, {stats['cache_capacity_bytes'] / 2**20:.2f} MiB  "
        f"compressions {stats['compressions']}"
    )


def format_answer(question: Question) -> str:
    """What the daemon prints for a finished question; every piece of request text is escaped."""
    asked = f"Q [{question.source}]: {printable(question.text)}"
    if question.error is not None:
        return f"{asked}\n   refused: {printable(str(question.error))}"
    a = question.answer
    # one token is all prefill: there is no decode step to time
    rate = f"{a.decode_tok_s:.1f} tok/s" if len(a.token_ids) > 1 else "no decode step"
    return (f"{asked}\nA: {printable(a.text, limit=4000)}\n   ({len(a.token_ids)} tokens, ttft {a.ttft_s * 1e3:.0f} ms, "
            f"{rate}, over {a.video_tokens} cached tokens)")


# ---------------------------------------------------------------------------------------------- command line
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default when it has a meaningful one (not None, False or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" not in text and default not in (None, False, [], argparse.SUPPRESS)
                and action.option_strings and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


def add_config_arguments(parser: argparse.ArgumentParser, model_positional: bool) -> None:
    """Where the deployment comes from: an optional YAML file, then flags that override its keys."""
    from edgekv.config import POLICIES, EdgeKVConfig

    group = parser.add_argument_group("deployment (a YAML file, and flags that override its keys)")
    if model_positional:
        group.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                           help="Qwen2.5-VL checkpoint directory (model.path); optional with --config")
    group.add_argument("--config", help="deployment YAML; defaults apply without one")
    group.add_argument("--model", dest="model_flag", metavar="DIR", help="checkpoint directory (model.path)")
    group.add_argument("--source", help="video.source: camera index, file, rtsp://..., gst:..., csi:N or synthetic:...")
    group.add_argument("--fps", type=float, help="video.fps: frames sampled per second")
    group.add_argument("--resolution", type=int, nargs=2, metavar=("H", "W"), help="video.resolution (multiples of 28)")
    group.add_argument("--loop", action="store_true", default=None, help="video.loop: play a file again at its end")
    group.add_argument("--policy", choices=POLICIES, help="cache.policy")
    group.add_argument("--max-tokens", type=int, help="cache.max_tokens: the hard cache cap M in tokens")
    group.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="model.dtype")
    group.add_argument("--device", help="model.device: auto, cpu, cuda or cuda:N")
    group.add_argument("--host", help="server.host: address the HTTP API binds")
    group.add_argument("--port", type=int, help="server.port (0: any free port)")
    group.add_argument("--max-new-tokens", type=int, help="generation.max_new_tokens: answer length")
    group.add_argument("--threads", type=threads_argument, metavar="N|auto",
                       help="runtime.threads: torch CPU threads")
    group.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="any other config key, value in YAML (repeatable), e.g. --set cache.sinks=1024")
    defaults = EdgeKVConfig().to_dict()
    for action in group._group_actions:  # say what applies when neither the flag nor the file sets the key
        key = _FLAG_KEYS.get(action.dest)
        if key is not None:
            section, name = key.split(".")
            action.help += f" (default: {_flow(defaults[section][name])} unless --config sets it)"


def _flow(value) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, list) else str(value).lower() \
        if isinstance(value, bool) else str(value)


_FLAG_KEYS = {"source": "video.source", "fps": "video.fps", "resolution": "video.resolution", "loop": "video.loop",
              "policy": "cache.policy", "max_tokens": "cache.max_tokens", "dtype": "model.dtype",
              "device": "model.device", "host": "server.host", "port": "server.port",
              "max_new_tokens": "generation.max_new_tokens", "threads": "runtime.threads"}


def config_from_args(args: argparse.Namespace):
    """The deployment: ``--config`` (or the defaults), then the flags, then ``--set``; ConfigError names
    the key. Paths given on the command line are relative to the current directory."""
    from edgekv.config import ConfigError, EdgeKVConfig, assignment_sections, load_config

    config = load_config(args.config) if getattr(args, "config", None) else EdgeKVConfig()
    sections: dict[str, dict] = {}
    model_dir = getattr(args, "model_dir", None) or getattr(args, "model_flag", None)
    if model_dir:
        sections["model"] = {"path": str(Path(model_dir).expanduser().resolve())}
    for flag, key in _FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if flag == "source" and not value.strip().isdigit() and Path(value).expanduser().is_file():
            value = str(Path(value).expanduser().resolve())
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = list(value) if isinstance(value, list) else value
    for section, values in assignment_sections(getattr(args, "set", None) or []).items():
        sections.setdefault(section, {}).update(values)
    if sections:  # one validation over flags and --set together (max_tokens and text_reserve_tokens go in pairs)
        config = config.with_overrides(label="command line", **sections)
    if config.model.path is None:
        raise ConfigError("model.path: no model directory: give MODEL_DIR (or --model DIR, or model.path in --config)")
    return config


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    """How the daemon runs (not part of the deployment config)."""
    group = parser.add_argument_group("running")
    group.add_argument("--ask", action="append", default=[], metavar="QUESTION",
                       help="question to answer when the stream ends, or every --ask-every pairs (repeatable)")
    group.add_argument("--ask-every", type=int, default=0, metavar="N", help="ask the --ask questions every N frame pairs")
    group.add_argument("--voice-wav", metavar="FILE", help="ask the questions spoken in this 16-bit PCM WAV file")
    group.add_argument("--max-frames", type=int, metavar="N",
                       help="ingest N frames, answer the --ask questions, then exit (one-shot)")
    group.add_argument("--exit-at-end", action="store_true",
                       help="exit when the stream ends (default: keep answering questions about what was seen)")
    group.add_argument("--realtime", action="store_true",
                       help="play a file or synthetic video at its own frame rate, as a camera would deliver it "
                            "(default: every frame, as fast as it is ingested)")
    group.add_argument("--no-server", action="store_true", help="do not start the HTTP API")
    group.add_argument("--no-stdin", action="store_true", help="do not read questions from stdin")
    group.add_argument("--quiet", action="store_true", help="no per-pair lines")
    group.add_argument("--quiz", type=int, default=0, metavar="N",
                       help="when a synthetic:events stream ends, ask N questions about the events seen and grade "
                            "each answer against the scene's ground truth (the toy model's demo)")


def version_string() -> str:
    from edgekv import __version__

    return f"edgekv {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgekv-camera", formatter_class=HelpFormatter,
        description="Watch a camera (or file, RTSP stream, GStreamer pipeline, synthetic video) and answer questions "
                    "about anything seen so far,\ninside a hard KV-cache memory cap. Questions come from --ask, stdin, "
                    "the HTTP API (OpenAI-compatible) and the microphone.",
        epilog="example: edgekv-camera --config configs/cpu-demo.yaml --no-stdin --exit-at-end --quiz 10 --ask 'Which shape was red?'")
    parser.add_argument("--version", action="version", version=version_string())
    add_config_arguments(parser, model_positional=False)
    add_daemon_arguments(parser)
    return parser


def run_daemon(args: argparse.Namespace, prog: str) -> int:
    """Load the deployment and run the daemon; a configuration mistake is one line and exit 2."""
    from edgekv.apps.startup import one_line

    try:
        config = config_from_args(args)
    except ValueError as exc:  # ConfigError: names the file and the key
        print(f"{prog}: cannot start: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    from edgekv.apps.daemon import Daemon, DaemonOptions

    return Daemon(config, DaemonOptions.from_namespace(args), prog=prog).run()


def main(argv: list[str] | None = None) -> int:
    prepare_process()  # the OpenMP wait policy, before anything imports torch (edgekv/threads.py)
    args = build_parser().parse_args(argv)
    if not args.config and not args.model_flag:
        print("edgekv-camera: cannot start: give --config FILE (or --model DIR)", file=sys.stderr)
        return 2
    return run_daemon(args, "edgekv-camera")


if __name__ == "__main__":
    sys.exit(main())
