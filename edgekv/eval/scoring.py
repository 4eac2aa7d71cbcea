"""How ``eval videoqa`` reads a reply: each benchmark's own rule under ``--prompt-style official``, edgekv's
first-letter rule under ``--prompt-style infinipot_v``, and token F1 for open-ended questions
(``edgekv/eval/open_ended.py``).

Each rule below was read from the benchmark's own scoring code (the rules are restated here in our words and
implemented anew; repository @ commit, file, function):

* ``mlvu`` — JUNJIE99/MLVU @ fd060c10a43e, ``evaluation/multiple_choice_evaluation/choice_bench.py``, ``check_ans``:
  when the reply has a ``)``, the prediction is the one character just before the first ``)``; otherwise the
  prediction is the whole reply. Correct when the prediction equals the key's letter. MLVU's run of it
  (``evaluation/models/videochat2/choice_bench.py``) primes the assistant's turn with ``Best option:(`` and passes
  the model's continuation alone, stripped (its ``answer`` decodes only the new tokens), so ``C) the car`` and ``C``
  are right and ``Best option: C`` is not; that run's ``check_ans`` keeps everything before the ``)``, which gives
  the same letter whenever the continuation starts with it, as the primer makes it. Here the reply read is the
  continuation after ``answer_prefix``, stripped.
* ``videomme`` — Video-MME's README (BradyFU/Video-MME @ 8889f31, "Evaluation") points to
  thanku-all/parse_answer @ afd52cf, ``eval_your_results.py``, ``extract_characters_regex``: the reply stripped,
  a list of answer phrases deleted wherever they occur ("The best answer is", "The correct answer is", "The answer
  is", "The answer", "Answer:", "Option:", "The correct answer", "The correct option"; two more entries of that list
  are each glued to the next by a missing comma, so only the glued strings are deleted — kept so here), then the
  first capital A-D anywhere in what is left, or none. That script leaves a reply with none out of the accuracy's
  denominator; here it is wrong and counted (``no_letter``), as for every rule.
* ``ovobench`` — JoeLeelyf/OVO-Bench @ c34093f9a072, ``utils/OVOBenchScore.py``,
  ``calculate_score_backward_realtime``: correct when the key's capital letter (``chr(65 + gt)``, from
  ``utils/OVOBench.py``) occurs anywhere in the reply. Nothing is extracted; what is kept as ``predicted`` is the
  option letters that occur in the reply, in order of first occurrence.
* ``ovobench_rec`` / ``ovobench_yes_no`` — OVO-Bench's Forward Active Responding asks (one test time each), the
  same file and commit, ``calculate_score_forward``. REC: every run of digits in the reply, joined, equal to the
  count as written (``2`` right for 2; ``2 or 3`` reads ``23``; a number in words reads nothing). SSR and CRR: a
  reply that is exactly ``Y`` (key Yes) or ``N`` (key No) is right; otherwise right when the key's word, ``Yes`` or
  ``No``, occurs anywhere in the reply, case as written (so ``Not yet`` is a No and ``Yes, no`` both).
  ``predicted`` keeps what the rule read: the digits, or the words found in order of first occurrence joined by
  ``/``. Each test time is one ask, scored alone; OVO-Bench pools them into its task's accuracy.
* ``streamingbench`` — THUNLP-MT/StreamingBench @ 89299232c4cc, ``src/data/count.py`` (``count``, the real-time
  branch): the reply's first character, as is (not stripped), compared with the key.
* ``first_letter`` — edgekv's: the first option letter standing alone in the reply (``A``, ``(B)``, ``C.``,
  ``[D]``; ``extract_letter``), the rule of every dataset before the official rules, kept for InfiniPot-V's format.
* ``token_f1`` — open-ended questions under either style (``edgekv/eval/open_ended.py``).

The same reply is read differently by these rules: ``Based on it, C`` is B for Video-MME and StreamingBench (the
``B`` of "Based"), C for the first-letter rule, the whole reply for MLVU (so never right), and right for OVO-Bench
when the key is B or C. A key that is no letter (an MLVU answer that is none of its candidates) is never right.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from edgekv.eval import open_ended
from edgekv.eval.qa_item import LETTERS
from edgekv.eval.streaming_sets import OVO_FORWARD

FIRST_LETTER = "first_letter"
TOKEN_F1 = "token_f1"
OFFICIAL_CHOICE_RULES = {"mlvu": "mlvu", "videomme": "videomme", "ovobench": "ovobench",
                         "streamingbench": "streamingbench"}
# OVO-Bench's forward tasks, by task: a count (REC) or Yes / No (SSR, CRR), official style only
OVOBENCH_FORWARD_RULES = {"REC": "ovobench_rec", "SSR": "ovobench_yes_no", "CRR": "ovobench_yes_no"}
# the rule that scored a line of results.jsonl written before lines named theirs, by open-endedness
EARLIER_RULES = {False: FIRST_LETTER, True: TOKEN_F1}

# the entries of Video-MME's list as the interpreter joins them (a missing comma glues two strings into one)
_VIDEOMME_PHRASES = ("The best answer is", "The correct answer is", "The answer is", "The answer",
                     "The best option isThe correct option is", "Best answer:Best option:", "Answer:", "Option:",
                     "The correct answer", "The correct option")


def extract_letter(reply: str, options: int = 4) -> str:
    """The first option letter in a reply (``A``, ``(B)``, ``C.``, ``[D]``); ``""`` when there is none, which is
    never correct and is counted (``no_letter`` in the summary). InfiniPot-V's current ``extract_answer`` scores such
    a reply wrong; its older script read it as C, a free 1-in-4 guess."""
    valid = LETTERS[:options]
    found = re.findall(rf"[\(\[\s]*([{valid}])(?:[\)\]\.\s:,]|$)", reply.replace("Answer", "").strip())
    return found[0] if found else ""


def mlvu_prediction(reply: str) -> str:
    """What MLVU's ``check_ans`` compares with the key: the character before the reply's first ``)``, else the
    whole (stripped) reply."""
    reply = reply.strip()
    close = reply.find(")")
    return reply if close < 0 else reply[close - 1:close]


def videomme_letter(reply: str) -> str:
    """Video-MME's extraction: the first capital A-D once its answer phrases are deleted; ``""`` when none."""
    text = reply.strip()
    for phrase in _VIDEOMME_PHRASES:
        text = text.replace(phrase, "")
    found = re.search("[ABCD]", text)
    return found[0] if found else ""


