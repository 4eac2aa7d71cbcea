"""``eval videoqa``'s readers on tiny datasets made here in the benchmarks' released layouts.

Field names, value formats and the odd records reproduced below were read from the benchmarks' public
repositories (facts only; the records are written here, nothing is copied or downloaded):

* MLVU dev: JUNJIE99/MLVU ``data/*.json`` @ fd060c10a43e (``2_needle.json`` items 34 and 338 answer a text no
  candidate has; ``1_plotQA.json`` item 335 lists its answer twice); scoring as in
  ``evaluation/multiple_choice_evaluation/choice_bench.py`` (the last equal candidate is the key).
* Video-MME: the ``lmms-lab/Video-MME`` dataset card's features; lmms-eval's reader also finds ``<videoID>.MP4``.
* OVO-Bench: JoeLeelyf/OVO-Bench ``data/ovo_bench_new.json`` @ c34093f9a072.
* StreamingBench: THUNLP-MT/StreamingBench ``src/data/questions_real.json`` @ 89299232c4cc.
* RVS: Becomebright/ReKV ``video_qa/rekv_stream_vqa.py`` @ 63793f752be2 (times in seconds, ``video_path`` as
  given relative to ReKV's root, e.g. ``data/rvs/ego/videos/<uuid>.mp4``).
"""

from __future__ import annotations

import json
from pathlib import Path

from edgekv.eval.streaming_sets import load_ovobench, load_rvs_ego, load_streamingbench
from edgekv.eval.videoqa import LETTERS, extract_letter, load_mlvu, load_videomme, summarize


