"""``edgekv eval compare``: two needle runs asked the same questions, compared question by question.

Two settings of a cache (a policy, ``tar_ratio``, a K/V dtype, ...) run on the same seeded streams answer the
same questions, so their accuracies are paired: what tells them apart is the questions one answers and the
other does not. Per cap this prints both accuracies, the paired difference with its 95 % interval and the exact
McNemar test on the discordant questions:

- difference d = (c - b) / n, where b questions only A answers and c only B answers, of n paired ones; its
  interval is the Wald interval for matched proportions, var(d) = ((b + c) - (c - b)^2 / n) / n^2
  (Agresti, Categorical Data Analysis, 3rd ed., section 11.1.1, eq. 11.2-11.3);
- McNemar's exact test: under "no difference" the b + c discordant questions split as Binomial(b + c, 1/2);
  p is the two-sided tail at min(b, c) (section 11.1.2, the exact form for small b + c).

The questions of one stream share that stream's events, so they are not independent: the stream counts (how
many streams B answers better, worse, the same) are printed beside the per-question figures as the coarser,
stream-level check. The "all caps" line pools the caps: a question counts once per cap there, so its p is
only a summary, not a test.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from edgekv.eval.stats import Z95, mcnemar_exact

# NeedleConfig fields that decide which streams are drawn and which questions are asked of them.
STREAM_KEYS = ("model", "streams", "events", "ages", "fps", "seed", "reserve", "checkpoints", "families", "style",
               "kinds", "repeats", "busy", "lures", "lure_colors", "lure_shapes")
# stream keys a part written before they existed lacks: their value then (the same streams)
STREAM_DEFAULTS = {"lure_colors": [], "lure_shapes": []}


def read_json(path: str) -> object:
    """A results file's JSON, or a ValueError that names the file and what is wrong with it."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None


def load_run(spec: str) -> tuple[str, str, list[dict], dict]:
    """``PATH`` or ``PATH@POLICY`` -> (path, policy label, its records, the run's config). A file with one policy
    label needs no ``@POLICY``; one with several names them in the error."""
    path, at, policy = spec.partition("@")
    result = read_json(path)
    records = result.get("records") if isinstance(result, dict) else None
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: no needle records (an `edgekv eval needle --json` file has them)")
    labels = sorted({r["policy"] for r in records})
    if not at:
        if len(labels) != 1:
            raise ValueError(f"{path}: holds {len(labels)} runs, name one as {path}@POLICY: {'; '.join(labels)}")
        policy = labels[0]
    elif policy not in labels:
        raise ValueError(f"{path}: no run {policy!r} (it holds: {'; '.join(labels)})")
    config = result.get("config")
    return path, policy, [r for r in records if r["policy"] == policy], config if isinstance(config, dict) else {}


def _keyed(records: list[dict]) -> dict[tuple, dict]:
    """Each question under a key that names it in its stream (the same question asked twice at one checkpoint
    is told apart by its order)."""
    seen: dict[tuple, int] = defaultdict(int)
    out = {}
    for r in records:
        base = (r.get("size", 112), r["length"], r.get("cap") or r["budget"], r["stream"], r.get("background"),
                r["checkpoint"], r["question"], r["answer"])
        out[base + (seen[base],)] = r
        seen[base] += 1
    return out


def paired(pairs: list[tuple[bool, bool]]) -> dict:
    """A vs B on the same questions: accuracies, d = B - A, its 95 % interval, the discordant counts and p."""
    n = len(pairs)
    if n == 0:
        raise ValueError("no paired questions")
    a = sum(x for x, _ in pairs)
    b_acc = sum(y for _, y in pairs)
    only_a = sum(1 for x, y in pairs if x and not y)
    only_b = sum(1 for x, y in pairs if y and not x)
    d = (only_b - only_a) / n
    var = max(0.0, (only_a + only_b) - (only_b - only_a) ** 2 / n) / n ** 2
    half = Z95 * math.sqrt(var)
    return {"n": n, "a": round(a / n, 4), "b": round(b_acc / n, 4), "diff": round(d, 4),
            "ci95": [round(d - half, 4), round(d + half, 4)], "only_a": only_a, "only_b": only_b,
            "p_mcnemar": round(mcnemar_exact(only_a, only_b), 4)}


