"""Issue 27: where does a toy's question look on a lured needle stream? (docs/measurements.md, "Every lure costs alike")

A toy's full cache loses a quarter of its answers on 250-pair needle streams with lures (``eval needle --lures 1
--lure-colors free``): out-of-vocabulary shapes in the vocabulary's colours, passing through the frame. This tool
ingests those streams with the full cache, asks each stream's last checkpoint's questions and records, in every LM
layer, the attention of the question's last token over the cache (averaged over the query heads): the mass on the
needles' tokens, the lures' tokens, the rest of the video, the text before the question and the question's
own tokens, in all and per token, split by whether the question was answered right (the five sum to 1). A token
is a needle's when the centre of a needle lies in its merged-grid cell (one token a needle and pair), a lure's when a
lure on screen at that frame pair shows in its cell (every cell it covers, ``WorldScene.lure_cells``; a needle's cell
stays the needle's). The per-token ratio of needle to lure mass is the LM's margin; with hundreds of lure tokens
against a few needle tokens, a margin of a few tens lets the lures take most of the mass. A toy trained to keep its
questions off the lures (``train-toy --avoid-weight``) may instead look at no video at all: the question share says.

``--keep-off-lures 1,2,3`` hides the lures' tokens from the questions' attention in those LM layers (only while the
questions are asked; the stream was ingested as always): if the answers come back, the lures cost the toy through
where its questions look, not through what the needles' own tokens took in from them.

``--by-pair`` splits the last query's score of each token into its rotary pairs' parts (head dims j and j + D/2,
each turned by one M-RoPE row at its own frequency) and prints, per LM layer and pair, what the pair adds to a
needle's score over a lure's, and how many radians it turns over the stream and over the range the toy trained on.
A pair that turns far over that range cannot carry what a token shows to a question asked at another distance.

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

CLASSES = ("needle", "lure", "video", "text", "question")


class LastQueryAttention:
    """While active, records per layer the first chunk's last-query attention over the committed slots (the
    question's prefill: a chunk of ``P`` tokens attends to ``start`` committed slots and itself)."""

    def __init__(self, hide: np.ndarray | None = None, layers: tuple[int, ...] = (), by_pair: bool = False) -> None:
        self.rows: dict[int, dict] = {}
        self.by_pair = by_pair  # also keep each rotary pair's part of the last query's scores
        self.active = False
        self.hide = hide  # [capacity] bool: slots kept from the question's attention in ``layers``
        self.layers = layers
        self.deviation = 0.0  # largest gap between the recorded attention's read-out and the layer's output
        self._original = attention.CacheAttention.__call__

    def __enter__(self) -> "LastQueryAttention":
        recorder, original = self, self._original

        def call(chunk, layer, q, k, v):
            hiding = recorder.active and recorder.hide is not None and layer in recorder.layers
            if recorder.active and recorder.hide is not None and chunk.visible is None and chunk.mass_out is None:
                cache = chunk.cache
                visible = torch.ones(cache.num_layers, cache.kv_heads, chunk.start, dtype=torch.bool)
                for hidden_layer in recorder.layers:
                    visible[hidden_layer] = ~torch.from_numpy(recorder.hide[:chunk.start])
                chunk.visible = visible
            out = original(chunk, layer, q, k, v)
            if recorder.active and layer not in recorder.rows:
                cache, start = chunk.cache, chunk.start
                keys = cache.keys(layer, start + chunk.num_new).float()  # as the chunk's attention read them
                group = q.shape[0] // keys.shape[0]
                last = q[:, -1].float()  # [Hq, D]
                scores = torch.einsum("hd,hnd->hn", last, keys.repeat_interleave(group, 0)) / last.shape[-1] ** 0.5
                if hiding:
                    hidden = torch.from_numpy(np.concatenate([recorder.hide[:start], np.zeros(chunk.num_new, bool)]))
                    scores = scores.masked_fill(hidden[: scores.shape[-1]], float("-inf"))
                weights = torch.softmax(scores, dim=-1)  # [Hq, start + P]
                # what these weights read must be what the layer's attention returned (the recorded attention is the
                # one the answer used, kept off the lures where asked)
                values = cache.values(layer, start + chunk.num_new).float().repeat_interleave(group, 0)
                read = torch.einsum("hn,hnd->hd", weights, values)
                recorder.deviation = max(recorder.deviation, float((read - out[:, -1].float()).abs().max()))
                probs = weights[:, :start].mean(0)  # [start]: mass per committed slot
                if recorder.by_pair:  # score = sum over pairs j of (q_j k_j + q_j+half k_j+half) / sqrt(D)
                    half = last.shape[-1] // 2
                    parts = last[:, None, :] * keys.repeat_interleave(group, 0)[:, :start] / last.shape[-1] ** 0.5
                    pairs = (parts[..., :half] + parts[..., half:]).permute(0, 2, 1)  # [Hq, half, start]
                recorder.rows[layer] = {"mass": probs.numpy(), "question": float(weights[:, start:].mean(0).sum()),
                                        "question_tokens": int(chunk.num_new),
                                        "kind": cache.kind[layer, 0, :start].numpy().copy(),
                                        "pair": cache.frame[layer, 0, :start].numpy().copy(),
                                        "row": cache.row[layer, 0, :start].numpy().copy(),
                                        "col": cache.col[layer, 0, :start].numpy().copy()}
                if recorder.by_pair:
                    recorder.rows[layer]["pairs"] = pairs.numpy()
                    recorder.rows[layer]["scores"] = scores[:, :start].numpy()
            return out

        attention.CacheAttention.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        attention.CacheAttention.__call__ = self._original


