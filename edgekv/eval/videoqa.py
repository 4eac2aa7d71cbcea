"""``edgekv eval videoqa``: real Qwen2.5-VL weights on video QA benchmarks, streamed through the capped cache.

Each video is streamed into ONE session at ``--fps`` (frames picked by their timestamps, as the daemon
samples a camera) under the deployment's cache (policy, cap, sinks), and its questions are asked of that
cache. The cache is query-agnostic (DESIGN invariant 3) and each answer leaves it as it was, so one pass
serves all of a video's questions:

* **offline** benchmarks (MLVU, Video-MME) ask every question after the whole video;
* **streaming** benchmarks (OVO-Bench, StreamingBench, RVS-Ego / RVS-Movie; readers and their layouts in
  ``edgekv/eval/streaming_sets.py``) ask each question when the stream reaches its timestamp — the frames
  after it are not yet seen — and streaming then goes on to the next question's time (and stops after the
  video's last question). OVO-Bench's Forward Active Responding questions (REC, SSR, CRR) are asked again at
  each of their test times in the same stream, each ask a line of its own (``ovo/<id>/<k>``) scored against
  that time's ground truth; official prompt style only (``infinipot_v`` has no form for their count or yes/no
  replies: they are left out there, said on stderr and in the summary's note). Each result row records what
  the session had seen when it was asked (``frames_seen``, ``stream_t``, ``pairs_prefilled``: frame pairs
  prefilled so far, kept or not).

Datasets, read in their published layouts from a local directory (nothing is downloaded):

* **MLVU** (dev set, the layout of the MLVU release): ``DATA/json/<n>_<task>.json`` — a list of
  ``{"video", "duration", "question", "candidates", "answer", "question_type"}`` with ``answer`` the text of
  a candidate — and the videos in ``DATA/video/<n>_<task>/<video>`` (InfiniPot-V's reader takes the same
  layout). Only multiple-choice tasks (items with ``candidates``) are scored. A repeated candidate and an answer
  that is no candidate are read as MLVU's scorer reads them (``_mlvu_answer``). The headline figure is the mean
  of the per-task accuracies.
* **Video-MME** (the ``lmms-lab/Video-MME`` layout): ``DATA/videomme/test-*.parquet`` (or the same rows
  as ``.json`` / ``.jsonl``) with ``videoID, duration, domain, sub_category, task_type, question_id,
  question, options, answer`` — ``options`` like ``"A. ..."``, ``answer`` a letter — and the videos in
  ``DATA/data/<videoID>.mp4`` (the released zips unpack there) or ``DATA/video/<videoID>.mp4``. Scored
  without subtitles, overall and per duration (short / medium / long) and task type.
* **OVO-Bench** (``ovobench``), **StreamingBench** real-time (``streamingbench``), **RVS-Ego** / **RVS-Movie**
  (``rvs_ego`` / ``rvs_movie``, open-ended): see ``edgekv/eval/streaming_sets.py``.

Prompts (``--prompt-style``; ``edgekv/eval/prompts.py`` gives each with its source file): ``official``, the
default, asks each benchmark's questions as its own evaluation code does (MLVU's ``choice_bench.py``, Video-MME's
README prompt, OVO-Bench's ``constant.py``, StreamingBench's ``src/benchmark/StreamingBench.py``; RVS as written,
as ReKV does); ``infinipot_v`` asks every multiple-choice question in the format of InfiniPot-V's evaluation code
(aiha-lab/InfiniPot-V ``dataset_utils.py``: ``Question:``, ``Options:``, one option per line, ``Respond with
only the letter ... of the correct option.``), the setting of its Table 1, and RVS's with ``Answer in a few
words.`` after it. The style is part of ``run.json`` and of each line of ``results.jsonl``: a rerun with the other
one into the same ``--out`` is refused, also where ``run.json`` and ``summary.json`` were deleted (answers written
before the option existed were asked in ``infinipot_v``). Official MLVU starts the assistant's reply with
``Best option:(`` (``answer_prefix``; ``reply`` is the model's continuation). A reply gets its benchmark's own
budget of new tokens in the official style (MLVU 100, OVO-Bench and StreamingBench 128, RVS 256 as ReKV; Video-MME
sets none and keeps edgekv's 8) and 8 / 64 (multiple choice / open-ended) in ``infinipot_v``; ``--max-new-tokens``
overrides both. A reply ends sooner at its end of turn; each line says how it ended (``finish_reason``, ``length``
when cut at the budget; ``cut_at_max_new_tokens`` in the summary counts those).

Scoring (``edgekv/eval/scoring.py``, each rule with its source): under ``official`` each benchmark's own scorer's
rule, under ``infinipot_v`` the reply's first option letter; a reply from which the rule reads no option letter is
wrong and counted (``no_letter`` in ``summary.json``); Video-MME's own scorer leaves such a reply out of the
denominator instead, and its figures are given beside edgekv's (``videomme_scorer``; the headline ``overall`` stays
edgekv's). Each line names its rule (``scored_by``) and what it read (``predicted``), and ``summary.json``
the run's. A resume rescores the answers there that another rule scored (an official Video-MME run made before the
benchmarks' rules existed) — their stored reply is all a rule reads — and refuses answers asked another way than
this run asks (another answer prefix or token budget: rescoring cannot make them this run's; official MLVU,
OVO-Bench, StreamingBench and RVS runs made before were asked with 8 or 64 tokens, MLVU's without the primer).
Open-ended questions (RVS) are scored with the token-F1 proxy of ``edgekv/eval/open_ended.py`` — not
the papers' GPT judge.

Results are appended to ``OUT/results.jsonl`` one item at a time (``--out``); a rerun skips the items
already there (resumable: a video with questions left is streamed again and only those are asked), and
``OUT/summary.json`` is rewritten after every video: accuracy per task and overall, each with a 95 % Wilson
interval (``edgekv/eval/stats.py``).

Reproducing InfiniPot-V's Qwen2.5-VL-3B figures at a 6K budget (seed 004, Table 1: MLVU 62.1, Video-MME
59.3 with 768 uniformly sampled frames at up to 128 x 28 x 28 pixels): see the README section
"Real-weights evaluation". Not run here: no real weights or datasets can be downloaded in this workplace.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from edgekv.eval import open_ended, scoring
from edgekv.eval.prompts import (CHOICE_MAX_NEW_TOKENS, DEFAULT_PROMPT_STYLE, EARLIER_PROMPT_STYLE,
                                 OFFICIAL_MAX_NEW_TOKENS, OFFICIAL_OPEN_MAX_NEW_TOKENS, OPEN_MAX_NEW_TOKENS,
                                 PROMPT_STYLES, answer_prefix, max_new_tokens_for, prompt)
from edgekv.eval.qa_item import LETTERS, VIDEO_SUFFIXES, DatasetError, Item, read_json
from edgekv.eval.scoring import extract_letter
from edgekv.eval.stats import proportion
from edgekv.eval.streaming_sets import (OVO_FORWARD, is_ovo_forward, load_ovobench, load_rvs_ego, load_rvs_movie,
                                        load_streamingbench)

__all__ = ["DatasetError", "Item", "LETTERS", "LOADERS", "VIDEO_SUFFIXES", "extract_letter", "load_mlvu",
           "load_videomme", "prompt", "run", "summarize"]


# ---------------------------------------------------------------------------------------------- readers
def load_mlvu(data: Path) -> list[Item]:
    folder = data / "json"
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise DatasetError(f"{folder}: no MLVU annotation files (expected json/<n>_<task>.json)")
    items: list[Item] = []
    for path in files:
        rows = read_json(path)  # names the file of a bad byte too (a UnicodeDecodeError did not)
        task = re.sub(r"^\d+_", "", path.stem)
        for index, row in enumerate(rows):
            if not isinstance(row, dict) or "candidates" not in row:
                continue  # generation tasks (sub_scene, summary) have no candidates: not multiple choice
            try:
                if not isinstance(row["candidates"], list):  # a string's letters were read as the options
                    raise ValueError(f"candidates is {row['candidates']!r:.40}, not a list")
                candidates = [str(c) for c in row["candidates"]]
                if not 2 <= len(candidates) <= len(LETTERS):
                    raise ValueError(f"{len(candidates)} candidates, not 2-{len(LETTERS)}")
                answer = _mlvu_answer(candidates, str(row["answer"]))
                video = data / "video" / path.stem / str(row["video"])
                question = str(row["question"])
            except (KeyError, ValueError, IndexError) as exc:
                raise DatasetError(f"{path}: item {index} lacks video/question/candidates/answer ({exc!r})") from None
            options = tuple(f"({LETTERS[i]}) {c}" for i, c in enumerate(candidates))
            extra = {"duration": row.get("duration")}
            if not answer:
                extra["answer_not_in_candidates"] = True
            items.append(Item(f"{path.stem}/{index}", video, question, options, answer, task, extra))
    return items


def _mlvu_answer(candidates: list[str], answer: str) -> str:
    """The letter of ``answer`` among ``candidates`` as MLVU's own scorer reads it (JUNJIE99/MLVU
    ``evaluation/multiple_choice_evaluation/choice_bench.py``; InfiniPot-V's ``dataset_utils.py`` reads it the
    same way): the LAST candidate equal to the answer, and no letter ("", so never correct, still counted) when
    none is. The released dev annotations have both: ``2_needle.json`` items 34 and 338 answer "Catching a flying
    drone quadcopter" with no such candidate, and 16 items across ``1_plotQA``, ``6_anomaly_reco`` and
    ``7_topic_reasoning`` repeat a candidate (6 repeat the answer: ``1_plotQA`` item 335 lists "Three" as B and
    C, and the key is C). Refusing the first kind refused the whole dataset."""
    matches = [i for i, candidate in enumerate(candidates) if candidate == answer]
    return LETTERS[matches[-1]] if matches else ""


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
            if path.suffix != ".jsonl":
                rows.extend(read_json(path))  # a JSON object's keys were read as rows
                continue
            try:
                rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DatasetError(f"{path}: not valid JSON lines ({exc})") from None
    else:
        raise DatasetError(f"{folder}: no Video-MME annotations (expected videomme/test-*.parquet, .json or .jsonl)")
    items = []
    for index, row in enumerate(rows):
        try:
            video_id = str(row["videoID"])
            if isinstance(row["options"], str):  # its letters were read as the options
                raise TypeError(f"options is {row['options']!r:.40}, not a list")
            options = tuple(str(o) for o in row["options"])
            answer = str(row["answer"]).strip().upper()[:1]
            question = str(row["question"])
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{folder}: row {index} lacks videoID/question/options/answer ({exc!r})") from None
        if answer not in LETTERS[: len(options)]:
            raise DatasetError(f"{folder}: row {index}: answer {row['answer']!r} is not an option letter")
        # lmms-eval's Video-MME reader (lmms_eval/tasks/videomme/utils.py) also looks for <videoID>.MP4
        video = _first_existing([data / sub / f"{video_id}{suffix}" for sub in ("data", "video")
                                 for suffix in (*VIDEO_SUFFIXES, *(ext.upper() for ext in VIDEO_SUFFIXES))]) \
            or data / "data" / f"{video_id}.mp4"
        items.append(Item(str(row.get("question_id", f"{video_id}-{index}")), video, question, options, answer,
                          str(row.get("task_type", "unknown")),
                          {"duration": row.get("duration"), "domain": row.get("domain")}))
    return items


def _first_existing(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


LOADERS = {"mlvu": load_mlvu, "videomme": load_videomme, "ovobench": load_ovobench,
           "streamingbench": load_streamingbench, "rvs_ego": load_rvs_ego, "rvs_movie": load_rvs_movie}


# ---------------------------------------------------------------------------------------------- running
ASK_EPSILON_S = 1e-6  # container clocks are in ms, floats are not: a frame read at 2.0000001 s is the 2 s frame
# what a line of results.jsonl without max_new_tokens was given (edgekv before the official style's RVS budget)
EARLIER_MAX_NEW_TOKENS = {False: CHOICE_MAX_NEW_TOKENS, True: OPEN_MAX_NEW_TOKENS}
NOTES = {
    "ovobench": "Backward Tracing, Real-Time Visual Perception and Forward Active Responding: each REC / SSR / CRR "
                "question asked at each of its test times during the video's one stream, one line per time, scored "
                "per time by OVO-Bench's forward rules; per_category: the mean of each category's task accuracies "
                "(a task's accuracy pools its asks); ovo_total: the mean of the three, OVO-Bench's Total Avg. "
                "(None until all three have answers); backward_realtime_avg: the mean of the first two",
    "streamingbench": "Real-Time Visual Understanding subset; each question sees what the cap kept of the whole "
                      "stream so far (StreamingBench's main table gives only the 60 s before the question)",
    "rvs_ego": f"open-ended: correct = token F1 >= {open_ended.CORRECT_F1} against the reference "
               "(edgekv/eval/open_ended.py), NOT the papers' GPT-3.5 judge; not comparable to published RVS figures",
}
NOTES["rvs_movie"] = NOTES["rvs_ego"]
# OVO-Bench in InfiniPot-V's format: the forward tasks are not asked (prompts.py docstring)
OVOBENCH_LETTER_NOTE = ("Backward Tracing and Real-Time Visual Perception only: the Forward Active Responding tasks "
                        f"({', '.join(OVO_FORWARD)}) are asked in the official prompt style only (InfiniPot-V's "
                        "format asks for an option letter and has no form for their count or yes/no replies), so "
                        "there is no forward average and no OVO-Bench total (ovo_total None); backward_realtime_avg "
                        "is the mean of the two category averages (each a mean of task accuracies)")
NOTES["videomme"] = ("without subtitles; overall counts a reply with no letter wrong, while Video-MME's own scorer "
                     "leaves it out of the denominator: its figures are accuracy.videomme_scorer (official prompt "
                     "style)")


def run(args: argparse.Namespace) -> int:
    from edgekv.config import ConfigError, EdgeKVConfig, load_config

    data = Path(args.data).expanduser()
    try:
        items = LOADERS[args.dataset](data)
    except DatasetError as exc:
        print(f"edgekv eval videoqa: {exc}", file=sys.stderr)
        return 2
    by_id = {item.id: item for item in items}  # every item, for rescoring answers past a --limit
    items, left_out = _askable(items, args.dataset, _prompt_style(args))
    if left_out:
        print(f"edgekv eval videoqa: {left_out} OVO-Bench Forward Active Responding asks ({', '.join(OVO_FORWARD)}) "
              f"left out: --prompt-style {_prompt_style(args)} asks for an option letter and has no form for their "
              "count or yes/no replies; --prompt-style official asks them with OVO-Bench's own prompts",
              file=sys.stderr)
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
    asked_in = _other_style(done, _prompt_style(args))
    if asked_in:
        print(f"edgekv eval videoqa: {results_path} holds answers asked in another prompt style ({asked_in}): a "
              f"rerun resumes only in the style of the answers there; give that --prompt-style or another --out",
              file=sys.stderr)
        return 2
    other = _other_run(out, run_settings(args, config), bool(done))
    if other:
        print(f"edgekv eval videoqa: --out {out} holds the answers of another run ({other}): a rerun resumes only "
              f"with the same settings; give another --out", file=sys.stderr)
        return 2
    asked_otherwise = _asked_otherwise(done, args.dataset, _prompt_style(args), args.max_new_tokens)
    if asked_otherwise:
        print(f"edgekv eval videoqa: {results_path} holds answers asked another way than this run asks them "
              f"({asked_otherwise}): a reply primed otherwise or given another token budget answers another prompt "
              f"(the official style primes MLVU's reply and gives each benchmark its own budget, "
              f"edgekv/eval/prompts.py), so they cannot be pooled with this run's; give another --out",
              file=sys.stderr)
        return 2
    from edgekv.runtime import Runtime

    rescored = _rescore(done, by_id, args.dataset, _prompt_style(args))
    if rescored:
        _rewrite_results(results_path, done)
        print(f"edgekv eval videoqa: rescored {rescored} in {results_path} with the rule of --prompt-style "
              f"{_prompt_style(args)} (edgekv/eval/scoring.py); each keeps its earlier score in rescored_from",
              file=sys.stderr)
    runtime = Runtime(config)
    asked = {item.id for item in items}  # the summary counts these: not a --limit's rest or an earlier annotation's
    done = {key: record for key, record in done.items() if key in asked}
    by_video: dict[Path, list[Item]] = {}
    for item in items:
        if item.id not in done:
            by_video.setdefault(item.video, []).append(item)
    progress = _progress(sum(len(v) for v in by_video.values()), f"{args.dataset} ({len(done)} already done)")
    with _append(results_path) as sink:
        for video, questions in by_video.items():
            for record in stream_and_ask(runtime.session(), video, questions, args.dataset, args.fps,
                                         args.max_frames, args.max_new_tokens, _prompt_style(args)):
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                done[record["id"]] = record
                progress(1)
            _write_summary(out, args, config, done)
    summary = _write_summary(out, args, config, done)
    print(json.dumps(summary["accuracy"], indent=1))
    if args.dataset == "ovobench":
        figures = summary["accuracy"]
        missing = ("" if figures["ovo_total"] is not None else " (the forward tasks are asked in the official "
                   "prompt style only)" if _prompt_style(args) != "official" else " (needs answers in all three "
                   "categories)")
        print(f"OVO-Bench: {', '.join(f'{c} {v}' for c, v in figures['per_category'].items())}; total "
              f"{figures['ovo_total']}{missing}")
    own = summary["accuracy"].get("videomme_scorer")
    if own:  # the headline stays edgekv's; Video-MME's own figure beside it, named
        theirs = f"{own['overall']} %" if own["answered"] else "none (no reply had a letter)"
        print(f"overall {summary['accuracy']['overall']} % of {summary['accuracy']['questions']} (a reply with no "
              f"letter counted wrong); Video-MME's own scorer: {theirs} of the {own['answered']} answered "
              f"({own['left_out']} left out of its denominator)")
    print(f"wrote {results_path} and {out / 'summary.json'}")
    return 0


RUN_FILE = "run.json"
# config keys that change an answer (routes and devices compute the same answers; sources are not used here). The
# benchmarks decode greedily (MLVU's run do_sample=False; OVO-Bench's and StreamingBench's Qwen2-VL runners with
# Qwen's near-greedy generation config), as edgekv's default temperature 0 does; a --config that samples is another run
ANSWER_KEYS = ("model.path", "model.dtype", "model.system_prompt", "model.text_after_video", "model.lm_head",
               "video.fps", "video.resolution", "video.resize", "video.skip_static", "generation.temperature",
               "generation.top_p")
# summary.json's names of those settings: an --out written before run.json existed is checked against them
SUMMARY_KEYS = {"dataset": "dataset", "policy": "cache.policy", "budget_tokens": "cache.max_tokens",
                "sinks": "cache.sinks", "fps": "video.fps", "resolution": "video.resolution", "dtype": "model.dtype",
                "prompt_style": "prompt_style"}


def _prompt_style(args: argparse.Namespace) -> str:
    return getattr(args, "prompt_style", None) or DEFAULT_PROMPT_STYLE


def _askable(items: list[Item], dataset: str, style: str) -> tuple[list[Item], int]:
    """The items ``style`` can ask, and how many it cannot: OVO-Bench's forward asks outside the official style
    (what ``--prompt-style infinipot_v`` did before they were read, so its runs resume the same)."""
    if style == "official":
        return items, 0
    kept = [item for item in items if not is_ovo_forward(item, dataset)]
    return kept, len(items) - len(kept)


def run_settings(args: argparse.Namespace, config) -> dict:
    """What decides a run's answers, as JSON values: the dataset, the answer length, the frames and every cache
    key. A rerun into an ``--out`` of other settings used to skip every question already there and write a
    summary that named the new settings over the old answers (or pooled two datasets' questions)."""
    sections = config.to_dict()
    model = Path(str(sections["model"]["path"])).expanduser()
    sections["model"]["path"] = str(model.resolve()) if model.exists() else sections["model"]["path"]
    settings = {"dataset": args.dataset, "max_frames": args.max_frames, "max_new_tokens": args.max_new_tokens,
                "prompt_style": _prompt_style(args),
                **{f"cache.{key}": value for key, value in sections["cache"].items()},
                **{key: sections[key.split(".")[0]][key.split(".")[1]] for key in ANSWER_KEYS}}
    return json.loads(json.dumps(settings, default=str))


def _other_style(done: dict[str, dict], style: str) -> str:
    """The prompt styles other than ``style`` that ``results.jsonl``'s answers were asked in, with how many
    (``"prompt_style 'x' (now 'y'): N of M answers"``); "" when none. Each line says its style; one without it was
    written before the option existed, in ``EARLIER_PROMPT_STYLE``. ``run.json`` says the same unless it was deleted
    by hand: a resume in another style would then pool two prompts' answers under one summary."""
    counts: dict[str, int] = {}
    for record in done.values():
        asked_in = record.get("prompt_style", EARLIER_PROMPT_STYLE)
        if asked_in != style:
            counts[str(asked_in)] = counts.get(str(asked_in), 0) + 1
    return "; ".join(f"prompt_style {name!r} (now {style!r}): {count} of {len(done)} answers"
                     for name, count in sorted(counts.items()))


def _asked_otherwise(done: dict[str, dict], dataset: str, style: str, max_new_tokens: int | None) -> str:
    """How ``results.jsonl``'s answers were asked otherwise than this run asks them, with how many
    (``"max_new_tokens 64 (now 256): 3 of 3 answers"``); "" when the same. Each line says its answer prefix and token
    budget; a line without them was written before either changed: no prefix, and ``--max-new-tokens`` or the
    defaults of then (``EARLIER_MAX_NEW_TOKENS``). Official MLVU now primes the reply with ``Best option:(``, and
    official replies get their benchmark's own budget (ReKV's 256 for RVS; MLVU's 100, OVO-Bench's and
    StreamingBench's 128 where edgekv gave 8): the replies asked before were answers to another prompt or cut
    shorter, which no rescoring turns into this run's."""
    counts: dict[str, int] = {}
    for record in done.values():
        open_question = "f1" in record
        earlier_budget = max_new_tokens if max_new_tokens is not None else EARLIER_MAX_NEW_TOKENS[open_question]
        for key, then, now in (
                ("answer_prefix", record.get("answer_prefix", ""), answer_prefix(dataset, style, open_question)),
                ("max_new_tokens", record.get("max_new_tokens", earlier_budget),
                 answer_budget(open_question, style, max_new_tokens, dataset))):
            if then != now:
                said = f"{key} {then!r} (now {now!r})"
                counts[said] = counts.get(said, 0) + 1
    return "; ".join(f"{said}: {count} of {len(done)} answers" for said, count in sorted(counts.items()))


def _rescore(done: dict[str, dict], by_id: dict[str, Item], dataset: str, style: str) -> str:
    """Score again, in place, the answers of ``done`` scored by another rule than ``style``'s (``"N answers scored by
    R"``; "" when none): an --out of the official style made before its benchmarks' own rules existed was scored by
    the first letter. Asked the same way (``_asked_otherwise``), their stored reply is all a rule reads, so
    rescoring gives what asking again would, without the model's time; each keeps its earlier fields in
    ``rescored_from``. A line without ``scored_by`` was scored by ``scoring.EARLIER_RULES``."""
    counts: dict[str, int] = {}
    for key, record in done.items():
        open_question = "f1" in record
        forward = dataset == "ovobench" and record.get("task") in OVO_FORWARD
        if forward and style != "official":
            continue  # never asked in that style (_askable): no rule of it reads such a reply
        rule = scoring.rule_for(dataset, style, open_question, record.get("task"))
        then = record.get("scored_by", scoring.EARLIER_RULES[open_question])
        if then == rule:
            continue
        item = by_id.get(key)
        earlier = {name: record[name] for name in ("predicted", "correct", "f1", "exact") if name in record}
        record.update(scoring.score(rule, str(record.get("reply", "")), str(record["answer"]),
                                    len(item.options) if item else len(LETTERS)))
        record["rescored_from"] = {"scored_by": then, **earlier}
        counts[then] = counts.get(then, 0) + 1
    return ", ".join(f"{count} answer(s) scored by {rule}" for rule, count in sorted(counts.items()))


def _rewrite_results(path: Path, done: dict[str, dict]) -> None:
    """``results.jsonl`` written anew from ``done`` (a line an interrupted run tore is dropped: it is asked again),
    through a temporary file, so an interruption leaves the old file or the new one whole."""
    partial = path.with_suffix(".tmp")
    partial.write_text("".join(json.dumps(record) + "\n" for record in done.values()))
    partial.replace(path)


def _other_run(out: Path, settings: dict, answered: bool) -> str:
    """The settings in which ``out``'s answers differ from ``settings`` (``"key earlier (now ...)"``); "" when
    they agree or there are none, after which ``settings`` are written down for the next rerun."""
    path = out / RUN_FILE
    earlier: dict = {}
    if answered and path.is_file():
        earlier = read_json(path, dict)
    elif answered and (out / "summary.json").is_file():
        summary = read_json(out / "summary.json", dict)
        earlier = {key: summary[name] for name, key in SUMMARY_KEYS.items() if name in summary}
    if earlier:  # answers written before --prompt-style existed were asked in InfiniPot-V's format
        earlier.setdefault("prompt_style", EARLIER_PROMPT_STYLE)
    differ = [f"{key} {earlier[key]!r} (now {settings[key]!r})" for key in settings
              if key in earlier and earlier[key] != settings[key]]
    if differ:
        return "; ".join(differ)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(settings, indent=1))
    partial.replace(path)
    return ""


