"""``edgekv bench archive``: what recall from the archive buys and costs (issue 15; ReKV, seed 001).

Three parts, each printed and saved in one JSON + PNG (figures only: nothing here asserts a speed):

* ``accuracy``: the trained toy model (``builtin:toy``) on needle streams (``edgekv.eval.needle``'s
  streams, replayed vision, questions at the end), policy ``--policy`` under cap ``--budget``: no archive,
  and an archive recalling ``k`` pairs per question for each ``--ks`` x ``--modes`` (per-layer / pooled
  retrieval), against two ceilings: needle's (a short stream of the same events, nothing evicted) and
  "full cache" (the same long stream, policy ``full``, a cap that holds all of it). The figure the issue
  reads is accuracy on questions about events **older than the capped cache's horizon** (more frame pairs
  ago than the cache holds whole), as a ratio of the ceiling on the same questions. With equal ``M``: the
  archive runs give the retrieval reserve out of the same cap.
* ``latency``: recall's select (score the index) + read (per-layer records from the segment files) +
  prepare (copy into the reserve, re-rotate keys) at the 3B cache shape (36 layers, 2 KV heads, head_dim
  128, bf16, 256 tokens per 448x448 pair) — synthetic KV, no model. ``--latency-pairs`` records are
  really written; archives of ``--sizes-gib`` are SIMULATED: an index of that many pairs (random index keys)
  whose entries point at the written records, so the disk holds only the read set. Reads are timed warm
  (page cache) and cold (the segment files' pages dropped with posix_fadvise first). Select scores the
  index with random queries of ``--q-heads`` x ``--question-tokens`` (attention scoring) or their mean
  (cosine). The probe (one question-length prefill) is a model forward and is not in these figures. Writing those records also
  times ``submit`` — the ingest thread's whole share of archiving a pair (copy into a staging buffer,
  hand-off) — and the writer thread's ms per pair, at that shape.
* ``ingest``: ms per frame pair with the archive writer on vs off (toy model, replayed vision so the
  figure is LM prefill + compression + archive hand-off; the "on" cap is larger by the retrieval reserve so
  both runs hold the same video and compress at the same pairs), alternating runs, and the process RSS along
  the stream with the writer on. Disk bytes per hour at the 3B shape: measured record size x pairs per
  hour, and the store-evictions alternative estimated from the toy run's evicted-token share.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def add_archive_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="accuracy,latency,ingest", help="comma-separated: accuracy, latency, ingest")
    parser.add_argument("--model", default="builtin:toy", help="toy checkpoint for the accuracy and ingest parts")
    parser.add_argument("--policy", default="infinipot_v", help="cache policy of every run")
    parser.add_argument("--length", type=int, default=600, help="frame pairs per needle stream")
    parser.add_argument("--budget", type=int, default=1024, help="cache cap M in tokens (toy: 16 tokens per pair)")
    parser.add_argument("--ages", default="150,250,350,450,550", help="needle event ages (frame pairs before the end)")
    parser.add_argument("--events", type=int, default=3)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--ks", default="4,16", help="pairs recalled per question (archive.top_k)")
    parser.add_argument("--modes", default="layer,pooled", help="archive.retrieval values to compare")
    parser.add_argument("--scorings", default="attention,cosine", help="archive.scoring values to compare")
    parser.add_argument("--index-keys", type=int, default=2, help="archive.index_keys of every archive run")
    parser.add_argument("--q-heads", type=int, default=16,
                        help="latency part: query heads (the 3B model: 16) scoring the index")
    parser.add_argument("--question-tokens", type=int, default=24,
                        help="latency part: question tokens whose queries score the index")
    parser.add_argument("--latency-pairs", type=int, default=48, help="records really written for the latency part")
    parser.add_argument("--shape", type=_ints, default=(36, 2, 128, 256),
                        help="latency part's KV shape: layers,kv_heads,head_dim,tokens per pair (bf16; default: "
                             "the 3B model at 448x448)")
    parser.add_argument("--sizes-gib", default="1,10,100", help="simulated archive sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ingest-pairs", type=int, default=400)
    parser.add_argument("--ingest-repeats", type=int, default=3)
    parser.add_argument("--queue-pairs", type=int, default=8, help="archive.queue_pairs of the ingest part's writer")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="model dtype of the ingest part (bf16 makes a 3B-shape checkpoint affordable)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--dir", default=None, help="folder for the archives (default: a temporary folder)")
    parser.add_argument("--json", default="bench-archive.json")
    parser.add_argument("--plot", default="bench-archive.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_archive)


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def run_archive(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"accuracy", "latency", "ingest"}
    if unknown:
        raise ValueError(f"--parts: unknown part(s) {sorted(unknown)} (known: accuracy, latency, ingest)")
    setup = {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads,
             "load_before": os.getloadavg(), "args": {k: v for k, v in vars(args).items() if k != "run"}}
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-archive-") as folder:
        root = Path(folder)
        if "accuracy" in parts:
            results["accuracy"] = accuracy(args, root / "accuracy")
        if "latency" in parts:
            results["latency"] = latency(args, root / "latency")
        if "ingest" in parts:
            results["ingest"] = ingest(args, root / "ingest")
    setup["load_after"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"setup": setup, "results": results}, indent=1, default=str))
    if args.plot:
        plot(results, Path(args.plot))
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


# ---------------------------------------------------------------------------------------------- accuracy
def _toy_runtime(model: str, policy: str, budget: int, archive: dict | None, dtype: str = "fp32"):
    from edgekv.runtime import Runtime

    return Runtime.from_pretrained(model, model={"dtype": dtype, "device": "cpu"},
                                   cache={"policy": policy, "max_tokens": budget, "text_reserve_tokens": 64},
                                   video={"fps": 2.0, "resolution": [112, 112]}, archive=archive or {})


def accuracy(args: argparse.Namespace, root: Path) -> dict:
    from edgekv.eval.needle import NeedleConfig, _ceilings, encode_stream, needle_stream

    ages = _ints(args.ages)
    config = NeedleConfig(model=args.model, lengths=(args.length,), budgets=(args.budget,), ages=ages,
                          streams=args.streams, events=args.events, checkpoints=(1.0,))
    # "full cache": the same stream with nothing evicted (policy full, a cap that holds it all) — the
    # ceiling at the same distances between event and question; needle's ceiling is a short stream
    runs: list[tuple[str, dict | None]] = [("full cache", None), ("no archive", None)]
    for k in _ints(args.ks):
        for mode in _names(args.modes):
            for scoring in _names(args.scorings):
                runs.append((f"archive k={k} {mode} {scoring}",
                             {"top_k": k, "retrieval": mode, "scoring": scoring, "index_keys": args.index_keys,
                              "max_gib": 1.0, "segment_mib": 64, "when_full": "wait"}))  # replayed: archive all
    plain = _toy_runtime(args.model, args.policy, args.budget, None).session()
    horizon = plain.frames_that_fit() // 2  # frame pairs the cache holds whole before it must compress
    base = _toy_runtime(args.model, "full", 128, None)
    records = []
    for index in range(args.streams):
        stream = needle_stream(args.length, ages, index, args.events, 2.0, (1.0,))
        ceiling = _ceilings(config, stream)
        replay = encode_stream(base, stream.scene, stream.pairs)
        for run_index, (label, archive) in enumerate(runs):
            if archive is not None:
                archive = {**archive, "dir": str(root / f"s{index}-r{run_index}")}
            full = label == "full cache"
            runtime = _toy_runtime(args.model, "full" if full else args.policy,
                                   32 + 16 * stream.pairs + 128 if full else args.budget, archive)
            started = time.perf_counter()
            answers, recalled, stats, whole = _ask_at_end(runtime, stream, replay)
            seconds = time.perf_counter() - started
            correct = [answers[p.qa.question] == p.qa.answer for p in stream.probes]
            old = [c for p, c in zip(stream.probes, correct) if p.age is not None and p.age > horizon]
            hits = [stream.pairs - p.age in recalled[p.qa.question] for p in stream.probes
                    if p.age is not None and p.age > horizon]
            print(f"stream {index} {label:24s} accuracy {sum(correct) / len(correct):.3f}, on events older than "
                  f"{horizon} pairs {sum(old)}/{len(old)}, event pair recalled {sum(hits)}/{len(hits)} "
                  f"({seconds:.1f} s, archive dropped {stats.get('archive_dropped', 0)}, recall ms/question "
                  f"{stats.get('recall_ms_total', 0) / max(stats.get('recalls', 0), 1):.1f})", flush=True)
            for probe, ok in zip(stream.probes, correct):
                records.append({"stream": index, "run": label, "family": probe.qa.family, "age": probe.age,
                                "question": probe.qa.question, "answer": probe.qa.answer,
                                "predicted": answers[probe.qa.question], "correct": bool(ok),
                                "recalled": list(recalled[probe.qa.question]),
                                "event_recalled": probe.age is not None and stream.pairs - probe.age
                                in recalled[probe.qa.question],
                                # whole in every layer and head at question time: not a recall candidate
                                "event_whole_in_cache": probe.age is not None and stream.pairs - probe.age in whole,
                                "ceiling_correct": ceiling[(probe.checkpoint, probe.qa.question)],
                                "evicted_share": stats["tokens_evicted"] / max(stats["frame_pairs"] * 16, 1),
                                "recall_ms": stats.get("recall_ms_total", 0) / max(stats.get("recalls", 0), 1)})
    summary = {}
    for label, _ in runs:
        rows = [r for r in records if r["run"] == label]
        old = [r for r in rows if r["age"] is not None and r["age"] > horizon]
        acc, ceil = _share(old, "correct"), _share(old, "ceiling_correct")
        full_rows = [r for r in records if r["run"] == "full cache" and r["age"] is not None and r["age"] > horizon]
        full_acc = _share(full_rows, "correct")
        summary[label] = {"old_n": len(old), "old_accuracy": acc, "old_ceiling": ceil,
                          "old_ratio": round(acc / ceil, 4) if ceil else None,
                          "old_full_cache_accuracy": full_acc,
                          "old_ratio_to_full_cache": round(acc / full_acc, 4) if full_acc else None,
                          "old_event_recalled": _share(old, "event_recalled"),
                          "old_event_whole_in_cache": _share(old, "event_whole_in_cache"),
                          "old_event_recalled_if_not_whole": _share(
                              [r for r in old if not r["event_whole_in_cache"]], "event_recalled"),
                          "all_accuracy": _share(rows, "correct"), "all_ceiling": _share(rows, "ceiling_correct"),
                          "recall_ms_per_question": round(statistics.mean(r["recall_ms"] for r in rows), 2)}
        print(f"{label:24s} events older than {horizon} pairs: accuracy {acc:.3f} vs short-stream ceiling {ceil:.3f} "
              f"(ratio {summary[label]['old_ratio']}) and full cache {full_acc:.3f} (ratio "
              f"{summary[label]['old_ratio_to_full_cache']}), n={len(old)}; event pair recalled "
              f"{summary[label]['old_event_recalled']:.3f} ({summary[label]['old_event_recalled_if_not_whole']:.3f} "
              f"of those not whole in the cache, {1 - summary[label]['old_event_whole_in_cache']:.3f} of them); all "
              f"questions {summary[label]['all_accuracy']:.3f}")
    return {"horizon_pairs": horizon, "budget": args.budget, "policy": args.policy, "length": args.length,
            "summary": summary, "records": records}


def _ask_at_end(runtime, stream, replay) -> tuple[dict[str, str], dict[str, tuple[int, ...]], dict, set[int]]:
    """Ingest the whole stream, then ask every probe; answers, the pairs each answer recalled, the session's
    stats and the pairs whole in the cache (every token in every layer and head) when the questions came."""
    from edgekv.toy.questions import answer_of

    session = runtime.session()
    replay.index = 0
    session.vision = replay
    for pair in range(stream.pairs):
        first, second = stream.scene.pair_frames(pair)
        session.ingest(first, t=stream.scene.time(2 * pair))
        session.ingest(second, t=stream.scene.time(2 * pair + 1))
    if session.recall is not None:
        session.recall.archive.flush()  # a question right after the last pair: let the writer catch up
    whole = _whole_pairs(session)
    answers, recalled = {}, {}
    for probe in stream.probes:
        if probe.qa.question not in answers:
            answer = session.ask(probe.qa.question, max_new_tokens=2)
            answers[probe.qa.question], recalled[probe.qa.question] = answer_of(answer.text), answer.recalled
    stats = session.stats()
    if session.recall is not None:
        session.recall.close()
    return answers, recalled, stats, whole


def _whole_pairs(session) -> set[int]:
    """Pairs whole in every layer and KV head of the session's cache (``edgekv.archive.recall.whole_in_cache``)."""
    from edgekv.archive.recall import whole_in_cache

    pairs = list(range(session.counters.frame_pairs))
    whole = whole_in_cache(session.cache, pairs, session.tokens_per_pair).all(dim=1)
    return {p for p, w in zip(pairs, whole.tolist()) if w}


