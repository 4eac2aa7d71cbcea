"""``edgekv bench fleet``: how long one fleet question takes to be answered by many devices over MQTT 5.

``--devices`` simulated devices run in this process, each a real ``FleetAgent`` (its own MQTT connection, status,
subscriptions) in front of its own toy session that has watched its own ``synthetic:events`` stream (seed = the
device's index). A Mosquitto broker is started on a loopback port (``--broker`` uses one already running). Then
``--questions`` yes/no questions ("Was there a {colour} {shape}?") are asked with ``ask_fleet``, one after the
other, each gathered until every device has answered. Reported per question and overall: each answer's
end-to-end latency (question published -> answer received by the asker), the time until the last device
answered, the fleet overhead (end-to-end minus the device's own time from receiving the question to its
answer: MQTT, JSON, the network threads), and how many answers matched the streams' ground truth.

The simulated devices share one model on this machine, so their answers run one at a time (``model_lock``): the
k-th answer waits for k-1 others. On a real fleet every device answers in parallel; its latency is then about
one device's own time plus the overhead, both reported here.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from edgekv.apps.bench.common import provenance, write_figures

STREAM = "synthetic:events?size=112x112&fps=2&frames={frames}&seed={seed}&rate=0.15&noise=3"


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=10, help="simulated devices (each its own MQTT client)")
    parser.add_argument("--questions", type=int, default=10, help="fleet questions, asked one after the other")
    parser.add_argument("--pairs", type=int, default=24, help="frame pairs each device has watched")
    parser.add_argument("--broker", default=None, help="an MQTT broker already running (default: start Mosquitto "
                                                       "on a loopback port)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one question may take")
    parser.add_argument("--json", default="bench-fleet.json")
    parser.add_argument("--plot", default="bench-fleet.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_fleet)


def _mosquitto(directory: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None)
    if binary is None:
        raise SystemExit("edgekv bench fleet: mosquitto is not installed (apt-get install mosquitto), or give --broker")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = directory / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\n"
                      f"log_dest file {directory / 'mosquitto.log'}\n")
    process = subprocess.Popen([binary, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, f"mqtt://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit(f"edgekv bench fleet: mosquitto did not start; see {directory / 'mosquitto.log'}")


def _questions(count: int) -> list[tuple[str, str, str]]:
    from edgekv.video.events import COLORS, SHAPES

    pairs = [(colour, shape) for shape in SHAPES for colour in COLORS]
    return [(f"Was there a {c} {s}?", c, s) for c, s in (pairs[(7 * i) % len(pairs)] for i in range(count))]


def run_fleet(args: argparse.Namespace) -> int:
    import edgekv
    from edgekv.apps.outputs.mqtt import FleetAgent, SessionHost, ask_fleet
    from edgekv.config import FleetSection
    from edgekv.video.sources import iter_frames, open_source

    if args.devices < 1 or args.questions < 1 or args.pairs < 1:
        raise SystemExit("edgekv bench fleet: --devices, --questions and --pairs must be >= 1")
    scratch = Path(tempfile.mkdtemp(prefix="edgekv-bench-fleet-"))
    broker, url = (None, args.broker) if args.broker else _mosquitto(scratch)
    runtime = edgekv.Runtime.from_pretrained("builtin:toy", model={"dtype": "fp32", "device": "cpu"},
                                             cache={"policy": "infinipot_v", "max_tokens": 640,
                                                    "text_reserve_tokens": 64},
                                             video={"resolution": [112, 112], "fps": 2.0},
                                             generation={"max_new_tokens": 4})
    lock = threading.Lock()
    devices, scenes = [], {}
    try:
        for index in range(args.devices):
            spec = STREAM.format(frames=2 * args.pairs, seed=index)
            source = open_source(spec)
            scenes[f"device-{index:02d}"] = source.scene
            source.close()
            host = SessionHost(runtime.session(), spec, model_lock=lock)
            for frame, t in iter_frames(spec):
                host.ingest(frame, t)
            host.stream_state = "ended"
            section = FleetSection(broker=url, device_id=f"device-{index:02d}", status_every_s=5.0)
            devices.append((FleetAgent(section, host.start()).start(), host))
        deadline = time.monotonic() + 60
        # every device's retained "online" status held by the broker (sent back to the device itself): an asker that
        # subscribes now gets them all before it decides that nobody is online (apps/outputs/mqtt.py ask_fleet)
        while not all(agent.connected.is_set() and agent.counts["status_echoed"] for agent, _ in devices):
            if time.monotonic() > deadline:
                raise SystemExit("edgekv bench fleet: not every device connected within 60 s")
            time.sleep(0.05)
        records = []
        for text, colour, shape in _questions(args.questions):
            result = ask_fleet(text, url, timeout_s=args.timeout)
            answers = []
            for a in result.answers:
                truth = "yes" if any(e.color == colour and e.shape == shape for e in scenes[a.device].events) else "no"
                answers.append({"device": a.device, "answer": a.answer, "truth": truth, "latency_ms": a.latency_s * 1e3,
                                "device_ms": a.device_s * 1e3 if a.device_s is not None else None,
                                "ttft_ms": a.ttft_s * 1e3 if a.ttft_s is not None else None,
                                "evidence_t": a.evidence_t, "error": a.error})
            records.append({"question": text, "answers": answers, "silent": result.silent,
                            "all_answered_ms": result.elapsed_s * 1e3 if not result.silent else None})
            print(f"{text:34s} {len(answers)}/{args.devices} answers, last after {result.elapsed_s * 1e3:7.1f} ms, "
                  f"{sum(x['answer'] == x['truth'] for x in answers)} right")
    finally:
        for agent, host in devices:
            agent.stop()
            host.stop()
        if broker is not None:
            broker.terminate()
            broker.wait(10)
    result = _summarize(records, args)
    result.update(provenance=provenance(),
                  broker=url if args.broker else "mosquitto on 127.0.0.1 (started by the bench)",
                  load_average_after=list(os.getloadavg()), records=records)
    s = result["summary"]
    print(f"{args.devices} devices x {args.questions} questions: all answered in median "
          f"{s['all_answered_ms']['median']:.1f} ms (p90 {s['all_answered_ms']['p90']:.1f}); first answer median {s['first_answer_ms']['median']:.1f} ms; "
          f"fleet overhead per answer median {s['overhead_ms']['median']:.2f} ms (p90 {s['overhead_ms']['p90']:.2f}); "
          f"device's own time median {s['device_ms']['median']:.1f} ms; {s['right']}/{s['answers']} answers right")
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "median": None, "p90": None, "min": None, "max": None}
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]  # nearest rank
    return {"n": len(ordered), "median": statistics.median(ordered), "p90": p90, "min": ordered[0], "max": ordered[-1]}


def _summarize(records: list[dict], args: argparse.Namespace) -> dict:
    answers = [a for r in records for a in r["answers"]]
    timed = [a for a in answers if a["device_ms"] is not None]
    return {"devices": args.devices, "questions": args.questions, "pairs": args.pairs, "summary": {
        "all_answered_ms": _stats([r["all_answered_ms"] for r in records if r["all_answered_ms"] is not None]),
        "first_answer_ms": _stats([min(a["latency_ms"] for a in r["answers"]) for r in records if r["answers"]]),
        "latency_ms": _stats([a["latency_ms"] for a in answers]),
        "device_ms": _stats([a["device_ms"] for a in timed]),
        "overhead_ms": _stats([a["latency_ms"] - a["device_ms"] for a in timed]),
        "answers": len(answers), "right": sum(a["answer"] == a["truth"] for a in answers),
        "silent": sum(len(r["silent"]) for r in records)}}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for index, record in enumerate(result["records"]):
        ordered = sorted(record["answers"], key=lambda a: a["latency_ms"])
        left.plot(range(1, len(ordered) + 1), [a["latency_ms"] for a in ordered], marker="o", alpha=0.6,
                  label=f"q{index + 1}" if index < 10 else None)
    left.set_xlabel("answer, in order of arrival")
    left.set_ylabel("ms from the question to the answer")
    left.set_title(f"{result['devices']} devices, one question at a time")
    left.legend(fontsize=7, ncol=2)
    overhead = [a["latency_ms"] - a["device_ms"] for r in result["records"] for a in r["answers"]
                if a["device_ms"] is not None]
    device = [a["device_ms"] for r in result["records"] for a in r["answers"] if a["device_ms"] is not None]
    right.boxplot([device, overhead], tick_labels=["device's own time\n(queued + answered)",
                                                   "fleet overhead\n(MQTT, JSON, threads)"], showfliers=True)
    right.set_title("per answer (the simulated devices share one model)", fontsize=10)
    right.set_ylabel("ms per answer")
    right.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
