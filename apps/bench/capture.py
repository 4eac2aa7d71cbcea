"""``edgekv bench capture``: what a camera's capture thread costs the CPU, decoding every frame against decoding only
the frames the sampler may take (edgekv/video/capture.py, ``CaptureThread.two_phase``).

A camera sends 30 frames a second whatever the model takes; the daemon samples ``video.fps`` of them (2 by default).
The capture thread must still take every frame from the driver or the network (else the newest is not the one
handed out), but only the frames near a sampler tick need their pixels: OpenCV's ``grab`` takes a frame, ``retrieve``
converts it to BGR — and, from a V4L2 camera sending MJPEG (what 720p and 1080p at 30 fps over USB 2 need), decodes
the JPEG. Each mode runs ``--seconds`` with a consumer taking ``--sample-fps`` frames a second, as the daemon's loop
does; reported per mode: the capture thread's CPU time a second (``/proc/self/task/TID/stat``: a share of one core),
the process's, frames read, frames decoded and frames handed out, the saving, and how old a frame is when it is
taken (from the moment the capture had it, before its pixels were retrieved where they were: the wanted mode's
figure includes the decoding, the other's does not). The modes alternate over
``--repeats`` rounds, so drift in the machine's load falls on both.

The source defaults to a 1080p MJPEG clip made at run time, played at its own 30 fps, looped (a stand-in for a USB
camera read by FFmpeg: FFmpeg decodes in ``grab``, so this measures the conversion only). On a device, name the camera:
``--source '/dev/video0?width=1920&height=1080&fps=30&fourcc=MJPG'`` or an ``rtsp://`` stream.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from edgekv.apps.bench.common import provenance, write_figures

MODES = ("every", "wanted")


def add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default=None,
                        help="a video source as video.source takes it (default: a 1080p MJPEG clip at 30 fps, looped)")
    parser.add_argument("--size", type=int, nargs=2, metavar=("W", "H"), default=(1920, 1080),
                        help="the default clip's frame size")
    parser.add_argument("--fps", type=float, default=30.0, help="the default clip's frame rate")
    parser.add_argument("--sample-fps", type=float, default=2.0, help="frames a second the consumer takes (video.fps)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each mode's run, each round")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the modes alternating")
    parser.add_argument("--json", default="bench-capture.json")
    parser.add_argument("--plot", default="bench-capture.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_capture)


def make_clip(path: Path, size: tuple[int, int], fps: float, frames: int) -> Path:
    """A camera-like MJPEG clip: sensor grain over gradients, and shapes that move (JPEGs of a camera's size)."""
    import cv2
    import numpy as np

    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (width, height))
    if not writer.isOpened():
        raise ValueError(f"could not write an MJPEG clip of {width}x{height} at {path}")
    rng = np.random.default_rng(0)
    base = np.dstack([np.linspace(40, 200, width, dtype=np.float32)[None, :].repeat(height, 0)] * 3)
    for k in range(frames):
        frame = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
        x = int((k * 37) % max(1, width - 200))
        cv2.rectangle(frame, (x, height // 3), (x + 200, height // 3 + 150), (30, 60, 220), -1)
        cv2.circle(frame, (width - x - 100, 2 * height // 3), 90, (200, 160, 20), -1)
        writer.write(frame)
    writer.release()
    return path


def _thread_cpu_s(native_id: int | None) -> float | None:
    """A thread's user + system CPU seconds (Linux ``/proc``), None where it cannot be read."""
    if native_id is None:
        return None
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def measure(spec: str, mode: str, sample_fps: float, seconds: float) -> dict:
    """One run: a capture in ``mode`` over ``spec`` (a recorded source looped and paced), a consumer taking
    ``sample_fps`` frames a second through a ``Sampler``, for ``seconds``."""
    from edgekv.video.capture import CaptureThread, Sampler
    from edgekv.video.sources import LoopingSource, open_source

    source = open_source(spec)
    if not source.live:
        source = LoopingSource(source, lambda: open_source(spec))
    capture = CaptureThread(source, decode_all=mode == "every", pace=True if not source.live else None)
    sampler = Sampler(capture.start(), sample_fps)
    taken = 0
    try:
        # the first frame and a second of warm-up outside the figures (the driver's start, the rate estimate)
        if sampler.next_frame(timeout=30) is None:
            raise ValueError(f"{spec}: no frame within 30 s")
        warm = time.monotonic() + 1.0
        while time.monotonic() < warm:
            sampler.next_frame(timeout=1)
        before = capture.stats()
        thread_0, process_0, started = (_thread_cpu_s(capture._thread.native_id), time.process_time(),
                                        time.monotonic())
        while (now := time.monotonic()) < started + seconds:
            taken += sampler.next_frame(timeout=started + seconds - now) is not None
        elapsed = time.monotonic() - started
        thread_1, process_1 = _thread_cpu_s(capture._thread.native_id), time.process_time()
        after = capture.stats()
    finally:
        sampler.close()
    taken = after["frames_consumed"] - before["frames_consumed"]
    age = None if not taken else (after["age_ms_taken"] * after["frames_consumed"]
                                  - (before["age_ms_taken"] or 0.0) * before["frames_consumed"]) / taken
    read = after["frames_read"] - before["frames_read"]
    decoded = after["frames_decoded"] - before["frames_decoded"]
    thread_ms = None if thread_0 is None or thread_1 is None else (thread_1 - thread_0) * 1e3 / elapsed
    return {"mode": mode, "seconds": elapsed, "frames_read": read, "frames_decoded": decoded, "frames_taken": taken,
            "read_fps": read / elapsed, "capture_cpu_ms_per_s": thread_ms,
            "capture_cpu_ms_per_frame": None if thread_ms is None or not read else thread_ms * elapsed / read,
            "process_cpu_ms_per_s": (process_1 - process_0) * 1e3 / elapsed, "decodes": after["decodes"],
            "age_ms_taken": age}


def run_capture(args: argparse.Namespace) -> int:
    for flag, value in (("--sample-fps", args.sample_fps), ("--seconds", args.seconds), ("--fps", args.fps)):
        if not value > 0:
            raise ValueError(f"{flag}: must be > 0, got {value:g}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.source is None and not all(16 <= side <= 8192 for side in args.size):
        raise ValueError(f"--size: width and height of 16 to 8192 pixels, got {args.size[0]} {args.size[1]}")
    if args.source is not None:
        from edgekv.video.sources import open_source

        probe = open_source(args.source)
        try:
            if not probe.grab_saves_decoding:
                raise ValueError(f"--source {probe.spec}: a {probe.kind} source makes every frame's pixels as it "
                                 "reads it, so there is nothing to compare (the saving is for OpenCV's cameras, "
                                 "streams and files)")
        finally:
            probe.close()
    with tempfile.TemporaryDirectory(prefix="edgekv-bench-capture-") as folder:
        spec = args.source
        if spec is None:
            width, height = args.size
            spec = str(make_clip(Path(folder) / f"clip-{width}x{height}.avi", (width, height), args.fps,
                                 frames=max(2, round(2 * args.fps))))
        runs = []
        for round_ in range(args.repeats):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                row = {"round": round_, **measure(spec, mode, args.sample_fps, args.seconds)}
                runs.append(row)
                cpu = row["capture_cpu_ms_per_s"]
                print(f"round {round_} {mode:>6}: {row['read_fps']:5.1f} frames/s read, {row['frames_decoded']:5d} "
                      f"of {row['frames_read']} decoded, {row['frames_taken']} taken; capture thread "
                      + (f"{cpu:6.1f} ms CPU a second ({row['capture_cpu_ms_per_frame']:.2f} a frame)"
                         if cpu is not None else "CPU not readable")
                      + f", process {row['process_cpu_ms_per_s']:.1f}; a frame taken {_ms(row['age_ms_taken'])} ms "
                        f"after it came")
    summary = {}
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode]
        cpu = [r["capture_cpu_ms_per_s"] for r in rows if r["capture_cpu_ms_per_s"] is not None]
        ages = [r["age_ms_taken"] for r in rows if r["age_ms_taken"] is not None]
        summary[mode] = {"capture_cpu_ms_per_s": statistics.median(cpu) if cpu else None,
                         "age_ms_taken": statistics.median(ages) if ages else None,
                         "process_cpu_ms_per_s": statistics.median(r["process_cpu_ms_per_s"] for r in rows),
                         "decoded_share": sum(r["frames_decoded"] for r in rows) / max(1, sum(r["frames_read"]
                                                                                             for r in rows))}
    saving = {}
    for key, what in (("capture_cpu_ms_per_s", "capture thread"), ("process_cpu_ms_per_s", "process (FFmpeg's decoder "
                                                                                              "threads too)")):
        every, wanted = summary["every"][key], summary["wanted"][key]
        saving[key] = None if not every or wanted is None else 1.0 - wanted / every
        print(f"{what}, median: every frame decoded {_ms(every)} ms CPU a second, wanted frames only {_ms(wanted)} "
              f"({summary['wanted']['decoded_share']:.0%} of frames decoded)"
              + (f": {saving[key]:.0%} less" if saving[key] is not None else ""))
    print(f"a frame taken, median of runs: {_ms(summary['every']['age_ms_taken'])} ms after it came with every frame "
          f"decoded, {_ms(summary['wanted']['age_ms_taken'])} with the wanted ones (their decoding included)")
    result = {"source": spec if args.source else f"generated MJPEG {args.size[0]}x{args.size[1]} at {args.fps:g} fps",
              "sample_fps": args.sample_fps, "runs": runs, "summary": summary, "saving": saving,
              "provenance": provenance()}
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, what in zip(axes, ("capture_cpu_ms_per_s", "process_cpu_ms_per_s"), ("capture thread", "process")):
        for i, mode in enumerate(MODES):
            values = [r[key] or 0.0 for r in result["runs"] if r["mode"] == mode]
            ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
            ax.bar(i, statistics.median(values) if values else 0.0, color=("tab:grey", "tab:green")[i], alpha=0.7)
        ax.set_xticks(range(len(MODES)), ["every frame decoded", "frames the sampler may take"])
        ax.set(ylabel=f"{what} CPU, ms a second", title=what)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{result['source']}, sampled at {result['sample_fps']:g}/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