@dataclass
class _Seen:
    """What the stream has put into the session so far."""

    frames: int = 0
    t: float | None = None  # the last frame's timestamp
    ingest_s: float = 0.0


def stream_and_ask(session, video: Path, questions: list[Item], dataset: str, fps: float,
                   max_frames: int | None = None, max_new_tokens: int | None = None,
                   prompt_style: str = DEFAULT_PROMPT_STYLE) -> Iterator[dict]:
    """Stream ``video`` into ``session`` once and ask each question when the stream reaches its ``ask_at``
    (after the whole video when it has none); yields each question's result row as it is answered.

    A question at time T is asked before the first frame stamped after T goes in, so it sees exactly the
    frames up to T; the stream stops after the last question (nothing later can change an answer).
    ``session`` is a ``StreamSession`` (``ingest``, ``ask``, ``stats``); its ``ask`` leaves the cache as it was.
    """
    from edgekv.video.sources import iter_frames

    queue = sorted(questions, key=lambda item: math.inf if item.ask_at is None else item.ask_at)  # stable
    seen = _Seen()
    with closing(iter_frames(str(video), max_frames=max_frames, fps=fps)) as frames:
        for frame, t in frames:
            while queue and queue[0].ask_at is not None and t > queue[0].ask_at + ASK_EPSILON_S:
                yield _ask(session, queue.pop(0), dataset, seen, max_new_tokens, prompt_style)
            if not queue:
                return
            started = time.perf_counter()
            session.ingest(frame, t=t)
            seen.ingest_s += time.perf_counter() - started
            seen.frames += 1
            seen.t = t
    while queue:  # after the whole video (offline benchmarks), or a time past the video's end
        yield _ask(session, queue.pop(0), dataset, seen, max_new_tokens, prompt_style)


