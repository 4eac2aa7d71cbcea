"""``edgekv-camera``: watch a camera (or file, RTSP, GStreamer pipeline, synthetic video) and answer
questions about anything seen so far, inside the hard cache cap.

One thread captures (latest frame wins, never blocked), the main loop ingests at the configured fps
and answers queued questions between frame pairs (from ``--ask``, stdin lines, or the HTTP API), so a
question never races an ingest. SIGTERM/SIGINT finish the current step, flush metrics and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("edgekv.camera")

RANDOM_WEIGHTS_NOTE = (
    "NOTE: {path} holds random weights (made by `edgekv make-tiny-checkpoint`): answers are meaningless text.\n"
    "      Point model.path at a real Qwen2.5-VL checkpoint directory for real answers."
)


@dataclass
class Question:
    """A question waiting for the main loop; ``done`` is set when ``answer`` or ``error`` is filled."""

    text: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    on_token: object = None
    source: str = "cli"
    answer: object = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


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


def answer_question(session, question: Question, out) -> None:
    try:
        question.answer = session.ask(question.text, max_new_tokens=question.max_new_tokens,
                                      temperature=question.temperature, top_p=question.top_p,
                                      seed=question.seed, on_token=question.on_token)
        a = question.answer
        print(f"Q: {question.text}\nA: {a.text!r}\n   ({len(a.token_ids)} tokens, ttft {a.ttft_s * 1e3:.0f} ms, "
              f"{a.decode_tok_s:.1f} tok/s, over {a.video_tokens} cached tokens)", file=out, flush=True)
    except Exception as exc:  # a bad question must not stop the stream; the asker gets the error
        question.error = exc
        print(f"Q: {question.text}\n   refused: {exc}", file=out, flush=True)
    finally:
        question.done.set()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgekv-camera", description=__doc__)
    parser.add_argument("--config", required=True, help="deployment YAML")
    parser.add_argument("--ask", action="append", default=[], help="question to answer (repeatable)")
    parser.add_argument("--ask-every", type=int, default=0,
                        help="ask the --ask questions every N frame pairs (default: once, at the end)")
    parser.add_argument("--max-frames", type=int, default=None, help="stop after this many frames")
    parser.add_argument("--no-server", action="store_true", help="do not start the HTTP API")
    parser.add_argument("--no-stdin", action="store_true", help="do not read questions from stdin")
    parser.add_argument("--quiet", action="store_true", help="no per-pair lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from edgekv.apps.daemon import Daemon

    daemon = Daemon.from_args(args)
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
