"""``edgekv bench cameras``: several cameras on one model (``video.sources``, apps/daemon/cameras.py).

``--cameras`` synthetic:events streams (different seeds), paced like cameras at ``--fps`` each, share one model
for ``--seconds``; a client asks a question of each camera in turn every ``--ask-every-s``. The default frame
size (224²) and rate make the loop the bottleneck on a CPU, so the cameras compete for it. Reported:

- memory: process RSS before the model loads, once every camera runs, and sampled through the run; against the
  model's parameter bytes plus every camera's cache (allocated once: the bytes at the end are checked equal);
- per camera: frames offered (``--fps`` x seconds), frames ingested, its share of all frames ingested (issue
  28's target: each of N cameras at equal fps ≥ 0.9 / N of them, 45 % for two), questions answered.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from edgekv.apps.bench.common import provenance, write_figures


def add_cameras_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:toy", help="checkpoint dir or builtin:toy")
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--fps", type=float, default=30.0, help="each camera's frame rate (and video.fps)")
    parser.add_argument("--size", type=int, default=224, help="frame size (a multiple of 28)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the device's cache budget, split equally")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--ask-every-s", type=float, default=2.0, help="a question to the next camera this often")
    parser.add_argument("--json", default="bench-cameras.json")
    parser.add_argument("--plot", default="bench-cameras.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_cameras)


def _rss_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_cameras(args: argparse.Namespace) -> int:
    import torch  # noqa: F401 - torch and the package in memory before the first RSS figure

    import edgekv  # noqa: F401
    from edgekv.apps.daemon.cameras import CameraSet
    from edgekv.apps.daemon.loop import DaemonOptions
    from edgekv.apps.questions import Question
    from edgekv.config import EdgeKVConfig

    names = [f"cam{i}" for i in range(args.cameras)]
    size = f"{args.size}x{args.size}"
    config = EdgeKVConfig().with_overrides(
        model={"path": args.model, "dtype": "fp32", "device": "cpu"},
        video={"sources": [{"name": name, "source": f"synthetic:events?size={size}&fps={args.fps:g}"
                                                     f"&frames=100000000&seed={i + 1}"}
                           for i, name in enumerate(names)],
               "fps": args.fps, "resolution": [args.size, args.size]},
        cache={"policy": "infinipot_v", "max_tokens": args.max_tokens, "text_reserve_tokens": 64},
        server={"enabled": False}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2})
    rss_before = _rss_mib()
    log = open(os.devnull, "w")
    cameras = CameraSet(config, DaemonOptions(realtime=True, no_stdin=True, quiet=True), out=log)
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    try:  # Ctrl-C included: the cameras stop and their threads end before the interpreter does (else abort)
        if not cameras.ready.wait(600):
            raise SystemExit("edgekv bench cameras: the cameras did not start")
        daemons = cameras.daemons
        first = next(iter(daemons.values()))
        model_bytes = sum(p.numel() * p.element_size() for p in first.runtime.model.parameters())
        cache_bytes = {name: d.session.cache.capacity_bytes for name, d in daemons.items()}
        rss_ready = _rss_mib()
        start_frames = {name: d.session.counters.frames for name, d in daemons.items()}
        asked: list[Question] = []
        samples = []
        started = time.monotonic()
        next_ask, turn = started, 0
        while time.monotonic() - started < args.seconds:
            now = time.monotonic()
            if now >= next_ask:
                name = names[turn % len(names)]
                question = Question("Was there a red circle?", max_new_tokens=2, source="http")
                try:
                    daemons[name].submit(question)
                    asked.append(question)
                except Exception:  # noqa: BLE001 - a refused question is counted below
                    pass
                turn, next_ask = turn + 1, now + args.ask_every_s
            samples.append({"t": now - started, "rss_mib": _rss_mib(),
                            **{name: d.session.counters.frames - start_frames[name] for name, d in daemons.items()}})
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        ingested = {name: d.session.counters.frames - start_frames[name] for name, d in daemons.items()}
        cache_after = {name: d.session.cache.capacity_bytes for name, d in daemons.items()}
        answered = {name: d.session.counters.questions for name, d in daemons.items()}
    finally:
        cameras.stop.event.set()
        thread.join(120)
    total = sum(ingested.values()) or 1
    result = {
        "provenance": provenance(), "load_average_after": list(os.getloadavg()),
        "args": {k: v for k, v in vars(args).items() if not callable(v)}, "seconds": elapsed,
        "memory": {"rss_before_model_mib": rss_before, "rss_running_mib": rss_ready,
                   "rss_max_mib": max(s["rss_mib"] for s in samples), "rss_end_mib": samples[-1]["rss_mib"],
                   "model_parameter_mib": model_bytes / 2**20,
                   "cache_mib": {k: v / 2**20 for k, v in cache_bytes.items()},
                   "caches_unchanged": cache_bytes == cache_after,
                   "model_plus_caches_mib": (model_bytes + sum(cache_bytes.values())) / 2**20},
        "cameras": {name: {"frames_offered": args.fps * elapsed, "frames_ingested": ingested[name],
                           "ingested_of_offered": ingested[name] / (args.fps * elapsed),
                           "share_of_ingested": ingested[name] / total, "questions_answered": answered[name]}
                    for name in names},
        "questions_asked": len(asked), "questions_refused_or_failed": sum(1 for q in asked if q.error is not None),
        "share_target": 0.9 / len(names), "samples": samples,
    }
    m = result["memory"]
    print(f"{len(names)} cameras at {args.fps:g} fps, {args.size}x{args.size}, {elapsed:.0f} s on one model "
          f"(load average after {result['load_average_after'][0]:.2f} on {os.cpu_count()} CPUs)")
    print(f"memory: RSS {m['rss_before_model_mib']:.0f} MiB before the model, {m['rss_running_mib']:.0f} MiB with every "
          f"camera running, max {m['rss_max_mib']:.0f}, end {m['rss_end_mib']:.0f}; model parameters "
          f"{m['model_parameter_mib']:.1f} MiB + caches {sum(m['cache_mib'].values()):.2f} MiB "
          f"(caches unchanged: {m['caches_unchanged']})")
    for name, c in result["cameras"].items():
        print(f"  {name}: {c['frames_ingested']} frames ingested of {c['frames_offered']:.0f} offered "
              f"({100 * c['ingested_of_offered']:.0f} %), {100 * c['share_of_ingested']:.1f} % of all ingested "
              f"[target >= {100 * result['share_target']:.0f} %], {c['questions_answered']} questions answered")
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    t = [s["t"] for s in result["samples"]]
    for name in result["cameras"]:
        left.plot(t, [s[name] for s in result["samples"]], label=name)
    left.set_xlabel("s")
    left.set_ylabel("frames ingested")
    left.legend()
    left.set_title("each camera's ingest on one model")
    right.plot(t, [s["rss_mib"] for s in result["samples"]])
    right.axhline(result["memory"]["rss_before_model_mib"] + result["memory"]["model_plus_caches_mib"], ls="--",
                  color="grey", label="RSS before model + parameters + caches")
    right.set_xlabel("s")
    right.set_ylabel("process RSS, MiB")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