def answer_budget(open_ended_question: bool, style: str, max_new_tokens: int | None, dataset: str) -> int:
    """New tokens a reply gets: ``--max-new-tokens`` when given, else ``dataset``'s default in ``style``
    (``prompts.max_new_tokens_for``: each benchmark's own under ``official``)."""
    if max_new_tokens is not None:
        return max_new_tokens
    return max_new_tokens_for(dataset, style, open_ended_question)


def _ask(session, item: Item, dataset: str, seen: _Seen, max_new_tokens: int | None,
         prompt_style: str = DEFAULT_PROMPT_STYLE) -> dict:
    stats = session.stats()
    # a forward ask has no options but is no open-ended question: OVO-Bench's runner gives it the same 128 tokens
    open_question = item.open_ended and not is_ovo_forward(item, dataset)
    max_new_tokens = answer_budget(open_question, prompt_style, max_new_tokens, dataset)
    prefix = answer_prefix(dataset, prompt_style, open_question)
    started = time.perf_counter()
    text = prompt(item, dataset, prompt_style)
    if prefix:  # a session stand-in without answer_prefix answers every other question
        answer = session.ask(text, max_new_tokens=max_new_tokens, answer_prefix=prefix)
    else:
        answer = session.ask(text, max_new_tokens=max_new_tokens)
    record: dict = {"id": item.id, "task": item.task, "video": str(item.video), "answer": item.answer,
                    "prompt_style": prompt_style, "max_new_tokens": max_new_tokens,
                    **({"answer_prefix": prefix} if prefix else {})}
    rule = scoring.rule_for(dataset, prompt_style, open_question, item.task)
    record.update(scoring.score(rule, answer.text, item.answer, len(item.options)))  # the reply after the prefix
    finish = getattr(answer, "finish_reason", None)  # "length": cut at max_new_tokens; "stop": ended its turn
    record.update({
        "reply": answer.text, **({"finish_reason": finish} if finish else {}),
        "answer_s": round(time.perf_counter() - started, 3), "ttft_s": round(answer.ttft_s, 3),
        "ask_at": item.ask_at, "stream_t": seen.t, "frames_seen": seen.frames, "pairs_prefilled": stats["frame_pairs"],
        "ingest_fps": round(seen.frames / seen.ingest_s, 3) if seen.ingest_s else None,
        "cache_tokens": stats["cache_tokens"], "compressions": stats["compressions"],
        **{k: v for k, v in item.extra.items() if v is not None}})
    return record


