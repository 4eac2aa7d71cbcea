"""``edgekv bench daemon``: what answering costs the stream, measured on the real daemon loop.

1. **Blind spot.** The deployment's source is played as a camera (``--realtime``: paced at its own
   frame rate, latest frame wins) and ``--questions`` questions are asked one after another, each
   answered with ``--answer-tokens`` tokens. Twice: with the answer backlog of the config
   (``video.answer_backlog_s``) and without one (``answer_backlog_s: 0``, the old behaviour). Every
   ingested frame's capture timestamp is recorded. Per question, from the last frame ingested before
   it was asked (capture time S) to the first frame ingested after ingest caught up again (E), the
   sampler's ticks are ``round((E - S) * fps)`` and each should have brought one frame: frames lost
   = ticks - frames ingested in (S, E] (counting, not per-gap rounding: latest-frame-wins sampling
   jitters each capture time by up to one source frame). Reported per question: frames lost, the
   answer's wall time (the latency the asker sees), and how long ingest then needed to catch up
   with the camera (backlog drain).
2. **Ingest under question load.** Ingest frames/s over ``--window-s`` seconds idle, then while
   ``--load`` questions wait at once (the fair-share rule of ``edgekv.apps.scheduling``).

``--token-delay-ms`` sleeps that long per answer token, to give the tiny CPU model the decode rate of a
real device (110 ms ≈ the 9 tok/s InfiniPot-V measured for Qwen2.5-VL-3B on AGX Orin, so a 64-token
answer spans ~7 s of video); 0 measures the model as it runs here. Figures only: JSON + PNG.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import threading
import time
from pathlib import Path

from edgekv.config_names import config_help, resolve_config
from edgekv.threads import threads_argument


def add_daemon_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, type=resolve_config,
                        help=config_help("the deployment (its model and source); default: configs/tiny-random.yaml's "
                                         "settings on a tiny random checkpoint made for the run"))
    parser.add_argument("--questions", type=int, default=5, help="questions asked one after another, per mode")
    parser.add_argument("--answer-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--token-delay-ms", type=float, default=0.0,
                        help="sleep per answer token, to emulate a slower device's decode (110 ms ~ 9 tok/s)")
    parser.add_argument("--load", type=int, default=50, help="questions waiting at once for the ingest-under-load part")
    parser.add_argument("--load-tokens", type=int, default=16, help="tokens per answer in the load part")
    parser.add_argument("--window-s", type=float, default=30.0, help="seconds of each ingest-rate window")
    parser.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", default="bench-daemon.json", help="figures (JSON) written here")
    parser.add_argument("--plot", default="bench-daemon.png", help="plot (PNG) written here ('' to skip)")
    parser.set_defaults(run=run_daemon_bench)


class Probe:
    """A daemon in a thread with its session's ingest wrapped to record (wall time, capture timestamp)."""

    def __init__(self, config, realtime: bool) -> None:
        from edgekv.apps.daemon.loop import Daemon, DaemonOptions

        self.daemon = Daemon(config, DaemonOptions(realtime=realtime, no_server=True, no_stdin=True, quiet=True),
                             out=io.StringIO())
        self.ingested: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)

    def __enter__(self) -> "Probe":
        self.thread.start()
        if not self.daemon.ready.wait(300):
            raise RuntimeError("the daemon did not start: " + self.daemon.out.getvalue()[-500:])
        session = self.daemon.session
        ingest = session.ingest

        def recording(frame, t=None, **stamps):  # stamps: the daemon's captured_unix (the wall-clock map)
            result = ingest(frame, t=t, **stamps)
            self.ingested.append((time.monotonic(), t))
            return result

        session.ingest = recording
        return self

    def __exit__(self, *exc) -> None:
        self.daemon.stop.event.set()
        self.thread.join(60)

    def frames(self) -> int:
        return len(self.ingested)

    def wait_frames(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.frames() < count and time.monotonic() < deadline:
            time.sleep(0.02)

    def wait_caught_up(self, timeout: float = 300.0) -> float:
        """Seconds until the backlog is empty and one more frame was ingested (ingest is live again)."""
        started = time.monotonic()
        while len(self.daemon.backlog) and time.monotonic() - started < timeout:
            time.sleep(0.01)
        self.wait_frames(self.frames() + 1)
        return time.monotonic() - started


def _question(text: str, tokens: int, delay_s: float):
    from edgekv.apps.questions import Question

    return Question(text, max_new_tokens=tokens, on_token=(lambda _token: time.sleep(delay_s)) if delay_s else None)


def frames_lost(records: list[tuple[float, float]], fps: float, asked: float, caught_up: float) -> dict:
    """Sampling ticks without an ingested frame between the last frame ingested before ``asked`` and the
    first ingested after ``caught_up`` (wall times); ``records`` = (ingest wall time, capture time)."""
    before = [t for wall, t in records if wall <= asked]
    after = [t for wall, t in records if wall > caught_up]
    start, end = before[-1], after[0]
    ingested = sum(1 for _, t in records if start < t <= end)
    ticks = round((end - start) * fps)
    return {"window_s": end - start, "ticks": ticks, "ingested": ingested, "lost": max(0, ticks - ingested)}


def blind_spot(config, args: argparse.Namespace, backlog: bool) -> dict:
    config = config if backlog else config.with_overrides(video={"answer_backlog_s": 0.0})
    fps = config.video.fps
    answers = []
    with Probe(config, realtime=True) as probe:
        probe.wait_frames(6)
        for number in range(args.questions):
            probe.wait_frames(probe.frames() + 3)
            question = _question(f"What happened before question {number}?", args.answer_tokens,
                                 args.token_delay_ms / 1e3)
            asked = time.monotonic()
            probe.daemon.submit(question)
            question.done.wait(600)
            answered = time.monotonic()
            drain_s = probe.wait_caught_up()
            answers.append({"asked": asked, "answered": answered, "answer_s": answered - asked, "drain_s": drain_s,
                            "caught_up": answered + drain_s,
                            "tokens": len(question.answer.token_ids) if question.answer else 0,
                            "ttft_s": question.answer.ttft_s if question.answer else None})
        probe.wait_frames(probe.frames() + 2)
        records = list(probe.ingested)
        status = probe.daemon.status()
    for answer in answers:
        window = frames_lost(records, fps, answer["asked"], answer["caught_up"])
        answer.update(frames_lost=window["lost"], ticks=window["ticks"], window_s=window["window_s"])
    lost = [a["frames_lost"] for a in answers]
    return {"backlog": backlog, "answer_backlog_s": config.video.answer_backlog_s, "fps": fps, "answers": answers,
            "frames_lost_per_question": sum(lost) / max(len(lost), 1), "frames_lost_max": max(lost),
            "answer_s_median": statistics.median(a["answer_s"] for a in answers),
            "drain_s_median": statistics.median(a["drain_s"] for a in answers),
            "frames_ingested": len(records), "daemon": status}


def ingest_under_load(config, args: argparse.Namespace, realtime: bool) -> dict:
    from edgekv.video.sources import parse_spec

    if not parse_spec(config.video.source).live:  # a recorded demo clip must not run out inside the windows
        config = config.with_overrides(video={"loop": True})
    with Probe(config, realtime=realtime) as probe:
        probe.wait_frames(6)
        idle = _rate(probe, args.window_s)
        questions = [_question(f"Question {i}?", args.load_tokens, args.token_delay_ms / 1e3) for i in range(args.load)]
        refused = 0
        for question in questions:
            try:
                probe.daemon.submit(question)
            except Exception:  # DaemonBusy: server.queue_size is smaller than the load
                refused += 1
        fair = probe.daemon.fair
        before = (fair.ingest_s, fair.answer_s)
        loaded = _rate(probe, args.window_s)
        ingest_s, answer_s = fair.ingest_s - before[0], fair.answer_s - before[1]
        answered_in_window = sum(q.done.is_set() for q in questions)
        for question in questions:
            question.done.wait(600)
        fair = probe.daemon.fair
        timeline = [(w, t) for w, t in probe.ingested]
    return {"realtime": realtime, "idle_fps": idle["fps"], "loaded_fps": loaded["fps"],
            "loaded_over_idle": loaded["fps"] / idle["fps"] if idle["fps"] else None,
            # the loop's own accounting in the loaded window: free of the machine's load drifting between windows
            "loaded_ingest_share": ingest_s / (ingest_s + answer_s) if ingest_s + answer_s else None,
            "questions": args.load, "refused": refused, "answered_in_window": answered_in_window,
            "ingest_s": fair.ingest_s, "answer_s": fair.answer_s, "answers_ahead_of_frames": fair.answers_ahead,
            "windows": [idle, loaded], "timeline": timeline}


def _rate(probe: Probe, seconds: float) -> dict:
    start_frames, start = probe.frames(), time.monotonic()
    time.sleep(seconds)
    frames, end = probe.frames(), time.monotonic()
    return {"start": start, "end": end, "frames": frames - start_frames, "fps": (frames - start_frames) / (end - start)}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    modes = result["blind_spot"]
    width = 0.38
    for offset, mode in zip((-width / 2, width / 2), modes):
        label = f"backlog {mode['answer_backlog_s']:g} s" if mode["backlog"] else "no backlog (dropped)"
        xs = [i + offset for i in range(len(mode["answers"]))]
        bars = axes[0].bar(xs, [a["frames_lost"] for a in mode["answers"]], width, label=label)
        axes[0].bar_label(bars, fontsize=7)
        axes[1].bar(xs, [a["answer_s"] for a in mode["answers"]], width, label=f"{label}: answer")
        axes[1].bar(xs, [a["drain_s"] for a in mode["answers"]], width, bottom=[a["answer_s"] for a in mode["answers"]],
                    alpha=0.4, label=f"{label}: catch-up")
    axes[0].set(title=f"frames lost per question ({modes[0]['fps']:g} fps)", xlabel="question")
    axes[1].set(title="answer wall time + ingest catch-up, s", xlabel="question")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    for load in result["ingest_under_load"]:
        timeline = load["timeline"]
        if not timeline:
            continue
        wall0 = timeline[0][0]
        counts = [(w - wall0, i + 1) for i, (w, _) in enumerate(timeline)]
        axes[2].plot(*zip(*counts), lw=0.9, label=f"{'paced' if load['realtime'] else 'as fast as ingested'}: "
                                                 f"{load['loaded_over_idle']:.0%} of idle fps under {load['questions']} questions")
        idle, loaded = load["windows"]
        axes[2].axvspan(loaded["start"] - wall0, loaded["end"] - wall0, alpha=0.08)
    axes[2].set(title="frames ingested (shaded: questions waiting)", xlabel="s")
    axes[2].legend(fontsize=7)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _tiny_random():
    """configs/tiny-random.yaml's deployment (a 224x224 synthesized camera, M = 1536) on a tiny random checkpoint
    written for this run: the bench runs from any folder, the wheel's included, with nothing made first."""
    import tempfile

    from edgekv.apps.bench.common import model_or_tiny
    from edgekv.config import EdgeKVConfig

    model = model_or_tiny(None, tempfile.mkdtemp(prefix="edgekv-bench-daemon-"))
    return EdgeKVConfig().with_overrides(
        model={"path": model, "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=320x240&fps=4&frames=400", "fps": 2.0, "resolution": [224, 224]},
        cache={"policy": "infinipot_v", "max_tokens": 1536, "text_reserve_tokens": 256},
        generation={"max_new_tokens": 24}, monitor={"backend": "auto"})


def run_daemon_bench(args: argparse.Namespace) -> int:
    from edgekv.apps.bench.common import provenance
    from edgekv.config import load_config

    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)

    config = (load_config(args.config) if args.config else _tiny_random()).with_overrides(
        server={"enabled": False, "queue_size": max(args.load, 16)},
        generation={"max_new_tokens": max(args.answer_tokens, args.load_tokens)})
    title = (f"edgekv bench daemon — {args.config or 'a tiny random checkpoint'}: {config.video.source} at "
             f"{config.video.fps:g} fps, "
             f"{args.answer_tokens}-token answers, token delay {args.token_delay_ms:g} ms")
    print(title)
    modes = []
    for backlog in (True, False):
        mode = blind_spot(config, args, backlog)
        modes.append(mode)
        print(f"  {'with' if backlog else 'without'} backlog: frames lost per question "
              f"{mode['frames_lost_per_question']:.2f} (max {mode['frames_lost_max']}), answer "
              f"{mode['answer_s_median']:.2f} s median, catch-up {mode['drain_s_median']:.2f} s median")
    loads = []
    for realtime in (True, False):
        load = ingest_under_load(config, args, realtime)
        loads.append(load)
        print(f"  ingest {'paced' if realtime else 'as fast as ingested'}: idle {load['idle_fps']:.2f} fps, "
              f"with {args.load} questions waiting {load['loaded_fps']:.2f} fps ({load['loaded_over_idle']:.0%}), "
              f"loop time ingesting {load['loaded_ingest_share']:.0%}; "
              f"{load['answered_in_window']} answered in the window, {load['refused']} refused")
    result = {"title": title, "config": args.config, "answer_tokens": args.answer_tokens,
              "token_delay_ms": args.token_delay_ms, **provenance(), "blind_spot": modes, "ingest_under_load": loads}
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.plot:
        _plot(result, Path(args.plot))
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0
