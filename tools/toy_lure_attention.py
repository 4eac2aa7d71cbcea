"""Issue 27: where does a toy's question look on a lured needle stream? (README, "Every lure costs alike")

A toy's full cache loses a quarter of its answers on 250-pair needle streams with lures (``eval needle --lures 1
--lure-colors free``): out-of-vocabulary shapes in the vocabulary's colours, passing through the frame. This tool
ingests those streams with the full cache, asks each stream's last checkpoint's questions and records, in every LM
layer, the attention of the question's last token over the cache (averaged over the query heads): the mass on the
needles' tokens, the lures' tokens, the rest of the video and the text, in all and per token, split by whether the
question was answered right. A token is a needle's (a lure's) when the centre of a needle (a lure on screen at that
frame pair) lies in its merged-grid cell: one token an object, the one under its centre. The per-token ratio of
needle to lure mass is the LM's margin; with hundreds of lure tokens against a few needle tokens, a margin of a few
tens lets the lures take most of the mass.

    python tools/toy_lure_attention.py --model builtin:toy --length 250 --seeds 49,50 --out lure_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np
import torch

import edgekv.attention as attention
from edgekv.cache.capped import SlotKind
from edgekv.eval.needle import DEFAULT_AGES, PolicyRun, encode_stream, needle_stream, runtime_for, tokens_per_pair
from edgekv.toy.data import CELL
from edgekv.toy.questions import answer_of
from edgekv.video.events import COLORS

CLASSES = ("needle", "lure", "video", "text")


class LastQueryAttention:
    """While active, records per layer the first chunk's last-query attention over the committed slots (the
    question's prefill: a chunk of ``P`` tokens attends to ``start`` committed slots and itself)."""

    def __init__(self) -> None:
        self.rows: dict[int, dict] = {}
        self.active = False
        self._original = attention.CacheAttention.__call__

    def __enter__(self) -> "LastQueryAttention":
        recorder, original = self, self._original

        def call(chunk, layer, q, k, v):
            out = original(chunk, layer, q, k, v)
            if recorder.active and layer not in recorder.rows:
                cache, start = chunk.cache, chunk.start
                keys = cache.keys(layer, start + chunk.num_new).float()  # as the chunk's attention read them
                group = q.shape[0] // keys.shape[0]
                last = q[:, -1].float()  # [Hq, D]
                scores = torch.einsum("hd,hnd->hn", last, keys.repeat_interleave(group, 0)) / last.shape[-1] ** 0.5
                probs = torch.softmax(scores, dim=-1)[:, :start].mean(0)  # [start]: mass per committed slot
                recorder.rows[layer] = {"mass": probs.numpy(), "kind": cache.kind[layer, 0, :start].numpy().copy(),
                                        "pair": cache.frame[layer, 0, :start].numpy().copy(),
                                        "row": cache.row[layer, 0, :start].numpy().copy(),
                                        "col": cache.col[layer, 0, :start].numpy().copy()}
            return out

        attention.CacheAttention.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        attention.CacheAttention.__call__ = self._original