def _append(path: Path):
    """``results.jsonl`` opened to append, after a newline if an interrupted run left a torn last line (the next
    row would be glued to it and lost too)."""
    torn = False
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as existing:
            existing.seek(-1, 2)
            torn = existing.read(1) != b"\n"
    sink = path.open("a")
    if torn:
        sink.write("\n")
    return sink


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
    """Accuracy per task and overall (percent, as the papers print them) and the same as proportions with a
    95 % Wilson interval (``tasks``, ``all``); the benchmark's own headline averages beside them."""
    tasks: dict[str, list[dict]] = {}
    durations: dict[str, list[bool]] = {}
    for r in records:
        tasks.setdefault(r["task"], []).append(r)
        if dataset == "videomme" and r.get("duration"):
            durations.setdefault(str(r["duration"]), []).append(r["correct"])
    per_task = {t: _percent(rs) for t, rs in sorted(tasks.items())}
    out = {"questions": len(records), "overall": _percent(records) if records else None, "per_task": per_task,
           "all": _proportion(records), "tasks": {t: _proportion(rs) for t, rs in sorted(tasks.items())}}
    choices = [r for r in records if "predicted" in r and r.get("scored_by") not in scoring.FORWARD_RULES]
    if choices:  # replies with no option letter: scored wrong, and how many there were (a prompt the model ignores)
        out["no_letter"] = sum(scoring.has_no_letter(r["predicted"]) for r in choices)
    forward = [r for r in records if r.get("scored_by") in scoring.FORWARD_RULES]
    if forward:  # OVO-Bench forward replies in which its rule found no count or no Yes / No
        out["forward_unread"] = sum(not r["predicted"] for r in forward)
    if any(r.get("finish_reason") for r in records):  # replies cut at max_new_tokens: the budget may cost answers
        out["cut_at_max_new_tokens"] = sum(r.get("finish_reason") == "length" for r in records)
    if any(r.get("scored_by") == "videomme" for r in records):
        out["videomme_scorer"] = videomme_scorer_figures(records)
    if dataset == "mlvu":
        out["m_avg"] = _mean(per_task.values())
    if durations:
        out["per_duration"] = {d: round(100 * sum(v) / len(v), 2) for d, v in sorted(durations.items())}
    if dataset == "ovobench":
        out.update(ovobench_averages(tasks))
    if records and "f1" in records[0]:  # open-ended: the proxy's mean F1 and exact-match rate beside "correct"
        out["f1_mean"] = round(sum(r["f1"] for r in records) / len(records), 4)
        out["exact_match"] = proportion(sum(bool(r["exact"]) for r in records), len(records))
    return out


