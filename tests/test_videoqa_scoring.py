"""``eval videoqa`` reads each reply by its benchmark's own rule under ``--prompt-style official`` (MLVU's
``check_ans``, Video-MME's ``extract_characters_regex``, OVO-Bench's score, StreamingBench's ``count.py``) and by
the first option letter under ``infinipot_v``; each line and the summary name the rule; an --out scored by another
rule is rescored on resume when its answers were asked the same way, and refused when they were not (sources:
``edgekv/eval/scoring.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekv.eval import scoring
from edgekv.eval.scoring import score
from test_eval import _mlvu, _videomme
from test_videoqa_streaming import FPS, _ovobench, _run, _rvs, _streamingbench

# one reply, five readings (key C of four options): (predicted, correct) per rule
READINGS = {
    "Based on it, C": {"first_letter": ("C", True), "mlvu": ("Based on it, C", False), "videomme": ("B", False),
                       "ovobench": ("BC", True), "streamingbench": ("B", False)},
    "(C) the car": {"first_letter": ("C", True), "mlvu": ("C", True), "videomme": ("C", True),
                    "ovobench": ("C", True), "streamingbench": ("(", False)},
    "C.": {"first_letter": ("C", True), "mlvu": ("C.", False), "videomme": ("C", True), "ovobench": ("C", True),
           "streamingbench": ("C", True)},
    " C": {"first_letter": ("C", True), "mlvu": ("C", True), "videomme": ("C", True), "ovobench": ("C", True),
           "streamingbench": (" ", False)},
    "The answer is A, not C": {"first_letter": ("A", False), "mlvu": ("The answer is A, not C", False),
                               "videomme": ("A", False), "ovobench": ("AC", True), "streamingbench": ("T", False)},
    "C) a car, not A)": {"first_letter": ("C", True), "mlvu": ("C", True), "videomme": ("C", True),
                         "ovobench": ("CA", True), "streamingbench": ("C", True)},
    "": {rule: ("", False) for rule in scoring.CHOICE_RULES},
}


@pytest.mark.parametrize("reply", list(READINGS))
def test_each_rule_reads_a_reply_as_its_benchmark_scores_it(reply):
    got = {rule: score(rule, reply, "C", 4) for rule in scoring.CHOICE_RULES}
    assert {rule: (s["predicted"], s["correct"]) for rule, s in got.items()} == READINGS[reply]
    assert all(s["scored_by"] == rule for rule, s in got.items())


def test_edge_cases_of_the_rules():
    # Video-MME deletes its answer phrases first (the "A" of "Answer:" is no answer), and reads only A-D
    assert score("videomme", "Answer: E or D", "D", 5)["predicted"] == "D"
    assert score("videomme", "Answer: E", "E", 5) == {"scored_by": "videomme", "predicted": "", "correct": False}
    # MLVU: a ")" first leaves nothing; a key that is no letter (an answer that is none of the candidates) is never
    # right, whatever the rule reads
    assert score("mlvu", ") C", "C", 4)["predicted"] == ""
    assert not score("mlvu", ")", "", 4)["correct"] and not score("streamingbench", "", "", 4)["correct"]
    # OVO-Bench: only the item's option letters are listed; the key's anywhere is right
    assert score("ovobench", "E? No: B", "B", 2) == {"scored_by": "ovobench", "predicted": "B", "correct": True}
    assert scoring.rule_for("rvs_ego", "official", True) == "token_f1"
    assert scoring.rule_for("rvs_ego", "infinipot_v", True) == "token_f1"
    assert [scoring.rule_for(d, "infinipot_v", False) for d in scoring.OFFICIAL_CHOICE_RULES] == ["first_letter"] * 4
    with pytest.raises(ValueError, match="dataset 'egoschema' has no official multiple-choice scoring rule"):
        scoring.rule_for("egoschema", "official", False)


# ---------------------------------------------------------------------------------------------- end to end
class PrimedSession:
    """A stand-in for ``StreamSession`` that takes ``answer_prefix``: replies from a script by the question the prompt
    holds, and records each call."""

    def __init__(self, log: list, replies: dict[str, str]) -> None:
        self.log, self.replies, self.frames = log, replies, 0

    def ingest(self, frame: np.ndarray, t: float) -> None:
        self.frames += 1

    def ask(self, text: str, max_new_tokens: int, answer_prefix: str = ""):
        (question,) = [q for q in self.replies if q in text]
        self.log.append({"question": question, "max_new_tokens": max_new_tokens, "answer_prefix": answer_prefix})
        return type("Answer", (), {"text": self.replies[question], "ttft_s": 0.0})()

    def stats(self) -> dict:
        return {"frame_pairs": self.frames // 2, "cache_tokens": 0, "compressions": 0}


@pytest.fixture
def primed(monkeypatch):
    asks: list[dict] = []
    replies: dict[str, str] = {}

    class PrimedRuntime:
        def __init__(self, config) -> None:
            assert config.video.fps == FPS

        def session(self) -> PrimedSession:
            return PrimedSession(asks, replies)

    monkeypatch.setattr("edgekv.runtime.Runtime", PrimedRuntime)
    return asks, replies


def _rows(out: Path) -> dict[str, dict]:
    return {row["id"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# question -> reply: the same two replies for every benchmark's questions, which the rules read differently
OVO = {"Who did I talk to?": "Based on it, C", "What did I drop?": "(C) a cup", "Where is the giant?": "B",
       "What is in my hand?": "D", "What is the score?": "E"}


def test_official_scores_ovobench_by_its_rule_and_infinipot_v_by_the_first_letter(tmp_path, primed):
    asks, replies = primed
    replies.update(OVO)
    data = _ovobench(tmp_path / "ovo")
    assert _run("ovobench", data, tmp_path / "official") == 0
    assert _run("ovobench", data, tmp_path / "letter", "--prompt-style", "infinipot_v") == 0
    official, letter = _rows(tmp_path / "official"), _rows(tmp_path / "letter")
    # ovo/0: key A, reply "Based on it, C": A is nowhere in it (OVO-Bench: wrong); its first letter standing alone is C
    assert (official["ovo/0"]["predicted"], official["ovo/0"]["correct"]) == ("BC", False)
    assert (letter["ovo/0"]["predicted"], letter["ovo/0"]["correct"]) == ("C", False)
    # ovo/1: key C, reply "(C) a cup": right under both
    assert official["ovo/1"]["correct"] and letter["ovo/1"]["correct"]
    assert {r["scored_by"] for r in official.values()} == {"ovobench"}
    assert {r["scored_by"] for r in letter.values()} == {"first_letter"}
    assert _summary(tmp_path / "official")["scored_by"] == "ovobench"
    assert "anywhere in the reply" in _summary(tmp_path / "official")["scoring"]
    assert _summary(tmp_path / "letter")["scored_by"] == "first_letter"
    assert all(a["answer_prefix"] == "" and a["max_new_tokens"] == 8 for a in asks)


def test_official_scores_streamingbench_by_the_first_character(tmp_path, primed):
    asks, replies = primed
    replies.update({"What is on the screen right now?": " B", "How many planes are there?": "A. one",
                    "What is the pilot holding?": "(D) a stick", "How many cars are there?": "C"})
    data = _streamingbench(tmp_path / "sb")
    assert _run("streamingbench", data, tmp_path / "official") == 0
    assert _run("streamingbench", data, tmp_path / "letter", "--prompt-style", "infinipot_v") == 0
    official, letter = _rows(tmp_path / "official"), _rows(tmp_path / "letter")
    ids = sorted(official)
    assert [(official[i]["predicted"], official[i]["correct"]) for i in ids] == [
        (" ", False), ("A", True), ("(", False), ("C", True)]
    assert [letter[i]["correct"] for i in ids] == [True, True, True, True]
    assert _summary(tmp_path / "official")["accuracy"]["no_letter"] == 2  # " " and "(": no option letter read


def test_official_scores_videomme_by_its_regex(tmp_path, primed):
    asks, replies = primed
    replies.update({"How many?": "Based on the video, the answer is B", "What?": "The correct option is D"})
    data = _videomme(tmp_path / "vmme", "json")
    assert _run("videomme", data, tmp_path / "official") == 0
    assert _run("videomme", data, tmp_path / "letter", "--prompt-style", "infinipot_v") == 0
    official, letter = _rows(tmp_path / "official"), _rows(tmp_path / "letter")
    # key B: "Based ..." is B at its first letter for Video-MME; key D: "The correct option" is deleted, then D
    assert [(r["predicted"], r["correct"]) for r in official.values()] == [("B", True), ("D", True)]
    assert [(r["predicted"], r["correct"]) for r in letter.values()] == [("B", True), ("D", True)]
    replies.update({"How many?": "Both A and B", "What?": "Clearly D"})
    assert _run("videomme", data, tmp_path / "official2") == 0
    assert _run("videomme", data, tmp_path / "letter2", "--prompt-style", "infinipot_v") == 0
    assert [(r["predicted"], r["correct"]) for r in _rows(tmp_path / "official2").values()] == [
        ("B", True), ("C", False)]  # "Both": B; "Clearly": C
    assert [(r["predicted"], r["correct"]) for r in _rows(tmp_path / "letter2").values()] == [
        ("A", False), ("D", True)]


def test_official_mlvu_primes_the_reply_and_scores_the_continuation_by_mlvus_rule(tmp_path, primed):
    asks, replies = primed
    replies.update({"What happens?": "C) z", "Who?": "I think A"})  # keys C and A
    data = _mlvu(tmp_path / "MLVU")
    assert _run("mlvu", data, tmp_path / "official") == 0
    assert [a["answer_prefix"] for a in asks] == ["Best option:(", "Best option:("]
    rows = _rows(tmp_path / "official")
    assert [(r["predicted"], r["correct"], r["answer_prefix"]) for r in rows.values()] == [
        ("C", True, "Best option:("), ("I think A", False, "Best option:(")]
    summary = _summary(tmp_path / "official")
    assert summary["scored_by"] == "mlvu" and summary["accuracy"]["no_letter"] == 1
    del asks[:]
    assert _run("mlvu", data, tmp_path / "letter", "--prompt-style", "infinipot_v") == 0
    assert [a["answer_prefix"] for a in asks] == ["", ""]  # InfiniPot-V's format starts no reply
    assert [(r["predicted"], r["correct"]) for r in _rows(tmp_path / "letter").values()] == [("C", True), ("A", True)]
    assert all("answer_prefix" not in r for r in _rows(tmp_path / "letter").values())


def test_rvs_replies_get_rekvs_budget_officially_and_max_new_tokens_overrides_it(tmp_path, primed):
    asks, replies = primed
    replies.update({"What is the person holding?": "a red cup", "Where is the cup now?": "on the table",
                    "What rolled away?": "a ball"})
    data = _rvs(tmp_path / "rvs")
    assert _run("rvs_ego", data, tmp_path / "official") == 0
    assert _run("rvs_ego", data, tmp_path / "letter", "--prompt-style", "infinipot_v") == 0
    assert _run("rvs_ego", data, tmp_path / "given", "--max-new-tokens", "20") == 0
    assert [a["max_new_tokens"] for a in asks] == [256] * 3 + [64] * 3 + [20] * 3
    assert {r["max_new_tokens"] for r in _rows(tmp_path / "official").values()} == {256}
    assert _summary(tmp_path / "official")["scored_by"] == "token_f1"


# ---------------------------------------------------------------------------------------------- resuming
def _as_before_rules(out: Path, keep: int | None = None) -> list[str]:
    """results.jsonl as edgekv wrote it before lines named their rule, budget and prefix (scored by the first
    letter), the first ``keep`` lines only; returns the original lines."""
    lines = (out / "results.jsonl").read_text().splitlines()
    earlier = []
    for line in lines[:keep]:
        row = json.loads(line)
        for key in ("scored_by", "max_new_tokens", "answer_prefix"):
            row.pop(key, None)
        if "predicted" in row:
            row["predicted"] = scoring.extract_letter(row["reply"], 5)
            row["correct"] = row["predicted"] == row["answer"]
        earlier.append(json.dumps(row))
    (out / "results.jsonl").write_text("".join(line + "\n" for line in earlier))
    return lines


def test_an_official_run_scored_by_the_first_letter_is_rescored_on_resume(tmp_path, primed, capsys):
    """Answers asked the same way (same prompt, budget, no prefix): their stored reply is all a rule reads, so a
    resume rescores them by the benchmark's rule and asks only what is left; each keeps its earlier score."""
    asks, replies = primed
    replies.update(OVO)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out) == 0
    fresh = _rows(out)
    _as_before_rules(out, keep=3)
    assert _rows(out)["ovo/0"]["predicted"] == "C"  # the first letter of "Based on it, C"
    del asks[:]
    capsys.readouterr()
    assert _run("ovobench", data, out) == 0
    assert "rescored 3 answer(s) scored by first_letter" in capsys.readouterr().err
    assert len(asks) == 2  # only the two answers that were not there
    rows = _rows(out)
    assert rows.keys() == fresh.keys()
    for key, row in rows.items():
        assert (row["scored_by"], row["predicted"], row["correct"]) == (
            "ovobench", fresh[key]["predicted"], fresh[key]["correct"])
    assert rows["ovo/0"]["rescored_from"] == {"scored_by": "first_letter", "predicted": "C", "correct": False}
    assert _summary(out)["scored_by"] == "ovobench"
    again = (out / "results.jsonl").read_text()
    assert _run("ovobench", data, out) == 0 and len(asks) == 2
    assert (out / "results.jsonl").read_text() == again  # rescored once


