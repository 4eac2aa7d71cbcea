"""Issue 27: does the toy take near-white background for white things?

Asks the card's held-out streams (``edgekv eval toy``'s: the same events and questions, ``heldout_streams``) drawn
on one world background family (``--style mild``: only the background differs) and sorts the answers by how much of
the stream's frames is near-white (every channel above 200, measured on every 4th pair). With ``--cap V`` the same
streams are asked again with the background (not the events, which keep their colours) capped at V in every
channel before the camera's noise: nothing near-white left but the noise's few. If the toy answers the capped
streams as well as the card's renderer, near-white background is what it misreads.

    python tools/toy_near_white.py --model builtin:toy --family tree --streams 300 --cap 190
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from edgekv.eval.stats import proportion
from edgekv.eval.toy_accuracy import ask_stream, heldout_streams, scene_for
from edgekv.toy.questions import FAMILIES
from edgekv.video.world import WorldScene

NEAR_WHITE = 200  # every channel above this: near-white
BINS = ((0.0, 0.02), (0.02, 0.10), (0.10, 0.25), (0.25, 1.01))  # near-white share of the stream's frames


class CappedScene(WorldScene):
    """A world scene whose background (after its grading) is capped at ``cap`` in every channel."""

    cap: float = 255.0

    def _graded(self, canvas: np.ndarray) -> np.ndarray:
        return np.minimum(super()._graded(canvas), np.float32(self.cap))


def near_white_share(scene, pairs: int) -> float:
    """Share of pixels near-white (every channel above NEAR_WHITE) over frames of every 4th pair."""
    frames = np.stack([scene.frame(2 * pair) for pair in range(0, pairs, 4)])
    return float((frames.min(axis=3) > NEAR_WHITE).mean())


def capped(scene: WorldScene, cap: float) -> CappedScene:
    out = CappedScene(scene.width, scene.height, scene.fps, scene.seed, list(scene.events), scene.family,
                      scene.style, scene.frames)
    out.cap = cap
    return out


def figures(rows: list[tuple[float, str, bool]]) -> dict:
    """Accuracy overall, per question family and per near-white bin (with its own per-family split)."""
    def split(sel):
        by = {f: [ok for _, fam, ok in sel if fam == f] for f in FAMILIES}
        return {"all": proportion(sum(ok for *_, ok in sel), len(sel)) if sel else None,
                "by_question": {f: proportion(sum(v), len(v)) for f, v in by.items() if v}}
    out = split(rows)
    out["bins"] = [{"near_white": [lo, min(hi, 1.0)], **split([r for r in rows if lo <= r[0] < hi])} for lo, hi in BINS]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--family", default="tree", help="world background family (not events)")
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--size", type=int, choices=(112, 224), default=112)
    parser.add_argument("--cap", type=float, default=0.0,
                        help="also ask the streams with the background capped at this value (0: not)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.streams < 1 or not 0 <= args.cap <= 255 or args.family == "events":
        parser.error(f"--streams must be >= 1, --cap in 0..255, --family a world family (got {args.streams}, "
                     f"{args.cap}, {args.family!r})")
    from edgekv.runtime import Runtime

    torch.set_num_threads(args.threads)
    streams = heldout_streams(args.streams, size=args.size)
    longest = max(s.pairs for s in streams)
    runtime = Runtime.from_pretrained(args.model, model={"dtype": "fp32", "device": "cpu"},
                                      cache={"policy": "full", "max_tokens": 64 + (args.size // 28) ** 2 * longest + 64,
                                             "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [args.size, args.size]})
    drawn, cut, shares = [], [], []
    for stream in streams:
        scene = scene_for(stream, args.family)
        share = near_white_share(scene, stream.pairs)
        shares.append(share)
        said = ask_stream(runtime, scene, stream.pairs, stream.questions)
        drawn += [(share, qa.family, word == qa.answer) for qa, word in zip(stream.questions, said)]
        if args.cap:
            said = ask_stream(runtime, capped(scene, args.cap), stream.pairs, stream.questions)
            cut += [(share, qa.family, word == qa.answer) for qa, word in zip(stream.questions, said)]
    result = {"model": args.model, "family": args.family, "streams": args.streams, "size": args.size,
              "near_white": NEAR_WHITE,
              "share_percentiles_25_50_75": np.percentile(shares, [25, 50, 75]).round(4).tolist(),
              "as_drawn": figures(drawn)}
    if args.cap:
        result["cap"] = args.cap
        result["capped"] = figures(cut)
    for name in ("as_drawn", "capped") if args.cap else ("as_drawn",):
        entry = result[name]
        print(f"{name}: all {entry['all']['accuracy']:.3f} (n={entry['all']['n']}) | "
              + "; ".join(f"{q} {v['accuracy']:.3f}" for q, v in entry["by_question"].items()))
        for b in entry["bins"]:
            if b["all"]:
                print(f"  near-white {b['near_white'][0]:.2f}-{b['near_white'][1]:.2f}: {b['all']['accuracy']:.3f} "
                      f"(n={b['all']['n']})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