def ovobench_averages(tasks: dict[str, list[dict]]) -> dict:
    """OVO-Bench's averages (JoeLeelyf/OVO-Bench @ c34093f9a072, ``utils/OVOBenchScore.py``, ``score``): a task's
    accuracy pools its asks (each forward test time is one), a category's figure is the mean of its tasks'
    accuracies, and the total (``ovo_total``) the mean of the Backward, Real-Time and Forward figures — None until
    each has answers (OVO-Bench's scorer has no figure then). Means are taken unrounded, rounded once, as there.
    ``backward_realtime_avg``: the mean of the first two, what edgekv gave before the forward tasks were asked."""
    categories: dict[str, list[float]] = {}
    for task, rs in sorted(tasks.items()):
        accuracy = sum(bool(r["correct"]) for r in rs) / len(rs)
        categories.setdefault(rs[0].get("category", "unknown"), []).append(accuracy)
    figures = {c: 100 * sum(v) / len(v) for c, v in sorted(categories.items())}
    first_two = [figures[c] for c in ("backward", "realtime") if c in figures]
    total = (sum(figures[c] for c in ("backward", "realtime", "forward")) / 3
             if all(c in figures for c in ("backward", "realtime", "forward")) else None)
    return {"per_category": {c: round(v, 2) for c, v in figures.items()},
            "backward_realtime_avg": round(sum(first_two) / len(first_two), 2) if first_two else None,
            "ovo_total": round(total, 2) if total is not None else None}


