"""Issue 27: can a toy's question tell a needle's token from a lure's at all, in the keys it reads?

The lured needle streams (``eval needle --lures 1 --lure-colors free``) cost the toy's full cache a quarter of its
answers, and no training signal on where its questions look (``train-toy --attend-weight``, ``--avoid-weight``,
``--distill-weight``) has taught it to read past the lures (docs/measurements.md, issue 27's lured section). A query can
only prefer a needle over a lure as far as the keys it reads separate them: this tool ingests the same streams with the
full cache and fits, per LM layer, a linear probe (class-balanced logistic regression, k-fold) from the cached keys
(post-RoPE, as the questions read them; both KV heads side by side, and each head alone) to "needle or lure", and
the same from the tower's output (the LM's input at those tokens). A token is a needle's when it is the cell under
an event's centre at a pair the event is on screen, a lure's when it is the cell a lure (a passing object in a
vocabulary colour) covers most at a pair it is on screen (one token a lure and pair, as one a needle and pair).

What it prints per feature set: the held-out balanced accuracy, the AUC and the share of lure tokens scored above
the score that 95 % of the needle tokens reach (FPR at 95 % TPR); and the same for needles against a sample of the
other video tokens (the background), the reference: what the keys tell apart when no lure is involved.
``--small 20`` keeps only objects of a lure's size, each whole in its token: the needles of events of radius <= 20
px and the lures covering at least half of their cell. With hundreds of lure tokens in a stream, a
query that reads one needle token past them needs that share near 0: at 0.05 a 250-pair stream still holds ~25
lure tokens a question cannot tell from a needle by any direction of that key space.

    python tools/toy_lure_keys.py --model builtin:toy --length 120 --seeds 49,50,51,52 --streams 8 --out keys.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from edgekv.cache.capped import SlotKind
from edgekv.toy.data import CELL
from edgekv.video.events import COLORS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_lure_attention import ingest_lured, stream_arguments, write_json  # noqa: E402 (the sibling tool)


BACKGROUND_SHARE = 0.05  # of the other video tokens, kept as the reference class (label 2: neither a needle's nor a
# lure's): a probe that tells needles from the background but not from lures shows what the lures share with needles


def token_labels(scene, pairs: int, rows: int, cols: int, small: float = 0.0) -> dict[tuple[int, int, int], int]:
    """(pair, row, col) -> 1 for a needle's token, 0 for a lure's (the cell it covers most in the pair's first
    frame); a needle's cell wins over a lure's. ``small`` > 0: only the needles of events of at most that radius
    (px) and the lures that cover at least half of their cell — objects of a lure's size, each whole in its token."""
    labels: dict[tuple[int, int, int], int] = {}
    for pair in range(pairs):
        index = 2 * pair
        ox, oy = scene.offset(index)
        x0, y0 = int(round(ox)), int(round(oy))
        for item in scene.transients(pair):
            if item.color not in COLORS:
                continue
            mask = scene._item_mask(item, index, x0, y0)[: rows * CELL, : cols * CELL]
            cover = mask.reshape(rows, CELL, cols, CELL).mean(axis=(1, 3))
            if cover.max() > 0 and cover.max() >= (0.5 if small else 0.0):
                r, c = np.unravel_index(int(cover.argmax()), cover.shape)
                labels[(pair, int(r), int(c))] = 0
    for event in (e for e in scene.events if not small or e.radius <= small):
        for pair in range(event.first_pair, min(event.last_pair, pairs - 1) + 1):
            labels[(pair, int(event.center[1] // CELL), int(event.center[0] // CELL))] = 1
    return labels


def collect(model: str, length: int, seeds: tuple[int, ...], streams: int, families: tuple[str, ...],
            busy: float = 0.2, size: int = 112, small: float = 0.0) -> tuple[dict[str, list[np.ndarray]], list[int]]:
    """Features per set ("tower", "layer L", "layer L head H") and labels of every needle and lure token."""
    features: dict[str, list[np.ndarray]] = {}
    labels: list[int] = []
    grid = size // CELL
    for seed in seeds:
        for index in range(streams):
            stream, replay, session = ingest_lured(model, length, seed, index, families, busy, size)
            cache = session.cache
            count = int(cache.length)
            kind = cache.kind[0, 0].numpy()
            video = np.nonzero(kind[:count] == int(SlotKind.VISION))[0]
            frame, row, col = (cache.frame[0, 0].numpy(), cache.row[0, 0].numpy(), cache.col[0, 0].numpy())
            marks = token_labels(stream.scene, length, grid, grid, small)
            chosen, chosen_labels = [], []
            pick = np.random.default_rng((seed, index, 5)).random(len(video)) < BACKGROUND_SHARE
            for slot, background in zip(video, pick):
                label = marks.get((int(frame[slot]), int(row[slot]), int(col[slot])), 2 if background else None)
                if label is not None:
                    chosen.append(int(slot))
                    chosen_labels.append(label)
            chosen_at = np.array(chosen)
            tower = torch.cat([t.float().reshape(-1, t.shape[-1]) for t in replay.tokens])  # [pairs * 16, d]
            pair_of, token_of = frame[chosen_at], row[chosen_at] * grid + col[chosen_at]
            features.setdefault("tower", []).append(tower[pair_of * grid * grid + token_of].numpy())
            for layer in range(cache.num_layers):
                keys = cache.keys(layer, int(chosen_at.max()) + 1).float()[:, chosen_at]  # [kv, n, hd]
                features.setdefault(f"layer {layer}", []).append(keys.permute(1, 0, 2).reshape(len(chosen), -1).numpy())
                for head in range(keys.shape[0]):
                    features.setdefault(f"layer {layer} head {head}", []).append(keys[head].numpy())
            labels.extend(chosen_labels)
    return features, labels


def probe(x: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0, l2: float = 1e-3) -> dict:
    """Held-out scores of a class-balanced logistic regression (k-fold, standardized features): balanced accuracy,
    AUC and the share of lures scored above the 5th percentile of the needles' scores."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    scores = np.zeros(len(y))
    for fold in range(folds):
        test = order[fold::folds]
        train = np.setdiff1d(order, test)
        mean, std = x[train].mean(0), x[train].std(0) + 1e-6
        xt = torch.tensor((x[train] - mean) / std, dtype=torch.float64)
        yt = torch.tensor(y[train], dtype=torch.float64)
        weight = torch.where(yt > 0, 0.5 / yt.mean(), 0.5 / (1 - yt.mean()))
        w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            logits = xt @ w + b
            loss = (weight * torch.nn.functional.binary_cross_entropy_with_logits(logits, yt, reduction="none")
                    ).mean() + l2 * (w * w).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            scores[test] = (torch.tensor((x[test] - mean) / std, dtype=torch.float64) @ w + b).numpy()
    needles, lures = scores[y == 1], scores[y == 0]
    balanced = 0.5 * ((needles > 0).mean() + (lures <= 0).mean())
    auc = float((needles[:, None] > lures[None, :]).mean() + 0.5 * (needles[:, None] == lures[None, :]).mean())
    threshold = np.quantile(needles, 0.05)
    return {"balanced_accuracy": round(float(balanced), 4), "auc": round(auc, 4),
            "lures_above_needle_p5": round(float((lures >= threshold).mean()), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(parser)
    parser.add_argument("--small", type=float, default=0.0, metavar="PX",
                        help="only needles of events of at most this radius and lures covering at least half a "
                             "cell (objects of a lure's size, 14-20 px at 112 x 112); 0: every needle and lure")
    args = parser.parse_args(argv)
    if args.length < 2 or args.streams < 1 or not args.busy > 0 or args.small < 0:
        parser.error(f"--length must be >= 2, --streams >= 1, --busy > 0 and --small >= 0 (got {args.length}, "
                     f"{args.streams}, {args.busy}, {args.small})")
    torch.set_num_threads(args.threads)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    features, labels = collect(args.model, args.length, seeds, args.streams, tuple(args.families.split(",")),
                               args.busy, small=args.small)
    y = np.array(labels)
    result = {"model": args.model, "length": args.length, "seeds": list(seeds), "streams": args.streams,
              "small": args.small, "needle_tokens": int((y == 1).sum()), "lure_tokens": int((y == 0).sum()),
              "background_tokens": int((y == 2).sum()), "probes": {}, "background_probes": {}}
    print(f"{result['needle_tokens']} needle tokens, {result['lure_tokens']} lure tokens, "
          f"{result['background_tokens']} background tokens")
    lures, background = y != 2, y != 0
    for name, parts in features.items():
        x = np.concatenate(parts)
        result["probes"][name] = probe(x[lures], y[lures]) | {"dims": int(x.shape[1])}
        result["background_probes"][name] = probe(x[background], (y[background] == 1).astype(int))
        p, b = result["probes"][name], result["background_probes"][name]
        print(f"{name:16s} ({p['dims']:3d} dims) needle vs lure: balanced accuracy {p['balanced_accuracy']:.3f}, "
              f"AUC {p['auc']:.3f}, above the needles' 5th percentile {p['lures_above_needle_p5']:.3f} | "
              f"vs background: {b['balanced_accuracy']:.3f}, {b['auc']:.3f}, {b['lures_above_needle_p5']:.3f}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
