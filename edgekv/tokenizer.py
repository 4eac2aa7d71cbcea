"""Text side of a checkpoint: the BPE tokenizer from ``tokenizer.json`` and the Qwen chat layout.

edgekv builds prompts itself instead of rendering the Jinja chat template at run time, because a
stream splits one chat turn in two: the system prefix and ``<|vision_start|>`` are prefilled when the
session starts, each frame pair's tokens follow as they arrive, and only at a question does the rest
of the user turn (``<|vision_end|>question<|im_end|>`` and the assistant header) go in. The pieces
below are the ones Qwen2.5-VL's template produces for a single video followed by text.

User text (a question typed, spoken or sent over HTTP) is encoded as plain text: a user who types
``<|im_end|><|im_start|>system`` gets those characters, never the control tokens that would end their
turn and open a system one (``QwenTokenizer.encode_text``). Only the layout's own pieces are control
tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tokenizers import Tokenizer

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class ChatLayout:
    """Qwen chat-template pieces around a streamed video (Qwen2.5-VL ``chat_template``)."""

    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def stream_prefix(self) -> str:
        return (
            f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n"
            "<|im_start|>user\n<|vision_start|>"
        )

    question_open: ClassVar[str] = "<|vision_end|>"
    question_close: ClassVar[str] = "<|im_end|>\n<|im_start|>assistant\n"

    @staticmethod
    def question_suffix(question: str) -> str:
        return f"{ChatLayout.question_open}{question}{ChatLayout.question_close}"

    def question_suffix_ids(self, tokenizer: "QwenTokenizer", question: str, history: Sequence = ()) -> list[int]:
        """The suffix's ids with the question as plain text and the layout's pieces as control tokens.

        Equal to ``tokenizer.encode(self.question_suffix(question))`` for every question that spells no
        added token (``tokenizers`` splits the text at added tokens and encodes each stretch alone).

        ``history``: earlier turns of the conversation, ``(role, text)`` with role ``user`` or ``assistant``
        (``conversation``), rendered as the chat template renders them after the video — the video is the first
        user turn's, so a first user turn's text follows ``<|vision_end|>`` and every later turn is
        ``<|im_start|>ROLE\nTEXT<|im_end|>\n`` — then the question as the last user turn. Their text is plain
        text too: a turn cannot open another.
        """
        if not history:
            return (tokenizer.encode(self.question_open) + tokenizer.encode_text(question)
                    + tokenizer.encode(self.question_close))
        end = tokenizer.encode("<|im_end|>\n")
        ids = tokenizer.encode(self.question_open)
        turns = [*conversation(history), ("user", question)]
        if turns[0][0] == "user":  # the video's own turn goes on with the first question
            ids += tokenizer.encode_text(turns.pop(0)[1]) + end
        else:  # the conversation starts with the assistant: the video's turn had no text
            ids += end
        for role, text in turns:
            ids += tokenizer.encode(f"<|im_start|>{role}\n") + tokenizer.encode_text(text) + end
        return ids + tokenizer.encode("<|im_start|>assistant\n")


def check_text(where: str, text: str) -> None:
    """``ValueError`` naming ``where`` when ``text`` holds a lone UTF-16 surrogate (``"\\ud800"``, from a JSON
    escape or a broken UTF-16 decode): it has no UTF-8 spelling, so no tokens, and the tokenizer's own
    ``UnicodeEncodeError`` named no argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: contains a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x} at character "
                         f"{exc.start}): not valid Unicode, so it cannot be tokenized") from None


MAX_TURNS = 64  # earlier turns a question may carry (each one's tokens count against the text reserve as well)