def videomme_scorer_figures(records: list[dict]) -> dict:
    """Video-MME's own figures beside edgekv's (``overall``, which counts a reply with no letter wrong): its scorer
    (thanku-all/parse_answer @ afd52cf, ``eval_your_results.py``) adds a reply to a question's ``answered`` only when
    ``extract_characters_regex`` reads a letter from it, and divides by ``answered``, overall, per duration and per
    task type. ``left_out`` counts the replies it leaves out; a figure with nothing answered is None (it prints 0)."""
    scored = [r for r in records if r.get("scored_by") == "videomme"]
    answered = [r for r in scored if r.get("predicted")]
    groups: dict[str, dict[str, list[dict]]] = {"per_duration": {}, "per_task": {}}
    for r in answered:
        if r.get("duration"):
            groups["per_duration"].setdefault(str(r["duration"]), []).append(r)
        groups["per_task"].setdefault(r["task"], []).append(r)
    return {"overall": _percent(answered) if answered else None, "answered": len(answered),
            "left_out": len(scored) - len(answered),
            **{name: {key: _percent(rs) for key, rs in sorted(group.items())} for name, group in groups.items()},
            "about": "Video-MME's own scorer: replies with no letter left out of the denominator"}


def _percent(records: list[dict]) -> float:
    return round(100 * sum(bool(r["correct"]) for r in records) / len(records), 2)


