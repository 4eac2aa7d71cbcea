"""The toy model's word-level ``tokenizer.json``: every word the questions, answers and Qwen's chat
layout use, plus Qwen2.5's special tokens (same strings, same order, new ids after the words).

The words of the question families added later (``EXTRA_FAMILIES``: where, second, binding) take the
ids after the special tokens (``extra_words``), so every id a checkpoint trained before them uses means
what it meant: such a checkpoint loads and trains on (``train-toy --init``) with the new questions, its
padding rows of the embedding becoming the new words.

Words are lower-cased and split on whitespace and punctuation; a newline is a token of its own (the
chat layout's ``<|im_start|>user\\n`` keeps its shape). Anything else is ``<unk>``. The file is an
ordinary ``tokenizers`` file, so ``edgekv.tokenizer.QwenTokenizer`` and transformers'
``PreTrainedTokenizerFast`` both read it; the session code runs unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from edgekv.toy.questions import COUNT_WORDS, EXTRA_FAMILIES, FAMILIES, TEMPLATES, WHERE_WORDS
from edgekv.tokenizer import DEFAULT_SYSTEM_PROMPT
from edgekv.video.events import COLORS, SHAPES

UNK = "<unk>"
# Qwen2.5's special tokens in their released order (ids 151643.. there; after the words here).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)
# A word, a number, one punctuation mark, or a newline; everything else (spaces) separates.
WORD_PATTERN = r"\n|[a-z]+|[0-9]+|[^\sa-z0-9]"


def words() -> list[str]:
    """The vocabulary's ordinary words, in id order: unk, newline, chat words, then the task words."""
    found: list[str] = [UNK, "\n"]

    def add(text: str) -> None:
        for word in _split(text):
            if word not in found:
                found.append(word)

    add(DEFAULT_SYSTEM_PROMPT)
    add("system user assistant")
    for family in FAMILIES:
        add(TEMPLATES[family].format(shape="", color="", a="", b=""))
    add(" ".join(SHAPES + COLORS + COUNT_WORDS) + " yes no")
    return found


def extra_words() -> list[str]:
    """The words only the extra question families use, in id order (their ids follow the special tokens)."""
    base = set(words())
    found: list[str] = []
    for text in [TEMPLATES[f].format(shape="", color="", a="", b="") for f in EXTRA_FAMILIES] + list(WHERE_WORDS):
        for word in _split(text):
            if word not in base and word not in found:
                found.append(word)
    return found


def _split(text: str) -> list[str]:
    return re.findall(WORD_PATTERN, text.lower())


def build_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    """The tokenizer and the ids of the special tokens."""
    vocab = {word: index for index, word in enumerate(words())}
    special = {token: len(vocab) + index for index, token in enumerate(SPECIAL_TOKENS)}
    extra = {word: len(vocab) + len(special) + index for index, word in enumerate(extra_words())}
    tokenizer = Tokenizer(models.WordLevel(vocab={**vocab, **special, **extra}, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="removed", invert=True)
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # words joined by spaces, "a ?" -> "a?"
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer, special


def write_tokenizer_files(out: Path, chat_template: str, max_length: int) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json and chat_template.json into ``out``; returns the special ids."""
    tokenizer, special = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": "Qwen2_5_VLProcessor",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": UNK,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "model_max_length": max_length,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}, indent=2))
    return special
