"""A deterministic stand-in for the LLM judge that scores open-ended video QA (RVS-Ego / RVS-Movie).

The papers that report RVS (Flash-VStream, arXiv 2406.08085; ReKV, ICLR 2025, seed 001) score each reply with
GPT-3.5 (Video-ChatGPT's protocol: the judge says yes/no and gives a 0-5 score for how well the reply matches
the reference). No judge can run here, and a judge's verdicts drift with its version, so ``eval videoqa``
scores open-ended replies with the token overlap of extractive QA instead (SQuAD v1.1's metric: Rajpurkar et
al., "SQuAD: 100,000+ Questions for Machine Comprehension of Text", EMNLP 2016, section 5):

    normalize(s) = lower case, punctuation removed, the articles a / an / the removed, whitespace collapsed
    F1           = 2 P R / (P + R),  P = |pred ∩ ref| / |pred|,  R = |pred ∩ ref| / |ref|  (token multisets)
    exact match  = normalize(pred) == normalize(ref)
    correct      = F1 >= 0.5  (the binary outcome the accuracy and its Wilson interval count)

These are NOT the papers' figures and cannot be compared with them: token overlap misses paraphrases the
judge accepts ("a mug" for "a cup") and accepts word salad that shares the reference's words. What it can
do, and what the harness uses it for, is compare cache policies and budgets against each other on the same
replies-to-reference scale, with no network and the same number every run. A judge can be run later on the
``reply`` and ``answer`` fields of ``results.jsonl``.
"""

from __future__ import annotations

import re
import string
from collections import Counter

CORRECT_F1 = 0.5
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style token F1 of two strings after ``normalize``; 1.0 when both are empty, 0.0 when one is."""
    predicted, expected = normalize(prediction).split(), normalize(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def score(reply: str, reference: str) -> dict:
    """``{"f1", "exact", "correct"}`` for one reply (the fields ``results.jsonl`` stores per open-ended item)."""
    f1 = token_f1(reply, reference)
    return {"f1": round(f1, 4), "exact": normalize(reply) == normalize(reference), "correct": f1 >= CORRECT_F1}
