"""``eval videoqa``'s prompts: each benchmark's own by default (``--prompt-style official``), InfiniPot-V's for every
benchmark when asked (``--prompt-style infinipot_v``), and the style kept with a run's answers.

The expected texts were read from the benchmarks' evaluation code (sources in ``edgekv/eval/prompts.py``):
JUNJIE99/MLVU ``evaluation/multiple_choice_evaluation/choice_bench.py``, BradyFU/Video-MME ``README.md``,
JoeLeelyf/OVO-Bench ``constant.py`` + ``utils/OVOBench.py``, THUNLP-MT/StreamingBench
``src/benchmark/StreamingBench.py``, Becomebright/ReKV ``video_qa/rekv_stream_vqa.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekv.apps.cli import main
from edgekv.eval.prompts import PROMPT_STYLES, prompt
from edgekv.eval.qa_item import Item
from test_videoqa_streaming import OVO_REPLIES, _ovobench, _run
from test_videoqa_streaming import scripted as scripted_fixture

scripted = scripted_fixture  # the scripted stand-in for the runtime, as a fixture of this module too


def _item(options: tuple[str, ...], question: str = "What is in my hand?") -> Item:
    return Item("x/0", Path("v.mp4"), question, options, "A", "t")


FOUR = ("A. a knife", "B. a fork", "C. a spoon", "D. nothing")


def test_each_benchmark_is_asked_its_own_prompt_by_default():
    mlvu = prompt(_item(("(A) x", "(B) y", "(C) z", "(D) w"), "What happens?"), "mlvu")
    assert mlvu == ("Carefully watch this video and pay attention to every detail. Based on your observations, select "
                    "the best option that accurately addresses the question.\nQuestion: What happens?\nOptions:\n"
                    "(A) x\n(B) y\n(C) z\n(D) w\nOnly give the best option.")
    assert prompt(_item(FOUR), "videomme") == (
        "Select the best answer to the following multiple-choice question based on the video. Respond with only the "
        "letter (A, B, C, or D) of the correct option.\nWhat is in my hand?\n"
        "A. a knife\nB. a fork\nC. a spoon\nD. nothing\nThe best answer is:")
    # OVO-Bench: all options on one line, "; " between and ";" after, the template's blank lines and trailing space
    assert prompt(_item(("A. 1", "B. 2", "C. 3", "D. 4", "E. 5"), "Score?"), "ovobench") == (
        "\nQuestion: Score?\nOptions:\nA. 1; B. 2; C. 3; D. 4; E. 5;\n\nRespond only with the letter corresponding to "
        "your chosen option (e.g., A, B, C). \nDo not include any additional text or explanation in your response.\n")
    assert prompt(_item(FOUR), "streamingbench") == (
        "You are an advanced video question-answering AI assistant. You have been provided with some frames from the "
        "video and a multiple-choice question related to the video. Your task is to carefully analyze the video and "
        "provide the best answer to question, choosing from the four options provided. Respond with only the letter "
        "(A, B, C, or D) of the correct option.\n\nQuestion: What is in my hand?\n\nOptions:\n"
        "A. a knife\nB. a fork\nC. a spoon\nD. nothing\n\nThe best option is:")
    # a count StreamingBench's real-time set does not have: the words follow the options
    three = prompt(_item(FOUR[:3]), "streamingbench")
    assert "choosing from the three options provided. Respond with only the letter (A, B, or C)" in three
    for dataset in ("rvs_ego", "rvs_movie"):
        assert prompt(_item(()), dataset) == "What is in my hand?"  # open-ended: as written, as ReKV asks


def test_infinipot_v_style_is_its_format_for_every_benchmark():
    assert prompt(_item(("(A) x", "(B) y")), "mlvu", "infinipot_v") == (
        "Question: What is in my hand?\nOptions:\n(A) x\n(B) y\nRespond with only the letter (A or B) of the correct "
        "option.")
    for dataset, letters in (("videomme", "A, B, C, or D"), ("streamingbench", "A, B, C, or D"),
                             ("ovobench", "A, B, C or D")):
        assert prompt(_item(FOUR), dataset, "infinipot_v") == (
            f"Question: What is in my hand?\nOptions:\n{chr(10).join(FOUR)}\n"
            f"Respond with only the letter ({letters}) of the correct option.")
    assert prompt(_item(()), "rvs_ego", "infinipot_v") == "What is in my hand?\nAnswer in a few words."


def test_an_unknown_style_or_dataset_is_refused_naming_it(capsys):
    with pytest.raises(ValueError, match=r"prompt style: expected one of official, infinipot_v, got 'gpt'"):
        prompt(_item(FOUR), "videomme", "gpt")
    with pytest.raises(ValueError, match="dataset 'egoschema' has no official multiple-choice prompt"):
        prompt(_item(FOUR), "egoschema")
    assert PROMPT_STYLES == ("official", "infinipot_v")
    with pytest.raises(SystemExit):
        main(["eval", "videoqa", "--model", "x", "--dataset", "mlvu", "--data", "x", "--prompt-style", "gpt"])
    assert "--prompt-style: invalid choice: 'gpt'" in capsys.readouterr().err


def test_the_style_reaches_the_model_and_stays_with_the_answers(tmp_path, scripted):
    """The default asks OVO-Bench's own prompt; ``run.json`` and ``summary.json`` keep the style, and a rerun in the
    other style into the same --out is refused naming it (its answers would be pooled with the first's)."""
    asks, _, replies = scripted
    replies.update(OVO_REPLIES)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out, "--limit", "2") == 0
    first = asks[0]["text"]
    assert first.startswith("\nQuestion: Who did I talk to?\nOptions:\nA. a man; B. a woman; C. a dog; D. nobody;\n")
    assert json.loads((out / "run.json").read_text())["prompt_style"] == "official"
    assert json.loads((out / "summary.json").read_text())["prompt_style"] == "official"
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 2
    assert len(asks) == 2
    other = tmp_path / "other"
    assert _run("ovobench", data, other, "--limit", "1", "--prompt-style", "infinipot_v") == 0
    assert asks[-1]["text"].startswith("Question: Who did I talk to?\nOptions:\nA. a man\nB. a woman\n")


