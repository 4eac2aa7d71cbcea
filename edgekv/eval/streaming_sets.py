"""Readers for the streaming video-QA benchmarks: questions asked at their time DURING the stream.

``eval videoqa`` streams each video once and asks each of these questions when the stream reaches the
question's time (``Item.ask_at``): the frames after it have not been seen yet, and an answer leaves the cache
as it was, so the later questions see the same memory a fresh stream cut at their own time would. Read from
the benchmarks' published layouts in a local directory (nothing is downloaded). Field names were read from
the benchmarks' public repositories (facts only; no code or text copied); sources below.

* **OVO-Bench** (Li et al., CVPR 2025, arXiv 2501.05510; github.com/JoeLeelyf/OVO-Bench, ``data/`` of the
  current edition, which its README asks users to prefer over the arXiv one). ``DATA/ovo_bench_new.json``: a
  list of ``{"id", "task", "video", "realtime", "question", "options", "gt", "answer"}`` — ``task`` a code,
  ``video`` a path under ``DATA/src_videos/`` (the source videos, not the pre-chunked clips), ``realtime`` the
  query time in seconds, ``options`` 2-5 strings, ``gt`` the 0-based index of the correct one: the Backward
  Tracing tasks (EPM, ASI, HLD) and the Real-Time Visual Perception tasks (STU, OJR, ATR, ACR, OCR, FPD),
  multiple choice. The Forward Active Responding tasks (REC, SSR, CRR) have no ``realtime``, ``options`` or
  ``gt``: a row asks its question again at each ``test_info[k].realtime`` (not in time order in the release),
  and each ask has its own ground truth — REC ``{"activity", "test_info": [{"realtime", "count"}]}`` (how many
  times so far), SSR ``{"tutorial", "test_info": [{"realtime", "step", "type"}]}`` (is this step being done
  now: ``type`` 1 yes, 0 no), CRR ``{"question", "answer", "ask_time", "clue_time", "test_info": [{"realtime",
  "type"}]}`` (can the question be answered yet: ``type`` 1 yes, 0 no). Each ask is an item of its own here,
  ``ovo/<id>/<k>`` (``k`` its index in ``test_info``, as OVO-Bench names the clip cut for it, ``<id>_<k>.mp4``),
  asked at its time during the video's one stream; its ``answer`` is the count or ``Yes`` / ``No``. OVO-Bench's
  offline runner cuts that clip at ``ceil(realtime)`` (``utils/chunk_videos.py``); here, as for the other
  tasks, the ask sees the frames up to ``realtime`` itself. Prompts and scoring: ``prompts.py``,
  ``scoring.py``; the averages (``videoqa.ovobench_averages``): a task's accuracy pools its asks, a
  category's figure is the mean of its tasks' accuracies and the total the mean of the three categories'.
* **StreamingBench** (Lin et al., arXiv 2411.03628; github.com/THUNLP-MT/StreamingBench), its Real-Time
  Visual Understanding subset: ``DATA`` is the repository's ``src/data`` after ``scripts/preprocess.sh``, with
  ``DATA/questions_real.json`` — a list of ``{"time", "questions", "video_categories", "video_path"}``, each
  question ``{"task_type", "question", "time_stamp", "options", "answer", "required_ability"}``, ``time_stamp``
  like ``"00:03:26"`` or ``"0:07:40"``, ``options`` ``"A. ..."`` lines, ``answer`` a letter — and the videos
  in ``DATA/videos/sample_<n>_real.mp4`` (``video_path`` is ``./videos/...``, or absolute after the
  preprocessing; an absolute path that does not exist here is looked up in ``DATA/videos/``). Several entries
  name the same video; it is streamed once. The omni-source (audio), sequential and proactive subsets are
  left out. StreamingBench's main table gives each question only the 60 s before it; here the question sees
  whatever the capped cache kept of the whole stream so far (its ``--context_time -1`` setting).
* **RVS-Ego / RVS-Movie** (VStream-QA's online subsets: Zhang et al., Flash-VStream, arXiv 2406.08085,
  huggingface.co/datasets/IVGSZ/VStream-QA), in the layout ReKV streams them (seed 001, section 4.5:
  "questions are input immediately after their annotated end timestamps"; github.com/Becomebright/ReKV
  ``video_qa/rekv_stream_vqa.py``, data at huggingface.co/datasets/Becomebright/RVS): ``DATA/ego/ego4d_oe.json``
  and ``DATA/movie/movienet_oe.json`` (or the file directly in ``DATA``), a list of ``{"video_id", "video_path",
  "conversations": [{"question", "answer", "start_time", "end_time"}]}``, videos in ``DATA/<subset>/videos/``.
  Open-ended: scored with the token-F1 proxy of ``edgekv/eval/open_ended.py``, NOT the papers' GPT-3.5
  judge — its figures are not comparable to theirs. Not confirmed here: the exact ``video_path`` strings of
  the released files (read as given when that file exists, else looked up in ``videos/`` by its name, else
  as ``videos/<video_id>.mp4``), and VStream-QA's own ``vstream-realtime/test_qa_*.json`` layout (per-clip
  frame folders), which this reader does not take.

Timestamps count from the video's first frame; a question is asked once every frame stamped at or before
its time has gone into the session (Qwen2.5-VL prefills frames in pairs: an odd last frame waits for its
partner, as a live camera's would). A time past the end of the video is asked at the end, as OVO-Bench's
clipping to the video's duration does.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from edgekv.eval.qa_item import LETTERS, DatasetError, Item, read_json

OVO_BACKWARD = ("EPM", "ASI", "HLD")
OVO_REALTIME = ("STU", "OJR", "ATR", "ACR", "OCR", "FPD")
OVO_FORWARD = ("REC", "SSR", "CRR")
OVO_CATEGORIES = {**{t: "backward" for t in OVO_BACKWARD}, **{t: "realtime" for t in OVO_REALTIME},
                  **{t: "forward" for t in OVO_FORWARD}}
# what a Forward Active Responding row gives its template (the question asked again at each test time)
_OVO_FORWARD_SUBJECT = {"REC": "activity", "CRR": "question"}  # SSR: each test time's own "step"
RVS_FILES = {"rvs_ego": ("ego", "ego4d_oe.json"), "rvs_movie": ("movie", "movienet_oe.json")}
_CLOCK = re.compile(r"^\d+(?::\d+){0,2}(?:\.\d+)?$")


# ---------------------------------------------------------------------------------------------- OVO-Bench
def load_ovobench(data: Path) -> list[Item]:
    path = data / "ovo_bench_new.json"
    if not path.is_file():
        raise DatasetError(f"{path}: no OVO-Bench annotations (expected OVO-Bench's data/ folder: "
                           "ovo_bench_new.json and src_videos/)")
    items = []
    for index, row in enumerate(read_json(path)):
        where = f"{path}: item {index}"
        task = _text(row, "task", where)
        if task not in OVO_CATEGORIES:
            raise DatasetError(f"{where}: field 'task' is {task!r}, not an OVO-Bench task "
                               f"({', '.join(OVO_CATEGORIES)})")
        if task in OVO_FORWARD:
            items.extend(_ovo_forward_asks(data, row, task, row.get("id", index), where))
            continue
        options = _options(row, "options", where)
        gt = row.get("gt")
        if isinstance(gt, bool) or not isinstance(gt, int) or not 0 <= gt < len(options):
            raise DatasetError(f"{where}: field 'gt' must be the index of the correct option "
                               f"(0-{len(options) - 1}), got {gt!r}")
        items.append(Item(f"ovo/{row.get('id', index)}", data / "src_videos" / _text(row, "video", where),
                          _text(row, "question", where), tuple(f"{LETTERS[i]}. {o}" for i, o in enumerate(options)),
                          LETTERS[gt], task, {"category": OVO_CATEGORIES[task]},
                          ask_at=_seconds(row, "realtime", where)))
    return _unique(items, path)


def is_ovo_forward(item: Item, dataset: str) -> bool:
    """``item`` is one test time of an OVO-Bench Forward Active Responding question (REC, SSR, CRR): no options,
    a count or ``Yes`` / ``No`` for its answer, asked and scored by OVO-Bench's own forward protocol."""
    return dataset == "ovobench" and item.task in OVO_FORWARD


