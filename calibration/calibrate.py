"""``edgekv calibrate``: choose a model's VaN CV thresholds tau1 < tau2 < tau3 from sample streams.

Streams each sample video through a session with the ``van`` policy and a small cap (so it compresses
often), records every layer's coefficient of variation of ||V|| at each compression (InfiniPot-V Alg. 2
lines 16-18), averages per layer, and writes the 25th/50th/75th percentiles of the per-layer means as
the thresholds (rule documented in ``edgekv.calibration.thresholds``). The runtime loads the file from
``cache.calibration``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


class Progress:
    """One status line on stderr: rewritten in place on a terminal, a line per tenth of the work in a log."""

    def __init__(self, total: int, stream: TextIO | None = None, label: str = "calibrate") -> None:
        self.total, self.label = max(total, 1), label
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.started = time.monotonic()
        self._last_tenth = -1

    def __call__(self, done: int, text: str) -> None:
        tenth = 10 * done // self.total
        if not self.live and tenth == self._last_tenth and done != self.total:
            return
        self._last_tenth = tenth
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (self.total - done) if done else float("nan")
        line = f"{self.label}: {100 * done / self.total:5.1f} %  {text}  ({elapsed:.0f} s, ~{eta:.0f} s left)"
        print(("\r" + line.ljust(100)) if self.live else line, end="" if self.live else "\n", file=self.stream,
              flush=True)

    def close(self) -> None:
        if self.live:
            print(file=self.stream, flush=True)


def calibrate(model_dir: str | Path, videos: list[str], out: str | Path, frames: int = 400,
              resolution: tuple[int, int] = (448, 448), max_tokens: int | None = None, fps: float = 1.0,
              dtype: str = "fp32", device: str = "auto",
              progress: Callable[[int, str], None] | None = None) -> dict:
    """``progress(frames_done, text)`` is called after every frame (all videos: ``frames * len(videos)``)."""
    import edgekv
    from edgekv.video.sources import looped_frames
    from edgekv.calibration.thresholds import write_thresholds

    target = Path(out)  # written last: a folder missing or read-only failed only after every video was streamed
    if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
        raise ValueError(f"--out {out}: {'a folder' if target.is_dir() else 'no writable folder ' + str(target.parent)}"
                         f"; name a YAML file in a folder that exists")
    for video in videos:  # each source opens before any is sampled: a bad last --video fails now, not after the rest
        first = looped_frames(video, 1, fps)
        try:
            next(first, None)
        finally:
            first.close()
    sums: list[float] = []  # per-layer CV sums over every video's compressions (running, not a list)
    count = 0
    per_pair = (resolution[0] // 28) * (resolution[1] // 28)
    cap = max_tokens or 64 + 256 + 12 * per_pair
    rt = edgekv.Runtime.from_pretrained(model_dir, model={"dtype": dtype, "device": device},  # once: a session a video
                                        video={"resolution": list(resolution), "fps": fps},
                                        cache={"policy": "van", "max_tokens": cap, "text_reserve_tokens": 256})
    for number, video in enumerate(videos):
        session = rt.session()
        for index, (frame, t) in enumerate(looped_frames(video, frames, fps)):
            session.ingest(frame, t=t)
            if progress is not None:
                progress(number * frames + index + 1, f"video {number + 1}/{len(videos)} frame {index + 1}/{frames}, "
                         f"{count + session.policy.cv_count} compressions sampled")
        policy = session.policy
        if policy.cv_count:
            sums = [a + b for a, b in zip(sums, policy.cv_sums)] if count else list(policy.cv_sums)
            count += policy.cv_count
    if not count:
        raise ValueError("no compression happened: use more --frames or a smaller --max-tokens")
    layer_cv = [total / count for total in sums]
    taus = write_thresholds(out, str(model_dir), layer_cv, samples=count)
    return {"thresholds": taus, "layer_cv": layer_cv, "compressions": count}


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Qwen2.5-VL checkpoint directory")
    parser.add_argument("--video", action="append", required=True,
                        help="sample video: file, rtsp://... or synthetic:... (repeatable)")
    parser.add_argument("--out", required=True, help="thresholds YAML to write (for cache.calibration)")
    parser.add_argument("--frames", type=int, default=400, help="frames sampled from each video")
    parser.add_argument("--fps", type=float, default=1.0, help="frames per second sampled from each video")
    parser.add_argument("--resolution", type=int, nargs=2, default=[448, 448], metavar=("H", "W"),
                        help="video.resolution of the deployment")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cache cap while sampling (default: room for 12 frame pairs, so it compresses often)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="model dtype")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def calibrate_main(args: argparse.Namespace) -> int:
    progress = None if args.quiet else Progress(args.frames * len(args.video))
    try:
        result = calibrate(args.model, args.video, args.out, frames=args.frames, resolution=tuple(args.resolution),
                           max_tokens=args.max_tokens, fps=args.fps, dtype=args.dtype, device=args.device,
                           progress=progress)
    finally:
        if progress is not None:
            progress.close()
    taus = ", ".join(f"{t:.4g}" for t in result["thresholds"])
    print(f"{result['compressions']} compressions sampled; thresholds tau1..tau3 = {taus}; wrote {args.out}")
    return 0
