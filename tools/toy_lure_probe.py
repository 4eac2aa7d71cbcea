"""Issue 27: can a toy's vision tower tell a needle from a look-alike of the same colour? (docs/measurements.md,
"Look-alikes in the tower")

Draws frame pairs of the randomized world, each with one object: half of them a vocabulary shape (an event), half a
look-alike (``edgekv.video.world.DISTRACTOR_SHAPES`` — star, ring, hexagon, ellipse — in a vocabulary colour, as
``eval needle --lures`` passes them), on the trained background families, and takes the tower's merged token the
object covers most. A linear probe (8 classes: the four shapes and the four look-alikes) trained on three quarters
of them is scored on the rest: how often a look-alike is read as a vocabulary shape and the reverse, by radius, and
the confusions. What the probe cannot read from one token, the LM reads only from the token's neighbours or not at
all: a ceiling on how well a toy answers lured streams (``eval needle --busy 0.2 --lures 1``).

    python tools/toy_lure_probe.py --model builtin:toy --pairs 4000 --out lure_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from edgekv.model.builtin import resolve_model_path
from edgekv.model.loading import load_pretrained
from edgekv.preprocess import FramePreprocessor
from edgekv.toy.data import CELL
from edgekv.video.events import COLORS, SHAPES
from edgekv.video.world import (DEFAULT_HOLDOUT, DISTRACTOR_SHAPES, Clutter, WorldScene, WorldStyle,
                                distractor_mask, draw_radius, drawable_families, world_event, world_radius_range)

CLASSES = (*SHAPES, *DISTRACTOR_SHAPES)
RADII = ((0, 20), (20, 1000))  # px: small (about one merged cell across) and the rest


def tokens_of(model, size: int, pairs: int, seed: int, families: tuple[str, ...]):
    """(features [pairs, width], class index [pairs], radius [pairs]) of the token each pair's object covers most."""
    rng = np.random.default_rng(seed)
    preprocessor = FramePreprocessor(resolution=(size, size))
    side = size // CELL
    features, labels, radii = [], [], []
    with torch.no_grad():
        for _ in range(pairs):
            color = str(rng.choice(COLORS))
            style = WorldStyle(noise=float(rng.uniform(1, 6)),
                               jpeg=int(rng.integers(40, 91)) if rng.random() < 0.5 else 0)
            family = families[int(rng.integers(len(families)))]
            if rng.random() < 0.5:  # a look-alike, as ``lure_clutter`` draws them
                shape = str(rng.choice(DISTRACTOR_SHAPES))
                low, high = world_radius_range(size, size)
                radius = float(draw_radius(rng, (low, max(low, high * 2 // 3))))
                center = (float(rng.uniform(radius, size - radius)), float(rng.uniform(radius, size - radius)))
                angle = float(rng.uniform(0, np.pi))
                scene = WorldScene(size, size, 2.0, int(rng.integers(2 ** 31)), [], family, style)
                scene.clutter = [Clutter(shape, color, center, radius, angle)]
                mask = distractor_mask(shape, center, radius, size, size, angle).astype(np.float64)
                cover = mask.reshape(side, CELL, side, CELL).mean(axis=(1, 3)).reshape(-1)
            else:
                shape = str(rng.choice(SHAPES))
                event = world_event(rng, shape, color, 0, 1, size, size)
                radius = float(event.radius)
                scene = WorldScene(size, size, 2.0, int(rng.integers(2 ** 31)), [event], family, style)
                cover = scene.cell_cover(event).reshape(-1)
            pixels, grid = preprocessor.pair(*scene.pair_frames(0))
            features.append(model.visual(pixels, grid)[int(np.argmax(cover))].float().numpy())
            labels.append(CLASSES.index(shape))
            radii.append(radius)
    return torch.tensor(np.array(features)), torch.tensor(labels), np.array(radii)


def probe(features: torch.Tensor, labels: torch.Tensor, radii: np.ndarray, steps: int = 1500) -> dict:
    """Train the 8-way linear probe on the first three quarters, score it on the rest."""
    x = (features - features.mean(0)) / (features.std(0) + 1e-6)
    cut = int(0.75 * len(labels))
    torch.manual_seed(0)
    head = torch.nn.Linear(x.shape[1], len(CLASSES))
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(head(x[:cut]), labels[:cut])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        predicted = head(x[cut:]).argmax(-1).numpy()
    truth, radius = labels[cut:].numpy(), radii[cut:]
    vocab, said_vocab = truth < len(SHAPES), predicted < len(SHAPES)
    out = {"test_pairs": int(len(truth)), "eight_way": round(float((predicted == truth).mean()), 4),
           "vocab_vs_lookalike": round(float((vocab == said_vocab).mean()), 4),
           "lookalike_read_as_vocab": round(float(said_vocab[~vocab].mean()), 4),
           "vocab_read_as_lookalike": round(float((~said_vocab[vocab]).mean()), 4), "by_radius": {}}
    for low, high in RADII:
        inside = (radius >= low) & (radius < high)
        if inside.any():
            out["by_radius"][f"{low}-{high if high < 1000 else 'max'} px"] = {
                "pairs": int(inside.sum()), "vocab_vs_lookalike": round(float((vocab == said_vocab)[inside].mean()), 4),
                "lookalike_read_as_vocab": round(float(said_vocab[inside & ~vocab].mean()), 4)
                if (inside & ~vocab).any() else None}
    out["confusion"] = {CLASSES[t]: {CLASSES[p]: int(((truth == t) & (predicted == p)).sum())
                                     for p in range(len(CLASSES)) if ((truth == t) & (predicted == p)).any()}
                        for t in range(len(CLASSES))}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:toy", help="a toy checkpoint directory or builtin:toy[-224]")
    parser.add_argument("--pairs", type=int, default=4000, help="frame pairs, one object each")
    parser.add_argument("--size", type=int, default=112, choices=(112, 224))
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = parser.parse_args(argv)
    if args.pairs < 40:
        parser.error(f"--pairs: at least 40 (a quarter of them are scored), got {args.pairs}")
    torch.set_num_threads(args.threads)
    model = load_pretrained(resolve_model_path(args.model)).eval()
    families = drawable_families(None, DEFAULT_HOLDOUT)
    result = {"model": args.model, "size": args.size, "pairs": args.pairs, "seed": args.seed,
              "families": list(families),
              **probe(*tokens_of(model, args.size, args.pairs, args.seed, families))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
