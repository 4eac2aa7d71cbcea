"""``edgekv eval videoqa``: real Qwen2.5-VL weights on MLVU or Video-MME, streamed through the capped cache.

Each video is streamed into ONE session at ``--fps`` (frames picked by their timestamps, as the daemon
samples a camera) under the deployment's cache (policy, cap, sinks); then every question about that
video is asked of the same cache — the cache is query-agnostic (DESIGN invariant 3), so one pass serves
all of a video's questions, and each answer leaves the cache as it was.

Datasets, read in their published layouts from a local directory (nothing is downloaded):

* **MLVU** (dev set, the layout of the MLVU release): ``DATA/json/<n>_<task>.json`` — a list of
  ``{"video", "duration", "question", "candidates", "answer", "question_type"}`` with ``answer`` one of the
  ``candidates`` — and the videos in ``DATA/video/<n>_<task>/<video>``. Only multiple-choice tasks
  (items with ``candidates``) are scored. The headline figure is the mean of the per-task accuracies.
* **Video-MME** (the ``lmms-lab/Video-MME`` layout): ``DATA/videomme/test-*.parquet`` (or the same rows
  as ``.json`` / ``.jsonl``) with ``videoID, duration, domain, sub_category, task_type, question_id,
  question, options, answer`` — ``options`` like ``"A. ..."``, ``answer`` a letter — and the videos in
  ``DATA/data/<videoID>.mp4`` (the released zips unpack there) or ``DATA/video/<videoID>.mp4``. Scored
  without subtitles, overall and per duration (short / medium / long) and task type.

Prompt (the format of InfiniPot-V's evaluation code, aiha-lab/InfiniPot-V): ``Question: {q}\\nOptions:\\n``
then one line per option (MLVU: ``(A) {candidate}``; Video-MME: the given ``A. ...`` lines), then
``Respond with only the letter (A, B, C or D) of the correct option.`` (Video-MME: ``(A, B, C, or D)``).
The reply's first option letter is the prediction; a reply with none counts as ``C``, as there.

Results are appended to ``OUT/results.jsonl`` one item at a time (``--out``); a rerun skips the items
already there (resumable), and ``OUT/summary.json`` is rewritten after every video.

Reproducing InfiniPot-V's Qwen2.5-VL-3B figures at a 6K budget (seed 004, Table 1: MLVU 62.1, Video-MME
59.3 with 768 uniformly sampled frames at up to 128 x 28 x 28 pixels): see the README section
"Real-weights evaluation". Not run here: no real weights or datasets can be downloaded in this workplace.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LETTERS = "ABCDEFGH"
VIDEO_SUFFIXES = (".mp4", ".mkv", ".avi", ".mov", ".webm")


@dataclass(frozen=True)
class Item:
    id: str
    video: Path
    question: str
    options: tuple[str, ...]  # display lines, in order
    answer: str               # the correct letter
    task: str
    extra: dict = field(default_factory=dict, compare=False, hash=False)


class DatasetError(ValueError):
    """A dataset directory that does not have the published layout; the message names the file."""


# ---------------------------------------------------------------------------------------------- readers
def load_mlvu(data: Path) -> list[Item]:
    folder = data / "json"
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise DatasetError(f"{folder}: no MLVU annotation files (expected json/<n>_<task>.json)")
    items: list[Item] = []
    for path in files:
        try:
            rows = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DatasetError(f"{path}: not a readable JSON list ({exc})") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: expected a JSON list of questions")
        task = re.sub(r"^\d+_", "", path.stem)
        for index, row in enumerate(rows):
            if not isinstance(row, dict) or "candidates" not in row:
                continue  # generation tasks (sub_scene, summary) have no candidates: not multiple choice
            try:
                candidates = [str(c) for c in row["candidates"]]
                answer = LETTERS[candidates.index(str(row["answer"]))]
                video = data / "video" / path.stem / str(row["video"])
                question = str(row["question"])
            except (KeyError, ValueError, IndexError) as exc:
                raise DatasetError(f"{path}: item {index} lacks video/question/candidates/answer ({exc!r})") from None
            options = tuple(f"({LETTERS[i]}) {c}" for i, c in enumerate(candidates))
            items.append(Item(f"{path.stem}/{index}", video, question, options, answer, task,
                              {"duration": row.get("duration")}))
    return items


def load_videomme(data: Path) -> list[Item]:
    folder = data / "videomme"
    rows: list[dict] = []
    parquet = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    plain = sorted([*folder.glob("*.json"), *folder.glob("*.jsonl")]) if folder.is_dir() else []
    if parquet:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{parquet[0]}: reading Video-MME's parquet needs pyarrow "
                               "(pip install 'edgekv[eval]' or pip install pyarrow)") from None
        for path in parquet:
            rows.extend(pq.read_table(path).to_pylist())
    elif plain:
        for path in plain:
            text = path.read_text()
            try:
                if path.suffix == ".jsonl":
                    rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
                else:
                    rows.extend(json.loads(text))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: not valid JSON ({exc})") from None
    else:
        raise DatasetError(f"{folder}: no Video-MME annotations (expected videomme/test-*.parquet, .json or .jsonl)")
    items = []
    for index, row in enumerate(rows):
        try:
            video_id = str(row["videoID"])
            options = tuple(str(o) for o in row["options"])
            answer = str(row["answer"]).strip().upper()[:1]
            question = str(row["question"])
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{folder}: row {index} lacks videoID/question/options/answer ({exc!r})") from None
        if answer not in LETTERS[: len(options)]:
            raise DatasetError(f"{folder}: row {index}: answer {row['answer']!r} is not an option letter")
        video = _first_existing([data / sub / f"{video_id}{suffix}" for sub in ("data", "video")
                                 for suffix in VIDEO_SUFFIXES]) or data / "data" / f"{video_id}.mp4"
        items.append(Item(str(row.get("question_id", f"{video_id}-{index}")), video, question, options, answer,
                          str(row.get("task_type", "unknown")),
                          {"duration": row.get("duration"), "domain": row.get("domain")}))
    return items


def _first_existing(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


LOADERS = {"mlvu": load_mlvu, "videomme": load_videomme}


def prompt(item: Item, dataset: str) -> str:
    letters = ", ".join(LETTERS[: len(item.options) - 1]) + ("," if dataset == "videomme" else "") + \
        f" or {LETTERS[len(item.options) - 1]}"
    lines = [f"Question: {item.question}", "Options:", *item.options,
             f"Respond with only the letter ({letters}) of the correct option."]
    return "\n".join(lines)


def extract_letter(reply: str, options: int = 4) -> str:
    """The first option letter in a reply (``A``, ``(B)``, ``C.``, ``[D]``); ``C`` when there is none."""
    valid = LETTERS[:options]
    found = re.findall(rf"[\(\[\s]*([{valid}])(?:[\)\]\.\s:,]|$)", reply.replace("Answer", "").strip())
    return found[0] if found else "C"


# ---------------------------------------------------------------------------------------------- running
def run(args: argparse.Namespace) -> int:
    from edgekv.config import ConfigError, EdgeKVConfig, load_config

    data = Path(args.data).expanduser()
    try:
        items = LOADERS[args.dataset](data)
    except DatasetError as exc:
        print(f"edgekv eval videoqa: {exc}", file=sys.stderr)
        return 2
    if args.limit:
        items = items[: args.limit]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = _read_results(results_path)
    try:
        base = load_config(args.config) if args.config else EdgeKVConfig()
        cache = {"policy": args.policy, "max_tokens": args.max_tokens, "sinks": args.sinks,
                 "text_reserve_tokens": args.text_reserve}
        config = base.with_overrides(model={"path": args.model, **({"dtype": args.dtype} if args.dtype else {})},
                                     cache=cache, video={"fps": args.fps, "resolution": args.resolution})
    except ConfigError as exc:
        print(f"edgekv eval videoqa: {exc}", file=sys.stderr)
        return 2
    missing = sorted({str(i.video) for i in items if not i.video.is_file()})
    if missing:
        print(f"edgekv eval videoqa: {len(missing)} video file(s) missing, e.g. {missing[0]}", file=sys.stderr)
        return 2
    from edgekv.runtime import Runtime

    runtime = Runtime(config)
    by_video: dict[Path, list[Item]] = {}
    for item in items:
        if item.id not in done:
            by_video.setdefault(item.video, []).append(item)
    progress = _progress(sum(len(v) for v in by_video.values()), f"{args.dataset} ({len(done)} already done)")
    with results_path.open("a") as sink:
        for video, questions in by_video.items():
            record_base, session = _stream(runtime, video, args.fps, args.max_frames)
            for item in questions:
                started = time.perf_counter()
                answer = session.ask(prompt(item, args.dataset), max_new_tokens=args.max_new_tokens)
                predicted = extract_letter(answer.text, len(item.options))
                record = {"id": item.id, "task": item.task, "video": str(item.video), "answer": item.answer,
                          "predicted": predicted, "correct": predicted == item.answer, "reply": answer.text,
                          "answer_s": round(time.perf_counter() - started, 3), "ttft_s": round(answer.ttft_s, 3),
                          **record_base, **{k: v for k, v in item.extra.items() if v is not None}}
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                done[item.id] = record
                progress(1)
            _write_summary(out, args, config, done)
    summary = _write_summary(out, args, config, done)
    print(json.dumps(summary["accuracy"], indent=1))
    print(f"wrote {results_path} and {out / 'summary.json'}")
    return 0


def _stream(runtime, video: Path, fps: float, max_frames: int | None):
    from edgekv.video.sources import iter_frames

    session = runtime.session()
    started = time.perf_counter()
    frames = 0
    for frame, t in iter_frames(str(video), max_frames=max_frames, fps=fps):
        session.ingest(frame, t=t)
        frames += 1
    seconds = time.perf_counter() - started
    stats = session.stats()
    return {"frames": frames, "ingest_fps": round(frames / seconds, 3) if seconds else None,
            "cache_tokens": stats["cache_tokens"], "compressions": stats["compressions"]}, session


def _read_results(path: Path) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by an interrupted run: that item is asked again
            done[record["id"]] = record
    return done


def summarize(records: list[dict], dataset: str) -> dict:
    tasks: dict[str, list[bool]] = {}
    durations: dict[str, list[bool]] = {}
    for r in records:
        tasks.setdefault(r["task"], []).append(r["correct"])
        if dataset == "videomme" and r.get("duration"):
            durations.setdefault(str(r["duration"]), []).append(r["correct"])
    per_task = {t: round(100 * sum(v) / len(v), 2) for t, v in sorted(tasks.items())}
    overall = round(100 * sum(r["correct"] for r in records) / len(records), 2) if records else None
    out = {"questions": len(records), "overall": overall, "per_task": per_task}
    if dataset == "mlvu":
        out["m_avg"] = round(sum(per_task.values()) / len(per_task), 2) if per_task else None
    if durations:
        out["per_duration"] = {d: round(100 * sum(v) / len(v), 2) for d, v in sorted(durations.items())}
    return out


def _write_summary(out: Path, args: argparse.Namespace, config, done: dict[str, dict]) -> dict:
    records = list(done.values())
    fps_values = [r["ingest_fps"] for r in records if r.get("ingest_fps")]
    summary = {
        "dataset": args.dataset, "model": args.model, "policy": config.cache.policy,
        "budget_tokens": config.cache.max_tokens, "sinks": config.cache.sinks, "fps": config.video.fps,
        "resolution": config.video.resolution, "dtype": config.model.dtype,
        "accuracy": summarize(records, args.dataset),
        "throughput": {"ingest_frames_per_s_mean": round(sum(fps_values) / len(fps_values), 3) if fps_values else None,
                       "answer_s_mean": round(sum(r["answer_s"] for r in records) / len(records), 3) if records else None},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _progress(total: int, label: str):
    try:
        from tqdm import tqdm
    except ImportError:
        count = [0]

        def step(n: int) -> None:
            count[0] += n
            print(f"{label}: {count[0]}/{total}", file=sys.stderr)

        return step
    bar = tqdm(total=total, desc=label, unit="q")
    return bar.update


def add_videoqa_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Qwen2.5-VL checkpoint directory (e.g. Qwen2.5-VL-3B-Instruct)")
    parser.add_argument("--dataset", required=True, choices=sorted(LOADERS))
    parser.add_argument("--data", required=True, help="dataset directory in its published layout (see docs)")
    parser.add_argument("--config", default=None, help="deployment YAML to start from (flags override it)")
    parser.add_argument("--policy", default="infinipot_v")
    parser.add_argument("--max-tokens", type=int, default=6144, help="cache cap M in tokens")
    parser.add_argument("--sinks", type=int, default=0, help="StateKV sink budget B (0 = off)")
    parser.add_argument("--text-reserve", type=int, default=512, help="slots of M kept for the prompt and answer")
    parser.add_argument("--fps", type=float, default=0.5, help="frames sampled per second of video")
    parser.add_argument("--resolution", type=int, nargs=2, default=[252, 448], metavar=("H", "W"),
                        help="frame grid (multiples of 28); 252x448 = 144 tokens per frame pair")
    parser.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--max-frames", type=int, default=None, help="stop each video after this many frames")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--out", default="out/videoqa", help="results.jsonl + summary.json go here")
    parser.set_defaults(run=run)
