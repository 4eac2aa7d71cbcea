"""``edgekv bench soak``: a long stream at full speed, watching what must stay flat for weeks.

A session ingests frame pairs as fast as the machine allows (timestamps run on a virtual clock at
``--fps``, so an hour of soak covers many hours of stream time, re-basing of positions included) and
asks a question every ``--ask-every`` pairs. Every ``--sample-s`` seconds it records process RSS, the
cache's allocated bytes, frames per second over the interval, Python objects alive, errors so far and
the session's counters; it prints each sample and saves JSON + PNG. The summary compares RSS at the end
with RSS after warm-up (the end of the first third of the run): a bounded runtime stays flat there.

``--daemon`` soaks the whole daemon instead, as a deployment runs: the daemon in a child process (its HTTP API
on 127.0.0.1, the source paced like a camera, or at full speed with ``--replay``) and clients around it —
``--clients`` chat clients each asking every ``--ask-every-s`` seconds (every other one streamed; every fifth
stream abandoned after its first token, as a closed browser tab does), a status-page poller and a Prometheus
scraper (once a second each) and a ``/healthz`` probe. Samples then hold the daemon's RSS (its process, read
from /proc), its counters, and the clients' errors (any status but 200, and failed connections) so far.

Nothing here keeps per-pair history either: samples are thinned (every other one dropped) once they
pass ``MAX_SAMPLES``, so a soak of weeks writes a JSON of bounded size. Figures only, no assertions.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch

from edgekv.apps.bench.common import ClientThreads
from edgekv.config_names import config_help, resolve_config
from edgekv.threads import threads_argument

MAX_SAMPLES = 2000
MAX_ERROR_MESSAGES = 10
# the options' values when not given (with --daemon --config an option not given leaves the config's value)
SOAK_DEFAULTS = {"resolution": [224, 224], "policy": "infinipot_v", "max_tokens": 1536, "text_reserve": 256,
                 "sinks": 0, "fps": 2.0, "answer_tokens": 24, "threads": 1}


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hours", type=float, default=None, help="how long to run (or --pairs)")
    parser.add_argument("--pairs", type=int, default=None, help="frame pairs to ingest (or --hours)")
    parser.add_argument("--model", help="checkpoint dir (default: a fresh tiny random checkpoint)")
    # defaults (SOAK_DEFAULTS): the CPU demo's budget (a random tiny checkpoint at 224 x 224); with --daemon --config
    # only the ones given on the command line override the config file's
    parser.add_argument("--resolution", type=int, nargs=2, default=None, metavar=("H", "W"), help="default: 224 224")
    parser.add_argument("--policy", default=None, help="default: infinipot_v")
    parser.add_argument("--max-tokens", type=int, default=None, help="cache cap M (default: 1536)")
    parser.add_argument("--text-reserve", type=int, default=None, help="cache.text_reserve_tokens (default: 256)")
    parser.add_argument("--sinks", type=int, default=None, help="StateKV sink budget B (policy statekv; default 0)")
    parser.add_argument("--fps", type=float, default=None,
                        help="the virtual clock's frame rate (timestamps; --daemon: video.fps) (default: 2.0)")
    parser.add_argument("--ask-every", type=int, default=100, help="ask a question every N frame pairs (0: never)")
    parser.add_argument("--answer-tokens", type=int, default=None,
                        help="max_new_tokens per question (default: 24; --daemon --config: the config's generation)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--sample-every-pairs", type=int, default=None,
                        help="sample every N pairs instead of every --sample-s seconds")
    parser.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads (default: 1)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="any other config key, e.g. --set archive.dir=/tmp/a --set archive.max_gib=0.01 "
                             "(the archive's disk and recall counters then go into the JSON)")
    parser.add_argument("--daemon", action="store_true",
                        help="soak the daemon in a child process with HTTP clients around it (module docstring)")
    parser.add_argument("--config", default=None, type=resolve_config,
                        help=config_help("--daemon: soak this deployment config (its model, cameras, archive, alerts, "
                                         "fleet ...; the API on a free port of 127.0.0.1), --set and the options "
                                         "given on top"))
    parser.add_argument("--clients", type=int, default=4, help="--daemon: chat clients")
    parser.add_argument("--ask-every-s", type=float, default=10.0, help="--daemon: seconds between a client's chats")
    parser.add_argument("--replay", action="store_true", help="--daemon: the source at full speed, not paced")
    parser.add_argument("--json", default="bench-soak.json")
    parser.add_argument("--plot", default="bench-soak.png", help="PNG to write ('' to skip)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    parser.set_defaults(run=run_soak)


# ---------------------------------------------------------------------------------------------- frames
def frame_pool(resolution: Sequence[int], count: int = 64, seed: int = 0) -> list[np.ndarray]:
    """``count`` BGR frames at the grid's resolution (no resize per frame): textured noise with a bright
    square that moves one step per frame, so consecutive frames differ and TaR/VaN have work to do."""
    height, width = int(resolution[0]), int(resolution[1])
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 120, size=(height, width, 3), dtype=np.uint8)
    side = max(4, min(height, width) // 4)
    frames = []
    for index in range(count):
        frame = background.copy()
        top = (index * 3) % (height - side)
        left = (index * 5) % (width - side)
        frame[top:top + side, left:left + side] = (40 + index % 200, 255, 180)
        frames.append(frame)
    return frames


# ---------------------------------------------------------------------------------------------- the soak
@dataclass
class SoakReport:
    samples: list[dict] = field(default_factory=list)
    warmup: dict | None = None  # the first sample at or after a third of the run
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    pairs: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False  # stopped by Ctrl-C before its --hours / --pairs: the figures are of the run so far

    def record_error(self, exc: Exception) -> None:
        self.errors += 1
        message = f"{type(exc).__name__}: {exc}"
        if len(self.error_messages) < MAX_ERROR_MESSAGES and message not in self.error_messages:
            self.error_messages.append(message)

    def add(self, sample: dict) -> None:
        self.samples.append(sample)
        if len(self.samples) > MAX_SAMPLES:  # keep the first and every other one: bounded, evenly spread
            self.samples = self.samples[::2] + ([self.samples[-1]] if len(self.samples) % 2 == 0 else [])

    def summary(self) -> dict:
        first, last = self.samples[0], self.samples[-1]
        warm = self.warmup or first
        after = [s for s in self.samples if s["elapsed_s"] >= warm["elapsed_s"]]
        fps = [s["fps"] for s in self.samples[1:] if s["fps"] is not None]
        return {
            "pairs": self.pairs, "elapsed_s": self.elapsed_s, "interrupted": self.interrupted, "errors": self.errors,
            "error_messages": self.error_messages,
            "rss_start_mb": first["rss_mb"], "rss_after_warmup_mb": warm["rss_mb"], "rss_end_mb": last["rss_mb"],
            "rss_max_after_warmup_mb": max(s["rss_mb"] for s in after),
            "rss_growth_after_warmup_pct": 100.0 * (last["rss_mb"] / warm["rss_mb"] - 1.0),
            "warmup_at_s": warm["elapsed_s"], "warmup_at_pair": warm["pairs"],
            "cache_bytes": sorted({s["cache_bytes"] for s in self.samples}),
            "py_objects_after_warmup": warm["py_objects"], "py_objects_end": last["py_objects"],
            "fps_mean": (2 * self.pairs / self.elapsed_s) if self.elapsed_s else None,
            "fps_min_sample": min(fps) if fps else None,
            "compressions": last["compressions"], "questions": last["questions"],
            "position_rebases": last["position_rebases"],
        }


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def soak(session, frames: Sequence[np.ndarray], fps: float, *, hours: float | None = None,
         pairs: int | None = None, ask_every: int = 0, answer_tokens: int = 8, sample_s: float = 10.0,
         sample_every_pairs: int | None = None, on_sample: Callable[[dict], None] | None = None) -> SoakReport:
    """Stream until ``hours`` of wall time or ``pairs`` frame pairs, whichever is given (both: the first)."""
    if hours is None and pairs is None:
        raise ValueError("soak: give --hours or --pairs")
    deadline = None if hours is None else time.monotonic() + hours * 3600.0
    report = SoakReport()
    started = time.monotonic()
    frame_index = 0
    last = {"time": started, "frames": 0}

    def done() -> bool:
        return (pairs is not None and report.pairs >= pairs) or (deadline is not None and time.monotonic() >= deadline)

    def past_a_third() -> bool:
        if pairs is not None and report.pairs >= pairs / 3:
            return True
        return hours is not None and time.monotonic() - started >= hours * 3600.0 / 3

    def take_sample() -> None:
        now = time.monotonic()
        stats = session.stats()
        frames_done = stats["frames"]
        interval = now - last["time"]
        sample = {
            "elapsed_s": round(now - started, 3), "pairs": stats["frame_pairs"], "frames": frames_done,
            "rss_mb": _rss_mb(), "cache_bytes": stats["cache_capacity_bytes"], "cache_tokens": stats["cache_tokens"],
            "fps": (frames_done - last["frames"]) / interval if interval > 0 and frames_done > last["frames"] else None,
            "errors": report.errors, "py_objects": len(gc.get_objects()), "compressions": stats["compressions"],
            "questions": stats["questions"], "position_max": stats["position_max"],
            "position_rebases": stats["position_rebases"],
        }
        last.update(time=now, frames=frames_done)
        report.add(sample)
        if report.warmup is None and past_a_third():
            report.warmup = sample
        if on_sample is not None:
            on_sample(sample)

    next_sample = started + sample_s
    try:
        while not done():
            for _ in range(2):
                try:
                    session.ingest(frames[frame_index % len(frames)], t=frame_index / fps)
                except Exception as exc:  # counted, not fatal: the soak reports errors over time
                    report.record_error(exc)
                frame_index += 1
            report.pairs += 1
            if ask_every and report.pairs % ask_every == 0:
                try:
                    session.ask("What is in the picture?", max_new_tokens=answer_tokens)
                except Exception as exc:
                    report.record_error(exc)
            if report.pairs == 1:
                take_sample()  # the start: after the first pair (weights touched, buffers faulted in)
            elif sample_every_pairs is not None:
                if report.pairs % sample_every_pairs == 0:
                    take_sample()
            elif time.monotonic() >= next_sample:
                take_sample()
                next_sample += sample_s * max(1, int((time.monotonic() - next_sample) // sample_s) + 1)
    except KeyboardInterrupt:  # a soak of hours stopped early keeps what it measured (with a sample at the stop)
        if not report.samples:
            raise
        report.interrupted = True
    report.elapsed_s = time.monotonic() - started
    if report.samples[-1]["pairs"] != report.pairs:
        take_sample()
    return report


# ---------------------------------------------------------------------------------------------- command
def _counts_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the run's length and sampling, before minutes of setup: --hours NaN never ended, and
    --hours <= 0, --pairs 0, --sample-s 0 or --sample-every-pairs 0 were tracebacks."""
    if args.hours is not None and not (math.isfinite(args.hours) and args.hours > 0):
        return f"--hours: a positive number of hours, got {args.hours}"
    if args.pairs is not None and args.pairs < 1:
        return f"--pairs: at least 1, got {args.pairs}"
    if not (math.isfinite(args.sample_s) and args.sample_s > 0):
        return f"--sample-s: a positive number of seconds, got {args.sample_s}"
    if args.sample_every_pairs is not None and args.sample_every_pairs < 1:
        return f"--sample-every-pairs: at least 1, got {args.sample_every_pairs}"
    if args.ask_every < 0:
        return f"--ask-every: a number of frame pairs, 0 for never, got {args.ask_every}"
    return None