def _proportion(records: list[dict]) -> dict:
    return proportion(sum(bool(r["correct"]) for r in records), len(records))


def _mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 2) if values else None


def _write_summary(out: Path, args: argparse.Namespace, config, done: dict[str, dict]) -> dict:
    records = list(done.values())
    fps_values = [r["ingest_fps"] for r in records if r.get("ingest_fps")]
    streamed = any(r.get("ask_at") is not None for r in records)
    rules = sorted({r.get("scored_by", scoring.EARLIER_RULES["f1" in r]) for r in records})
    summary = {
        "dataset": args.dataset, "model": args.model, "policy": config.cache.policy,
        "budget_tokens": config.cache.max_tokens, "sinks": config.cache.sinks, "fps": config.video.fps,
        "resolution": config.video.resolution, "dtype": config.model.dtype, "prompt_style": _prompt_style(args),
        "scored_by": rules[0] if len(rules) == 1 else rules,
        "scoring": "; ".join(scoring.DESCRIPTIONS[rule] for rule in rules),
        "questions_asked": "at their timestamps during the stream" if streamed else "after the whole video",
        "accuracy": summarize(records, args.dataset),
        "throughput": {"ingest_frames_per_s_mean": round(sum(fps_values) / len(fps_values), 3) if fps_values else None,
                       "answer_s_mean": (round(sum(r["answer_s"] for r in records) / len(records), 3)
                                         if records else None)},
    }
    if args.dataset in NOTES:
        summary["note"] = NOTES[args.dataset]
    if args.dataset == "ovobench" and _prompt_style(args) != "official":
        summary["note"] = OVOBENCH_LETTER_NOTE
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
    from edgekv.config_names import config_help, resolve_config

    parser.add_argument("--model", required=True, help="Qwen2.5-VL checkpoint directory (e.g. Qwen2.5-VL-3B-Instruct)")
    parser.add_argument("--dataset", required=True, choices=sorted(LOADERS))
    parser.add_argument("--data", required=True,
                        help="dataset directory in its published layout (edgekv/eval/videoqa.py, streaming_sets.py)")
    parser.add_argument("--config", default=None, type=resolve_config,
                        help=config_help("the deployment to start from (flags override it)"))
    parser.add_argument("--policy", default="infinipot_v")
    parser.add_argument("--max-tokens", type=int, default=6144, help="cache cap M in tokens")
    parser.add_argument("--sinks", type=int, default=0, help="StateKV sink budget B (0 = off)")
    parser.add_argument("--text-reserve", type=int, default=512, help="slots of M kept for the prompt and answer")
    parser.add_argument("--fps", type=float, default=0.5, help="frames sampled per second of video")
    parser.add_argument("--resolution", type=int, nargs=2, default=[252, 448], metavar=("H", "W"),
                        help="frame grid (multiples of 28); 252x448 = 144 tokens per frame pair")
    parser.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--max-frames", type=int, default=None,
                        help="stop each video after this many frames (questions left are asked there)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens per answer (a reply ends sooner at its end of turn); when not given, each "
                             "benchmark's own in the official prompt style ("
                             + ", ".join(f"{name} {n}" for name, n in OFFICIAL_MAX_NEW_TOKENS.items())
                             + f", videomme {CHOICE_MAX_NEW_TOKENS} as it sets none, "
                             f"RVS {OFFICIAL_OPEN_MAX_NEW_TOKENS} as ReKV), and in infinipot_v "
                             f"{CHOICE_MAX_NEW_TOKENS} for multiple choice and {OPEN_MAX_NEW_TOKENS} for open-ended "
                             "questions")
    parser.add_argument("--prompt-style", choices=PROMPT_STYLES, default=DEFAULT_PROMPT_STYLE,
                        help="official: each benchmark's own prompt; infinipot_v: InfiniPot-V's format for every "
                             "benchmark, as in its Table 1 (edgekv/eval/prompts.py)")
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--out", default="out/videoqa", help="results.jsonl + summary.json go here")
    parser.set_defaults(run=run)
