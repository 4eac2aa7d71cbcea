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
        reply = self.replies[question]  # the reply, or (reply, how it ended: Answer.finish_reason)
        text, finish = (reply, None) if isinstance(reply, str) else reply
        return type("Answer", (), {"text": text, "ttft_s": 0.0, **({"finish_reason": finish} if finish else {})})()

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
    # OVO-Bench's own budget (its Qwen2-VL runner's 128 new tokens) officially, edgekv's 8 in InfiniPot-V's format
    assert [(a["answer_prefix"], a["max_new_tokens"]) for a in asks] == [("", 128)] * 5 + [("", 8)] * 5


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
    resume rescores them by the benchmark's rule and asks only what is left; each keeps its earlier score. Video-MME
    is the benchmark whose official budget is still the 8 tokens of then (the others' own are longer: refused,
    ``test_an_official_run_given_8_tokens_is_refused_where_the_benchmark_gives_more``)."""
    asks, replies = primed
    replies.update({"How many?": "Both A and B", "What?": "Clearly D"})  # keys B and D
    data, out = _videomme(tmp_path / "vmme", "json"), tmp_path / "out"
    assert _run("videomme", data, out) == 0
    fresh = _rows(out)
    _as_before_rules(out, keep=1)
    assert _rows(out)["001-1"]["predicted"] == "A"  # the first letter standing alone in "Both A and B"
    del asks[:]
    capsys.readouterr()
    assert _run("videomme", data, out) == 0
    assert "rescored 1 answer(s) scored by first_letter" in capsys.readouterr().err
    assert [a["question"] for a in asks] == ["What?"]  # only the answer that was not there
    rows = _rows(out)
    assert rows.keys() == fresh.keys()
    for key, row in rows.items():
        assert (row["scored_by"], row["predicted"], row["correct"]) == (
            "videomme", fresh[key]["predicted"], fresh[key]["correct"])
    assert rows["001-1"]["rescored_from"] == {"scored_by": "first_letter", "predicted": "A", "correct": False}
    assert (rows["001-1"]["predicted"], rows["001-1"]["correct"]) == ("B", True)  # Video-MME reads the B of "Both"
    assert _summary(out)["scored_by"] == "videomme"
    again = (out / "results.jsonl").read_text()
    assert _run("videomme", data, out) == 0 and len(asks) == 1
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


# ---------------------------------------------------------------------------------------------- budgets
BUDGET_REPLIES = {"What happens?": "C) z", "Who?": "A", "How many?": "B", "What?": "D", **OVO,
                  "What is on the screen right now?": "B", "How many planes are there?": "A",
                  "What is the pilot holding?": "D", "How many cars are there?": "C"}
DATASETS = {"mlvu": lambda root: _mlvu(root / "MLVU"), "videomme": lambda root: _videomme(root / "vmme", "json"),
            "ovobench": lambda root: _ovobench(root / "ovo"),
            "streamingbench": lambda root: _streamingbench(root / "sb")}
# each benchmark's own multiple-choice budget: MLVU's VideoChat2 run 100, OVO-Bench's and StreamingBench's Qwen2-VL
# runners 128; Video-MME sets none (edgekv's 8)
OWN_BUDGET = {"mlvu": 100, "videomme": 8, "ovobench": 128, "streamingbench": 128}


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_official_replies_get_their_benchmarks_own_budget_and_max_new_tokens_overrides_it(tmp_path, primed, dataset):
    asks, replies = primed
    replies.update(BUDGET_REPLIES)
    data = DATASETS[dataset](tmp_path)
    runs = {"official": [], "letter": ["--prompt-style", "infinipot_v"], "given": ["--max-new-tokens", "20"],
            "given-letter": ["--prompt-style", "infinipot_v", "--max-new-tokens", "20"]}
    budgets = {}
    for name, extra in runs.items():
        del asks[:]
        assert _run(dataset, data, tmp_path / name, *extra) == 0
        budgets[name] = {a["max_new_tokens"] for a in asks}
        assert {r["max_new_tokens"] for r in _rows(tmp_path / name).values()} == budgets[name]
    assert budgets == {"official": {OWN_BUDGET[dataset]}, "letter": {8}, "given": {20}, "given-letter": {20}}


def _as_asked_with_8_tokens(out: Path) -> None:
    """results.jsonl as edgekv wrote it when every multiple-choice reply got 8 new tokens (commit 29bdf71: the lines
    name their rule, prefix and budget)."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    (out / "results.jsonl").write_text("".join(json.dumps({**row, "max_new_tokens": 8}) + "\n" for row in rows))


