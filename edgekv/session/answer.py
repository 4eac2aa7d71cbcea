"""Answer: a question prefilled over the whole capped cache (and, with an archive, the pairs it recalls),
then decoded token by token; the question and answer tokens are dropped afterwards, so the next frame
continues the video as if no one had asked (DESIGN: "question tokens dropped"; invariant 3: nothing the
cache keeps depends on a question)."""

from __future__ import annotations

import time

import torch

from edgekv.cache.capped import ChunkMeta, SlotKind
from edgekv.model.rope import text_position_ids
from edgekv.session.results import Answer


class Answerer:
    """The question side of a ``StreamSession`` (which calls it under its lock)."""

    def __init__(self, session) -> None:
        self.session = session
        self.video_length: int | None = None  # while answering: the cache's length before the question

    def ask(self, question: str, max_new_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, seed: int | None = None, on_token=None, recall: bool | None = None) -> Answer:
        """Answer a question about everything the cache holds; the cache is unchanged afterwards.

        ``recall`` (default ``archive.recall`` when an archive is configured, else off): first bring back the
        archived frame pairs the question points at into the retrieval reserve (edgekv/archive/recall.py).
        """
        s = self.session
        gen = s.config.generation
        max_new_tokens = gen.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = gen.temperature if temperature is None else temperature
        top_p = gen.top_p if top_p is None else top_p
        if recall is None:
            recall = s.recall is not None and s.config.archive.recall
        if recall and s.recall is None:
            raise ValueError("recall=True needs an archive: set archive.dir in the config")
        ids = self.question_ids(question, max_new_tokens, temperature, top_p,
                                reserved=s.recall_reserve if recall else 0)
        video_len = s.cache.length
        self.video_length = video_len
        recalled = ()
        generator = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
        started = time.perf_counter()
        out: list[int] = []
        finish = "length"
        try:
            with torch.inference_mode():
                positions = text_position_ids(self.text_start(), len(ids)).to(s.device)
                embeds = s.embed(ids)
                if recall:
                    recalled = s.recall.recall(embeds, positions).unique_pairs
                hidden = s.prefill(embeds, positions, ChunkMeta(SlotKind.TEXT, tpos=positions[0]),
                                   visible=self._answer_visible(recall))
                position = self.text_start() + len(ids)
                logits = s.llm.logits(hidden[-1])
                ttft = None
                decode_start = time.perf_counter()
                for step in range(max_new_tokens):
                    token = sample(logits, temperature, top_p, generator)
                    if ttft is None:
                        ttft = time.perf_counter() - started
                        decode_start = time.perf_counter()
                    if token in s.tokenizer.stop_ids:
                        finish = "stop"
                        break
                    out.append(token)
                    if on_token is not None:
                        on_token(token)
                    if step == max_new_tokens - 1:
                        break
                    pos = text_position_ids(position, 1).to(s.device)
                    hidden = s.prefill(s.embed([token]), pos, ChunkMeta(SlotKind.TEXT, tpos=pos[0]),
                                       visible=self._answer_visible(recall))
                    position += 1
                    logits = s.llm.logits(hidden[-1])
                decode_s = time.perf_counter() - decode_start
        finally:
            used = max(s.cache.length, video_len + len(ids) + (s.recall_reserve if recall else 0))
            s.cache.truncate(video_len)
            self.video_length = None
            if recall:
                s.recall.clear(video_len, used)
        s.counters.questions += 1
        s.counters.answer_tokens += len(out)
        ttft = ttft if ttft is not None else time.perf_counter() - started
        rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0
        return Answer(s.tokenizer.decode(out), out, ttft, rate, len(ids), video_len, finish, recalled)

    def text_start(self) -> int:
        """Position of the first text token after the video (``model.text_after_video``).

        ``qwen``: the largest position used so far + 1 (Qwen2.5-VL's reference ``get_rope_index`` and
        transformers 4.x). ``transformers-5``: video start + max(grid h, grid w), ignoring time, which is
        what transformers 5.x computes — kept so that streaming can be checked against that oracle.
        """
        s = self.session
        if s.config.model.text_after_video == "transformers-5" and s.grid is not None:
            return s.video_start + max(s.grid)
        return s.next_position

    def question_logits(self, question: str, recall: bool = False) -> torch.Tensor:
        """Logits [n, V] at every token of the question suffix, over the cache as it is; nothing kept.

        The parity surface for streaming exactness: equals transformers' one-shot logits at the same
        tokens for the same video and question when nothing was evicted. ``recall``: as in ``ask``.
        """
        s = self.session
        if recall and s.recall is None:
            raise ValueError("recall=True needs an archive: set archive.dir in the config")
        ids = self.question_ids(question, 1, 0.0, 1.0, reserved=s.recall_reserve if recall else 0)
        video_len = s.cache.length
        try:
            with torch.inference_mode():
                positions = text_position_ids(self.text_start(), len(ids)).to(s.device)
                embeds = s.embed(ids)
                if recall:
                    s.recall.recall(embeds, positions)
                hidden = s.prefill(embeds, positions, ChunkMeta(SlotKind.TEXT, tpos=positions[0]),
                                   visible=self._answer_visible(recall))
                return s.llm.logits(hidden).float()
        finally:
            used = max(s.cache.length, video_len + len(ids) + (s.recall_reserve if recall else 0))
            s.cache.truncate(video_len)
            if recall:
                s.recall.clear(video_len, used)

    def _answer_visible(self, recall: bool) -> torch.Tensor | None:
        """With recall: hide the cache's kept copies of the pairs recalled whole (edgekv/archive/recall.py)."""
        s = self.session
        return s.recall.visible(s.cache.length) if recall else None

    def question_ids(self, question: str, max_new_tokens: int, temperature: float, top_p: float,
                     reserved: int = 0) -> list[int]:
        s = self.session
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question must be a non-empty string, got {question!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not 0.0 <= float(temperature) <= 10.0:
            raise ValueError(f"temperature must be in [0, 10], got {temperature}")
        if not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        ids = s.layout.question_suffix_ids(s.tokenizer, question)  # the question as plain text
        room = s.capacity - s.cache.length - reserved
        if len(ids) + max_new_tokens > room:
            raise ValueError(
                f"question ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the {room} free slots "
                f"(cache.text_reserve_tokens={s.text_reserve}); shorten the question, lower max_new_tokens, "
                f"or raise cache.text_reserve_tokens"
            )
        return ids

    # ------------------------------------------------------------------ persistence


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling over the temperature-scaled distribution."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        return int(order[torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))
