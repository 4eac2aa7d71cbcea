"""Issue 27: does a toy vision tower read held-out backgrounds as well as the trained ones? (docs/measurements.md, "The
vision tower on held-out backgrounds")

Trains a tower — new (``--vision-width/--vision-depth``) or a checkpoint's (``--init``; ``--freeze``: only the
probes) — with the warm-up's two per-token linear probes (``edgekv.toy.train.warm_up_vision``'s losses) on frame
pairs of the randomized world drawn on ``--train-families`` (default: every family but the held-out ones), then
scores the probes on each of ``--families``: the same event draws on every background (one seed), so only the
background differs. Writes JSON: shape and colour accuracy on event tokens, and ``bg``, the share of background
tokens the colour probe calls background, per family; with ``--position`` (the warm-up's position probes too) also
``row`` / ``col``, event tokens whose row / column in the frame the probes read right; ``--save DIR`` keeps the
model with the trained tower.

    python tools/toy_tower_probe.py --steps 2000 --vision-width 128 --vision-depth 6 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from edgekv.preprocess import FramePreprocessor
from edgekv.toy.data import CELL
from edgekv.toy.model import init_model, toy_config
from edgekv.toy.train import _from_checkpoint, position_loss, probe_loss, token_positions, vision_batch
from edgekv.video.events import COLORS, SHAPES
from edgekv.video.world import DEFAULT_HOLDOUT, drawable_families, parse_families

SIZE = 112
EVAL_BATCH = 32


def train_probes(tower, width: int, steps: int, batch: int, lr: float, families: tuple[str, ...], freeze: bool,
                 log=print, position: bool = False):
    """The probes (shape, colour; with ``position`` row and column too) trained with the tower unless ``freeze``;
    returns (probes, history, seconds), the probes as a dict."""
    side = SIZE // CELL
    probes = {"shape": torch.nn.Linear(width, len(SHAPES) + 1), "color": torch.nn.Linear(width, len(COLORS) + 1)}
    if position:
        probes.update(row=torch.nn.Linear(width, side), col=torch.nn.Linear(width, side))
    tower.requires_grad_(not freeze)
    params = [*(() if freeze else tower.parameters()), *(p for probe in probes.values() for p in probe.parameters())]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    rng, preprocessor = np.random.default_rng(0), FramePreprocessor(resolution=(SIZE, SIZE))
    tower.train()
    history, started = [], time.perf_counter()
    for step in range(steps):
        pixels, grid, shape, color = vision_batch(rng, preprocessor, batch, families, SIZE, 1.0)
        tokens = tower(pixels, grid)
        loss = probe_loss(probes["shape"], probes["color"], tokens, shape, color)
        if position:
            loss = loss + position_loss(probes["row"], probes["col"], tokens, side)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % 50 == 0 or step == steps - 1:
            history.append({"step": step + 1, "loss": round(loss.item(), 4),
                            "seconds": round(time.perf_counter() - started, 1)})
            log(json.dumps(history[-1]))
    return probes, history, time.perf_counter() - started


@torch.no_grad()
def score(tower, probes: dict, family: str, pairs: int) -> dict:
    """Probe accuracies on ``pairs`` frame pairs of ``family`` (the same event draws for every family)."""
    tower.eval()
    rng, preprocessor = np.random.default_rng(1234), FramePreprocessor(resolution=(SIZE, SIZE))
    counts = {name: [0, 0] for name in ("shape", "color", "bg", *(("row", "col") if "row" in probes else ()))}
    for _ in range(max(1, pairs // EVAL_BATCH)):
        pixels, grid, shape, color = vision_batch(rng, preprocessor, EVAL_BATCH, (family,), SIZE, 1.0)
        tokens = tower(pixels, grid)
        background = color == 0
        checks = [("shape", probes["shape"](tokens[shape > 0]).argmax(-1) == shape[shape > 0]),
                  ("color", probes["color"](tokens[~background]).argmax(-1) == color[~background]),
                  ("bg", probes["color"](tokens[background]).argmax(-1) == 0)]
        if "row" in probes:
            row, col = token_positions(tokens.shape[0], SIZE // CELL)
            checks += [("row", probes["row"](tokens[~background]).argmax(-1) == row[~background]),
                       ("col", probes["col"](tokens[~background]).argmax(-1) == col[~background])]
        for name, ok in checks:
            counts[name][0] += int(ok.sum())
            counts[name][1] += ok.numel()
    out = {name: round(right / max(total, 1), 3) for name, (right, total) in counts.items()}
    out["tokens"] = counts["shape"][1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="per-token probes of a toy vision tower, per background family")
    parser.add_argument("--vision-width", type=int, default=64, help="a new tower's width")
    parser.add_argument("--vision-depth", type=int, default=4, help="a new tower's depth")
    parser.add_argument("--init", default=None, help="a toy checkpoint whose tower to probe instead")
    parser.add_argument("--freeze", action="store_true", help="train the probes only (the tower as it is)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32, help="frame pairs a step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-families", default=None, help="default: every family but the held-out ones")
    parser.add_argument("--families", default="classic,noise,photo,vtest,cells,skimage,tree",
                        help="the families to score (each must be available here)")
    parser.add_argument("--eval-pairs", type=int, default=384, help="frame pairs scored per family")
    parser.add_argument("--position", action="store_true",
                        help="also train and score row / column probes (the warm-up's position loss)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="also write the model with the trained tower as a toy checkpoint (the LM as it was: "
                             "go on with `train-toy --init DIR --freeze-vision`)")
    args = parser.parse_args(argv)
    try:
        trained = (parse_families(args.train_families) if args.train_families
                   else drawable_families(None, DEFAULT_HOLDOUT))
        scored = parse_families(args.families)
        missing = [f for f in (*trained, *scored) if f not in drawable_families(None, ())]
        if missing:
            raise ValueError(f"not available here: {', '.join(sorted(set(missing)))}")
    except ValueError as exc:
        print(f"toy_tower_probe: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.init:
        model = _from_checkpoint(args.init)[0]
    else:
        model = init_model(toy_config(vision_width=args.vision_width, vision_depth=args.vision_depth), 0)
    tower = model.visual
    probes, history, seconds = train_probes(tower, model.config.vision.out_hidden_size, args.steps, args.batch,
                                            args.lr, trained, args.freeze, position=args.position)
    by_family = {}
    for family in scored:
        by_family[family] = score(tower, probes, family, args.eval_pairs)
        print(family, by_family[family], flush=True)
    with open(args.out, "w") as handle:
        json.dump({"args": vars(args), "train_s": round(seconds, 1),
                   "params_tower": sum(p.numel() for p in tower.parameters()), "trained": list(trained),
                   "held_out": list(DEFAULT_HOLDOUT), "log": history, "by_family": by_family}, handle, indent=1)
    if args.save:
        from edgekv.toy.model import save_checkpoint

        save_checkpoint(model.eval(), args.save, {"note": f"tower trained by tools/toy_tower_probe.py "
                                                          f"{' '.join(argv if argv is not None else sys.argv[1:])}",
                                                  "tower_probe": by_family})
    return 0


if __name__ == "__main__":
    sys.exit(main())
