"""``edgekv bench api``: what 50 concurrent chats cost the stream and the API, measured over HTTP.

A daemon runs in a child process (its own interpreter: the client threads here never share its GIL) on
the model (default: a fresh tiny random checkpoint) with a paced source (``--realtime``: sampled at
``--fps`` on the wall clock, latest frame wins, as a camera is). Then:

1. **idle**: ``--idle-s`` seconds with no question; ``/healthz`` is probed every ``--probe-ms`` on a
   fresh connection, which gives its latency and the frame count over time (ingest rate).
2. **load**: ``--chats`` chat completions (``--answer-tokens`` each) are sent at once, each on its own
   connection; the window lasts until the last one is answered. The probes go on.

``--load`` chooses what the load phase is (issue 26's probes, so that their figures can be reproduced):

- ``burst`` (default): the ``--chats`` chats above, once each;
- ``hammer``: ``--chats`` clients each send chats back to back (a new one as soon as the last is answered or
  refused) for ``--load-s`` seconds;
- ``read``: ``--clients`` kept-alive connections hammer the read-only routes (``/metrics``,
  ``/v1/edgekv/status``, ``/frame.jpg``, ``/v1/models``) for ``--load-s`` seconds;
- ``slowloris``: ``--clients`` connections from one other loopback address (``--attacker``, default
  127.0.0.2) each send half a request and hold it, reopened as soon as the server closes one, for
  ``--load-s`` seconds; the probes (from 127.0.0.1) say how many ``/healthz`` were served.

``--replay`` plays the source at full speed (a file replayed, read losslessly) instead of paced like a camera:
the ingest rate is then bounded by the machine, which is where the fair share between frames and answers
must hold. All traffic goes to 127.0.0.1 and is bounded in time (``--load-s``) and count (``--max-requests``).

Reported: ingest frames/s idle and under load (and their ratio), ``/healthz`` latency p50/p99/max in
each phase and how many probes were served, the load's statuses and latency. The targets of issue 13 (≥ 80 %
of the idle ingest rate, ``/healthz`` p99 < 100 ms) are printed next to the figures, not asserted. The
ingest rate under load is set by the daemon's rule for sharing its loop between frames and answers; the
HTTP side (non-blocking handoff) decides ``/healthz``. Figures only: JSON + PNG.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from edgekv.apps.bench.common import ClientThreads, daemon_port, serve_daemon

INGEST_TARGET = 0.8
HEALTHZ_P99_TARGET_MS = 100.0


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint dir (default: a fresh tiny random checkpoint)")
    parser.add_argument("--source", default="synthetic:shapes?size=320x240&fps=30&frames=10000000",
                        help="video source")
    parser.add_argument("--fps", type=float, default=8.0, help="sampling rate (video.fps)")
    parser.add_argument("--resolution", type=int, nargs=2, default=[112, 112], metavar=("H", "W"))
    parser.add_argument("--policy", default="infinipot_v", help="cache policy")
    parser.add_argument("--max-tokens", type=int, default=600, help="cache cap M")
    parser.add_argument("--chats", type=int, default=50, help="concurrent chat completions in the load phase")
    parser.add_argument("--answer-tokens", type=int, default=16, help="max_tokens of each chat")
    parser.add_argument("--idle-s", type=float, default=15.0, help="seconds measured before the load")
    parser.add_argument("--probe-ms", type=float, default=50.0, help="/healthz probe interval")
    parser.add_argument("--load", choices=("burst", "hammer", "read", "slowloris"), default="burst",
                        help="the load phase: chats once each, chats back to back, read-only routes, or a "
                             "one-host slowloris (see the module docstring)")
    parser.add_argument("--load-s", type=float, default=30.0, help="length of a hammer / read / slowloris phase")
    parser.add_argument("--clients", type=int, default=20, help="connections of a read or slowloris load")
    parser.add_argument("--max-requests", type=int, default=100000, help="bound on the requests a load sends")
    parser.add_argument("--attacker", default="127.0.0.2", help="loopback address the slowloris connects from")
    parser.add_argument("--stagger-s", type=float, default=0.0,
                        help="hammer: client i sends its first chat i x this many seconds into the load (so that "
                             "chats arrive while answers decode, not all before the first one starts)")
    parser.add_argument("--replay", action="store_true",
                        help="play the source at full speed (read losslessly) instead of paced like a camera")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=JSON",
                        help="extra config override, e.g. video.min_ingest_share=0.8 (repeatable)")
    parser.add_argument("--json", default="bench-api.json")
    parser.add_argument("--plot", default="bench-api.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_api)


# ---------------------------------------------------------------------------------------------- the daemon
def _sections(args: argparse.Namespace, model_dir: Path) -> dict:
    sections = {
        "model": {"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        "video": {"source": args.source, "fps": args.fps, "resolution": list(args.resolution)},
        "cache": {"policy": args.policy, "max_tokens": args.max_tokens, "text_reserve_tokens": 96},
        "server": {"port": 0, "queue_size": max(args.chats, 16), "max_new_tokens": max(args.answer_tokens, 1),
                   "max_connections": max(100, args.chats + 32)},
        "generation": {"max_new_tokens": args.answer_tokens},
        "monitor": {"interval_s": 1.0, "backend": "cpu"},
        "_replay": bool(args.replay),
    }
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        if not (section and name and value):
            raise SystemExit(f"edgekv bench api: --set {item!r}: expected SECTION.KEY=JSON")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        sections.setdefault(section, {})[name] = parsed
    return sections


# ---------------------------------------------------------------------------------------------- clients
def _get(port: int, path: str, timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Prober:
    """``/healthz`` every ``interval_s`` on a fresh connection: (time, latency s, frames or None)."""

    def __init__(self, port: int, interval_s: float) -> None:
        self.port, self.interval_s = port, interval_s
        self.samples: list[tuple[float, float, int | None]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Prober":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status, body = _get(self.port, "/healthz", timeout=10)
                frames = json.loads(body)["frames"] if status == 200 else None
            except (OSError, ValueError, KeyError):
                self.failures += 1
                frames = None
            self.samples.append((started, time.monotonic() - started, frames))
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def _chat(port: int, index: int, tokens: int, barrier: threading.Barrier, out: list) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": f"What happened, question {index}?"}],
                       "max_tokens": tokens}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.connect()
        barrier.wait(30)
        started = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        out.append((response.status, started, time.monotonic()))
    except OSError as exc:
        out.append((f"error: {exc}", time.monotonic(), time.monotonic()))
    finally:
        conn.close()


class Load(ClientThreads):
    """Clients sending ``kind`` traffic until ``stop()`` or ``max_requests`` in all: statuses counted."""

    READ_ROUTES = ("/metrics", "/v1/edgekv/status", "/frame.jpg", "/v1/models")

    def __init__(self, kind: str, port: int, clients: int, args: argparse.Namespace) -> None:
        self.kind, self.port, self.args = kind, port, args
        self.deadline = time.monotonic() + args.load_s  # a request still waiting then is left (not counted)
        self.statuses: dict[str, int] = {}
        self.latencies: list[float] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        target = {"hammer": self._chats, "read": self._reads, "slowloris": self._slowloris}[kind]
        self.threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(clients)]


    def _count(self, status, seconds: float | None = None) -> bool:
        """Record one outcome; False once the bound on requests is reached."""
        with self._lock:
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            if seconds is not None:
                self.latencies.append(seconds)
            self.requests += 1
            if self.requests >= self.args.max_requests:
                self._stop.set()
        return not self._stop.is_set()

    def _chats(self, index: int) -> None:
        sent = 0
        if self._stop.wait(index * self.args.stagger_s):
            return
        while not self._stop.is_set():
            body = json.dumps({"messages": [{"role": "user", "content": f"What happened, client {index}, "
                                                                         f"question {sent}?"}],
                               "max_tokens": self.args.answer_tokens}).encode()
            started = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=max(1.0, self.deadline - started + 2))
            try:
                conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                status = response.status
            except OSError as exc:
                if time.monotonic() >= self.deadline:
                    return  # still waiting when the load ended: left, not counted
                status = f"error: {type(exc).__name__}"
            finally:
                conn.close()
            sent += 1
            if not self._count(status, time.monotonic() - started):
                return

    def _reads(self, index: int) -> None:
        conn = None
        turn = index
        while not self._stop.is_set():
            path = self.READ_ROUTES[turn % len(self.READ_ROUTES)]
            turn += 1
            started = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                status = response.status
                if response.will_close:
                    conn.close()
                    conn = None
            except OSError as exc:
                status = f"error: {type(exc).__name__}"
                if conn is not None:
                    conn.close()
                conn = None
            if not self._count(status, time.monotonic() - started):
                break
        if conn is not None:
            conn.close()

    def _slowloris(self, _index: int) -> None:
        """Half a request, held until the server closes it; then again at once (from ``--attacker``)."""
        while not self._stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5,
                                                source_address=(self.args.attacker, 0))
            except OSError as exc:
                if not self._count(f"connect error: {type(exc).__name__}"):
                    return
                self._stop.wait(0.05)
                continue
            try:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                sock.settimeout(0.5)
                first = b""
                while not self._stop.is_set():
                    try:
                        chunk = sock.recv(4096)
                    except socket.timeout:
                        sock.sendall(b"a")  # one more byte of the never-ending header
                        continue
                    if not chunk:
                        break
                    first = first or chunk
                status = first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed"
            except OSError as exc:
                status = f"error: {type(exc).__name__}"
            finally:
                sock.close()
            if not self._count(f"slowloris {status}"):
                return


# ---------------------------------------------------------------------------------------------- figures
def _rate(samples: list[tuple[float, float, int | None]], start: float, end: float) -> float | None:
    """Frames per second between the first and last probe answered inside [start, end]."""
    inside = [(t, f) for t, _, f in samples if start <= t <= end and f is not None]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _common(prober, windows: tuple, status: int, metrics: bytes) -> dict:
    """What every load's result holds beside its own figures: targets, the probes and the windows."""
    idle_start, idle_end, load_start, load_end = windows
    return {
        "targets": {"ingest_ratio_min": INGEST_TARGET, "healthz_p99_ms_max": HEALTHZ_P99_TARGET_MS},
        "probe_failures": prober.failures,
        "samples": [{"t": t - idle_start, "latency_ms": 1e3 * latency, "frames": frames}
                    for t, latency, frames in prober.samples],
        "windows": {"idle": [0.0, idle_end - idle_start], "load": [load_start - idle_start, load_end - idle_start]},
        "daemon_status": json.loads(metrics).get("daemon") if status == 200 else None,
    }