def run_soak(args: argparse.Namespace) -> int:
    import edgekv

    if args.hours is None and args.pairs is None:
        print("edgekv bench soak: give --hours H or --pairs N", file=sys.stderr)
        return 2
    if problem := _counts_problem(args):
        print(f"edgekv bench soak: {problem}", file=sys.stderr)
        return 2
    if args.config is not None and not args.daemon:
        print("edgekv bench soak: --config soaks a deployment's daemon; add --daemon")
        return 2
    if args.config is None:
        for name, value in SOAK_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.daemon:
        if args.hours is None:
            print("edgekv bench soak --daemon: give --hours H (the daemon's stream has no pair count to stop at)")
            return 2
        return run_daemon_soak(args)
    from edgekv.threads import apply_threads

    apply_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from edgekv.model.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="edgekv-soak-")) / "tiny", preset="tiny")
    from edgekv.config import ConfigError, assignment_sections

    sections = {"model": {"dtype": "fp32", "device": "cpu"},
                "video": {"resolution": list(args.resolution), "fps": args.fps},
                "cache": {"policy": args.policy, "max_tokens": args.max_tokens, "text_reserve_tokens": args.text_reserve,
                          "sinks": args.sinks}}
    try:
        for name, values in assignment_sections(args.set).items():
            sections[name] = {**sections.get(name, {}), **values}
        runtime = edgekv.Runtime.from_pretrained(model_dir, **sections)
        session = runtime.session()
    except (ValueError, ConfigError) as exc:
        print(f"edgekv bench soak: {exc}")
        return 2
    frames = frame_pool(args.resolution)
    target = f"{args.hours} h" if args.hours is not None else f"{args.pairs} pairs"
    print(f"soak: {target} at {args.resolution[0]}x{args.resolution[1]} ({session.tokens_per_pair} tokens/pair), "
          f"policy {args.policy}, M={session.capacity}, question every {args.ask_every} pairs, pid {os.getpid()}")

    def show(sample: dict) -> None:
        if not args.quiet:
            fps = f"{sample['fps']:.1f}" if sample["fps"] is not None else "-"
            print(f"  {sample['elapsed_s']:9.1f} s  pairs {sample['pairs']:8d}  RSS {sample['rss_mb']:7.1f} MiB  "
                  f"cache {sample['cache_bytes'] / 2**20:.3f} MiB  {fps} fps  errors {sample['errors']}  "
                  f"objects {sample['py_objects']}", flush=True)

    report = soak(session, frames, args.fps, hours=args.hours, pairs=args.pairs, ask_every=args.ask_every,
                  answer_tokens=args.answer_tokens, sample_s=args.sample_s,
                  sample_every_pairs=args.sample_every_pairs, on_sample=show)
    summary = report.summary()
    if session.recall is not None:  # the archive's counters as of the last pair: let its writer finish first
        session.recall.archive.flush()
    setup = {"model": str(model_dir), "resolution": list(args.resolution), "policy": args.policy,
             "max_tokens": session.capacity, "tokens_per_pair": session.tokens_per_pair, "fps_clock": args.fps,
             "ask_every": args.ask_every, "answer_tokens": args.answer_tokens, "torch_threads": torch.get_num_threads(),
             "host_memory": runtime.host_memory, "machine": platform.machine(), "cpus": os.cpu_count(),
             "load_avg_end": list(os.getloadavg()), "set": list(args.set),
             "archive": {k: v for k, v in session.stats().items() if k.startswith(("archive", "recall"))}}
    Path(args.json).write_text(json.dumps({"setup": setup, "summary": summary, "samples": report.samples}, indent=1))
    print(f"soak {'stopped early (Ctrl-C)' if report.interrupted else 'done'}: {summary['pairs']} pairs in "
          f"{summary['elapsed_s'] / 3600:.2f} h ({summary['fps_mean']:.1f} fps); "
          f"RSS start {summary['rss_start_mb']:.1f} / after warm-up {summary['rss_after_warmup_mb']:.1f} / end "
          f"{summary['rss_end_mb']:.1f} MiB ({summary['rss_growth_after_warmup_pct']:+.3f} % after warm-up); cache "
          f"bytes {summary['cache_bytes']}; errors {summary['errors']}")
    if args.plot:
        _plot(report, Path(args.plot), f"soak {target}: {args.policy}, M={session.capacity}, "
                                       f"{args.resolution[0]}x{args.resolution[1]}")
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 130 if report.interrupted else 0  # the figures are written; the exit still says it was cut short


