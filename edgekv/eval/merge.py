"""``edgekv eval merge``: needle runs made in parts, put back into one result.

``edgekv eval needle`` is one process on one thread (the toy's matrices are too small for more), so a frontier of
several policies x K/V dtypes x caps is run faster as parts side by side, e.g. ``--policies infinipot_v`` with
the full-cache ceiling in one process and ``--policies sliding_window,uniform_frames --full-max-tokens 0`` in
another. Merging their ``--json`` files gives what one run of everything would have written: the records of
every part, each question's full-cache ceiling (``ceiling_full``, and ``ceiling_oracle``) copied to the records
of the parts that did not run it, then the summary, the frontier and the figure made anew, so every policy's
ratio is against the same full cache on the same long stream.

Parts merge only when they asked the same questions of the same streams: the settings that make a stream (model,
seed, streams, families, style, events, ages, repeats, kinds, busy, lures, fps, ...) must be equal, a stream in
two parts must carry the same questions with the same short-stream answers, and no run (policy label x cap x
size x length) may be in two parts (its questions would count twice); a part cut short by Ctrl-C (``interrupted``)
holds fewer streams than the others and is refused too. Anything else is refused, naming it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from edgekv.eval.compare import STREAM_DEFAULTS, STREAM_KEYS

CEILINGS = ("ceiling_full", "ceiling_oracle")


def load_part(path: str) -> dict:
    from edgekv.eval.compare import read_json

    result = read_json(path)
    if not isinstance(result, dict) or not isinstance(result.get("records"), list) or not result["records"] \
            or not isinstance(result.get("config"), dict):
        raise ValueError(f"{path}: not an `edgekv eval needle --json` file (it needs its config and records)")
    return result


def _stream(record: dict) -> tuple:
    return record.get("size", 112), record["length"], record["stream"], record.get("background")


def _question(record: dict) -> tuple:
    return record["checkpoint"], record["question"], record["answer"], record.get("age"), record["ceiling_correct"]


def _run(record: dict) -> tuple:
    return record.get("size", 112), record["length"], record["budget"], record["policy"]


def merge(paths: list[str]) -> dict:
    """The parts at ``paths`` as one ``eval needle`` result (config, records, summary, frontier)."""
    from edgekv.eval.needle import frontier, summarize

    if len(paths) < 2:
        raise ValueError("give at least two `eval needle --json` files to merge")
    resolved = [Path(path).resolve() for path in paths]
    twice = next((path for path, where in zip(paths, resolved) if resolved.count(where) > 1), None)
    if twice is not None:
        raise ValueError(f"{twice} is given twice: its questions would count twice")
    parts = [(path, load_part(path)) for path in paths]
    for path, part in parts:  # a part cut short answered fewer streams than the others: not the same questions
        if part.get("interrupted"):
            done = part["interrupted"].get("streams_done")
            raise ValueError(f"{path} was interrupted (its figures are of {done} whole stream(s)): run that part "
                             f"again to merge it")
    first_path, first = parts[0]
    for path, part in parts[1:]:
        for key in STREAM_KEYS:
            mine, theirs = (p["config"].get(key, STREAM_DEFAULTS.get(key)) for p in (part, first))
            if mine != theirs:
                raise ValueError(f"{path} and {first_path} drew different streams: {key} is {mine!r} against "
                                 f"{theirs!r}")
    references = {p["config"]["kv_dtypes"][0] for _, p in parts if p["config"].get("kv_dtypes")}
    if len(references) > 1:
        raise ValueError(f"the parts compare K/V dtypes at the bytes of different first dtypes "
                         f"({', '.join(sorted(references))}): their 'equal bytes' are not the same bytes")

    # Every stream's questions, from whichever part has it first; every other part must ask the same.
    asked: dict[tuple, tuple[str, Counter]] = {}
    owner: dict[tuple, str] = {}
    for path, part in parts:
        per_run: dict[tuple, dict[tuple, Counter]] = {}
        for record in part["records"]:
            per_run.setdefault(_run(record), {}).setdefault(_stream(record), Counter())[_question(record)] += 1
        for run, streams in per_run.items():
            if run in owner and owner[run] != path:
                size, length, budget, policy = run
                raise ValueError(f"{path} and {owner[run]} both ran {policy!r} at M={budget} (L={length}, "
                                 f"{size}px): its questions would count twice")
            owner[run] = path
            for stream, questions in streams.items():
                seen = asked.setdefault(stream, (path, questions))
                if seen[1] != questions:
                    size, length, index, background = stream
                    differ = min((seen[1] - questions) + (questions - seen[1]), key=lambda q: (q[0], q[1]))
                    raise ValueError(f"{path} and {seen[0]} asked stream {index} ({background}, L={length}, "
                                     f"{size}px) different questions or got other short-stream answers, e.g. "
                                     f"{differ[1]!r} at pair {differ[0]}")

    # The ceilings each question got in the parts that ran them; a question asked twice at one checkpoint of a
    # stream is told apart by its order within its run.
    def keyed(part: dict) -> list[tuple[tuple, dict]]:
        order: Counter = Counter()
        out = []
        for record in part["records"]:
            key = _stream(record) + _question(record)
            order[(_run(record), key)] += 1
            out.append((key + (order[(_run(record), key)],), record))
        return out

    every = [(path, keyed(part)) for path, part in parts]
    ceilings: dict[tuple, dict[str, tuple[bool, str]]] = {}
    for path, rows in every:
        for key, record in rows:
            for name in CEILINGS:
                value = record.get(name)
                if value is None:
                    continue
                held = ceilings.setdefault(key, {})
                if name in held and held[name][0] != value:
                    raise ValueError(f"{path} and {held[name][1]} disagree on the {name.replace('_', ' ')} of "
                                     f"{record['question']!r} (stream {record['stream']}, pair "
                                     f"{record['checkpoint']}): were they run with the same model and code?")
                held.setdefault(name, (value, path))

    records = []
    for _, rows in every:
        for key, record in rows:
            filled = dict(record)
            for name, (value, _) in ceilings.get(key, {}).items():
                filled[name] = value
            records.append(filled)

    config = dict(first["config"])
    for key in ("lengths", "sizes", "budgets", "caps", "runs", "kv_dtypes"):
        merged: list = []
        for _, part in parts:
            merged += [v for v in part["config"].get(key) or () if v not in merged]
        config[key] = merged
    config["full_max_tokens"] = max(int(p["config"].get("full_max_tokens") or 0) for _, p in parts)
    config["oracle"] = any(p["config"].get("oracle") for _, p in parts)
    config["merged_from"] = [path for path, _ in parts]
    summary = summarize(records)
    return {"config": config, "records": records, "summary": summary, "frontier": frontier(summary)}