@pytest.mark.parametrize("dataset", ["mlvu", "ovobench", "streamingbench"])
def test_an_official_run_given_8_tokens_is_refused_where_the_benchmark_gives_more(tmp_path, primed, capsys, dataset):
    """A reply cut at 8 tokens answers another prompt than one given the benchmark's own budget: a resume of such an
    --out is refused naming the budgets and what to do, and nothing is asked or written; a fresh --out runs."""
    asks, replies = primed
    replies.update(BUDGET_REPLIES)
    data, out = DATASETS[dataset](tmp_path), tmp_path / "out"
    assert _run(dataset, data, out, "--limit", "2") == 0
    _as_asked_with_8_tokens(out)
    before = {name: (out / name).read_text() for name in ("results.jsonl", "summary.json", "run.json")}
    count = len(asks)
    capsys.readouterr()
    assert _run(dataset, data, out) == 2
    err = capsys.readouterr().err
    assert f"max_new_tokens 8 (now {OWN_BUDGET[dataset]}): 2 of 2 answers" in err and "give another --out" in err, err
    assert "gives each benchmark its own budget" in err
    # asking the rest with 8 tokens into it is refused too: run.json says the run was made with the default
    assert _run(dataset, data, out, "--max-new-tokens", "8") == 2
    assert "max_new_tokens None (now 8)" in capsys.readouterr().err
    assert len(asks) == count and {name: (out / name).read_text() for name in before} == before
    assert _run(dataset, data, tmp_path / "fresh") == 0
    assert {r["max_new_tokens"] for r in _rows(tmp_path / "fresh").values()} == {OWN_BUDGET[dataset]}


def test_replies_cut_at_the_budget_are_named_and_counted(tmp_path, primed):
    asks, replies = primed
    replies.update({"How many?": ("The best answer is", "length"), "What?": ("D", "stop")})
    data = _videomme(tmp_path / "vmme", "json")
    assert _run("videomme", data, tmp_path / "out") == 0
    assert [r["finish_reason"] for r in _rows(tmp_path / "out").values()] == ["length", "stop"]
    assert _summary(tmp_path / "out")["accuracy"]["cut_at_max_new_tokens"] == 1


# ---------------------------------------------------------------------------------------------- Video-MME's figure
def test_videomme_gives_its_own_scorers_figure_beside_the_headline(tmp_path, primed, capsys):
    """Video-MME's scorer leaves a reply with no letter out of the accuracy's denominator; edgekv's headline counts it
    wrong. Both are in summary.json and the printed summary under the official style, Video-MME's named as such."""
    asks, replies = primed
    replies.update({"How many?": "B", "What?": "I cannot tell"})  # keys B and D: right, and no letter
    data = _videomme(tmp_path / "vmme", "json")
    capsys.readouterr()
    assert _run("videomme", data, tmp_path / "official") == 0
    printed = capsys.readouterr().out
    summary = _summary(tmp_path / "official")
    accuracy = summary["accuracy"]
    assert (accuracy["overall"], accuracy["no_letter"], accuracy["per_duration"]) == (50.0, 1, {"short": 50.0})
    own = accuracy["videomme_scorer"]
    assert {key: value for key, value in own.items() if key != "about"} == {
        "overall": 100.0, "answered": 1, "left_out": 1, "per_duration": {"short": 100.0},
        "per_task": {"Counting Problem": 100.0}}
    assert "Video-MME's own scorer" in own["about"] and "videomme_scorer" in summary["note"]
    assert "without subtitles" in summary["note"]
    assert json.loads(printed[:printed.index("\n}\n") + 3])["videomme_scorer"] == own  # the printed accuracy
    assert ("overall 50.0 % of 2 (a reply with no letter counted wrong); Video-MME's own scorer: 100.0 % of the 1 "
            "answered (1 left out of its denominator)") in printed
    # no reply with a letter: its figure is none, said so
    replies.update({"How many?": "I cannot tell"})
    assert _run("videomme", data, tmp_path / "none") == 0
    assert _summary(tmp_path / "none")["accuracy"]["videomme_scorer"]["overall"] is None
    assert "Video-MME's own scorer: none (no reply had a letter) of the 0 answered" in capsys.readouterr().out
    # InfiniPot-V's format is scored by edgekv's first-letter rule: no Video-MME figure
    assert _run("videomme", data, tmp_path / "letter", "--prompt-style", "infinipot_v") == 0
    assert "videomme_scorer" not in _summary(tmp_path / "letter")["accuracy"]
    assert "Video-MME's own scorer" not in capsys.readouterr().out


def test_a_rerun_that_samples_otherwise_is_refused(tmp_path, primed, capsys):
    """The benchmarks decode greedily; a --config whose generation samples (temperature, top_p) gives other answers,
    so a rerun with it into the same --out is refused naming the setting, as every other setting that changes an
    answer. An --out whose run.json predates these keys resumes."""
    asks, replies = primed
    replies.update(BUDGET_REPLIES)
    data, out = _videomme(tmp_path / "vmme", "json"), tmp_path / "out"
    assert _run("videomme", data, out, "--limit", "1") == 0
    settings = json.loads((out / "run.json").read_text())
    assert (settings["generation.temperature"], settings["generation.top_p"]) == (0.0, 1.0)
    sampling = tmp_path / "sampling.yaml"
    sampling.write_text("generation:\n  temperature: 0.7\n  top_p: 0.9\n")
    capsys.readouterr()
    assert _run("videomme", data, out, "--config", str(sampling)) == 2
    err = capsys.readouterr().err
    assert "generation.temperature 0.0 (now 0.7)" in err and "generation.top_p 1.0 (now 0.9)" in err, err
    assert len(asks) == 1
    for key in ("generation.temperature", "generation.top_p"):
        del settings[key]  # as edgekv wrote run.json before
    (out / "run.json").write_text(json.dumps(settings))
    assert _run("videomme", data, out) == 0 and len(asks) == 2
    assert json.loads((out / "run.json").read_text())["generation.temperature"] == 0.0