def _plot(report: SoakReport, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [s["elapsed_s"] / 3600 for s in report.samples]
    panels = [("rss_mb", "process RSS (MiB)", 1.0), ("cache_bytes", "cache allocated (MiB)", 1 / 2**20),
              ("fps", "frames / s", 1.0), ("errors", "errors (cumulative)", 1.0)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), sharex=True)
    for ax, (key, label, scale) in zip(axes, panels):
        points = [(h, s[key] * scale) for h, s in zip(hours, report.samples) if s[key] is not None]
        if points:
            ax.plot(*zip(*points), lw=0.8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    if report.warmup is not None:
        for ax in axes:
            ax.axvline(report.warmup["elapsed_s"] / 3600, color="grey", ls="--", lw=0.6)
    axes[-1].set_xlabel("hours (dashed: end of warm-up, a third of the run)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------- --daemon
class _Clients(ClientThreads):
    """Chat clients, a status-page poller, a Prometheus scraper and a /healthz probe around a daemon on
    127.0.0.1; every outcome that is not a 200 is counted as an error (with the first few kept as text)."""

    join_s = 120.0

    def __init__(self, port: int, args: argparse.Namespace, cameras: Sequence[str] = (), https: bool = False) -> None:
        import threading

        self.port, self.args, self.https = port, args, https
        self.cameras = list(cameras)  # video.sources: a streamed answer names one (in turn), the others ask all
        self.requests = self.errors = self.answers = self.abandoned = 0
        self.error_messages: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._chats, args=(i,), daemon=True) for i in range(args.clients)]
        self.threads += [threading.Thread(target=self._poll, args=(path, period), daemon=True)
                         for path, period in (("/v1/edgekv/status", 1.0), ("/metrics", 1.0), ("/healthz", 0.5))]

    def _outcome(self, what: str, status) -> None:
        with self._lock:
            self.requests += 1
            if status != 200:
                self.errors += 1
                message = f"{what}: {status}"
                if len(self.error_messages) < MAX_ERROR_MESSAGES and message not in self.error_messages:
                    self.error_messages.append(message)

    def _request(self, method: str, path: str, body: bytes | None = None, abandon: bool = False):
        conn = _connection(self.port, self.https, 600)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            response = conn.getresponse()
            if abandon:
                response.read(1)  # the stream started: leave
                return response.status, b""
            return response.status, response.read()
        except OSError as exc:
            return f"{type(exc).__name__}", b""
        finally:
            conn.close()

    def _chats(self, index: int) -> None:
        turn = 0
        self._stop.wait(index * self.args.ask_every_s / max(1, self.args.clients))  # spread the clients out
        while not self._stop.is_set():
            stream, abandon = turn % 2 == 1, turn % 10 == 9
            request = {"messages": [{"role": "user", "content": f"What is in the picture, {index}.{turn}?"}],
                       "max_tokens": self.args.answer_tokens, "stream": stream}
            if stream and self.cameras:
                request["camera"] = self.cameras[(index + turn) % len(self.cameras)]
            body = json.dumps(request).encode()
            status, _ = self._request("POST", "/v1/chat/completions", body, abandon=abandon)
            self._outcome("chat", status)
            with self._lock:
                self.answers += status == 200 and not abandon
                self.abandoned += abandon
            turn += 1
            self._stop.wait(self.args.ask_every_s)

    def _poll(self, path: str, period: float) -> None:
        while not self._stop.wait(period):
            status, _ = self._request("GET", path)
            self._outcome(path, status)


