"""``edgekv calibrate``: choose a model's VaN CV thresholds tau1 < tau2 < tau3 from sample streams.

Streams each sample video through a session with the ``van`` policy and a small cap (so it compresses
often), records every layer's coefficient of variation of ||V|| at each compression (InfiniPot-V Alg. 2
lines 16-18), averages per layer, and writes the 25th/50th/75th percentiles of the per-layer means as
the thresholds (rule documented in ``edgekv.calibration.thresholds``). The runtime loads the file from
``cache.calibration``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgekv.calibration.thresholds import write_thresholds


def calibrate(model_dir: str | Path, videos: list[str], out: str | Path, frames: int = 400,
              resolution: tuple[int, int] = (448, 448), max_tokens: int | None = None, fps: float = 1.0,
              dtype: str = "fp32", device: str = "auto") -> dict:
    import edgekv
    from edgekv.apps.bench import frame_stream

    sums: list[float] = []
    count = 0
    for video in videos:
        per_pair = (resolution[0] // 28) * (resolution[1] // 28)
        cap = max_tokens or 64 + 256 + 12 * per_pair
        rt = edgekv.Runtime.from_pretrained(model_dir, model={"dtype": dtype, "device": device},
                                            video={"resolution": list(resolution), "fps": fps},
                                            cache={"policy": "van", "max_tokens": cap, "text_reserve_tokens": 256})
        session = rt.session()
        for frame, t in frame_stream(video, frames, fps):
            session.ingest(frame, t=t)
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
    parser.add_argument("--model", required=True)
    parser.add_argument("--video", action="append", required=True, help="sample video (repeatable)")
    parser.add_argument("--out", required=True, help="thresholds YAML to write")
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--resolution", type=int, nargs=2, default=[448, 448], metavar=("H", "W"))
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--device", default="auto")


def calibrate_main(args: argparse.Namespace) -> int:
    result = calibrate(args.model, args.video, args.out, frames=args.frames, resolution=tuple(args.resolution),
                       max_tokens=args.max_tokens, fps=args.fps, dtype=args.dtype, device=args.device)
    taus = ", ".join(f"{t:.4g}" for t in result["thresholds"])
    print(f"{result['compressions']} compressions sampled; thresholds tau1..tau3 = {taus}; wrote {args.out}")
    return 0