def ovobench_letters(reply: str, options: int) -> str:
    """The option letters that occur anywhere in the reply, in order of first occurrence (OVO-Bench's rule asks only
    whether the key's is among them)."""
    seen = sorted({reply.find(letter): letter for letter in LETTERS[:options] if letter in reply}.items())
    return "".join(letter for _, letter in seen)


def ovobench_count(reply: str) -> str:
    """What OVO-Bench's REC rule compares with the count: every run of digits in the reply, joined."""
    return "".join(re.findall(r"\d+", reply))


def ovobench_yes_no(reply: str) -> str:
    """What OVO-Bench's SSR / CRR rule finds in a reply: a bare ``Y`` / ``N`` as Yes / No, else the words ``Yes``
    and ``No`` wherever they occur (case as written), in order of first occurrence, joined by ``/``."""
    if reply in ("Y", "N"):
        return "Yes" if reply == "Y" else "No"
    return "/".join(word for _, word in sorted((reply.find(word), word) for word in ("Yes", "No") if word in reply))


@dataclass(frozen=True)
class ChoiceRule:
    """A rule for a short reply (a multiple-choice one, or an OVO-Bench forward count or yes / no): what it reads
    from a reply (``predicted``) and when that is the key."""

    name: str
    describe: str
    read: Callable[[str, int], str]  # (reply, option count) -> predicted
    judge: Callable[[str, str], bool] = lambda predicted, key: bool(key) and predicted == key


CHOICE_RULES = {rule.name: rule for rule in (
    ChoiceRule(FIRST_LETTER, "the first option letter standing alone in the reply (edgekv)", extract_letter),
    ChoiceRule("mlvu", "MLVU's check_ans: the character before the first ')' of the continuation after "
               "'Best option:(', else the whole continuation, equal to the key",
               lambda reply, options: mlvu_prediction(reply)),
    ChoiceRule("videomme", "Video-MME's extract_characters_regex: the first capital A-D after its answer phrases "
               "are deleted", lambda reply, options: videomme_letter(reply)),
    ChoiceRule("ovobench", "OVO-Bench's score: the key's letter anywhere in the reply", ovobench_letters,
               lambda predicted, key: bool(key) and key in predicted),
    ChoiceRule("streamingbench", "StreamingBench's count.py: the reply's first character equal to the key",
               lambda reply, options: reply[:1]),
)}
FORWARD_RULES = {rule.name: rule for rule in (
    ChoiceRule("ovobench_rec", "OVO-Bench's REC score: the reply's digits, joined, equal to the count so far",
               lambda reply, options: ovobench_count(reply)),
    ChoiceRule("ovobench_yes_no", "OVO-Bench's SSR/CRR score: the reply exactly Y / N, or the key's Yes / No "
               "anywhere in it", lambda reply, options: ovobench_yes_no(reply),
               lambda predicted, key: bool(key) and key in predicted.split("/")),
)}
DESCRIPTIONS = {**{name: rule.describe for name, rule in {**CHOICE_RULES, **FORWARD_RULES}.items()},
                TOKEN_F1: f"token F1 >= {open_ended.CORRECT_F1} against the reference (edgekv/eval/open_ended.py)"}


def rule_for(dataset: str, style: str, open_ended_question: bool, task: str | None = None) -> str:
    """The rule that scores a reply of ``dataset`` asked in prompt ``style`` (``task``: the question's, which picks
    OVO-Bench's forward rules)."""
    if dataset == "ovobench" and task in OVO_FORWARD:
        if style != "official":
            raise ValueError(f"OVO-Bench's forward task {task} is scored in the official style only")
        return OVOBENCH_FORWARD_RULES[task]
    if open_ended_question:
        return TOKEN_F1
    if style == "official":
        if dataset not in OFFICIAL_CHOICE_RULES:
            raise ValueError(f"dataset {dataset!r} has no official multiple-choice scoring rule here")
        return OFFICIAL_CHOICE_RULES[dataset]
    return FIRST_LETTER


def score(rule: str, reply: str, key: str, options: int) -> dict:
    """The fields ``results.jsonl`` keeps of one reply's score: ``scored_by`` and, for a multiple-choice or an
    OVO-Bench forward rule, ``predicted`` (what the rule read) and ``correct``; for ``token_f1``, ``f1``, ``exact``
    and ``correct``."""
    if rule == TOKEN_F1:
        return {"scored_by": rule, **open_ended.score(reply, key)}
    choice = CHOICE_RULES[rule] if rule in CHOICE_RULES else FORWARD_RULES[rule]
    predicted = choice.read(reply, options)
    return {"scored_by": rule, "predicted": predicted, "correct": choice.judge(predicted, key)}


def has_no_letter(predicted: str) -> bool:
    """A multiple-choice rule read no option letter (``no_letter`` in the summary): nothing, or not letters."""
    return not predicted or any(char not in LETTERS for char in predicted)
