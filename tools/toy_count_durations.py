"""Issue 27: does a toy count one event that stays on screen for several frame pairs as one appearance?

Draws ``--streams`` classic streams (``edgekv.video.events``, 40 frame pairs at 2 fps, the card's noise) per event
duration in ``--durations``: 1-3 events of distinct shapes and colours at distinct pairs, the first of them lasting
the duration (the others one or two pairs), and asks "How many times did the {shape} appear?" about the first
(truth: ``one``) through the live session with the full cache. Prints and writes (``--out``) the share answered
right per duration. The same streams for every model (seeded by duration and stream index).

    python tools/toy_count_durations.py --model builtin:toy --streams 30 --out counts.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import edgekv
from edgekv.video.events import COLORS, SHAPES, EventScene, SceneStyle, place_event

PAIRS = 40


def stream(duration: int, index: int) -> EventScene:
    rng = np.random.default_rng((duration, index, 7))
    k = int(rng.integers(1, 4))
    shapes, colors = rng.permutation(SHAPES)[:k], rng.permutation(COLORS)[:k]
    starts = sorted(rng.choice(np.arange(3, PAIRS - 6), size=k, replace=False))
    events = []
    for j, (shape, color, start) in enumerate(zip(shapes, colors, starts)):
        pairs = duration if j == 0 else int(rng.integers(1, 3))
        events.append(place_event(rng, str(shape), str(color), int(start), pairs, 112, 112, avoid=events))
    return EventScene(112, 112, 2.0, index, events, SceneStyle(noise=3.0), frames=2 * PAIRS)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--durations", default="1,2,3", help="event lengths in frame pairs, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runtime = edgekv.Runtime.from_pretrained(args.model, model={"dtype": "fp32", "device": "cpu"},
                                             cache={"policy": "full", "max_tokens": 64 + 2 * PAIRS * 16 + 64},
                                             video={"resolution": [112, 112], "fps": 2.0})
    result = {"model": args.model, "streams": args.streams, "by_duration": {}}
    for duration in (int(d) for d in args.durations.split(",")):
        right = 0
        for index in range(args.streams):
            scene = stream(duration, index)
            session = runtime.session()
            for frame in range(2 * PAIRS):
                session.ingest(scene.frame(frame), t=frame / 2.0)
            answer = session.ask(f"How many times did the {scene.events[0].shape} appear?", max_new_tokens=1,
                                 temperature=0.0)
            right += answer.text == "one"
        result["by_duration"][duration] = {"right": right, "n": args.streams, "accuracy": round(right / args.streams, 3)}
        print(f"{args.model}: one event of {duration} pair(s) counted as one in {right}/{args.streams} streams")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