def test_answers_asked_another_way_are_refused_not_rescored(tmp_path, primed, capsys):
    """Official MLVU now primes the reply and official RVS gives it 256 tokens: the replies of an --out made before
    were answers to another prompt, so a resume is refused naming how, and nothing is written."""
    asks, replies = primed
    replies.update({"What happens?": "C", "Who?": "A", "What is the person holding?": "a cup",
                    "Where is the cup now?": "table", "What rolled away?": "ball"})
    for dataset, data, said in (
            ("mlvu", _mlvu(tmp_path / "MLVU"), "answer_prefix '' (now 'Best option:('): 1 of 1 answers"),
            ("rvs_ego", _rvs(tmp_path / "rvs"), "max_new_tokens 64 (now 256): 2 of 2 answers")):
        out = tmp_path / f"out-{dataset}"
        assert _run(dataset, data, out, "--limit", "2") == 0
        _as_before_rules(out, keep=None if dataset == "rvs_ego" else 1)
        before = {name: (out / name).read_text() for name in ("results.jsonl", "summary.json", "run.json")}
        count = len(asks)
        capsys.readouterr()
        assert _run(dataset, data, out, "--limit", "2") == 2
        err = capsys.readouterr().err
        assert said in err and "give another --out" in err, err
        assert len(asks) == count and {name: (out / name).read_text() for name in before} == before


def test_an_infinipot_v_run_from_before_the_rules_resumes_untouched(tmp_path, primed):
    asks, replies = primed
    replies.update(OVO)
    data, out = _ovobench(tmp_path / "ovo"), tmp_path / "out"
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 0
    _as_before_rules(out)
    before = (out / "results.jsonl").read_text()
    count = len(asks)
    assert _run("ovobench", data, out, "--prompt-style", "infinipot_v") == 0
    assert len(asks) == count and (out / "results.jsonl").read_text() == before
    assert _summary(out)["scored_by"] == "first_letter"
