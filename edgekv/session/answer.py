"""Answer: a question prefilled over the whole capped cache (and, with an archive, the pairs it recalls),
then decoded token by token; the question and answer tokens are dropped afterwards, so the next frame
continues the video as if no one had asked (DESIGN: "question tokens dropped"; invariant 3: nothing the
cache keeps depends on a question)."""

from __future__ import annotations

import math
import numbers
import time

import numpy as np
import torch

from edgekv.cache.capped import ChunkMeta, SlotKind
from edgekv.model.rope import text_position_ids
from edgekv.session.clock import real_seconds
from edgekv.session.results import Answer, YesNo
from edgekv.tokenizer import check_text

YES_WORDS = ("yes", "Yes", " yes", " Yes")
NO_WORDS = ("no", "No", " no", " No")


class WindowEmpty(ValueError):
    """A question's window holds no frame pair: none kept in the cache (nor, with recall, brought back)."""


class Answerer:
    """The question side of a ``StreamSession`` (which calls it under its lock)."""

    def __init__(self, session) -> None:
        self.session = session
        self._mass: torch.Tensor | None = None  # [layers, kv_heads, M] fp32, allocated at the first probe
        self._yes_no: tuple[list[int], list[int]] | None = None
        self.video_length: int | None = None  # while answering: the cache's length before the question
        self._window: torch.Tensor | None = None  # while answering with a window: its visible mask (capacity)

    def probe(self, question: str, window: tuple[float, float] | None = None) -> YesNo:
        """A yes/no question answered by one prefill of its tokens over the cache: P(yes) among the model's
        yes/no tokens at the first answer position, and the attention mass each kept frame pair drew (summed
        over layers, KV heads and the question's tokens). No token is decoded and the question's slots are
        dropped afterwards: the cache is exactly as before (DESIGN invariant 3). ``window``: only the frame
        pairs stamped in it are read, as ``ask``'s (``WindowEmpty`` when none is held)."""
        s = self.session
        started = time.perf_counter()
        yes_ids, no_ids = self._yes_no_ids()
        window = checked_window(window)
        ids = self.question_ids(question, 1, 0.0, 1.0)
        video_len = s.cache.length
        if window is not None and not self._window_pairs(video_len, window):
            raise WindowEmpty(self._nothing_held(window))
        self.video_length = video_len
        try:
            with torch.inference_mode():
                positions = text_position_ids(self.text_start(), len(ids)).to(s.device)
                if window is not None:
                    self._window = self._window_mask(video_len, window, False)
                hidden = s.prefill(s.embed(ids), positions, ChunkMeta(SlotKind.TEXT, tpos=positions[0]),
                                   visible=self._answer_visible(False), mass_out=self._mass_buffer())
                logits = s.llm.logits(hidden[-1]).float()
                both = torch.log_softmax(logits, dim=-1)
                yes = torch.logsumexp(both[yes_ids], dim=0)
                no = torch.logsumexp(both[no_ids], dim=0)
                p_yes = float(torch.sigmoid(yes - no))
                pair_mass = self._pair_mass(video_len)
        finally:
            s.cache.truncate(video_len)
            self.video_length = None
            self._window = None
        s.counters.probes += 1
        return YesNo(p_yes, pair_mass, (time.perf_counter() - started) * 1e3, len(ids))

    def _mass_buffer(self) -> torch.Tensor:
        """[layers, kv_heads, M] fp32 attention mass of a question's prefill, allocated at the first use."""
        if self._mass is None:
            cache = self.session.cache
            self._mass = torch.zeros(cache.num_layers, cache.kv_heads, cache.capacity, dtype=torch.float32,
                                     device=self.session.device)
        return self._mass

    def _pair_mass(self, video_len: int) -> dict[int, float]:
        cache = self.session.cache
        mass = self._mass[:, :, :video_len]
        vision = cache.kind[:, :, :video_len] == int(SlotKind.VISION)
        frames = cache.frame[:, :, :video_len][vision].long()
        if frames.numel() == 0:
            return {}
        totals = torch.zeros(int(frames.max()) + 1, dtype=torch.float64, device=mass.device)
        totals.index_add_(0, frames, mass[vision].double())
        share = totals / max(float(mass.sum()), 1e-30)
        present = torch.unique(frames)
        return {int(pair): float(share[pair]) for pair in present}

    def _yes_no_ids(self) -> tuple[list[int], list[int]]:
        """The tokens that start a "yes" and a "no" answer in this vocabulary (one token each)."""
        if self._yes_no is None:
            tokenizer = self.session.tokenizer

            def single(words: tuple[str, ...]) -> list[int]:
                ids = {tuple(tokenizer.encode(word)) for word in words}
                return sorted({i[0] for i in ids if len(i) == 1 and i[0] not in tokenizer.control_ids})

            yes_ids, no_ids = single(YES_WORDS), single(NO_WORDS)
            if not yes_ids or not no_ids:
                raise ValueError("this model's tokenizer has no single-token 'yes' and 'no': yes/no probes "
                                 "(standing questions) need them")
            self._yes_no = (yes_ids, no_ids)
        return self._yes_no

    def ask(self, question: str, max_new_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, seed: int | None = None, on_token=None, recall: bool | None = None,
            evidence: int = 0, history=(), window: tuple[float, float] | None = None,
            answer_prefix: str = "") -> Answer:
        """Answer a question about everything the cache holds; the cache is unchanged afterwards.

        ``recall`` (default ``archive.recall`` when an archive is configured, else off): first bring back the
        archived frame pairs the question points at into the retrieval reserve (edgekv/archive/recall.py).
        ``evidence``: also name the frame pairs the question attended most (at most that many; the question's
        prefill then records each key's attention mass, as ``probe`` does). ``Answer.confidence`` is the
        geometric mean of the answer tokens' probabilities under the model (temperature 1).
        ``answer_prefix``: text that starts the assistant's turn, so the model continues it (MLVU's evaluation
        primes each reply with ``Best option:(``): its tokens (plain text, as the question's) follow the template's
        assistant header and are prefilled with the question. ``Answer.text`` and ``Answer.token_ids`` are the
        continuation only — what the model generated, as transformers' ``generate`` returns after its input ids —
        so the whole assistant turn is ``answer_prefix + Answer.text``; ``prompt_tokens`` counts the prefix's.
        """
        s = self.session
        gen = s.config.generation
        max_new_tokens = gen.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = gen.temperature if temperature is None else temperature
        top_p = gen.top_p if top_p is None else top_p
        if recall is None:
            recall = s.recall is not None and s.config.archive.recall
        if not isinstance(recall, (bool, np.bool_)):  # recall="no" was truthy: recall on
            raise ValueError(f"recall must be True, False or None, got {recall!r:.40}")
        recall = bool(recall)
        if recall and s.recall is None:
            raise ValueError("recall=True needs an archive: set archive.dir in the config")
        if not isinstance(evidence, numbers.Integral) or isinstance(evidence, bool) or evidence < 0:
            raise ValueError(f"evidence must be a whole number of frame pairs >= 0, got {evidence!r}")
        window = checked_window(window)
        seed = checked_seed(seed)
        ids = self.question_ids(question, max_new_tokens, temperature, top_p,
                                reserved=s.recall_reserve if recall else 0, history=history,
                                answer_prefix=answer_prefix)
        temperature, top_p = float(temperature), float(top_p)
        max_new_tokens = int(max_new_tokens)
        video_len = s.cache.length
        if window is not None and not recall and not self._window_pairs(video_len, window):
            raise WindowEmpty(self._nothing_held(window))
        self.video_length = video_len
        self._window = None
        recalled = ()
        pairs: tuple[int, ...] = ()
        logprob = 0.0
        generator = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
        started = time.perf_counter()
        out: list[int] = []
        finish = "length"
        try:
            with torch.inference_mode():
                positions = text_position_ids(self.text_start(), len(ids)).to(s.device)
                embeds = s.embed(ids)
                if recall:
                    recalled = s.recall.recall(embeds, positions, window=window).unique_pairs
                if window is not None:
                    self._window = self._window_mask(video_len, window, recall)
                    seen = self._window_pairs(video_len, window) | set(recalled)
                    if not seen:
                        raise WindowEmpty(self._nothing_held(window, recall))
                if evidence:
                    # the evidence is what the token that answers attends to: the question's last row. The rows
                    # before it are prefilled first (causal: the same states), so their mass is left out — the
                    # template's first words spread theirs over every pair (measured, issue 27: a whole-prefill
                    # mass put the world-trained toy's evidence 3-10 pairs off the event it answered about). The
                    # recall mask is taken per chunk: it covers the slots before the chunk's start.
                    if len(ids) > 1:
                        s.prefill(embeds[:-1], positions[:, :-1], ChunkMeta(SlotKind.TEXT, tpos=positions[0][:-1]),
                                  visible=self._answer_visible(recall))
                    hidden = s.prefill(embeds[-1:], positions[:, -1:], ChunkMeta(SlotKind.TEXT, tpos=positions[0][-1:]),
                                       visible=self._answer_visible(recall), mass_out=self._mass_buffer())
                    shares = self._pair_mass(video_len)
                    pairs = tuple(sorted(shares, key=lambda pair: -shares[pair])[:evidence])
                else:
                    hidden = s.prefill(embeds, positions, ChunkMeta(SlotKind.TEXT, tpos=positions[0]),
                                       visible=self._answer_visible(recall))
                position = self.text_start() + len(ids)
                logits = s.llm.logits(hidden[-1])
                # recall and a window hide slots step by step (a mask the graph does not read): then decode eagerly
                graph = s.decode_graph() if not recall and window is None and max_new_tokens > 1 else None
                ttft = None
                decode_start = time.perf_counter()
                for step in range(max_new_tokens):
                    token = sample(logits, temperature, top_p, generator)
                    logprob += float(torch.log_softmax(logits.float(), dim=-1)[token])
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
                    if graph is not None:  # one CUDA graph replay (edgekv/session/decode_graph.py)
                        graph.feed(token, position)
                        logits = graph.step()
                    else:
                        pos = text_position_ids(position, 1).to(s.device)
                        hidden = s.prefill(s.embed([token]), pos, ChunkMeta(SlotKind.TEXT, tpos=pos[0]),
                                           visible=self._answer_visible(recall))
                        logits = s.llm.logits(hidden[-1])
                    position += 1
                decode_s = time.perf_counter() - decode_start
        finally:
            used = max(s.cache.length, video_len + len(ids) + (s.recall_reserve if recall else 0))
            s.cache.truncate(video_len)
            self.video_length = None
            self._window = None
            if recall:
                s.recall.clear(video_len, used)
        s.counters.questions += 1
        s.counters.answer_tokens += len(out)
        ttft = ttft if ttft is not None else time.perf_counter() - started
        rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0
        scored = len(out) + (finish == "stop")  # the end-of-turn token is part of the answer's likelihood
        confidence = math.exp(logprob / scored) if scored else None
        return Answer(s.tokenizer.decode(out), out, ttft, rate, len(ids), video_len, finish, recalled, confidence,
                      pairs, window_pairs=len(seen) if window is not None else None)

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
        self.video_length = video_len
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
            self.video_length = None
            if recall:
                s.recall.clear(video_len, used)

    def _answer_visible(self, recall: bool) -> torch.Tensor | None:
        """With recall: hide the cache's kept copies of the pairs recalled whole (edgekv/archive/recall.py); with
        a window, the question's window mask (``_window_mask``, which has the recall's in it)."""
        s = self.session
        if self._window is not None:
            return self._window[:, :, :s.cache.length]
        return s.recall.visible(s.cache.length) if recall else None

    def _held_pairs(self, video_len: int) -> set[int]:
        """The frame pairs that still have a token in the cache's first ``video_len`` slots."""
        cache = self.session.cache
        vision = cache.kind[:, :, :video_len] == int(SlotKind.VISION)
        return set(torch.unique(cache.frame[:, :, :video_len][vision]).tolist())

    def _window_pairs(self, video_len: int, window: tuple[float, float]) -> set[int]:
        """The frame pairs with a frame in ``window`` that still have a token in the cache."""
        inside = set(self.session.pairs_in(*window))
        return inside & self._held_pairs(video_len) if inside else set()

    def _window_mask(self, video_len: int, window: tuple[float, float], recall: bool) -> torch.Tensor:
        """[L, Hkv, M] bool over the whole capacity, built once per question: every slot but the video slots
        [0, video_len) of a pair stamped outside ``window`` (and, with recall, the kept copies of the pairs it
        brought back); the recalled pairs (chosen inside the window) and the question's slots stay visible."""
        s, cache = self.session, self.session.cache
        visible = torch.ones(cache.num_layers, cache.kv_heads, cache.capacity, dtype=torch.bool, device=cache.device)
        if recall and s.recall.hidden is not None:
            visible[:, :, :cache.length] = s.recall.visible(cache.length)
        inside = s.pairs_in(*window)
        frames = cache.frame[:, :, :video_len]
        outside = (cache.kind[:, :, :video_len] == int(SlotKind.VISION)) & ~torch.isin(
            frames, torch.tensor(inside, dtype=frames.dtype, device=frames.device))
        visible[:, :, :video_len] &= ~outside
        return visible

    def _nothing_held(self, window: tuple[float, float], recall: bool = False) -> str:
        s = self.session
        held = self._held_pairs(s.cache.length)
        times = [t for pair, t in s.pair_times.items() if pair in held]
        span = f"; the cache holds stream seconds {min(times):.1f}-{max(times):.1f}" if times else ""
        how = ("nor did recall find any in the archive" if recall
               else "ask with recall (an archive) to bring them back" if s.recall is not None else "")
        return (f"window {window[0]:g}-{window[1]:g} s: no frame pair of it is in the cache{span}"
                + (f"; {how}" if how else ""))

    def question_ids(self, question: str, max_new_tokens: int, temperature: float, top_p: float,
                     reserved: int = 0, history=(), answer_prefix: str = "") -> list[int]:
        """The question's tokens after the video (``ChatLayout.question_suffix_ids``), then ``answer_prefix``'s
        (``ask``), checked against the free slots; ``ValueError`` naming what is wrong."""
        s = self.session
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question must be a non-empty string, got {question!r}")
        check_text("question", question)
        if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)  # numpy's int64 too
        # a number only: float("0.5") passed the range check and the string then failed in sampling, unnamed
        if not _is_number(temperature) or not 0.0 <= float(temperature) <= 10.0:
            raise ValueError(f"temperature must be a number in [0, 10], got {temperature!r}")
        if not _is_number(top_p) or not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if not isinstance(answer_prefix, str):
            raise ValueError(f"answer_prefix must be a string, got {answer_prefix!r:.40}")
        check_text("answer_prefix", answer_prefix)
        ids = s.layout.question_suffix_ids(s.tokenizer, question, history)  # the question as plain text
        if answer_prefix:  # plain text too: a prefix cannot close the assistant's turn
            ids = ids + s.tokenizer.encode_text(answer_prefix)
        room = s.capacity - s.cache.length - reserved
        if len(ids) + max_new_tokens > room:
            raise ValueError(
                f"question ({len(ids)} tokens{' with its history' if history else ''}"
                f"{' and answer_prefix' if answer_prefix else ''}) + max_new_tokens "
                f"({max_new_tokens}) exceed the {room} free slots "
                f"(cache.text_reserve_tokens={s.text_reserve}); shorten the question, lower max_new_tokens, "
                f"or raise cache.text_reserve_tokens"
            )
        return ids

    # ------------------------------------------------------------------ persistence


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def checked_seed(seed) -> int | None:
    """``seed`` as a Python int in the range torch's generator takes, or ``ValueError`` naming it: a numpy integer
    was a bare ``TypeError: an integer is required``, a float or one past 64 bits a torch error naming no argument."""
    if seed is None:
        return None
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be a whole number, got {seed!r:.40}")
    if not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    return int(seed)


def checked_window(window) -> tuple[float, float] | None:
    """``window`` (stream seconds, ``(from, to)``, both ends included) as floats, or ``ValueError`` naming it."""
    if window is None:
        return None
    try:
        t_from, t_to = window
    except (TypeError, ValueError):
        raise ValueError(f"window: expected (from, to) in stream seconds, got {window!r:.80}") from None
    seconds = []
    for name, value in (("from", t_from), ("to", t_to)):
        second = real_seconds(value)
        if second is None or not math.isfinite(second):
            raise ValueError(f"window {name}: must be a finite number of seconds, got {value!r:.40}")
        seconds.append(second)
    if seconds[0] > seconds[1]:
        raise ValueError(f"window: from ({seconds[0]:g}) is after to ({seconds[1]:g})")
    return seconds[0], seconds[1]


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
