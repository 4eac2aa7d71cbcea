"""``edgekv eval videoqa`` on the streaming benchmarks (OVO-Bench, StreamingBench, RVS-Ego / RVS-Movie): tiny
datasets in each published layout, questions asked at their timestamps while the video streams.

Most tests run the command end to end with a scripted stand-in for the runtime (it counts the frames it is
given and answers from a script), so what is asserted — which frames a question saw, the rows, the summary —
does not depend on a model or on timing; one test runs the tiny random-weight checkpoint through the same path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from edgekv.apps.cli import main
from edgekv.eval.open_ended import normalize, token_f1
from edgekv.eval.qa_item import DatasetError
from edgekv.eval.stats import proportion
from edgekv.eval.streaming_sets import load_ovobench, load_rvs_ego, load_streamingbench
from edgekv.eval.videoqa import prompt

FPS = 2.0  # the stream's sampling rate in every test: frames at 0, 0.5, 1.0, ... s


def _video(path: Path, seconds: float = 6.0, rate: float = 4.0, size=(48, 64)) -> None:
    """An MJPG file of ``seconds`` at ``rate`` fps; frame k is stamped k / rate by the reader."""
    cv2 = pytest.importorskip("cv2")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), rate, (size[1], size[0]))
    rng = np.random.default_rng(len(path.name))
    for _ in range(round(seconds * rate)):
        writer.write(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))
    writer.release()


def _seen_at(t: float, seconds: float = 6.0) -> int:
    """Frames a question at ``t`` has seen at ``FPS``: those stamped 0, 1/FPS, ... up to t (all, past the end)."""
    return min(math.floor(t * FPS + 1e-9) + 1, round(seconds * FPS))


# ---------------------------------------------------------------------------------------------- layouts
OVO_ROWS = [
    {"id": 0, "task": "EPM", "video": "Ego4D/clips/a.avi", "realtime": 1.2, "question": "Who did I talk to?",
     "answer": "a man", "options": ["a man", "a woman", "a dog", "nobody"], "gt": 0},
    {"id": 1, "task": "EPM", "video": "Ego4D/clips/a.avi", "realtime": 4, "question": "What did I drop?",
     "answer": "a cup", "options": ["a pen", "a key", "a cup", "a book"], "gt": 2},
    {"id": 2, "task": "STU", "video": "YouTube_Games/b.avi", "realtime": 2.0, "question": "Where is the giant?",
     "answer": "behind", "options": ["in front", "behind"], "gt": 1},
    {"id": 3, "task": "STU", "video": "Ego4D/clips/a.avi", "realtime": 0, "question": "What is in my hand?",
     "answer": "nothing", "options": ["a knife", "a fork", "a spoon", "nothing"], "gt": 3},
    {"id": 4, "task": "OCR", "video": "YouTube_Games/b.avi", "realtime": 100.0, "question": "What is the score?",
     "answer": "5", "options": ["1", "2", "3", "4", "5"], "gt": 4},
]  # the forward tasks (REC, SSR, CRR): tests/test_videoqa_forward.py
# question -> reply of the scripted answerer; ids 0, 2, 3 right, 1 and 4 wrong
OVO_REPLIES = {"Who did I talk to?": "A", "What did I drop?": "(B) a key", "Where is the giant?": "B.",
               "What is in my hand?": "D", "What is the score?": "C"}


def _ovobench(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "ovo_bench_new.json").write_text(json.dumps(OVO_ROWS))
    for video in ("Ego4D/clips/a.avi", "YouTube_Games/b.avi"):
        _video(root / "src_videos" / video)
    return root


SB_ENTRIES = [
    {"time": "[0:00:00 - 0:00:10]", "video_categories": "flying_pov", "video_path": "./videos/sample_1_real.avi",
     "questions": [{"task_type": "Object Recognition", "question": "What is on the screen right now?",
                    "time_stamp": "00:00:03", "answer": "B", "required_ability": "working memory",
                    "options": ["A. a map", "B. a compass", "C. a clock", "D. nothing"]}]},
    {"time": "[0:00:00 - 0:00:10]", "video_categories": "flying_pov", "video_path": "./videos/sample_1_real.avi",
     "questions": [{"task_type": "Counting", "question": "How many planes are there?", "time_stamp": "0:00:01",
                    "answer": "A", "options": ["A. one", "B. two", "C. three", "D. four"]},
                   {"task_type": "Object Recognition", "question": "What is the pilot holding?",
                    "time_stamp": "00:00:05", "answer": "D", "options": ["A. a map", "B. a pen", "C. a cup", "D. a stick"]}]},
    {"time": "[0:00:00 - 0:00:10]", "video_path": "/somewhere/else/videos/sample_2_real.avi",  # preprocessed elsewhere
     "questions": [{"task_type": "Counting", "question": "How many cars are there?", "time_stamp": "00:00:02.5",
                    "answer": "c", "options": ["none", "one", "two", "three"]}]},
]
SB_REPLIES = {"What is on the screen right now?": "B", "How many planes are there?": "B",
              "What is the pilot holding?": "D", "How many cars are there?": "C"}


def _streamingbench(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "questions_real.json").write_text(json.dumps(SB_ENTRIES))
    for name in ("sample_1_real.avi", "sample_2_real.avi"):
        _video(root / "videos" / name)
    return root


RVS_ROWS = [
    {"video_id": "v1", "video_path": "data/rvs/ego/videos/v1.avi",  # relative to ReKV's root, not to the json
     "conversations": [{"question": "Where is the cup now?", "answer": "on the table", "start_time": 2,
                        "end_time": 3.0},
                       {"question": "What is the person holding?", "answer": "a red cup", "start_time": 0.5,
                        "end_time": 1.5}]},
    {"video_id": "v2", "conversations": [{"question": "What rolled away?", "answer": "a green ball",
                                          "start_time": 0, "end_time": 2}]},
]
RVS_REPLIES = {"What is the person holding?": "A red cup.", "Where is the cup now?": "It is on the kitchen table",
               "What rolled away?": "blue"}


def _rvs(root: Path) -> Path:
    (root / "ego").mkdir(parents=True)
    (root / "ego" / "ego4d_oe.json").write_text(json.dumps(RVS_ROWS))
    for name in ("v1.avi", "v2.mp4"):
        _video(root / "ego" / "videos" / name)
    return root


def test_ovobench_layout_is_read(tmp_path):
    items = load_ovobench(_ovobench(tmp_path / "ovo"))
    assert [i.id for i in items] == ["ovo/0", "ovo/1", "ovo/2", "ovo/3", "ovo/4"]
    assert [i.answer for i in items] == ["A", "C", "B", "D", "E"]
    assert [i.ask_at for i in items] == [1.2, 4.0, 2.0, 0.0, 100.0]
    assert items[0].video == tmp_path / "ovo" / "src_videos" / "Ego4D" / "clips" / "a.avi"
    assert items[0].extra["category"] == "backward" and items[2].extra["category"] == "realtime"
    assert prompt(items[4], "ovobench", "infinipot_v").splitlines()[2:] == [
        "A. 1", "B. 2", "C. 3", "D. 4", "E. 5", "Respond with only the letter (A, B, C, D or E) of the correct option."]


def test_streamingbench_layout_is_read(tmp_path):
    data = _streamingbench(tmp_path / "sb")
    items = load_streamingbench(data)
    assert [i.ask_at for i in items] == [3.0, 1.0, 5.0, 2.5]
    assert [i.answer for i in items] == ["B", "A", "D", "C"]
    assert {i.video for i in items} == {data / "videos" / "sample_1_real.avi", data / "videos" / "sample_2_real.avi"}
    assert items[3].options == ("A. none", "B. one", "C. two", "D. three")  # bare options get their letters
    assert len({i.id for i in items}) == 4 and items[0].task == "Object Recognition"
    assert prompt(items[0], "streamingbench", "infinipot_v").endswith(
        "Respond with only the letter (A, B, C, or D) of the correct option.")
    # the published questions_real.json has one "00:12450": read as 12450 s (StreamingBench's own rule), asked at the end
    (data / "questions_real.json").write_text(json.dumps(_set(SB_ENTRIES, (0, "questions", 0, "time_stamp"), "00:12450")))
    assert load_streamingbench(data)[0].ask_at == 12450.0


def test_rvs_layout_is_read_as_open_ended(tmp_path):
    data = _rvs(tmp_path / "rvs")
    items = load_rvs_ego(data)
    assert [(i.id, i.ask_at, i.answer) for i in items] == [("v1/0", 3.0, "on the table"), ("v1/1", 1.5, "a red cup"),
                                                          ("v2/0", 2.0, "a green ball")]
    assert all(i.open_ended and i.task == "rvs_ego" for i in items)
    assert items[0].video == data / "ego" / "videos" / "v1.avi" and items[2].video == data / "ego" / "videos" / "v2.mp4"
    assert prompt(items[1], "rvs_ego", "infinipot_v") == "What is the person holding?\nAnswer in a few words."
    assert prompt(items[1], "rvs_ego") == "What is the person holding?"  # as ReKV asks it


def test_open_ended_proxy_is_squad_token_f1():
    assert normalize("The Red, cup!") == "red cup"
    assert token_f1("A red cup.", "a red cup") == 1.0
    assert token_f1("It is on the kitchen table", "on the table") == pytest.approx(2 * (2 / 5) * 1 / (2 / 5 + 1))
    assert token_f1("blue", "a green ball") == 0.0 and token_f1("", "") == 1.0 and token_f1("the", "cup") == 0.0


# ---------------------------------------------------------------------------------------------- running
class ScriptedSession:
    """A stand-in for ``StreamSession``: counts the frames it is given and answers each question from a script
    (the scripted question the prompt holds; every prompt style puts the question in as written)."""

    def __init__(self, log: list, replies: dict[str, str]) -> None:
        self.log, self.replies, self.frames, self.t = log, replies, 0, None

    def ingest(self, frame: np.ndarray, t: float) -> None:
        assert frame.ndim == 3 and (self.t is None or t > self.t)
        self.frames, self.t = self.frames + 1, t

    def ask(self, text: str, max_new_tokens: int):
        (question,) = [q for q in self.replies if q in text]
        self.log.append({"question": question, "frames": self.frames, "t": self.t, "max_new_tokens": max_new_tokens,
                         "text": text})
        return type("Answer", (), {"text": self.replies[question], "ttft_s": 0.0})()

    def stats(self) -> dict:
        return {"frame_pairs": self.frames // 2, "cache_tokens": 10 * (self.frames // 2), "compressions": 0}


@pytest.fixture
def scripted(monkeypatch):
    """Replace the runtime with one whose sessions are ``ScriptedSession``s; returns (asks, sessions, replies)."""
    asks: list[dict] = []
    sessions: list[ScriptedSession] = []
    replies: dict[str, str] = {}

    class ScriptedRuntime:
        def __init__(self, config) -> None:
            assert config.video.fps == FPS

        def session(self) -> ScriptedSession:
            sessions.append(ScriptedSession(asks, replies))
            return sessions[-1]

    monkeypatch.setattr("edgekv.runtime.Runtime", ScriptedRuntime)
    return asks, sessions, replies


def _run(dataset: str, data: Path, out: Path, *extra: str) -> int:
    return main(["eval", "videoqa", "--model", "unused-by-the-scripted-runtime", "--dataset", dataset,
                 "--data", str(data), "--fps", str(FPS), "--out", str(out), *extra])


def _rows(out: Path, torn: int = 0) -> dict[str, dict]:
    """results.jsonl by id; ``torn``: how many lines an interrupted run left unreadable (the harness skips them)."""
    rows, bad = {}, 0
    for line in (out / "results.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        rows[row["id"]] = row
    assert bad == torn
    return rows


def test_ovobench_questions_are_asked_at_their_timestamps_and_scored(tmp_path, scripted, capsys):
    asks, sessions, replies = scripted
    replies.update(OVO_REPLIES)
    out = tmp_path / "out"
    assert _run("ovobench", _ovobench(tmp_path / "ovo"), out) == 0
    # one stream per video; a video's questions in time order, each after exactly the frames up to its time
    assert [a["question"] for a in asks] == ["What is in my hand?", "Who did I talk to?", "What did I drop?",
                                             "Where is the giant?", "What is the score?"]
    rows = _rows(out)
    for row in rows.values():
        assert row["frames_seen"] == _seen_at(row["ask_at"]), row
        assert row["stream_t"] == (row["frames_seen"] - 1) / FPS and row["pairs_prefilled"] == row["frames_seen"] // 2
    assert [a["frames"] for a in asks] == [1, 3, 9, 5, 12]  # the session's own count agrees
    assert [s.frames for s in sessions] == [9, 12]  # a.avi stops after its last question (4 s); b.avi is read to its end
    assert {i: (r["predicted"], r["correct"]) for i, r in rows.items()} == {
        "ovo/0": ("A", True), "ovo/1": ("B", False), "ovo/2": ("B", True), "ovo/3": ("D", True), "ovo/4": ("C", False)}
    assert rows["ovo/1"]["category"] == "backward" and rows["ovo/1"]["answer"] == "C"
    assert asks[0]["max_new_tokens"] == 128  # OVO-Bench's own budget (models/QWen2VL.py), the official style's default

    summary = json.loads((out / "summary.json").read_text())
    accuracy = summary["accuracy"]
    assert summary["questions_asked"] == "at their timestamps during the stream" and "REC" in summary["note"]
    assert accuracy["per_task"] == {"EPM": 50.0, "OCR": 0.0, "STU": 100.0}
    assert accuracy["per_category"] == {"backward": 50.0, "realtime": 50.0} and accuracy["backward_realtime_avg"] == 50.0
    assert accuracy["ovo_total"] is None  # no forward answers: OVO-Bench's total needs all three categories
    assert accuracy["overall"] == 60.0 and accuracy["all"] == proportion(3, 5)
    assert accuracy["tasks"]["EPM"] == proportion(1, 2) and accuracy["tasks"]["STU"]["ci95"][1] == 1.0
    assert 0 < accuracy["all"]["ci95"][0] < 0.6 < accuracy["all"]["ci95"][1] < 1
    assert "backward_realtime_avg" in capsys.readouterr().out


def test_a_rerun_asks_only_what_is_left_at_the_same_frames(tmp_path, scripted):
    asks, sessions, replies = scripted
    replies.update(OVO_REPLIES)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out) == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    first = _rows(out)
    assert _run("ovobench", data, out) == 0 and len(asks) == 5  # all done: nothing asked, no video opened
    assert len(sessions) == 2
    # an interrupted run: a.avi's last answer was never written and b.avi's last one was torn
    kept = [line for line in lines if json.loads(line)["id"] not in ("ovo/1", "ovo/4")]
    (out / "results.jsonl").write_text("\n".join(kept) + '\n{"id": "ovo/4", "ta')
    del asks[:]
    assert _run("ovobench", data, out) == 0
    assert [(a["question"], a["frames"]) for a in asks] == [("What did I drop?", 9), ("What is the score?", 12)]
    rows = _rows(out, torn=1)  # the torn line stays, on a line of its own: the row after it is whole
    assert rows.keys() == first.keys()
    assert all(rows[i]["frames_seen"] == first[i]["frames_seen"] for i in rows)
    assert json.loads((out / "summary.json").read_text())["accuracy"]["all"] == proportion(3, 5)


def test_streamingbench_questions_are_asked_at_their_clock_times(tmp_path, scripted):
    asks, _, replies = scripted
    replies.update(SB_REPLIES)
    out = tmp_path / "out"
    assert _run("streamingbench", _streamingbench(tmp_path / "sb"), out) == 0
    rows = _rows(out)
    assert [(a["question"], a["frames"]) for a in asks] == [("How many planes are there?", 3),
                                                            ("What is on the screen right now?", 7),
                                                            ("What is the pilot holding?", 11),
                                                            ("How many cars are there?", 6)]
    assert all(r["frames_seen"] == _seen_at(r["ask_at"]) for r in rows.values())
    summary = json.loads((out / "summary.json").read_text())["accuracy"]
    assert summary["per_task"] == {"Counting": 50.0, "Object Recognition": 100.0}
    assert summary["all"] == proportion(3, 4) and "m_avg" not in summary


def test_rvs_is_scored_with_the_token_f1_proxy(tmp_path, scripted):
    asks, _, replies = scripted
    replies.update(RVS_REPLIES)
    out = tmp_path / "out"
    assert _run("rvs_ego", _rvs(tmp_path / "rvs"), out) == 0
    rows = _rows(out)
    # 256 new tokens: ReKV's RVS budget (video_qa/rekv_stream_vqa.py), the official style's default
    assert [(a["question"], a["frames"], a["max_new_tokens"]) for a in asks] == [
        ("What is the person holding?", 4, 256), ("Where is the cup now?", 7, 256), ("What rolled away?", 5, 256)]
    assert (rows["v1/1"]["f1"], rows["v1/1"]["exact"], rows["v1/1"]["correct"]) == (1.0, True, True)
    assert (rows["v1/0"]["f1"], rows["v1/0"]["exact"], rows["v1/0"]["correct"]) == (0.5714, False, True)
    assert (rows["v2/0"]["f1"], rows["v2/0"]["correct"]) == (0.0, False)
    assert rows["v1/1"]["start_time"] == 0.5 and rows["v1/1"]["reply"] == "A red cup."
    summary = json.loads((out / "summary.json").read_text())
    assert "GPT-3.5 judge" in summary["note"]
    assert summary["accuracy"]["all"] == proportion(2, 3) and summary["accuracy"]["exact_match"] == proportion(1, 3)
    assert summary["accuracy"]["f1_mean"] == pytest.approx((1 + 0.5714 + 0) / 3, abs=1e-4)


def test_max_frames_stops_the_stream_and_asks_what_is_left(tmp_path, scripted):
    asks, _, replies = scripted
    replies.update(RVS_REPLIES)
    out = tmp_path / "out"
    assert _run("rvs_ego", _rvs(tmp_path / "rvs"), out, "--max-frames", "2") == 0
    assert [a["frames"] for a in asks] == [2, 2, 2]
    assert all(r["frames_seen"] == 2 and r["stream_t"] == 0.5 for r in _rows(out).values())


# ---------------------------------------------------------------------------------------------- bad layouts
def _drop(rows: list, index: int, key: str) -> list:
    rows = json.loads(json.dumps(rows))
    del rows[index][key]
    return rows


def _set(rows: list, path: tuple, value) -> list:
    rows = json.loads(json.dumps(rows))
    target = rows
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return rows


@pytest.mark.parametrize("dataset, build, name, rows, field", [
    ("ovobench", _ovobench, "ovo_bench_new.json", _drop(OVO_ROWS, 2, "realtime"), "'realtime'"),
    ("ovobench", _ovobench, "ovo_bench_new.json", _set(OVO_ROWS, (1, "gt"), 4), "'gt'"),
    ("ovobench", _ovobench, "ovo_bench_new.json", _set(OVO_ROWS, (0, "task"), "XYZ"), "'task'"),
    ("streamingbench", _streamingbench, "questions_real.json",
     _set(SB_ENTRIES, (1, "questions", 0, "time_stamp"), "soon"), "'time_stamp'"),
    ("streamingbench", _streamingbench, "questions_real.json", _drop(SB_ENTRIES, 0, "video_path"), "'video_path'"),
    ("rvs_ego", _rvs, "ego/ego4d_oe.json", _set(RVS_ROWS, (0, "conversations", 1, "end_time"), "late"), "'end_time'"),
    ("rvs_ego", _rvs, "ego/ego4d_oe.json", _drop(RVS_ROWS, 1, "video_id"), "'video_id'"),
])
def test_a_malformed_annotation_is_refused_naming_the_file_and_field(tmp_path, capsys, dataset, build, name, rows,
                                                                     field):
    data = build(tmp_path / "data")
    (data / name).write_text(json.dumps(rows))
    assert main(["eval", "videoqa", "--model", "x", "--dataset", dataset, "--data", str(data),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(data / name) in err and field in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_unreadable_or_missing_annotations_are_refused(tmp_path):
    data = _rvs(tmp_path / "rvs")
    (data / "ego" / "ego4d_oe.json").write_text('[{"video_id": "v1", "conversations": [')
    with pytest.raises(DatasetError, match="ego4d_oe.json: not a readable JSON file"):
        load_rvs_ego(data)
    (data / "ego" / "ego4d_oe.json").write_text('{"video_id": "v1"}')
    with pytest.raises(DatasetError, match="expected a JSON list, found dict"):
        load_rvs_ego(data)
    with pytest.raises(DatasetError, match="no OVO-Bench annotations"):
        load_ovobench(tmp_path / "nothing")
    with pytest.raises(DatasetError, match=r"no StreamingBench real-time annotations .*questions_real.json"):
        load_streamingbench(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------- the real session
def test_the_tiny_model_answers_mid_stream_and_an_answer_leaves_the_cache_as_it_was(tmp_path, tiny_checkpoint):
    data = tmp_path / "ovo"
    data.mkdir()
    rows = [{"id": k, "task": "STU", "video": "a.avi", "realtime": t, "question": q, "options": ["x", "y", "z", "w"],
             "gt": 0, "answer": "x"} for k, (t, q) in enumerate([(0.5, "What moves?"), (1.5, "What is red?"),
                                                                  (1.5, "What is left?")])]
    (data / "ovo_bench_new.json").write_text(json.dumps(rows))
    _video(data / "src_videos" / "a.avi", seconds=2.0)
    out = tmp_path / "out"
    args = ["eval", "videoqa", "--model", str(tiny_checkpoint), "--dataset", "ovobench", "--data", str(data),
            "--resolution", "56", "56", "--fps", str(FPS), "--max-tokens", "768", "--text-reserve", "384",
            "--dtype", "fp32", "--out", str(out)]
    assert main(args) == 0
    first = _rows(out)
    assert [first[f"ovo/{k}"]["frames_seen"] for k in range(3)] == [2, 4, 4]
    assert [first[f"ovo/{k}"]["pairs_prefilled"] for k in range(3)] == [1, 2, 2]
    # the second question at 1.5 s meets the cache the first one found: the answer's tokens were dropped
    assert first["ovo/1"]["cache_tokens"] == first["ovo/2"]["cache_tokens"] > first["ovo/0"]["cache_tokens"]
    # asked alone on a fresh stream (the others already done), the last question gets the same reply
    kept = [line for line in (out / "results.jsonl").read_text().splitlines() if json.loads(line)["id"] != "ovo/2"]
    (out / "results.jsonl").write_text("\n".join(kept) + "\n")
    assert main(args) == 0
    again = _rows(out)["ovo/2"]
    assert (again["reply"], again["cache_tokens"], again["frames_seen"]) == (
        first["ovo/2"]["reply"], first["ovo/2"]["cache_tokens"], 4)


def test_a_rerun_into_the_results_of_other_settings_is_refused(tmp_path, scripted, capsys):
    """A rerun with another budget, policy or dataset into the same --out skipped every question already there and
    wrote a summary naming the new settings over the old answers (or pooling two datasets' questions)."""
    asks, sessions, replies = scripted
    replies.update(OVO_REPLIES)
    replies.update(RVS_REPLIES)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out, "--max-tokens", "768") == 0
    before = {name: (out / name).read_text() for name in ("results.jsonl", "summary.json")}
    capsys.readouterr()
    for extra, said in ((["--max-tokens", "1024"], "cache.max_tokens 768 (now 1024)"),
                        (["--max-tokens", "768", "--policy", "full"], "cache.policy 'infinipot_v' (now 'full')"),
                        (["--max-tokens", "768", "--max-new-tokens", "32"], "max_new_tokens None (now 32)")):
        assert _run("ovobench", data, out, *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and f"--out {out}" in err
    assert _run("rvs_ego", _rvs(tmp_path / "rvs"), out, "--max-tokens", "768") == 2
    assert "dataset 'ovobench' (now 'rvs_ego')" in capsys.readouterr().err
    assert {name: (out / name).read_text() for name in before} == before and len(asks) == 5
    # an --out written before run.json existed: checked against its summary.json
    (out / "run.json").unlink()
    assert _run("ovobench", data, out, "--max-tokens", "1024") == 2
    assert "cache.max_tokens 768 (now 1024)" in capsys.readouterr().err
    assert _run("ovobench", data, out, "--max-tokens", "768") == 0 and len(asks) == 5  # the same: resumed
    assert json.loads((out / "run.json").read_text())["cache.max_tokens"] == 768


def test_the_summary_counts_only_the_questions_of_this_run(tmp_path, scripted):
    """``--limit 2`` after a whole run summarized all five questions already answered."""
    asks, sessions, replies = scripted
    replies.update(OVO_REPLIES)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out) == 0
    assert _run("ovobench", data, out, "--limit", "2") == 0 and len(asks) == 5
    accuracy = json.loads((out / "summary.json").read_text())["accuracy"]
    assert accuracy["questions"] == 2 and accuracy["all"] == proportion(1, 2)  # ovo/0 right, ovo/1 wrong
    assert len((out / "results.jsonl").read_text().splitlines()) == 5  # every answer is kept