def _ovo_forward_asks(data: Path, row: dict, task: str, key, where: str) -> list[Item]:
    """One item per ``test_info`` entry of a forward row, each with its own time and ground truth."""
    tests = _field(row, "test_info", where)
    if not isinstance(tests, list) or not tests:
        raise DatasetError(f"{where}: field 'test_info' must be a non-empty list, got {tests!r:.60}")
    video = data / "src_videos" / _text(row, "video", where)
    subject = _text(row, _OVO_FORWARD_SUBJECT[task], where) if task in _OVO_FORWARD_SUBJECT else None
    asks = []
    for k, test in enumerate(tests):
        here = f"{where} test_info {k}"
        if task == "REC":
            count = _field(test, "count", here)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise DatasetError(f"{here}: field 'count' must be a whole number >= 0, got {count!r:.60}")
            answer, truth = str(count), {"count": count}
        else:
            kind = _field(test, "type", here)
            if isinstance(kind, bool) or kind not in (0, 1):
                raise DatasetError(f"{here}: field 'type' must be 1 (yes) or 0 (no), got {kind!r:.60}")
            answer, truth = ("Yes" if kind == 1 else "No"), {"type": kind}
        question = subject if subject is not None else _text(test, "step", here)
        asks.append(Item(f"ovo/{key}/{k}", video, question, (), answer, task,
                         {"category": "forward", "question_id": f"ovo/{key}", "test_index": k, **truth},
                         ask_at=_seconds(test, "realtime", here)))
    return asks