def run_daemon_soak(args: argparse.Namespace) -> int:
    """``--daemon``: the daemon in a child process, clients around it, samples of its RSS and counters."""
    import multiprocessing

    from edgekv.apps.bench.common import daemon_port, serve_daemon

    scratch = Path(tempfile.mkdtemp(prefix="edgekv-soak-"))
    try:
        sections, model, https = _daemon_sections(args, scratch)
    except ValueError as exc:  # ConfigError: the file or an option, named
        print(f"edgekv bench soak: {exc}")
        return 2
    log_path = scratch / "daemon.log"
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    child = context.Process(target=serve_daemon, args=(sections, str(log_path), port_queue))
    child.start()
    seconds = args.hours * 3600.0 if args.hours is not None else None
    try:
        port = daemon_port(child, port_queue)
        if port is None:
            print(f"edgekv bench soak: the daemon did not start; see {log_path}")
            return 2
        print(f"soak --daemon: {args.hours} h, {args.clients} chat clients every {args.ask_every_s:g} s, "
              f"{_what(args)}, daemon pid {child.pid} on 127.0.0.1:{port} (log {log_path})")
        report, clients = _soak_daemon(child.pid, port, args, seconds, https)
    finally:
        child.terminate()
        child.join(60)
        if child.is_alive():
            child.kill()
    summary = report.summary()
    summary.update(requests=clients.requests, client_errors=clients.errors, answers=clients.answers,
                   abandoned_streams=clients.abandoned, client_error_messages=clients.error_messages)
    setup = {"model": model, "config": args.config, "resolution": args.resolution, "policy": args.policy,
             "max_tokens": args.max_tokens, "fps": args.fps, "clients": args.clients, "ask_every_s": args.ask_every_s,
             "answer_tokens": args.answer_tokens, "replay": args.replay, "daemon_log": str(log_path),
             "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_end": list(os.getloadavg()),
             "set": list(args.set)}
    Path(args.json).write_text(json.dumps({"setup": setup, "summary": summary, "samples": report.samples}, indent=1))
    print(f"soak --daemon {'stopped early (Ctrl-C)' if report.interrupted else 'done'}: "
          f"{summary['elapsed_s'] / 3600:.2f} h, {summary['pairs']} pairs; daemon RSS start "
          f"{summary['rss_start_mb']:.1f} / after warm-up {summary['rss_after_warmup_mb']:.1f} / end "
          f"{summary['rss_end_mb']:.1f} MiB ({summary['rss_growth_after_warmup_pct']:+.3f} % after warm-up); "
          f"{clients.requests} requests, {clients.answers} answers, {clients.abandoned} streams abandoned, "
          f"{clients.errors} client errors; daemon errors {summary['errors']}")
    if args.plot:
        _plot(report, Path(args.plot), f"soak --daemon {args.hours} h: {args.clients} clients, {_what(args)}")
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 130 if report.interrupted else 0  # the figures are written; the exit still says it was cut short