def slot_classes(row: dict, scene, pairs: int) -> np.ndarray:
    """Per committed slot: needle, lure, video (any other vision token) or text (prefix and question)."""
    video = row["kind"] == int(SlotKind.VISION)
    classes = np.where(video, "video", "text").astype(object)
    cells: dict[tuple[int, int, int], str] = {}
    for pair in range(pairs):
        for item in scene.transients(pair):
            if item.color in COLORS:  # a lure: a passing object in a vocabulary colour
                cells[(pair, int(item.center[1] // CELL), int(item.center[0] // CELL))] = "lure"
    for event in scene.events:  # a needle's cell wins over a lure's
        for pair in range(event.first_pair, event.last_pair + 1):
            cells[(pair, int(event.center[1] // CELL), int(event.center[0] // CELL))] = "needle"
    for index in np.nonzero(video)[0]:
        name = cells.get((int(row["pair"][index]), int(row["row"][index]), int(row["col"][index])))
        if name:
            classes[index] = name
    return classes


def measure(model: str, length: int, seeds: tuple[int, ...], streams: int, families: tuple[str, ...],
            busy: float = 0.2, size: int = 112) -> dict:
    """Per layer and class: mean attention mass of the question's last token, in all and per token, over the
    questions answered right and those answered wrong."""
    sums: dict[tuple[bool, int, str], list[tuple[float, int]]] = defaultdict(list)
    answered = {True: 0, False: 0}
    for seed in seeds:
        for index in range(streams):
            stream = needle_stream(length, DEFAULT_AGES, seed * 1000 + index, 3, 2.0, family=families[index % len(
                families)], size=size, style="world", busy=busy, lures=1.0, lure_colors="free")
            runtime = runtime_for(model, PolicyRun("full"), 32 + length * tokens_per_pair(size) + 64, 2.0, 64,
                                  size=size)
            replay = encode_stream(runtime, stream.scene, length)
            session = runtime.session()
            session.vision = replay
            for pair in range(length):
                first, second = stream.scene.pair_frames(pair)
                session.ingest(first, t=stream.scene.time(2 * pair))
                session.ingest(second, t=stream.scene.time(2 * pair + 1))
            classes = None
            for probe in (p for p in stream.probes if p.checkpoint == length):
                with LastQueryAttention() as recorder:
                    recorder.active = True
                    said = answer_of(session.ask(probe.qa.question, max_new_tokens=1).text)
                right = said == probe.qa.answer
                answered[right] += 1
                for layer, row in recorder.rows.items():
                    if classes is None or len(classes) != len(row["mass"]):
                        classes = slot_classes(row, stream.scene, length)
                    for name in CLASSES:
                        chosen = classes == name
                        sums[(right, layer, name)].append((float(row["mass"][chosen].sum()), int(chosen.sum())))
    layers = sorted({layer for _, layer, _ in sums})
    out: dict = {"model": model, "length": length, "seeds": list(seeds), "streams": streams, "busy": busy,
                 "answered": {"right": answered[True], "wrong": answered[False]}, "layers": {}}
    for layer in layers:
        entry = {}
        for right in (True, False):
            group = {}
            for name in CLASSES:
                values = sums.get((right, layer, name))
                if not values:
                    continue
                mass = float(np.mean([m for m, _ in values]))
                tokens = float(np.mean([n for _, n in values]))
                group[name] = {"mass": round(mass, 5), "tokens": round(tokens, 1),
                               "per_token": round(mass / tokens, 7) if tokens else None}
            if group:
                entry["right" if right else "wrong"] = group
        out["layers"][str(layer)] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--length", type=int, default=250, help="frame pairs a stream")
    parser.add_argument("--seeds", default="49,50", help="as `eval needle --seed`, comma-separated")
    parser.add_argument("--streams", type=int, default=4, help="streams a seed")
    parser.add_argument("--families", default="photo,cells")
    parser.add_argument("--busy", type=float, default=0.2, help="passing objects per pair (all of them lures)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.length < 2 or args.streams < 1 or not args.busy > 0:
        parser.error(f"--length must be >= 2, --streams >= 1 and --busy > 0 (got {args.length}, {args.streams}, "
                     f"{args.busy})")
    torch.set_num_threads(args.threads)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    result = measure(args.model, args.length, seeds, args.streams, tuple(args.families.split(",")), args.busy)
    print(f"{result['answered']['right']} questions answered right, {result['answered']['wrong']} wrong")
    for layer, entry in result["layers"].items():
        for verdict, group in entry.items():
            print(f"layer {layer} {verdict:5s}: " + "; ".join(
                f"{name} {v['mass']:.3f} ({v['tokens']:.0f} tokens, {v['per_token']:.5f} each)"
                for name, v in group.items() if v["per_token"] is not None))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
