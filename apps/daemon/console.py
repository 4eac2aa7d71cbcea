"""What the daemon prints: a line per frame pair, each answer with its figures, the random-weights note;
and the stop flag SIGTERM/SIGINT set."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from edgekv.apps.questions import Question, printable

RANDOM_WEIGHTS_NOTE = (
    "NOTE: {path} holds random weights (made by `edgekv make-tiny-checkpoint`): answers are meaningless text.\n"
    "      Point model.path at a real Qwen2.5-VL checkpoint directory for real answers."
)


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop finishes its current step and exits cleanly. SIGHUP (a closed terminal,
    ``systemctl reload``) does not stop it: it sets ``hangup``, and the loop saves the memory and goes on (its
    default action killed the daemon without saving)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.hangup = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}  # the handlers install() replaced, put back by uninstall()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (tests, another app): the owner stops the loop through ``event``
        signals = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
        self._previous = {sig: signal.getsignal(sig) for sig in signals}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, lambda _signum, _frame: self.hangup.set())

    def uninstall(self) -> None:
        """Put back the handlers ``install`` replaced: a program that ran the daemon in its main thread (an app
        embedding it, a test) got a Ctrl-C that only set this flag, for the rest of its life."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

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


ANSWERED_HERE = ("stdin", "cli", "quiz")  # questions asked on this console: their answers are shown whatever the log


def format_answer(question: Question, log_text: bool = True) -> str:
    """What the daemon prints for a finished question; every piece of request text is escaped. Without
    ``log_text`` (``privacy.log_text``) the question and answer of another channel (HTTP, voice, ROS 2, the fleet:
    they get their answer there) are logged by length only."""
    shown = log_text or question.source in ANSWERED_HERE
    text = printable(question.text) if shown else f"({len(question.text)} characters; privacy.log_text)"
    asked = f"Q [{question.source}]: {text}"
    if question.error is not None:
        return f"{asked}\n   refused: {printable(str(question.error))}"
    a = question.answer
    # one token is all prefill: there is no decode step to time
    rate = f"{a.decode_tok_s:.1f} tok/s" if len(a.token_ids) > 1 else "no decode step"
    reply = whole_reply(question)
    said = printable(reply, limit=4000) if shown else f"({len(reply)} characters; privacy.log_text)"
    given = getattr(question, "answer_prefix", "")
    continued = f", continuing the {len(given)} characters the asker gave" if given else ""
    return (f"{asked}\nA: {said}\n   ({len(a.token_ids)} tokens{continued}, ttft {a.ttft_s * 1e3:.0f} ms, "
            f"{rate}, over {a.video_tokens} cached tokens)")


def whole_reply(question: Question) -> str:
    """The assistant's reply as its reader has it: a chat's ``continue_final_message`` gave its start
    (``question.answer_prefix``) and the model wrote the rest (``answer.text``, the continuation only, as the API
    returns it). The console shows the whole of it, as the status page's history does."""
    return getattr(question, "answer_prefix", "") + question.answer.text