def _share(rows: list[dict], key: str) -> float:
    return round(sum(bool(r[key]) for r in rows) / len(rows), 4) if rows else float("nan")


# ---------------------------------------------------------------------------------------------- latency
def _fake_session(folder: Path, shape: dict, top_k: int, mode: str, cache, scoring: str = "attention",
                  index_keys: int = 2):
    """What Recall needs of a session, at a cache shape, without a model (select/load/clear only)."""
    from edgekv.archive.recall import STREAM_KEY, Recall
    from edgekv.config import ArchiveSection
    from edgekv.model.rope import rotary_inv_freq

    session = SimpleNamespace(
        # t_offset -4: every recalled pair is re-rotated by 4 positions, as after a re-basing
        llm=SimpleNamespace(name="torch"), cache=cache, capacity=cache.capacity, t_offset=-4,
        inv_freq=rotary_inv_freq(shape["head_dim"], 1e6), temporal_section=shape["head_dim"] // 8,
        preprocessor=SimpleNamespace(tokens_per_pair=shape["tokens"]),
        counters=SimpleNamespace(extra={STREAM_KEY: (b"b" * 16).hex()}, frame_pairs=0))
    section = ArchiveSection(dir=str(folder), max_gib=1024.0, segment_mib=1024.0, top_k=top_k, retrieval=mode,
                             scoring=scoring, index_keys=index_keys)
    return session, Recall(session, section)


