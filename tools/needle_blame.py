"""Issue 27: which background frame pairs of a needle stream mislead the toy's answers?

`edgekv eval needle --oracle` tells whether the full cache on a long stream loses its answers to what it forgot or to
what it holds besides the needles: cut down to the needle pairs (``oracle_cut``), the same cache answers as it does
on the short streams. This tool says *which* background pairs do it. It ingests one needle stream (the same stream
`edgekv eval needle` draws from ``--seed S``: ``needle_stream(..., seed=S * 1000)``) with the full cache, asks the
last checkpoint's questions of the whole cache and of the needle pairs alone (each with the ``CEILING_GAP`` pairs
before it, as ``--oracle`` cuts it), then of those plus one window of ``--window`` background pairs at a time (the
cache is put back after each: one ingest). A window whose questions go wrong holds a look-alike.

    python tools/needle_blame.py --model M --size 224 --length 120 --seed 63 --family photo --window 10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgekv.eval.needle import (CEILING_GAP, CHECKPOINTS, DEFAULT_AGES, PolicyRun, encode_stream, needle_stream,
                                oracle_cut, oracle_pairs, runtime_for, tokens_per_pair)
from edgekv.toy.questions import ALL_FAMILIES, FAMILIES, answer_of


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--size", type=int, default=112, help="frame side: 112 or 224")
    parser.add_argument("--length", type=int, default=120, help="frame pairs in the stream")
    parser.add_argument("--seed", type=int, default=0, help="as `edgekv eval needle --seed` (its first stream)")
    parser.add_argument("--family", default="photo", help="background family (events: the classic renderer)")
    parser.add_argument("--style", default="world", choices=("mild", "world"))
    parser.add_argument("--events", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kinds", default="all", help="all or base")
    parser.add_argument("--window", type=int, default=10, help="background pairs added back at a time")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.window < 1 or args.length < 2:
        parser.error(f"--window must be >= 1 and --length >= 2 (got {args.window}, {args.length})")
    torch.set_num_threads(args.threads)
    kinds = ALL_FAMILIES if args.kinds == "all" else FAMILIES
    stream = needle_stream(args.length, DEFAULT_AGES, args.seed * 1000, args.events, 2.0, CHECKPOINTS,
                           family=args.family, size=args.size, kinds=kinds, repeats=args.repeats, style=args.style)
    probes = [p for p in stream.probes if p.checkpoint == args.length]
    runtime = runtime_for(args.model, PolicyRun("full"), 32 + args.length * tokens_per_pair(args.size) + 64, 2.0, 64,
                          size=args.size)
    replay = encode_stream(runtime, stream.scene, args.length)
    session = runtime.session()
    session.vision = replay
    for pair in range(args.length):
        first, second = stream.scene.pair_frames(pair)
        session.ingest(first, t=stream.scene.time(2 * pair))
        session.ingest(second, t=stream.scene.time(2 * pair + 1))
    needles = oracle_pairs(stream.scene.events)

    def wrong() -> list[dict]:
        out = []
        for probe in probes:
            said = answer_of(session.ask(probe.qa.question, max_new_tokens=2).text)
            if said != probe.qa.answer:
                out.append({"question": probe.qa.question, "answer": probe.qa.answer, "said": said})
        return out

    result = {"model": args.model, "size": args.size, "length": args.length, "seed": args.seed,
              "family": args.family, "style": args.style, "questions": len(probes),
              "events": [e.describe() for e in stream.scene.events], "full": wrong()}
    with oracle_cut(session, needles):
        result["needles_only"] = wrong()
    print(f"{len(probes)} questions at pair {args.length}; events {result['events']}")
    print(f"whole cache: {len(result['full'])} wrong; needle pairs only: {len(result['needles_only'])} wrong "
          f"({len(needles)} pairs with the {CEILING_GAP} before each needle)")
    result["windows"] = []
    background = [p for p in range(args.length) if p not in needles]
    for start in range(0, len(background), args.window):
        window = background[start:start + args.window]
        with oracle_cut(session, needles | set(window)):
            misled = wrong()
        result["windows"].append({"pairs": [window[0], window[-1]], "wrong": misled})
        print(f"  + background pairs {window[0]:5d}-{window[-1]:5d}: {len(misled)} wrong"
              + "".join(f"; {m['question']} {m['said']} (not {m['answer']})" for m in misled))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