def _latency_ms(samples: list, start: float, end: float) -> dict:
    values = sorted(1e3 * latency for t, latency, _ in samples if start <= t <= end)
    if not values:
        return {"n": 0}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": pick(0.50), "p99": pick(0.99), "max": values[-1]}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_api(args: argparse.Namespace) -> int:
    if args.model:
        model_dir = Path(args.model)
    else:
        from edgekv.model.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="edgekv-bench-")) / "tiny", preset="tiny")
    log_path = Path(tempfile.mkdtemp(prefix="edgekv-bench-api-")) / "daemon.log"
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    child = context.Process(target=serve_daemon, args=(_sections(args, model_dir), str(log_path), port_queue))
    load_before = os.getloadavg()
    child.start()
    try:
        port = daemon_port(child, port_queue)
        if port is None:
            raise SystemExit(f"edgekv bench api: the daemon did not start; see {log_path}")
        result = _measure(port, args)
    finally:
        child.terminate()  # SIGTERM: the daemon finishes its step and exits
        child.join(60)
        if child.is_alive():
            child.kill()
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    result["run"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
                     "model": str(model_dir), "daemon_log": str(log_path),
                     "args": {k: v for k, v in vars(args).items() if k not in ("run", "func")}}
    Path(args.json).write_text(json.dumps(result, indent=1))
    _print(result)
    if args.plot:
        _plot(result, Path(args.plot))
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _measure(port: int, args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # warm up: a few pairs in, the first compression behind if any
        status, body = _get(port, "/healthz")
        if status == 200 and json.loads(body)["frames"] >= 8:
            break
        time.sleep(0.2)
    prober = Prober(port, args.probe_ms / 1e3).start()
    idle_start = time.monotonic()
    time.sleep(args.idle_s)
    idle_end = time.monotonic()
    if args.load != "burst":
        return _measure_load(port, args, prober, idle_start, idle_end)
    barrier = threading.Barrier(args.chats + 1)
    answers: list = []
    threads = [threading.Thread(target=_chat, args=(port, i, args.answer_tokens, barrier, answers), daemon=True)
               for i in range(args.chats)]
    for thread in threads:
        thread.start()
    barrier.wait(60)
    load_start = time.monotonic()
    for thread in threads:
        thread.join(900)
    load_end = time.monotonic()
    time.sleep(2.0)
    prober.stop()
    statuses: dict[str, int] = {}
    for status, _, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    latencies = sorted(end - start for status, start, end in answers if status == 200)
    idle_rate, load_rate = _rate(prober.samples, idle_start, idle_end), _rate(prober.samples, load_start, load_end)
    status, metrics = _get(port, "/v1/edgekv/status")
    return {
        "idle": {"seconds": idle_end - idle_start, "ingest_fps": idle_rate,
                 "healthz_ms": _latency_ms(prober.samples, idle_start, idle_end)},
        "load": {"seconds": load_end - load_start, "chats": args.chats, "answer_tokens": args.answer_tokens,
                 "statuses": statuses, "ingest_fps": load_rate,
                 "ingest_ratio": load_rate / idle_rate if idle_rate and load_rate is not None else None,
                 "healthz_ms": _latency_ms(prober.samples, load_start, load_end),
                 "chat_latency_s": {"p50": statistics.median(latencies), "max": latencies[-1]} if latencies else None},
        **_common(prober, (idle_start, idle_end, load_start, load_end), status, metrics),
    }


def _served(samples: list, start: float, end: float) -> dict:
    """Probes sent inside [start, end] and how many got an answer (a 200 with the frame count)."""
    inside = [frames for t, _, frames in samples if start <= t <= end]
    return {"sent": len(inside), "served": sum(f is not None for f in inside)}


def _measure_load(port: int, args: argparse.Namespace, prober: Prober, idle_start: float, idle_end: float) -> dict:
    clients = args.chats if args.load == "hammer" else args.clients
    load = Load(args.load, port, clients, args).start()
    load_start = time.monotonic()
    load._stop.wait(args.load_s)
    load_end = time.monotonic()
    load.stop()
    time.sleep(2.0)
    prober.stop()
    idle_rate, load_rate = _rate(prober.samples, idle_start, idle_end), _rate(prober.samples, load_start, load_end)
    latencies = sorted(load.latencies)
    status, metrics = _get(port, "/v1/edgekv/status")
    return {
        "idle": {"seconds": idle_end - idle_start, "ingest_fps": idle_rate,
                 "healthz_ms": _latency_ms(prober.samples, idle_start, idle_end),
                 "healthz_served": _served(prober.samples, idle_start, idle_end)},
        "load": {"kind": args.load, "seconds": load_end - load_start, "clients": clients,
                 "chats": clients if args.load == "hammer" else 0, "answer_tokens": args.answer_tokens,
                 "requests": load.requests, "statuses": load.statuses, "ingest_fps": load_rate,
                 "ingest_ratio": load_rate / idle_rate if idle_rate and load_rate is not None else None,
                 "healthz_ms": _latency_ms(prober.samples, load_start, load_end),
                 "healthz_served": _served(prober.samples, load_start, load_end),
                 "chat_latency_s": ({"p50": statistics.median(latencies), "max": latencies[-1]}
                                    if latencies and args.load == "hammer" else None)},
        **_common(prober, (idle_start, idle_end, load_start, load_end), status, metrics),
    }


def _print(result: dict) -> None:
    idle, load = result["idle"], result["load"]
    fmt = lambda x, d=2: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
    ratio = load["ingest_ratio"]
    print(f"idle  {idle['seconds']:.1f} s: ingest {fmt(idle['ingest_fps'])} frames/s, /healthz p50 "
          f"{fmt(idle['healthz_ms'].get('p50'), 1)} ms p99 {fmt(idle['healthz_ms'].get('p99'), 1)} ms")
    what = (f"{load['chats']} chats x {load['answer_tokens']} tokens" if load.get("kind", "burst") in ("burst", "hammer")
            else f"{load['clients']} {load['kind']} clients")
    print(f"load  {load['seconds']:.1f} s ({load.get('kind', 'burst')}: {what}, {load.get('requests', load.get('chats'))} requests, "
          f"statuses {load['statuses']}): ingest {fmt(load['ingest_fps'])} frames/s = {fmt(ratio and 100 * ratio, 0)} % of idle "
          f"(target >= {100 * INGEST_TARGET:.0f} %), /healthz p50 {fmt(load['healthz_ms'].get('p50'), 1)} ms p99 "
          f"{fmt(load['healthz_ms'].get('p99'), 1)} ms max {fmt(load['healthz_ms'].get('max'), 1)} ms "
          f"(target p99 < {HEALTHZ_P99_TARGET_MS:.0f} ms)")
    if "healthz_served" in load:
        served = load["healthz_served"]
        print(f"      /healthz probes served under load: {served['served']} of {served['sent']}")
    if load["chat_latency_s"]:
        latency = load["chat_latency_s"]
        print(f"      chat latency median {latency['p50']:.1f} s, last {latency['max']:.1f} s")
    print(f"      machine load average before/after: {result['machine']['loadavg_before'][0]:.2f} / "
          f"{result['machine']['loadavg_after'][0]:.2f} on {result['machine']['cpus']} CPUs")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    t = [s["t"] for s in samples if s["frames"] is not None]
    top.plot(t, [s["frames"] for s in samples if s["frames"] is not None], color="tab:blue")
    load = result["windows"]["load"]
    for axis in (top, bottom):
        axis.axvspan(load[0], load[1], color="tab:orange", alpha=0.15,
                     label=f"load: {result['load'].get('kind', 'burst')}")
    ratio = result["load"]["ingest_ratio"]
    top.set_ylabel("frames ingested")
    top.set_title(f"ingest {result['idle']['ingest_fps'] or 0:.2f} fps idle, "
                  f"{result['load']['ingest_fps'] or 0:.2f} fps under load ({100 * (ratio or 0):.0f} %; "
                  f"target >= {100 * INGEST_TARGET:.0f} %)")
    top.legend(loc="upper left")
    bottom.scatter([s["t"] for s in samples], [max(s["latency_ms"], 0.1) for s in samples], s=4, color="tab:green")
    bottom.axhline(HEALTHZ_P99_TARGET_MS, color="tab:red", linestyle="--", label="p99 target 100 ms")
    bottom.set_yscale("log")
    bottom.set_ylabel("/healthz latency (ms)")
    bottom.set_xlabel("seconds")
    p99 = result["load"]["healthz_ms"].get("p99")
    bottom.set_title(f"/healthz under load: p50 {result['load']['healthz_ms'].get('p50', 0):.1f} ms, p99 "
                     f"{p99 or 0:.1f} ms")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