def _write_records(folder: Path, shape: dict, pairs: int, index_keys: int) -> tuple[int, list[float], float]:
    """Write ``pairs`` records through ``submit`` from strided cache views, as ingest does; returns the
    bytes on disk, the ms of each accepted ``submit`` (the ingest thread's share) and the writer's ms/pair."""
    from edgekv.archive.store import FrameArchive, KVShape

    archive = FrameArchive(folder, KVShape.of(shape["layers"], shape["kv_heads"], shape["head_dim"], shape["dtype"],
                                              index_keys),
                           max_bytes=1 << 40, segment_bytes=1 << 30, queue_pairs=4)
    generator = torch.Generator().manual_seed(0)
    # k: [layers, kv_heads, 4 P, head_dim], a cache-like buffer: each pair is a strided slice of it
    k = torch.empty(shape["layers"], shape["kv_heads"], 4 * shape["tokens"], shape["head_dim"], dtype=shape["dtype"])
    k.copy_(torch.randn(k.shape, generator=generator))
    submit_ms = []
    for pair in range(pairs):
        view = k[:, :, (pair % 4) * shape["tokens"]:(pair % 4 + 1) * shape["tokens"]]
        while True:
            started = time.perf_counter()
            accepted = archive.submit(view, view, frame=pair, t=2.0 * pair, tpos=10 + 2 * pair, t_offset=0, rows=16,
                                      cols=16, stream=b"b" * 16)
            if accepted:
                submit_ms.append((time.perf_counter() - started) * 1e3)
                break
            archive.flush()
        time.sleep(0.05)  # one pair per 50 ms: the writer keeps up, as it must on a device
    archive.close()
    return archive.bytes_on_disk, submit_ms, archive.write_ms_total / pairs