def compare(spec_a: str, spec_b: str) -> dict:
    """Per (frame size, stream length, cap) and pooled: the paired figures of B against A, and per-stream
    counts of B better / worse / equal."""
    path_a, policy_a, rec_a, config_a = load_run(spec_a)
    path_b, policy_b, rec_b, config_b = load_run(spec_b)
    # Streams of another seed (or model, families, ...) share a question's key now and then — stream 0's
    # checkpoint 1 asked "what colour" of other events: such runs were paired and tested as if the same questions
    for key in STREAM_KEYS if config_a and config_b else ():
        mine, theirs = (config.get(key, STREAM_DEFAULTS.get(key)) for config in (config_a, config_b))
        if mine != theirs:
            raise ValueError(f"{path_a} and {path_b} drew different streams: {key} is {mine!r} against {theirs!r} "
                             f"(compare runs of the same streams)")
    keyed_a, keyed_b = _keyed(rec_a), _keyed(rec_b)
    shared = [k for k in keyed_a if k in keyed_b]
    if not shared:
        raise ValueError(f"{path_a} and {path_b} share no question: run them with the same --seed, --streams, "
                         "--lengths, --sizes, --families, --events and caps")
    cells: dict[tuple, list[tuple]] = defaultdict(list)
    for key in shared:
        cells[key[:3]].append(key)
    out = {"a": {"file": path_a, "policy": policy_a}, "b": {"file": path_b, "policy": policy_b},
           "unpaired": {"a": len(keyed_a) - len(shared), "b": len(keyed_b) - len(shared)}, "cells": [], "all": {}}

    def figures(keys: list[tuple]) -> dict:
        entry = paired([(keyed_a[k]["correct"], keyed_b[k]["correct"]) for k in keys])
        per_stream: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for k in keys:
            score = per_stream[k[:5]]
            score[0] += keyed_a[k]["correct"]
            score[1] += keyed_b[k]["correct"]
        entry["streams"] = {"b_better": sum(1 for x, y in per_stream.values() if y > x),
                            "b_worse": sum(1 for x, y in per_stream.values() if y < x),
                            "equal": sum(1 for x, y in per_stream.values() if y == x)}
        return entry

    for (size, length, cap), keys in sorted(cells.items(), key=lambda item: (item[0][0], item[0][1], -item[0][2])):
        entry = figures(keys)
        entry.update({"size": size, "length": length, "cap": cap})
        out["cells"].append(entry)
    out["all"] = figures(shared)
    return out


def format_comparison(result: dict) -> str:
    from edgekv.eval.needle import share_label

    a, b = result["a"], result["b"]
    lines = [f"A = {a['policy']} ({a['file']}), B = {b['policy']} ({b['file']}); "
             f"questions in one file only: A {result['unpaired']['a']}, B {result['unpaired']['b']}"]

    def line(name: str, e: dict) -> str:
        s = e["streams"]
        return (f"{name:>18s}  n={e['n']:4d}  A {e['a']:.3f}  B {e['b']:.3f}  B-A {e['diff']:+.3f} "
                f"[{e['ci95'][0]:+.3f}, {e['ci95'][1]:+.3f}]  only A {e['only_a']:3d} only B {e['only_b']:3d} "
                f"McNemar p={e['p_mcnemar']:.3f}  streams B better/worse/equal {s['b_better']}/{s['b_worse']}/"
                f"{s['equal']}")

    for e in result["cells"]:
        cap = share_label(e["cap"]) if e["cap"] < 1 else f"M={e['cap']}"
        lines.append(line(f"{e['size']}px L={e['length']} {cap}", e))
    lines.append(line("all caps", result["all"]))  # a question counts once per cap here
    return "\n".join(lines)