def _daemon_sections(args: argparse.Namespace, scratch: Path) -> tuple[dict, str, bool]:
    """The child daemon's config overrides (``_config``: the file they go on top of), its model and whether it serves
    HTTPS, checked here so that a bad file or option is refused before a process starts. Raises ``ConfigError``
    naming what is wrong."""
    from edgekv.apps.bench.common import model_or_tiny
    from edgekv.config import EdgeKVConfig, assignment_sections, load_config

    if args.config is None:
        model = model_or_tiny(args.model, scratch)
        sections = {"model": {"path": model, "dtype": "fp32", "device": "cpu"},
                    "video": {"source": "synthetic:shapes?size=320x240&fps=30&frames=100000000", "fps": args.fps,
                              "resolution": list(args.resolution)},
                    "cache": {"policy": args.policy, "max_tokens": args.max_tokens,
                              "text_reserve_tokens": args.text_reserve, "sinks": args.sinks},
                    "server": {"port": 0, "max_new_tokens": max(args.answer_tokens, 1),
                               "queue_size": max(16, args.clients)},
                    "generation": {"max_new_tokens": args.answer_tokens},
                    "runtime": {"threads": args.threads},
                    "monitor": {"interval_s": 1.0, "backend": "cpu"}}
    else:  # the deployment's own config; what the command line gives goes on top, the API on a free local port
        given = {"video": {"resolution": args.resolution and list(args.resolution), "fps": args.fps},
                 "cache": {"policy": args.policy, "max_tokens": args.max_tokens,
                           "text_reserve_tokens": args.text_reserve, "sinks": args.sinks},
                 "model": {"path": args.model}, "runtime": {"threads": args.threads},
                 "generation": {"max_new_tokens": args.answer_tokens}}
        sections = {name: {key: value for key, value in values.items() if value is not None}
                    for name, values in given.items()}
        sections["server"] = {"enabled": True, "host": "127.0.0.1", "port": 0}
    for name, values in assignment_sections(args.set).items():
        sections[name] = {**sections.get(name, {}), **values}
    base = EdgeKVConfig() if args.config is None else load_config(args.config)
    config = base.with_overrides(**sections)
    if args.config is not None:
        sections["_config"] = str(Path(args.config).resolve())
    sections["_replay"] = bool(args.replay)
    return sections, config.model.path, config.server.tls()


