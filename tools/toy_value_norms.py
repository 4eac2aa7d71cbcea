"""Issue 27: do the toy's value norms alone tell event frame pairs from background ones?

InfiniPot-V's VaN (value norm, §3.2 of the paper) keeps the tokens whose value vectors are largest. If, in the toy,
every frame pair that shows an event holds a token with a larger value norm than any token of any background pair,
VaN ranks the needles first by itself and no cap that still holds one token per event can make infinipot_v forget
one — the needle benchmark cannot find its frontier. This tool measures that: it ingests ``--streams`` streams of
``--source`` (a ``synthetic:`` spec; ``&seed=I`` is appended per stream) with the full cache, takes per frame pair the
largest value norm of its video tokens (each token's L2 norm averaged over layers and KV heads), and prints the
AUC between event pairs and background pairs (1.0: every event pair above every background pair; 0.5: no signal).

    python tools/toy_value_norms.py --model builtin:toy --streams 6 --out vn.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import edgekv
from edgekv.cache.capped import SlotKind
from edgekv.video.sources import open_source

DEFAULT_SOURCE = "synthetic:events?size=112x112&fps=2&frames=200&rate=0.1&noise=3"


def pair_peaks(session) -> dict[int, float]:
    """Per frame pair in the cache: the largest value norm of its video tokens (mean over layers and KV heads)."""
    cache, n = session.cache, session.cache.length
    norms = cache.v[:, :, :n].float().norm(dim=-1).mean(dim=(0, 1))
    vision = cache.kind[0, 0, :n] == int(SlotKind.VISION)
    frames = cache.frame[0, 0, :n]
    peaks: dict[int, float] = {}
    for slot in torch.nonzero(vision).flatten().tolist():
        pair = int(frames[slot])
        peaks[pair] = max(peaks.get(pair, 0.0), float(norms[slot]))
    return peaks


def auc(positive: list[float], negative: list[float]) -> float | None:
    """P(a positive scores above a negative), ties counted half; None without both."""
    if not positive or not negative:
        return None
    pos, neg = np.asarray(positive)[:, None], np.asarray(negative)[None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="a synthetic: spec without seed")
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"model": args.model, "source": args.source, "streams": []}
    for seed in range(args.streams):
        source = open_source(f"{args.source}&seed={seed}")
        scene, pairs = source.scene, (source.frames + 1) // 2
        runtime = edgekv.Runtime.from_pretrained(
            args.model, model={"dtype": "fp32", "device": "cpu"},
            cache={"policy": "full", "max_tokens": 64 + pairs * (source.width // 28) * (source.height // 28) + 64,
                   "text_reserve_tokens": 64},
            video={"resolution": [source.width, source.height], "fps": source.fps})
        session = runtime.session()
        for frame, t in source:
            session.ingest(frame, t)
        shown = {p for e in scene.events for p in range(e.first_pair, e.first_pair + e.pairs)}
        peaks = pair_peaks(session)
        row = {"seed": seed, "event_pairs": sum(p in shown for p in peaks),
               "background_pairs": sum(p not in shown for p in peaks),
               "auc": auc([v for p, v in peaks.items() if p in shown], [v for p, v in peaks.items() if p not in shown])}
        result["streams"].append(row)
        print(f"stream {seed}: {row['event_pairs']} event pairs, {row['background_pairs']} background pairs, "
              f"AUC {row['auc'] if row['auc'] is None else round(row['auc'], 3)}")
    values = [r["auc"] for r in result["streams"] if r["auc"] is not None]
    result["mean_auc"] = float(np.mean(values)) if values else None
    print(f"{args.model}: mean AUC {result['mean_auc'] if result['mean_auc'] is None else round(result['mean_auc'], 3)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