def _write(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def _mlvu_release(root: Path) -> Path:
    """json/<n>_<task>.json with the released dev set's odd records, generation tasks beside them."""
    _write(root / "json" / "1_plotQA.json", [
        {"video": "movie101_1.mp4", "duration": 500.0, "question": "How many cars?",
         "candidates": ["Six", "Three", "Three", "Eight"], "answer": "Three", "question_type": "plotQA"},
        {"video": "movie101_2.mp4", "duration": 400.0, "question": "What colour?",
         "candidates": ["Blue", "Red", "White", "Blue"], "answer": "White", "question_type": "plotQA"}])
    _write(root / "json" / "2_needle.json", [
        {"video": "needle_1.mp4", "duration": 300.0, "question": "What is the person doing?",
         "candidates": ["Fishing", "Catching the drone", "Launching the drone", "Sunbathing"],
         "answer": "Catching a flying drone quadcopter", "question_type": "findNeedle"},
        {"video": "needle_2.mp4", "duration": 300.0, "question": "What appears?",
         "candidates": ["a cat", "a dog", "a cup", "a car"], "answer": "a cup", "question_type": "findNeedle"}])
    _write(root / "json" / "8_sub_scene.json", [
        {"video": "subPlot_1.mp4", "duration": 5000.0, "question": "Describe the scene.", "answer": "text",
         "scoring_points": ["a", "b"], "question_type": "subPlot"}])
    _write(root / "json" / "9_summary.json", [
        {"video": "1.mp4", "duration": 600.0, "question": "Summarize.", "answer": "text", "question_type": "summary"}])
    return root


def test_mlvu_release_with_an_answer_that_is_no_candidate_is_read_and_scored_wrong(tmp_path):
    """The released ``2_needle.json`` has two items whose answer is none of the candidates: the whole dataset was
    refused (DatasetError). MLVU's scorer keeps them, and no reply can match them."""
    items = load_mlvu(_mlvu_release(tmp_path / "MLVU"))
    needle = [i for i in items if i.task == "needle"]
    assert [i.id for i in needle] == ["2_needle/0", "2_needle/1"]
    unanswerable, plain = needle
    assert unanswerable.answer == "" and unanswerable.extra["answer_not_in_candidates"] is True
    assert plain.answer == "C" and "answer_not_in_candidates" not in plain.extra
    assert unanswerable.video == tmp_path / "MLVU" / "video" / "2_needle" / "needle_1.mp4"
    assert all(extract_letter(f"({letter})") != unanswerable.answer for letter in LETTERS[:4])
    records = [{"task": "needle", "correct": extract_letter("(B)") == unanswerable.answer},
               {"task": "needle", "correct": extract_letter("(C)") == plain.answer}]
    assert summarize(records, "mlvu")["per_task"] == {"needle": 50.0}  # counted, and wrong


def test_mlvu_repeated_candidate_keys_the_last_one_as_mlvus_scorer_does(tmp_path):
    """``["Six", "Three", "Three", "Eight"]`` answered "Three": MLVU's scorer (and InfiniPot-V's reader) key C, the
    last equal candidate; the first match (B) was keyed here."""
    plot = [i for i in load_mlvu(_mlvu_release(tmp_path / "MLVU")) if i.task == "plotQA"]
    assert [i.answer for i in plot] == ["C", "C"]
    assert plot[0].options == ("(A) Six", "(B) Three", "(C) Three", "(D) Eight")


def test_videomme_finds_videos_with_an_upper_case_extension(tmp_path):
    """lmms-eval's Video-MME reader looks for ``data/<videoID>.MP4`` too; such a video was reported missing."""
    root = tmp_path / "Video-MME"
    _write(root / "videomme" / "test.json", [
        {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
         "url": "https://www.youtube.com/watch?v=abcDEF12345", "videoID": "abcDEF12345", "question_id": "001-1",
         "task_type": "Counting Problem", "question": "How many?",
         "options": ["A. one", "B. two", "C. three", "D. four"], "answer": "B"}])
    _touch(root / "data" / "abcDEF12345.MP4")
    (item,) = load_videomme(root)
    assert item.video == root / "data" / "abcDEF12345.MP4" and item.video.is_file()
    assert item.answer == "B" and item.extra == {"duration": "short", "domain": "Knowledge"}


def test_ovobench_release_records_are_read(tmp_path):
    """``ovo_bench_new.json``: int and float ``realtime``, 2-5 options, forward tasks with ``test_info`` and no
    options (one item per test time, its own ground truth; SSR's times out of order as released), ``video`` under
    ``src_videos/``."""
    _write(tmp_path / "ovo_bench_new.json", [
        {"id": 0, "task": "EPM", "video": "Ego4D/clips/ec4a.mp4", "realtime": 215, "question": "Who?",
         "answer": "b", "options": ["a", "b", "c", "d"], "gt": 1},
        {"id": 900, "task": "OCR", "video": "AutoEvalMetaData/252.mp4", "realtime": 268.73, "question": "Text?",
         "answer": "y", "options": ["x", "y"], "gt": 1},
        {"id": 901, "task": "ACR", "video": "thumos/v1.mp4", "realtime": 12.5, "question": "Act?",
         "answer": "e", "options": ["a", "b", "c", "d", "e"], "gt": 4},
        {"id": 1558, "task": "REC", "video": "perception_test/video_1.mp4", "activity": "breaking something",
         "start_times": [6], "end_times": [17], "test_info": [{"realtime": 17, "count": 1}]},
        {"id": 1468, "task": "CRR", "video": "MovieNet/tt1.mp4", "question": "What?", "answer": "x",
         "ask_time": 297, "clue_time": 308, "test_info": [{"realtime": 297, "type": 0}]},
        {"id": 1516, "task": "SSR", "video": "COIN/x.mp4", "tutorial": "PutOnHairExtensions",
         "all_steps": ["pull up the hair", "put on the extensions"], "start_time": [25, 31], "end_time": [30, 49],
         "test_info": [{"realtime": 27, "step": "pull up the hair", "type": 1},
                       {"realtime": 26.5, "step": "put on the extensions", "type": 0}]}])
    items = load_ovobench(tmp_path)
    assert [(i.id, i.task, i.answer, i.ask_at) for i in items] == [
        ("ovo/0", "EPM", "B", 215.0), ("ovo/900", "OCR", "B", 268.73), ("ovo/901", "ACR", "E", 12.5),
        ("ovo/1558/0", "REC", "1", 17.0), ("ovo/1468/0", "CRR", "No", 297.0), ("ovo/1516/0", "SSR", "Yes", 27.0),
        ("ovo/1516/1", "SSR", "No", 26.5)]
    assert items[0].video == tmp_path / "src_videos" / "Ego4D" / "clips" / "ec4a.mp4"
    assert items[2].options[-1] == "E. e" and items[0].extra == {"category": "backward"}
    assert [i.question for i in items[3:]] == ["breaking something", "What?", "pull up the hair",
                                               "put on the extensions"]
    assert items[3].options == () and items[3].video == tmp_path / "src_videos" / "perception_test" / "video_1.mp4"
    assert items[6].extra == {"category": "forward", "question_id": "ovo/1516", "test_index": 1, "type": 0}
    assert items[3].extra == {"category": "forward", "question_id": "ovo/1558", "test_index": 0, "count": 1}


def test_streamingbench_release_records_are_read(tmp_path):
    """``questions_real.json``: odd stamps ("00:12450", "00:24", "00:00:8"), an entry without
    ``video_categories``, a question without ``required_ability`` and one with ``cause``/``effect``."""
    question = {"task_type": "Object Recognition", "question": "What?", "answer": "A",
                "options": ["A. a", "B. b", "C. c", "D. d"], "required_ability": "x"}
    _write(tmp_path / "questions_real.json", [
        {"time": "[0:00:00 - 0:00:10]", "video_categories": "driving", "video_path": "./videos/sample_1_real.mp4",
         "questions": [{**question, "time_stamp": "00:00:8"}, {**question, "time_stamp": "00:24", "answer": "D"}]},
        {"time": "[0:03:17 - 0:03:27]", "captions": [], "video_path": "/elsewhere/src/data/videos/sample_1_real.mp4",
         "questions": [{k: v for k, v in question.items() if k != "required_ability"} | {"time_stamp": "00:12450"}]},
        {"time": "[0:00:00 - 0:00:10]", "video_categories": "cooking", "video_path": "./videos/sample_2_real.mp4",
         "questions": [{**question, "time_stamp": "0:07:40", "cause": "c", "effect": "e",
                        "task_type": "Causal Reasoning"}]}])
    items = load_streamingbench(tmp_path)
    assert [(i.ask_at, i.answer) for i in items] == [(8.0, "A"), (24.0, "D"), (12450.0, "A"), (460.0, "A")]
    assert items[2].video == tmp_path / "videos" / "sample_1_real.mp4" == items[0].video.resolve()
    assert items[3].task == "Causal Reasoning"


def test_rvs_video_path_relative_to_rekvs_root_is_found_in_the_subset_folder(tmp_path):
    """ReKV opens ``video_path`` as written, relative to its repository root (``data/rvs/ego/videos/...``)."""
    _write(tmp_path / "ego" / "ego4d_oe.json", [
        {"video_id": "0fa75cb3", "video_path": "data/rvs/ego/videos/0fa75cb3.mp4",
         "conversations": [{"question": "What did I pick up?", "answer": "a knife", "start_time": 30.5,
                            "end_time": 41.0},
                           {"question": "Where am I?", "answer": "kitchen", "start_time": 0, "end_time": 12}]}])
    _touch(tmp_path / "ego" / "videos" / "0fa75cb3.mp4")
    items = load_rvs_ego(tmp_path)
    assert {i.video for i in items} == {tmp_path / "ego" / "videos" / "0fa75cb3.mp4"}
    assert [(i.ask_at, i.answer, i.open_ended) for i in items] == [(41.0, "a knife", True), (12.0, "kitchen", True)]