def slot_classes(row: dict, scene, pairs: int) -> np.ndarray:
    """Per committed slot: needle, lure, video (any other vision token) or text (the prompt before the video)."""
    video = row["kind"] == int(SlotKind.VISION)
    classes = np.where(video, "video", "text").astype(object)
    cells: dict[tuple[int, int, int], str] = {}
    for pair in range(pairs):
        for r, c in zip(*np.nonzero(scene.lure_cells(pair, CELL))):  # every cell a lure shows in
            cells[(pair, int(r), int(c))] = "lure"
    for event in scene.events:  # a needle's cell wins over a lure's
        for pair in range(event.first_pair, event.last_pair + 1):
            cells[(pair, int(event.center[1] // CELL), int(event.center[0] // CELL))] = "needle"
    for index in np.nonzero(video)[0]:
        name = cells.get((int(row["pair"][index]), int(row["row"][index]), int(row["col"][index])))
        if name:
            classes[index] = name
    return classes


def ingest_lured(model: str, length: int, seed: int, index: int, families: tuple[str, ...], busy: float = 0.2,
                 size: int = 112):
    """(stream, replay, session): the full cache of ``model`` after ingesting stream ``index`` of ``eval needle
    --seed seed``'s free-colour lured needle streams (``--lures 1 --lure-colors free --events 3``), ``length``
    pairs; ``replay`` holds the tower's output per pair."""
    stream = needle_stream(length, DEFAULT_AGES, seed * 1000 + index, 3, 2.0, family=families[index % len(families)],
                           size=size, style="world", busy=busy, lures=1.0, lure_colors="free")
    runtime = runtime_for(model, PolicyRun("full"), 32 + length * tokens_per_pair(size) + 64, 2.0, 64, size=size)
    replay = encode_stream(runtime, stream.scene, length)
    session = runtime.session()
    session.vision = replay
    for pair in range(length):
        first, second = stream.scene.pair_frames(pair)
        session.ingest(first, t=stream.scene.time(2 * pair))
        session.ingest(second, t=stream.scene.time(2 * pair + 1))
    return stream, replay, session


def stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The lured streams' flags, shared with ``toy_lure_keys.py``."""
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--length", type=int, default=250, help="frame pairs a stream")
    parser.add_argument("--seeds", default="49,50", help="as `eval needle --seed`, comma-separated")
    parser.add_argument("--streams", type=int, default=4, help="streams a seed")
    parser.add_argument("--families", default="photo,cells")
    parser.add_argument("--busy", type=float, default=0.2, help="passing objects per pair (all of them lures)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write")


def write_json(path: str | None, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (nothing when None), as both lure tools write theirs."""
    if path:
        with open(path, "w") as handle:
            json.dump(result, handle, indent=1)


def measure(model: str, length: int, seeds: tuple[int, ...], streams: int, families: tuple[str, ...],
            busy: float = 0.2, size: int = 112, keep_off: tuple[int, ...] = (), by_pair: bool = False) -> dict:
    """Per layer and class: mean attention mass of the question's last token, in all and per token, over the
    questions answered right and those answered wrong; ``keep_off``: the LM layers where the questions do not see
    the lures' tokens. ``by_pair``: also, per layer and rotary pair, what the pair adds to the last query's score of
    a needle's token over a lure's (``pair_margins``)."""
    sums: dict[tuple[bool, int, str], list[tuple[float, int]]] = defaultdict(list)
    pair_rows: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    text = None
    answered = {True: 0, False: 0}
    deviation = 0.0
    for seed in seeds:
        for index in range(streams):
            stream, _, session = ingest_lured(model, length, seed, index, families, busy, size)
            text, spacing = session.model.config.text, session.pair_spacing
            classes = hide = None
            if keep_off:
                cache = session.cache
                classes = slot_classes({"kind": cache.kind[0, 0].numpy(), "pair": cache.frame[0, 0].numpy(),
                                        "row": cache.row[0, 0].numpy(), "col": cache.col[0, 0].numpy()},
                                       stream.scene, length)
                hide = classes == "lure"
            for probe in (p for p in stream.probes if p.checkpoint == length):
                with LastQueryAttention(hide, keep_off, by_pair) as recorder:
                    recorder.active = True
                    said = answer_of(session.ask(probe.qa.question, max_new_tokens=1).text)
                right = said == probe.qa.answer
                deviation = max(deviation, recorder.deviation)
                answered[right] += 1
                for layer, row in recorder.rows.items():
                    if classes is None or len(classes) != len(row["mass"]):
                        classes = slot_classes(row, stream.scene, length)
                    classes = classes[: len(row["mass"])]
                    sums[(right, layer, "question")].append((row["question"], row["question_tokens"]))
                    needle, lure = classes == "needle", classes == "lure"
                    if by_pair and needle.any() and lure.any():
                        score = row["scores"]  # [Hq, slots]: the whole score, the pairs' parts summed
                        row["score_margin"] = score[:, needle].mean(-1) - score[:, lure].mean(-1)
                        parts = row["pairs"]  # [Hq, half, slots]
                        pair_rows[layer].append((parts[:, :, needle].mean(-1) - parts[:, :, lure].mean(-1),
                                                 parts[:, :, lure].std(-1), row["score_margin"]))
                    for name in CLASSES[:-1]:
                        chosen = classes == name
                        sums[(right, layer, name)].append((float(row["mass"][chosen].sum()), int(chosen.sum())))
    layers = sorted({layer for _, layer, _ in sums})
    out: dict = {"model": model, "length": length, "seeds": list(seeds), "streams": streams, "busy": busy,
                 "keep_off_lures": list(keep_off), "readout_deviation": deviation,
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
    if by_pair and text is not None:
        out["pair_margins"] = pair_margins(pair_rows, text, length * spacing)
    return out


def pair_margins(rows: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]], text, span: int) -> dict:
    """Per LM layer and rotary pair j (head dims j and j + head_dim / 2): the M-RoPE row that turns it (t, h or w),
    its frequency, how far it turns over the stream's ``span`` positions and over the temporal range the toy trained
    on (``max_position_embeddings``; radians), and, averaged over the query
    heads and the questions, what it adds to the last query's mean score of a needle's token over a lure's
    (``margin``) and the spread of its part over the lures' tokens (``lure_spread``). A pair that turns through
    many radians over the span sees a needle and a lure at unrelated angles: it can tell them apart only by
    where they are in the stream, not by what they show; one that turns that far over the trained range meets
    questions at unrelated angles from one stream length to another, so training cannot give it a fixed use.
    ``score_margin``: the same for the whole score (the pairs' margins sum to it)."""
    from edgekv.model.rope import mrope_dim_rows, rotary_inv_freq

    sections = mrope_dim_rows(text.mrope_section).tolist()
    freq = rotary_inv_freq(text.head_dim, text.rope_theta).tolist()
    trained = int(text.max_position_embeddings)
    out = {"span_positions": span, "trained_positions": trained, "rope_theta": text.rope_theta, "layers": {},
           "score_margin": {}}
    for layer, entries in sorted(rows.items()):
        margin = np.mean([m for m, _, _ in entries], axis=(0, 1))  # over questions and heads: [half]
        spread = np.mean([s for _, s, _ in entries], axis=(0, 1))
        out["score_margin"][str(layer)] = round(float(np.mean([w for _, _, w in entries])), 4)
        out["layers"][str(layer)] = [
            {"pair": j, "row": "thw"[sections[j]], "inv_freq": freq[j], "turn": round(freq[j] * span, 3),
             "turn_trained": round(freq[j] * trained, 3), "margin": round(float(margin[j]), 4),
             "lure_spread": round(float(spread[j]), 4)}
            for j in range(len(freq))]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(parser)
    parser.add_argument("--keep-off-lures", default="", metavar="LAYERS",
                        help="comma-separated LM layers where the questions do not see the lures' tokens")
    parser.add_argument("--by-pair", action="store_true",
                        help="also print, per LM layer and rotary pair, what the pair adds to a needle's score over a "
                             "lure's and how far it turns over the stream")
    args = parser.parse_args(argv)
    if args.length < 2 or args.streams < 1 or not args.busy > 0:
        parser.error(f"--length must be >= 2, --streams >= 1 and --busy > 0 (got {args.length}, {args.streams}, "
                     f"{args.busy})")
    try:
        keep_off = tuple(int(layer) for layer in args.keep_off_lures.split(",")) if args.keep_off_lures else ()
    except ValueError:
        parser.error(f"--keep-off-lures takes comma-separated LM layers, got {args.keep_off_lures!r}")
    if keep_off and args.by_pair:
        parser.error("--by-pair compares needles with lures in the scores, and --keep-off-lures hides the lures: one "
                     "at a time")
    if any(layer < 0 for layer in keep_off):
        parser.error(f"--keep-off-lures: LM layers are >= 0, got {args.keep_off_lures!r}")
    torch.set_num_threads(args.threads)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    result = measure(args.model, args.length, seeds, args.streams, tuple(args.families.split(",")), args.busy,
                     keep_off=keep_off, by_pair=args.by_pair)
    print(f"{result['answered']['right']} questions answered right, {result['answered']['wrong']} wrong")
    for layer, entry in result["layers"].items():
        for verdict, group in entry.items():
            print(f"layer {layer} {verdict:5s}: " + "; ".join(
                f"{name} {v['mass']:.3f} ({v['tokens']:.0f} tokens, {v['per_token']:.5f} each)"
                for name, v in group.items() if v["per_token"] is not None))
    for layer, pairs in result.get("pair_margins", {}).get("layers", {}).items():
        print(f"layer {layer} by rotary pair (row, turn over the stream / the trained range in rad: needle - lure "
              f"score, lure spread): " + "; ".join(
                  f"{p['row']}{p['pair']} {p['turn']:.3g}/{p['turn_trained']:.3g}: {p['margin']:+.2f} / "
                  f"{p['lure_spread']:.2f}" for p in pairs))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
