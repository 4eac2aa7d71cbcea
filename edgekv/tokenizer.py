"""Text side of a checkpoint: the BPE tokenizer from ``tokenizer.json`` and the Qwen chat layout.

edgekv builds prompts itself instead of rendering the Jinja chat template at run time, because a
stream splits one chat turn in two: the system prefix and ``<|vision_start|>`` are prefilled when the
session starts, each frame pair's tokens follow as they arrive, and only at a question does the rest
of the user turn (``<|vision_end|>question<|im_end|>`` and the assistant header) go in. The pieces
below are the ones Qwen2.5-VL's template produces for a single video followed by text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    @staticmethod
    def question_suffix(question: str) -> str:
        return f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"


class QwenTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer``: no network, no transformers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.im_end_id = self._required_id("<|im_end|>")
        self.endoftext_id = self._required_id("<|endoftext|>")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "QwenTokenizer":
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model directory")
        try:
            return cls(Tokenizer.from_file(str(path)))
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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.im_end_id, self.endoftext_id})