def conversation(history) -> list[tuple[str, str]]:
    """``history`` as ``[(role, text), ...]``: each turn a ``(role, text)`` pair or an OpenAI-style message
    ``{"role": ..., "content": "..."}``; role ``user`` or ``assistant``, text a string (an assistant's may be
    empty). ``ValueError`` naming the turn otherwise."""
    if isinstance(history, (str, bytes)) or not hasattr(history, "__iter__"):
        raise ValueError(f"history: expected a list of (role, text) turns, got {type(history).__name__}")
    turns = []
    for index, turn in enumerate(history):
        if isinstance(turn, dict):
            role, text = turn.get("role"), turn.get("content")
        elif isinstance(turn, (tuple, list)) and len(turn) == 2:
            role, text = turn
        else:
            raise ValueError(f"history[{index}]: expected (role, text) or {{'role': ..., 'content': ...}}, "
                             f"got {turn!r:.80}")
        if role not in ("user", "assistant"):
            raise ValueError(f"history[{index}]: role must be 'user' or 'assistant', got {role!r:.40}")
        if not isinstance(text, str) or (role == "user" and not text.strip()):
            what = "a user turn's text must be a non-empty" if role == "user" else "an assistant turn's text must be a"
            raise ValueError(f"history[{index}]: {what} string, got {text!r:.80}")
        check_text(f"history[{index}]", text)
        turns.append((role, text))
    if len(turns) > MAX_TURNS:
        raise ValueError(f"history: {len(turns)} turns, at most {MAX_TURNS}")
    return turns


@functools.lru_cache(maxsize=2)
def _parsed(path: str, stamp: tuple[int, int, int, int]) -> Tokenizer:
    """``path`` parsed once per process while ``stamp`` (device, inode, size, mtime) stays the same: Qwen's
    11 MB tokenizer.json takes 0.4-0.7 s to parse on the 2-core machine, and an eval or a bench loads a runtime
    per configuration. At most two are kept (a parsed Qwen tokenizer holds about 90 MB). Shared read-only:
    nothing here changes a loaded tokenizer (its truncation, padding or pipeline), and its encode/decode are
    safe from several threads."""
    return Tokenizer.from_file(path)


class QwenTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer``: no network, no transformers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.im_end_id = self._required_id("<|im_end|>")
        self.endoftext_id = self._required_id("<|endoftext|>")
        # Every added token (special or not) and the stop tokens: ids user text must never produce.
        self.control_ids = frozenset(tokenizer.get_added_tokens_decoder()) | {self.im_end_id, self.endoftext_id}
        unk = getattr(tokenizer.model, "unk_token", None)
        self._unk_id = tokenizer.token_to_id(unk) if isinstance(unk, str) else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "QwenTokenizer":
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model directory")
        stat = path.stat()
        try:
            return cls(_parsed(str(path.resolve()), (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise ValueError(f"{path}: not a readable tokenizer.json ({exc})") from exc

    def _required_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token!r} token; is this a Qwen tokenizer?")
        return token_id

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        # Qwen adds no BOS; special tokens written in the text are matched as added tokens.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: the normalizer, pre-tokenizer and model of ``tokenizer.json`` without the
        added-token matching that ``encode`` does first, so ``<|im_end|>`` typed by a user becomes the
        ordinary tokens of those characters. Works for byte-level BPE (Qwen) and word-level files alike.

        A pre-tokenized piece whose model tokens include a control id (a word-level vocabulary that also
        lists the special tokens as words) is spelled character by character instead; a character that is
        itself a control token becomes the unknown token (or is dropped when the model has none).
        """
        tok = self._tok
        normalized = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
        if tok.pre_tokenizer is not None:
            pieces = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(normalized)]
        else:
            pieces = [normalized] if normalized else []
        ids: list[int] = []
        for piece in pieces:
            piece_ids = self._model_ids(piece)
            if self.control_ids.isdisjoint(piece_ids):
                ids += piece_ids
                continue
            for char in piece:
                for token_id in self._model_ids(char):
                    if token_id not in self.control_ids:
                        ids.append(token_id)
                    elif self._unk_id is not None and self._unk_id not in self.control_ids:
                        ids.append(self._unk_id)
        return ids

    def _model_ids(self, piece: str) -> list[int]:
        return [token.id for token in self._tok.model.tokenize(piece)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.im_end_id, self.endoftext_id})