def _connection(port: int, https: bool, timeout: float):
    """A connection to the soaked daemon on 127.0.0.1: HTTPS when its config serves it (the soak measures the daemon,
    not its certificate: nothing is verified on the loopback)."""
    import http.client
    import ssl

    if https:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context)
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def _what(args: argparse.Namespace) -> str:
    """The run in a few words, for its first line and its figure's title."""
    if args.config is not None:
        return f"config {Path(args.config).name}"
    return f"policy {args.policy}, M={args.max_tokens}"


def _daemon_stats(page: dict) -> dict:
    """The status page's counters; with several cameras, the frames, pairs and cache bytes of all of them summed
    (the page's own ``stats`` are the first camera's)."""
    stats = dict(page.get("stats") or {})
    cameras = [camera for camera in (page.get("cameras") or {}).values() if isinstance(camera, dict)]
    if len(cameras) > 1:
        for key in ("frames", "frame_pairs", "cache_capacity_bytes", "cache_tokens", "compressions", "questions"):
            stats[key] = sum(camera.get(key) or 0 for camera in cameras)
    return stats


def _soak_daemon(pid: int, port: int, args: argparse.Namespace, seconds: float,
                 https: bool = False) -> tuple[SoakReport, _Clients]:
    daemon = psutil.Process(pid)
    report = SoakReport()

    def status() -> dict:
        conn = _connection(port, https, 60)
        try:
            conn.request("GET", "/v1/edgekv/status")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    clients = _Clients(port, args, cameras=list(status().get("cameras") or {}), https=https).start()
    started = time.monotonic()
    last = {"time": started, "frames": None}

    try:
        while True:
            now = time.monotonic()
            try:
                page = status()
            except (OSError, ValueError) as exc:
                report.record_error(exc)
                page = None
            stats = _daemon_stats(page or {})
            frames = stats.get("frames", 0)
            interval = now - last["time"]
            fps = ((frames - last["frames"]) / interval if last["frames"] is not None and interval > 0 else None)
            last.update(time=now, frames=frames)
            daemon_errors = stats.get("frames_rejected", 0) + stats.get("archive_write_errors", 0)
            sample = {"elapsed_s": round(now - started, 3), "pairs": stats.get("frame_pairs", 0), "frames": frames,
                      "rss_mb": daemon.memory_info().rss / 2**20, "cache_bytes": stats.get("cache_capacity_bytes", 0),
                      "cache_tokens": stats.get("cache_tokens", 0), "fps": fps, "errors": report.errors + daemon_errors,
                      "client_errors": clients.errors, "requests": clients.requests, "py_objects": None,
                      "stream_state": (page or {}).get("daemon", {}).get("stream_state"),
                      "compressions": stats.get("compressions", 0), "questions": stats.get("questions", 0),
                      "position_max": stats.get("position_max", 0), "position_rebases": stats.get("position_rebases", 0)}
            report.add(sample)
            report.pairs = sample["pairs"]
            if report.warmup is None and now - started >= seconds / 3:
                report.warmup = sample
            if not args.quiet:
                print(f"  {sample['elapsed_s']:9.1f} s  pairs {sample['pairs']:8d}  daemon RSS {sample['rss_mb']:7.1f} MiB"
                      f"  {fps if fps is None else round(fps, 1)} fps  requests {clients.requests}  client errors "
                      f"{clients.errors}  daemon errors {sample['errors']}", flush=True)
            if now - started >= seconds:
                break
            time.sleep(max(0.0, args.sample_s - (time.monotonic() - now)))
    except KeyboardInterrupt:  # stopped early: the figures so far are written
        if not report.samples:
            raise
        report.interrupted = True
    finally:
        clients.stop()
    report.elapsed_s = time.monotonic() - started
    report.errors = report.samples[-1]["errors"]
    return report, clients
