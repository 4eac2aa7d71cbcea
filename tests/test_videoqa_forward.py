"""``eval videoqa`` on OVO-Bench's Forward Active Responding tasks (REC, SSR, CRR): each question asked again at each
of its test times during the video's one stream, scored per time, averaged as OVO-Bench averages them.

The layout, prompts and rules were read from JoeLeelyf/OVO-Bench @ c34093f9a072 (``data/ovo_bench_new.json``,
``constant.py``, ``utils/OVOBench.py``, ``utils/OVOBenchScore.py``); the expected prompt texts below are
OVO-Bench's templates as written there, filled as its ``build_prompt`` fills them. The dataset is made here, in the
released layout, beside the backward / real-time rows of ``test_videoqa_streaming.py``; a scripted stand-in for the
runtime counts the frames it is given and replies per (question, frames seen), so every score is hand-computed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekv.apps.cli import main
from edgekv.eval.prompts import prompt
from edgekv.eval.scoring import rule_for, score
from edgekv.eval.stats import proportion
from edgekv.eval.streaming_sets import load_ovobench
from edgekv.eval.videoqa import ovobench_averages
from test_videoqa_streaming import FPS, OVO_REPLIES, OVO_ROWS, _run, _seen_at, _video

FORWARD_ROWS = [
    {"id": 10, "task": "REC", "video": "perception_test/c.avi", "activity": "clapping", "start_times": [2, 4.5],
     "end_times": [2.5, 5], "test_info": [{"realtime": 1.0, "count": 0}, {"realtime": 2.5, "count": 1},
                                          {"realtime": 5, "count": 3}]},
    # SSR's test times out of order, as in the release; two steps of one tutorial
    {"id": 11, "task": "SSR", "video": "COIN/d.avi", "tutorial": "MakeToast", "all_steps": ["cut the bread",
     "spread the butter"], "start_time": [2, 4], "end_time": [3.5, 5], "test_info": [
        {"realtime": 3.0, "step": "cut the bread", "type": 1}, {"realtime": 1.0, "step": "cut the bread", "type": 0},
        {"realtime": 4.2, "step": "spread the butter", "type": 1}]},
    # CRR on a video that backward / real-time questions stream too: one stream serves them all
    {"id": 12, "task": "CRR", "video": "Ego4D/clips/a.avi", "question": "Where will the cup land?",
     "answer": "on the floor", "ask_time": 0.5, "clue_time": 2.8, "test_info": [{"realtime": 0.5, "type": 0},
                                                                               {"realtime": 3.0, "type": 1}]},
]
# (subject in the prompt, frames seen) -> reply; the hand-computed reading and score beside each
FORWARD_REPLIES = {
    ("clapping", 3): "0",                       # "0" == "0": right
    ("clapping", 6): "They did it 2 times.",    # "2" != "1": wrong
    ("clapping", 11): "3 (three)",              # "3" == "3": right
    ("cut the bread", 3): "N",                  # a bare N for No: right
    ("cut the bread", 7): "yes",                # lower case: neither Yes nor No found: wrong
    ("spread the butter", 9): "Yes, but No",    # Yes among what was found: right
    ("Where will the cup land?", 2): "Not yet",  # "No" occurs ("Not"): right
    ("Where will the cup land?", 7): "No.",     # key Yes: wrong
}
EXPECTED = {"ovo/10/0": ("0", True), "ovo/10/1": ("2", False), "ovo/10/2": ("3", True), "ovo/11/0": ("", False),
            "ovo/11/1": ("No", True), "ovo/11/2": ("Yes/No", True), "ovo/12/0": ("No", True),
            "ovo/12/1": ("No", False)}

REC_PROMPT = ("\nYou're watching a video in which people may perform a certain type of action repetively. \n"
              "The person performing this kind of action are referred to as 'they' in the following statement.\n"
              "You're task is to count how many times have different people in the video perform this kind of "
              "action in total.\nOne complete motion counts as one. \n"
              "Now, answer the following question: How many times did they clapping?\n"
              "Provide your answer as a single number (e.g., 0, 1, 2, 3…) indicating the total count.\n"
              "Do not include any additional text or explanation in your response.\n")
SSR_PROMPT = ("\nYou're watching a tutorial video which contain a sequential of steps. \n"
              "The following is one step from the whole procedures: \nspread the butter\n"
              "Your task is to determine if the man or woman in the video is currently performing this step.\n"
              "Answer only with “Yes” or “No”.\n"
              "Do not include any additional text or explanation in your response.\n")
CRR_PROMPT = ("\nYou're responsible of answering questions based on the video content. \n"
              "The following question are relevant to the latest frames, i.e. the end of the video.\n"
              "Where will the cup land?\n"
              "Decide whether existing visual content, especially latest frames, i.e. frames that near the end of the "
              "video, provide enough information for answering the question.\n"
              "Answer only with “Yes” or “No”.\n"
              "Do not include any additional text or explanation in your response.\n")


def _ovobench(root: Path, rows: list = OVO_ROWS + FORWARD_ROWS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ovo_bench_new.json").write_text(json.dumps(rows))
    for video in ("Ego4D/clips/a.avi", "YouTube_Games/b.avi", "perception_test/c.avi", "COIN/d.avi"):
        if not (root / "src_videos" / video).is_file():
            _video(root / "src_videos" / video)
    return root


class TimedSession:
    """A stand-in for ``StreamSession`` that keeps every frame time it was given and replies per (subject, frames
    seen): a forward question is the same text at each of its times, its replies differ."""

    def __init__(self, log: list) -> None:
        self.log, self.times = log, []

    def ingest(self, frame, t: float) -> None:
        assert frame.ndim == 3 and (not self.times or t > self.times[-1])
        self.times.append(t)

    def ask(self, text: str, max_new_tokens: int):
        frames = len(self.times)
        forward = [key for key in FORWARD_REPLIES if key[0] in text and key[1] == frames]
        if forward:
            (key,) = forward
            reply = FORWARD_REPLIES[key]
        else:
            (question,) = [q for q in OVO_REPLIES if q in text]
            reply = OVO_REPLIES[question]
        self.log.append({"text": text, "frames": frames, "times": list(self.times), "session": id(self),
                         "max_new_tokens": max_new_tokens})
        return type("Answer", (), {"text": reply, "ttft_s": 0.0})()

    def stats(self) -> dict:
        return {"frame_pairs": len(self.times) // 2, "cache_tokens": 10 * (len(self.times) // 2), "compressions": 0}


@pytest.fixture
def timed(monkeypatch):
    """The runtime replaced by one whose sessions are ``TimedSession``s; returns (asks, sessions)."""
    asks: list[dict] = []
    sessions: list[TimedSession] = []

    class TimedRuntime:
        def __init__(self, config) -> None:
            assert config.video.fps == FPS

        def session(self) -> TimedSession:
            sessions.append(TimedSession(asks))
            return sessions[-1]

    monkeypatch.setattr("edgekv.runtime.Runtime", TimedRuntime)
    return asks, sessions


def _rows(out: Path) -> dict[str, dict]:
    return {row["id"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def _accuracy(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())["accuracy"]


# hand-computed: REC 2/3, SSR 2/3, CRR 1/2 -> forward (2/3 + 2/3 + 1/2) / 3; backward EPM 1/2 -> 50; real-time STU
# 2/2, OCR 0/1 -> 50; total (50 + 50 + 61.11...) / 3
FORWARD_AVG = 100 * (2 / 3 + 2 / 3 + 1 / 2) / 3
TOTAL = (50 + 50 + FORWARD_AVG) / 3


def test_forward_questions_are_asked_at_each_test_time_of_the_one_stream_and_scored(tmp_path, timed, capsys):
    asks, sessions = timed
    out = tmp_path / "out"
    assert _run("ovobench", _ovobench(tmp_path / "ovo"), out) == 0
    rows = _rows(out)
    assert set(rows) == {f"ovo/{k}" for k in range(5)} | set(EXPECTED)  # one line per (question, test time)
    # every ask saw exactly the frames stamped up to its time, and the next frame came after it (no look-ahead)
    for row in rows.values():
        assert row["frames_seen"] == _seen_at(row["ask_at"]), row
        assert row["stream_t"] <= row["ask_at"]
        # OCR at 100 s is asked at the 6 s video's end
        assert row["ask_at"] < row["stream_t"] + 1 / FPS or row["frames_seen"] == 12
    for ask in asks:
        session = next(s for s in sessions if id(s) == ask["session"])
        assert session.times[:ask["frames"]] == ask["times"]
    # one stream per video (a, b, c, d): a.avi's backward, real-time and CRR asks interleaved in time order
    assert len(sessions) == 4
    a_stream = [ask["frames"] for ask in asks if ask["session"] == asks[0]["session"]]
    assert a_stream == [1, 2, 3, 7, 9]  # STU at 0, CRR at 0.5, EPM at 1.2, CRR at 3, EPM at 4
    # SSR's test times, given out of order, asked in time order: 1.0 (3 frames), 3.0 (7), 4.2 (9)
    ssr = [ask for ask in asks if "tutorial video" in ask["text"]]
    assert [ask["frames"] for ask in ssr] == [3, 7, 9]
    assert [rows[f"ovo/11/{k}"]["frames_seen"] for k in (1, 0, 2)] == [3, 7, 9]
    # OVO-Bench's own templates, filled as its build_prompt fills them
    texts = {ask["text"] for ask in asks}
    assert {REC_PROMPT, SSR_PROMPT, CRR_PROMPT} <= texts
    assert SSR_PROMPT.replace("spread the butter", "cut the bread") in texts
    assert {ask["max_new_tokens"] for ask in asks} == {128}  # its Qwen2-VL runner's budget, for every task
    # each ask scored against its own time's ground truth
    assert {key: (rows[key]["predicted"], rows[key]["correct"]) for key in EXPECTED} == EXPECTED
    assert [rows[f"ovo/10/{k}"]["answer"] for k in range(3)] == ["0", "1", "3"]
    assert [rows[f"ovo/11/{k}"]["answer"] for k in range(3)] == ["Yes", "No", "Yes"]
    assert {rows[key]["scored_by"] for key in EXPECTED} == {"ovobench_rec", "ovobench_yes_no"}
    assert (rows["ovo/11/1"]["question_id"], rows["ovo/11/1"]["test_index"], rows["ovo/11/1"]["type"]) == (
        "ovo/11", 1, 0)
    assert rows["ovo/10/2"]["count"] == 3 and rows["ovo/12/0"]["category"] == "forward"

    accuracy = _accuracy(out)
    assert accuracy["per_task"] == {"CRR": 50.0, "EPM": 50.0, "OCR": 0.0, "REC": 66.67, "SSR": 66.67, "STU": 100.0}
    assert accuracy["tasks"]["REC"] == proportion(2, 3) and accuracy["tasks"]["CRR"] == proportion(1, 2)
    assert accuracy["per_category"] == {"backward": 50.0, "forward": round(FORWARD_AVG, 2), "realtime": 50.0}
    assert accuracy["ovo_total"] == round(TOTAL, 2) == 53.7
    assert accuracy["backward_realtime_avg"] == 50.0
    assert accuracy["all"] == proportion(3 + 5, 5 + 8) and accuracy["questions"] == 13
    assert accuracy["no_letter"] == 0 and accuracy["forward_unread"] == 1  # "yes": no Yes / No as written
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scored_by"] == ["ovobench", "ovobench_rec", "ovobench_yes_no"]
    assert "Total Avg." in summary["note"]
    assert f"forward {round(FORWARD_AVG, 2)}" in capsys.readouterr().out


def test_forward_resume_asks_only_the_missing_test_times_at_the_same_frames(tmp_path, timed):
    asks, _ = timed
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out) == 0
    first = _rows(out)
    assert _run("ovobench", data, out) == 0 and len(asks) == 13  # all done: nothing asked
    # an interrupted run: two of SSR's test times and one of REC's were never written
    kept = [line for line in (out / "results.jsonl").read_text().splitlines()
            if json.loads(line)["id"] not in ("ovo/11/0", "ovo/11/2", "ovo/10/1")]
    (out / "results.jsonl").write_text("\n".join(kept) + "\n")
    del asks[:]
    assert _run("ovobench", data, out) == 0
    assert [(ask["frames"], ask["text"] in (SSR_PROMPT, REC_PROMPT)) for ask in asks] == [
        (6, True), (7, False), (9, True)]
    rows = _rows(out)
    assert rows.keys() == first.keys()
    assert all(rows[k]["frames_seen"] == first[k]["frames_seen"] and rows[k]["correct"] == first[k]["correct"]
               for k in rows)
    assert _accuracy(out)["ovo_total"] == round(TOTAL, 2)


def test_a_run_made_before_the_forward_tasks_resumes_by_asking_them(tmp_path, timed):
    """Before, the reader skipped REC / SSR / CRR: an --out of then holds the backward and real-time lines alone
    (the same lines this reader writes for them). Resumed, only the forward test times are asked; the earlier lines
    are kept as they are, and the summary gains the forward figure and the total."""
    asks, _ = timed
    data, out = _ovobench(tmp_path / "ovo", OVO_ROWS), tmp_path / "out"
    assert _run("ovobench", data, out) == 0
    before = (out / "results.jsonl").read_text()
    assert _accuracy(out)["ovo_total"] is None and len(asks) == 5
    _ovobench(data)  # the whole annotation file
    del asks[:]
    assert _run("ovobench", data, out) == 0
    assert len(asks) == 8 and all("Respond only with the letter" not in ask["text"] for ask in asks)
    assert (out / "results.jsonl").read_text().startswith(before)
    assert _accuracy(out)["ovo_total"] == round(TOTAL, 2)


def test_infinipot_v_style_leaves_the_forward_tasks_out_and_says_why(tmp_path, timed, capsys):
    asks, _ = timed
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "total None (the forward tasks are asked in the official prompt style only)" in captured.out
    assert "8 OVO-Bench Forward Active Responding asks (REC, SSR, CRR) left out" in err
    assert "--prompt-style official" in err
    assert len(asks) == 5 and set(_rows(out)) == {f"ovo/{k}" for k in range(5)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"]["ovo_total"] is None and "forward" not in summary["accuracy"]["per_category"]
    assert "official prompt style only" in summary["note"]
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 0 and len(asks) == 5  # resumes the same
    forward = [item for item in load_ovobench(data) if item.task == "REC"][0]
    with pytest.raises(ValueError, match="forward task REC has no infinipot_v prompt"):
        prompt(forward, "ovobench", "infinipot_v")
    with pytest.raises(ValueError, match="forward task SSR is scored in the official style only"):
        rule_for("ovobench", "infinipot_v", True, "SSR")


@pytest.mark.parametrize("rule, reply, key, read, right", [
    ("ovobench_rec", "3", "3", "3", True),
    ("ovobench_rec", " 3\n", "3", "3", True),
    ("ovobench_rec", "12", "12", "12", True),
    ("ovobench_rec", "2 or 3", "3", "23", False),  # every digit joined
    ("ovobench_rec", "three", "3", "", False),
    ("ovobench_rec", "0", "0", "0", True),
    ("ovobench_yes_no", "Y", "Yes", "Yes", True),
    ("ovobench_yes_no", "Y", "No", "Yes", False),
    ("ovobench_yes_no", "N", "No", "No", True),
    ("ovobench_yes_no", "Yes.", "Yes", "Yes", True),
    ("ovobench_yes_no", "YES", "Yes", "", False),  # case as written
    ("ovobench_yes_no", "Nope", "No", "No", True),
    ("ovobench_yes_no", "No, yes: Yes", "Yes", "No/Yes", True),
    ("ovobench_yes_no", " Y", "Yes", "", False),  # only a reply that IS "Y" is read as Yes
])
def test_forward_rules_read_replies_as_ovobench_scores_them(rule, reply, key, read, right):
    assert score(rule, reply, key, 0) == {"scored_by": rule, "predicted": read, "correct": right}


def test_ovobench_total_is_the_mean_of_the_three_category_means_of_task_accuracies():
    def rows(task: str, category: str, right: int, total: int) -> list[dict]:
        return [{"task": task, "category": category, "correct": k < right} for k in range(total)]

    tasks = {"EPM": rows("EPM", "backward", 1, 3), "ASI": rows("ASI", "backward", 2, 2),
             "STU": rows("STU", "realtime", 1, 4), "REC": rows("REC", "forward", 5, 7),
             "CRR": rows("CRR", "forward", 0, 1)}
    backward, realtime, forward = 100 * (1 / 3 + 1) / 2, 25.0, 100 * (5 / 7 + 0) / 2
    assert ovobench_averages(tasks) == {
        "per_category": {"backward": round(backward, 2), "forward": round(forward, 2), "realtime": 25.0},
        "backward_realtime_avg": round((backward + realtime) / 2, 2),
        "ovo_total": round((backward + realtime + forward) / 3, 2)}
    del tasks["REC"], tasks["CRR"]
    assert ovobench_averages(tasks)["ovo_total"] is None


@pytest.mark.parametrize("index, change, field", [
    (0, ("test_info", 1, "count"), "'count'"),
    (1, ("test_info", 0, "type"), "'type'"),
    (1, ("test_info", 2, "step"), "'step'"),
    (2, ("test_info",), "'test_info'"),
    (0, ("test_info", 0, "realtime"), "'realtime'"),
    (2, ("question",), "'question'"),
])
def test_a_malformed_forward_row_is_refused_naming_the_file_and_field(tmp_path, capsys, index, change, field):
    rows = json.loads(json.dumps(OVO_ROWS + FORWARD_ROWS))
    target = rows[len(OVO_ROWS) + index]
    for key in change[:-1]:
        target = target[key]
    target[change[-1]] = {"count": "two", "type": 2, "step": "", "test_info": [], "realtime": "soon",
                          "question": None}[change[-1]]
    data = _ovobench(tmp_path / "ovo", rows)
    assert main(["eval", "videoqa", "--model", "x", "--dataset", "ovobench", "--data", str(data),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(data / "ovo_bench_new.json") in err and field in err, err
    assert not (tmp_path / "out").exists()


def test_the_tiny_model_answers_forward_asks_mid_stream(tmp_path, tiny_checkpoint):
    """The real session path: OVO-Bench's forward templates (curly quotes, an ellipsis) go through the tokenizer and
    the capped cache, each test time sees its own frames, and an ask at a time leaves the cache to the next."""
    data = tmp_path / "ovo"
    rows = [{"id": 7, "task": "REC", "video": "a.avi", "activity": "waving", "start_times": [0], "end_times": [1],
             "test_info": [{"realtime": 1.5, "count": 1}, {"realtime": 0.5, "count": 0}]},
            {"id": 8, "task": "CRR", "video": "a.avi", "question": "What is red?", "answer": "x", "ask_time": 0,
             "clue_time": 1, "test_info": [{"realtime": 1.5, "type": 1}]}]
    data.mkdir()
    (data / "ovo_bench_new.json").write_text(json.dumps(rows))
    _video(data / "src_videos" / "a.avi", seconds=2.0)
    out = tmp_path / "out"
    assert main(["eval", "videoqa", "--model", str(tiny_checkpoint), "--dataset", "ovobench", "--data", str(data),
                 "--resolution", "56", "56", "--fps", str(FPS), "--max-tokens", "768", "--text-reserve", "384",
                 "--dtype", "fp32", "--max-new-tokens", "4", "--out", str(out)]) == 0
    got = _rows(out)
    assert [(got[k]["frames_seen"], got[k]["pairs_prefilled"]) for k in ("ovo/7/1", "ovo/7/0", "ovo/8/0")] == [
        (2, 1), (4, 2), (4, 2)]
    assert got["ovo/7/0"]["cache_tokens"] == got["ovo/8/0"]["cache_tokens"] > got["ovo/7/1"]["cache_tokens"]
    assert {r["scored_by"] for r in got.values()} == {"ovobench_rec", "ovobench_yes_no"}
    assert all(isinstance(r["reply"], str) and r["max_new_tokens"] == 4 for r in got.values())
    assert _accuracy(out)["per_category"].keys() == {"forward"} and _accuracy(out)["ovo_total"] is None