# ---------------------------------------------------------------------------------------------- StreamingBench
def load_streamingbench(data: Path) -> list[Item]:
    path = data / "questions_real.json"
    if not path.is_file():
        raise DatasetError(f"{path}: no StreamingBench real-time annotations (expected StreamingBench's src/data "
                           "after scripts/preprocess.sh: questions_real.json and videos/)")
    items = []
    for index, entry in enumerate(read_json(path)):
        where = f"{path}: entry {index}"
        video_path = _text(entry, "video_path", where)
        questions = entry.get("questions")
        if not isinstance(questions, list) or not questions:
            raise DatasetError(f"{where}: field 'questions' must be a non-empty list, got {questions!r:.60}")
        video = _streamingbench_video(data, video_path)
        for k, question in enumerate(questions):
            here = f"{where} question {k}"
            stamp = _text(question, "time_stamp", here)
            options = _options(question, "options", here)
            if not options[0].startswith("A."):  # the layout allows bare options; the letters are implied
                options = [f"{LETTERS[i]}. {o}" for i, o in enumerate(options)]
            answer = _text(question, "answer", here).strip().upper()[:1]
            if answer not in LETTERS[: len(options)]:
                raise DatasetError(f"{here}: field 'answer' is {question['answer']!r}, not an option letter")
            items.append(Item(f"{Path(video_path).stem}/{index}.{k}", video, _text(question, "question", here),
                              tuple(options), answer, str(question.get("task_type", "unknown")),
                              {"time_stamp": stamp, "required_ability": question.get("required_ability")},
                              ask_at=_clock(stamp, f"{here}: field 'time_stamp'")))
    return _unique(items, path)


def _streamingbench_video(data: Path, video_path: str) -> Path:
    given = Path(video_path)
    if given.is_absolute():
        return given if given.is_file() else data / "videos" / given.name  # preprocessed on another machine
    return data / given