def _drop_page_cache(folder: Path) -> None:
    for path in folder.glob("seg-*.ekva"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def latency(args: argparse.Namespace, root: Path) -> dict:
    from dataclasses import replace

    from edgekv.cache.capped import CappedKVCache
    from edgekv.cache.specs import CacheSpec

    if len(args.shape) != 4 or min(args.shape) <= 0:
        raise ValueError(f"--shape: expected four positive integers layers,kv_heads,head_dim,tokens, got {args.shape}")
    shape = dict(zip(("layers", "kv_heads", "head_dim", "tokens"), args.shape), dtype=torch.bfloat16)
    root.mkdir(parents=True)
    disk, submit_ms, writer_ms = _write_records(root, shape, args.latency_pairs, args.index_keys)
    record = disk / args.latency_pairs
    print(f"submit (on the ingest thread): median {statistics.median(submit_ms):.2f} ms, max {max(submit_ms):.2f} ms "
          f"per pair; the writer thread {writer_ms:.1f} ms per pair", flush=True)
    print(f"shape {args.shape}: {args.latency_pairs} records written, {record / 1e6:.2f} MB each (K+V of "
          f"{shape['tokens']} tokens x {shape['layers']} layers + index row)", flush=True)
    ks = _ints(args.ks)
    cache = CappedKVCache(CacheSpec.uniform(shape["layers"], shape["kv_heads"], shape["head_dim"], shape["dtype"]),
                          max(ks) * shape["tokens"])
    out = []
    for size in (float(x) for x in args.sizes_gib.split(",") if x.strip()):
        pairs = max(int(size * 2**30 // record), 1)
        for mode, scoring in [(m, s) for m in _names(args.modes) for s in _names(args.scorings)]:
            for k in ks:
                session, recall = _fake_session(root, shape, k, mode, cache, scoring, args.index_keys)
                real = recall.archive.entries()
                generator = torch.Generator().manual_seed(pairs)
                cells = (shape["layers"], shape["kv_heads"], args.index_keys)
                for pair in range(len(real), pairs):  # simulated rows: random keys, records reused
                    entry = replace(real[pair % len(real)], pair=pair, frame=pair, t=2.0 * pair, tpos=10 + 2 * pair)
                    recall.archive._add(entry, torch.randn(*cells, shape["head_dim"], generator=generator).half(),
                                        torch.full(cells, 1.0 / args.index_keys).half())
                index_mb = pairs * (recall.archive.shape.summary_bytes() + 4 * shape["layers"]) / 2**20
                timings = {"select": [], "read_warm": [], "read_cold": []}
                for repeat in range(args.repeats):
                    query = torch.randn(shape["layers"], args.q_heads, args.question_tokens, shape["head_dim"],
                                        generator=generator)
                    _drop_page_cache(root)  # cold: the records come from the disk
                    started = time.perf_counter()
                    ranked = recall.select(query)
                    selected = time.perf_counter()
                    for name in ("read_cold", "read_warm"):  # warm: the same records again, now in the page cache
                        began = time.perf_counter()
                        loaded = recall.load(ranked)
                        timings[name].append((time.perf_counter() - began) * 1e3)
                        assert all(len(row) == k for row in loaded)
                        recall.clear(0, cache.length)
                        cache.truncate(0)
                    timings["select"].append((selected - started) * 1e3)
                row = {"size_gib": size, "pairs": pairs, "mode": mode, "scoring": scoring, "k": k,
                       "index_keys": args.index_keys, "index_mib": round(index_mb, 1),
                       **{f"{name}_ms": round(statistics.median(v), 2) for name, v in timings.items()}}
                row["total_cold_ms"] = round(row["select_ms"] + row["read_cold_ms"], 2)
                print(f"  {size:>5} GiB ({pairs:>6} pairs, index {index_mb:7.1f} MiB) {mode:6s} {scoring:9s} k={k:<3d} select "
                      f"{row['select_ms']:8.2f} ms, read+prepare warm {row['read_warm_ms']:8.2f} ms, cold "
                      f"{row['read_cold_ms']:8.2f} ms", flush=True)
                out.append(row)
                recall.close()
    pairs_per_hour = {fps: 3600 * fps / 2 for fps in (0.5, 1.0, 2.0)}
    return {"record_bytes": record, "pairs_written": args.latency_pairs, "rows": out,
            "submit_ms_median": round(statistics.median(submit_ms), 3), "submit_ms_max": round(max(submit_ms), 3),
            "writer_ms_per_pair": round(writer_ms, 2),
            "bytes_per_hour_at_ingest": {f"{fps:g} fps": round(record * n) for fps, n in pairs_per_hour.items()}}


# ---------------------------------------------------------------------------------------------- ingest
def ingest(args: argparse.Namespace, root: Path) -> dict:
    import psutil

    from edgekv.config import EdgeKVConfig
    from edgekv.eval.needle import encode_stream, needle_stream

    stream = needle_stream(args.ingest_pairs, (args.ingest_pairs // 2,), 0, 1, 2.0, (1.0,))
    base = _toy_runtime(args.model, "full", 128, None, args.dtype)
    replay = encode_stream(base, stream.scene, stream.pairs)
    process = psutil.Process()
    per_pair = {"off": [], "on": []}
    rss_mb: list[tuple[int, float]] = []
    evicted_share = None
    limits: dict[str, int] = {}
    compressions: dict[str, list[int]] = {"off": [], "on": []}
    # The writer's cost alone: the "on" cache is larger by the retrieval reserve (archive.top_k pairs), so
    # both hold the same video and compress at the same pairs (with equal max_tokens the reserve would take
    # video room and the "on" run would compress more often — a cost of the reserve, not of the writer).
    reserve = EdgeKVConfig().archive.top_k * 16  # 16 tokens per pair at 112 x 112
    for repeat in range(args.ingest_repeats):
        for label in ("off", "on"):
            archive = ({"dir": str(root / f"r{repeat}"), "max_gib": 1.0, "segment_mib": 64,
                        "queue_pairs": args.queue_pairs} if label == "on" else None)
            budget = args.budget + (reserve if label == "on" else 0)
            # the weights are loaded once (a 3B-shape checkpoint twice over would not fit): each run is the
            # same runtime with its own cache and archive sections
            runtime = copy.copy(base)
            runtime.config = base.config.with_overrides(cache={"policy": args.policy, "max_tokens": budget},
                                                        archive=archive or {})
            session = runtime.session()
            limits[label] = session.video_limit
            replay.index = 0
            session.vision = replay
            started = time.perf_counter()
            for pair in range(stream.pairs):
                first, second = stream.scene.pair_frames(pair)
                session.ingest(first, t=stream.scene.time(2 * pair))
                session.ingest(second, t=stream.scene.time(2 * pair + 1))
                if label == "on" and repeat == args.ingest_repeats - 1 and pair % 20 == 0:
                    rss_mb.append((pair, process.memory_info().rss / 2**20))
            per_pair[label].append((time.perf_counter() - started) * 1e3 / stream.pairs)
            stats = session.stats()
            compressions[label].append(stats["compressions"])
            evicted_share = stats["tokens_evicted"] / (stats["frame_pairs"] * 16)
            if session.recall is not None:
                session.recall.close()
                print(f"  writer on: {per_pair['on'][-1]:.3f} ms/pair, {stats['archive_pairs']} archived, "
                      f"{stats['archive_dropped']} dropped, writer busy {stats['archive_write_ms_total']:.0f} ms",
                      flush=True)
            else:
                print(f"  writer off: {per_pair['off'][-1]:.3f} ms/pair", flush=True)
    if limits["on"] != limits["off"]:
        raise RuntimeError(f"ingest: video room differs with the archive ({limits['on']} vs {limits['off']} tokens)")
    off, on = statistics.median(per_pair["off"]), statistics.median(per_pair["on"])
    print(f"ingest {on:.3f} ms/pair with the writer vs {off:.3f} without: {100 * (on / off - 1):+.1f} %", flush=True)
    # store-evictions alternative at the 3B shape: evicted tokens x (K+V + 12 B provenance) per slot-head
    slot_head_bytes = 2 * 128 * 2 + 12
    tokens_per_hour_1fps = 1800 * 256
    return {"ms_per_pair": per_pair, "compressions": compressions, "video_room_tokens": limits["off"],
            "median_off_ms": round(off, 4), "median_on_ms": round(on, 4),
            "slowdown_pct": round(100 * (on / off - 1), 2), "rss_mb_on": rss_mb,
            "evicted_share_toy": round(evicted_share, 4),
            "store_evictions_bytes_per_hour_1fps_3b": round(tokens_per_hour_1fps * evicted_share * 36 * 2
                                                            * slot_head_bytes)}


# ---------------------------------------------------------------------------------------------- figure
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("accuracy", "latency", "ingest") if p in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, part in zip(axes[0], panels):
        data = results[part]
        if part == "accuracy":
            labels = list(data["summary"])
            ax.bar(range(len(labels)), [data["summary"][l]["old_accuracy"] for l in labels], color="tab:blue")
            ax.axhline(statistics.mean(data["summary"][l]["old_ceiling"] for l in labels), color="k", ls="--",
                       label="ceiling (needle: short stream, nothing evicted)")
            ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("accuracy")
            ax.set_title(f"toy, events older than {data['horizon_pairs']} pairs (M={data['budget']})", fontsize=9)
            ax.legend(fontsize=7)
        elif part == "latency":
            for mode, scoring in sorted({(r["mode"], r.get("scoring", "cosine")) for r in data["rows"]}):
                for k in sorted({r["k"] for r in data["rows"]}):
                    rows = [r for r in data["rows"]
                            if r["mode"] == mode and r.get("scoring", "cosine") == scoring and r["k"] == k]
                    ax.plot([r["size_gib"] for r in rows], [r["total_cold_ms"] for r in rows], marker="o",
                            label=f"{mode} {scoring} k={k} (cold)")
            ax.set_xscale("log")
            ax.set_xlabel("archive size (GiB, simulated index)")
            ax.set_ylabel("select + read + prepare (ms)")
            ax.set_title("recall latency at the 3B shape", fontsize=9)
            ax.legend(fontsize=7)
        else:
            xs = [p for p, _ in data["rss_mb_on"]]
            ax.plot(xs, [m for _, m in data["rss_mb_on"]], label="RSS, writer on")
            ax.set_xlabel("frame pair")
            ax.set_ylabel("RSS (MiB)")
            ax.set_title(f"ingest {data['median_on_ms']:.2f} ms/pair on vs {data['median_off_ms']:.2f} off "
                         f"({data['slowdown_pct']:+.1f} %)", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