def test_answers_written_before_the_style_existed_resume_only_in_infinipot_v_format(
        tmp_path, scripted, capsys):
    """An --out of an earlier edgekv (no prompt_style in run.json) was asked in InfiniPot-V's format: resuming it
    with the new default would pool two prompts' answers under one summary, so it is refused naming the style."""
    asks, _, replies = scripted
    replies.update(OVO_REPLIES)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out, "--limit", "1", "--prompt-style", "infinipot_v") == 0
    settings = json.loads((out / "run.json").read_text())
    del settings["prompt_style"]
    (out / "run.json").write_text(json.dumps(settings))  # as an earlier edgekv wrote it
    capsys.readouterr()
    assert _run("ovobench", data, out) == 2
    assert "prompt_style 'infinipot_v' (now 'official')" in capsys.readouterr().err
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 0
    assert len(asks) == 5 and all(a["text"].startswith("Question: ") for a in asks)


def test_each_answer_keeps_its_style_and_a_resume_in_another_is_refused_without_run_json(tmp_path, scripted, capsys):
    """Issue: with ``run.json`` and ``summary.json`` deleted by hand, a resume in the other style pooled two prompts'
    answers silently. Each line of ``results.jsonl`` says its style; a line without one is ``infinipot_v``'s."""
    asks, _, replies = scripted
    replies.update(OVO_REPLIES)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out, "--limit", "2") == 0
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [line["prompt_style"] for line in lines] == ["official", "official"]
    (out / "run.json").unlink()
    (out / "summary.json").unlink()
    capsys.readouterr()
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 2
    err = capsys.readouterr().err
    assert str(out / "results.jsonl") in err and "prompt_style 'official' (now 'infinipot_v'): 2 of 2 answers" in err
    assert len(asks) == 2 and not (out / "run.json").exists()  # nothing asked, nothing written down
    for line in lines:  # as an edgekv before the option wrote them (nor the budget, nor the rule)
        for key in ("prompt_style", "max_new_tokens", "scored_by"):
            del line[key]
    (out / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _run("ovobench", data, out) == 2
    assert "prompt_style 'infinipot_v' (now 'official'): 2 of 2 answers" in capsys.readouterr().err
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 0
    assert len(asks) > 2 and all(a["text"].startswith("Question: ") for a in asks[2:])