def _clock(text: str, where: str) -> float:
    """``"H:MM:SS"`` / ``"MM:SS"`` / ``"SS"`` (seconds may have a fraction) to seconds. The parts are not
    range-checked, as StreamingBench's own reader does not check them: its ``questions_real.json`` has one
    ``"00:12450"`` (entry 276), read there and here as 12450 s, past the video's end, so asked at the end."""
    if not _CLOCK.match(text.strip()):
        raise DatasetError(f"{where} is {text!r}, not a time like 00:03:26")
    return float(sum(float(part) * 60 ** i for i, part in enumerate(reversed(text.strip().split(":")))))


# ---------------------------------------------------------------------------------------------- RVS
def load_rvs(data: Path, subset: str) -> list[Item]:
    folder, name = RVS_FILES[subset]
    path = next((p for p in (data / folder / name, data / name) if p.is_file()), None)
    if path is None:
        raise DatasetError(f"{data / folder / name}: no RVS annotations (expected ReKV's data/rvs layout: "
                           f"{folder}/{name} and {folder}/videos/)")
    items = []
    for index, entry in enumerate(read_json(path)):
        where = f"{path}: entry {index}"
        video_id = str(_field(entry, "video_id", where))
        conversations = entry.get("conversations")
        if not isinstance(conversations, list) or not conversations:
            raise DatasetError(f"{where}: field 'conversations' must be a non-empty list, got {conversations!r:.60}")
        video = _rvs_video(path.parent, video_id, entry.get("video_path"))
        for k, turn in enumerate(conversations):
            here = f"{where} conversation {k}"
            end = _seconds(turn, "end_time", here)
            start = _seconds(turn, "start_time", here) if "start_time" in turn else None
            if start is not None and start > end:
                raise DatasetError(f"{here}: field 'start_time' ({start}) is after 'end_time' ({end})")
            items.append(Item(f"{video_id}/{k}", video, _text(turn, "question", here), (), _text(turn, "answer", here),
                              subset, {"start_time": start}, ask_at=end))
    return _unique(items, path)


def load_rvs_ego(data: Path) -> list[Item]:
    return load_rvs(data, "rvs_ego")


def load_rvs_movie(data: Path) -> list[Item]:
    return load_rvs(data, "rvs_movie")


def _rvs_video(folder: Path, video_id: str, video_path) -> Path:
    candidates = []
    if isinstance(video_path, str) and video_path:
        given = Path(video_path)
        candidates += [given if given.is_absolute() else folder / given, folder / "videos" / given.name]
    candidates.append(folder / "videos" / f"{video_id}.mp4")
    return next((p for p in candidates if p.is_file()), candidates[0])


# ---------------------------------------------------------------------------------------------- fields
def _field(row, key: str, where: str):
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, found {type(row).__name__}")
    if key not in row or row[key] is None:
        raise DatasetError(f"{where}: field {key!r} is missing")
    return row[key]


def _text(row, key: str, where: str) -> str:
    value = _field(row, key, where)
    if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value).strip():
        raise DatasetError(f"{where}: field {key!r} must be a non-empty string, got {value!r:.60}")
    return str(value)


def _seconds(row, key: str, where: str) -> float:
    value = _field(row, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DatasetError(f"{where}: field {key!r} must be a time in seconds (a number >= 0), got {value!r:.60}")
    return float(value)


def _options(row, key: str, where: str) -> list[str]:
    value = _field(row, key, where)
    if (not isinstance(value, list) or not 2 <= len(value) <= len(LETTERS)
            or not all(isinstance(o, (str, int, float)) and not isinstance(o, bool) for o in value)):
        raise DatasetError(f"{where}: field {key!r} must be a list of 2-{len(LETTERS)} options, got {value!r:.60}")
    return [str(o) for o in value]


def _unique(items: list[Item], path: Path) -> list[Item]:
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise DatasetError(f"{path}: two questions have the id {item.id!r} (results are resumed by id)")
        seen.add(item.id)
    return items
