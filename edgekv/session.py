"""StreamSession: ingest a video frame pair by frame pair into the capped cache; answer at any time.

The conversation a session holds is Qwen2.5-VL's chat template for one video, split in time:

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n<|vision_start|>   prefilled at start
    [frame pair 0 tokens][frame pair 1 tokens] ...                                    prefilled per pair
    <|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n{answer}            per ask, then dropped

Positions follow transformers' ``get_rope_index`` for a video: text before the video counts 0..s-1;
frame pair k's tokens get temporal position ``s + floor(seconds_k * tokens_per_second)`` and height /
width positions ``s + row`` / ``s + col`` in the merged grid (``seconds_k`` = time of the pair's first
frame since the stream's first frame; HF computes ``k * second_per_grid * tokens_per_second`` for a
uniformly sampled video, the same number). Text after the video starts at the largest position used
so far plus one. A question's tokens and its answer are removed after the answer, so the next frame
continues the video as if no one had asked (DESIGN: "question tokens dropped").
"""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from edgekv.cache.capped import CacheFullError, CappedKVCache, ChunkMeta, SlotKind
from edgekv.frameskip import StaticPairSkipper
from edgekv.model.rope import text_position_ids, vision_block_position_ids
from edgekv.policies.base import CacheView
from edgekv.policies.statekv import SinkSelector
from edgekv.positions import rotary_inv_freq, squeeze_gaps
from edgekv.tokenizer import ChatLayout

# Beyond 2**42 s (~139,000 years) float64 timestamps step by more than a millisecond.
MAX_ABS_SECONDS = 2.0 ** 42


def _exclusive(method):
    """Run a public session method under the session's lock (see StreamSession's docstring)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class IngestResult:
    """What one ``ingest`` call did. A frame waits for its partner: a pair is the model's unit."""

    frame_index: int
    pair_index: int | None  # the frame pair prefilled by this call, None if the frame is waiting
    tokens_added: int
    ms: float
    vision_ms: float = 0.0
    prefill_ms: float = 0.0
    compression_ms: float = 0.0
    skipped: bool = False  # the pair was a near-duplicate of the last ingested one (video.skip_static)


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]
    ttft_s: float
    decode_tok_s: float
    prompt_tokens: int = 0
    video_tokens: int = 0
    finish_reason: str = "stop"  # "stop" (end-of-turn token) or "length" (max_new_tokens)
    recalled: tuple[int, ...] = ()  # archived frame pairs brought back for this answer (edgekv/archive)


@dataclass
class _Counters:
    frames: int = 0
    frame_pairs: int = 0
    pairs_skipped: int = 0  # near-duplicate pairs never encoded nor prefilled (video.skip_static)
    frames_rejected: int = 0
    compressions: int = 0
    compression_ms_total: float = 0.0
    ingest_ms_total: float = 0.0
    ingest_ms_last: float = 0.0
    questions: int = 0
    answer_tokens: int = 0
    tokens_evicted: int = 0
    extra: dict = field(default_factory=dict)


class StreamSession:
    """One live stream's state. Create it with ``Runtime.session()``.

    Threads: a session may be shared. ``ingest``, ``ask``, ``question_logits``, ``save`` and ``stats``
    each hold the session's lock from start to end, so they run one at a time in call order: a frame
    ingested while another thread is answering waits for the answer, then goes in; nothing is dropped
    and an answer never sees half a frame pair. The lock is re-entrant, so an ``on_token`` callback may
    call ``stats()``; it must not wait for another thread that uses this session (that would deadlock).
    """

    def __init__(self, runtime: "Runtime") -> None:  # noqa: F821 - Runtime imports this module
        self._lock = threading.RLock()
        self.runtime = runtime
        self.model = runtime.model
        self.vision, self.llm = runtime.vision_backend, runtime.llm_backend
        self.tokenizer = runtime.tokenizer
        self.config = runtime.config
        self.device = runtime.device
        self.dtype = runtime.dtype
        text = self.model.config.text
        self.layout = ChatLayout(self.config.model.system_prompt)
        self.policy = runtime.make_policy()
        self.preprocessor = runtime.make_preprocessor()
        self.tokens_per_second = float(self.model.config.vision.tokens_per_second)
        self.merge = self.model.config.vision.spatial_merge_size
        self.inv_freq = rotary_inv_freq(text.head_dim, text.rope_theta, device=self.device)
        self.temporal_section = int(text.mrope_section[0])
        self.sink_budget = int(self.config.cache.sinks)
        # Re-basing (DESIGN invariant 5): once positions pass this mark, a compaction squeezes the gaps
        # between kept frames' temporal positions to at most one nominal pair spacing.
        self.rebase_at = int(self.config.cache.rebase_position or text.max_position_embeddings // 2)
        self.pair_spacing = max(1, round(2.0 / self.config.video.fps * self.tokens_per_second))
        self.t_offset = 0  # subtracted from new frames' temporal positions after re-basing
        self.rebases = 0

        spec = runtime.cache_spec()
        self.capacity = runtime.cache_capacity_tokens(spec)
        self.text_reserve = int(self.config.cache.text_reserve_tokens)
        self.cache = CappedKVCache(spec, self.capacity, device=self.device, compute_dtype=self.dtype,
                                   rope=(self.inv_freq, self.temporal_section))
        if getattr(self.policy, "uses_sinks", False) and self.sink_budget <= 0:
            raise ValueError(f"cache.policy: '{self.policy.name}' needs cache.sinks > 0 (StateKV sink budget B)")
        self.sinks = SinkSelector(self.cache, self.sink_budget) if self.sink_budget > 0 else None
        self.counters = _Counters()
        self.recall = None  # edgekv.archive.recall.Recall when archive.dir is set
        if self.config.archive.dir is not None:
            from edgekv.archive.recall import Recall

            self.recall = Recall(self, self.config.archive)
        skip = self.config.video.skip_static
        self.skipper = StaticPairSkipper(skip.threshold, skip.max_gap_pairs) if skip.enabled else None
        self._pending: tuple[np.ndarray, float] | None = None
        self._t0: float | None = None
        self._last_t: float | None = None
        self.restored_from = None  # edgekv.state.SnapshotInfo when Runtime.restore built this session

        prefix_ids = self.tokenizer.encode(self.layout.stream_prefix())
        self.prefix_tokens = len(prefix_ids)
        self.grid: tuple[int, int] | None = None
        self._check_budget()
        self.video_start = self.prefix_tokens  # HF's st_idx for the video block
        self.next_position = self.video_start
        with torch.inference_mode():
            positions = text_position_ids(0, self.prefix_tokens).to(self.device)
            self._prefill(self._embed(prefix_ids), positions, ChunkMeta(SlotKind.PREFIX, tpos=positions[0]))

    # ------------------------------------------------------------------ budget
    @property
    def video_limit(self) -> int:
        """Slots the prefix and the video may use: the cap less the room kept for a question and, with an
        archive, the retrieval reserve for recalled pairs (DESIGN invariant 10)."""
        return self.capacity - self.text_reserve - self.recall_reserve

    @property
    def recall_reserve(self) -> int:
        return self.recall.reserve_tokens if self.recall is not None else 0

    def _check_budget(self) -> None:
        if self.preprocessor is None:
            return  # the grid is fixed by the first frame; checked then
        per_pair = self.tokens_per_pair
        needed = self.prefix_tokens + 2 * per_pair + self.text_reserve + self.recall_reserve
        if needed > self.capacity:
            recall = (f", the retrieval reserve (archive.top_k={self.recall.top_k} pairs = {self.recall_reserve} "
                      f"tokens)" if self.recall is not None else "")
            raise ValueError(
                f"cache.max_tokens={self.capacity} cannot hold the prefix ({self.prefix_tokens} tokens), two frame "
                f"pairs ({per_pair} tokens each at {self.preprocessor.resolution}) and the text reserve "
                f"({self.text_reserve}){recall}: the minimum is {needed}; raise cache.max_tokens (or max_mib), lower "
                f"video.resolution or cache.text_reserve_tokens"
            )
        self.policy.check(self)

    @property
    def tokens_per_pair(self) -> int:
        return self.preprocessor.tokens_per_pair

    def frames_that_fit(self) -> int:
        per_pair = self.preprocessor.tokens_per_pair
        return 2 * ((self.video_limit - self.prefix_tokens) // per_pair)

    # ------------------------------------------------------------------ ingest
    @_exclusive
    def ingest(self, frame: np.ndarray, t: float | None = None) -> IngestResult:
        """Add one BGR uint8 frame (HxWx3). Every second frame completes a pair that is prefilled.

        Invalid input raises ``ValueError`` before any state changes, so nothing ingested is lost.
        """
        started = time.perf_counter()
        if self.preprocessor is None:
            self.preprocessor = self.runtime.make_preprocessor(frame)
            self._check_budget()
        try:
            self.preprocessor.check_frame(frame)
            t = self._check_time(t)
        except ValueError:
            self.counters.frames_rejected += 1
            raise
        frame_index = self.counters.frames
        if self._pending is None:
            self._pending = (np.array(frame, copy=True), t)
            self.counters.frames += 1
            self._last_t = t
            return IngestResult(frame_index, None, 0, (time.perf_counter() - started) * 1e3)

        first, t_first = self._pending
        if self.skipper is not None and self.skipper.should_skip(first, frame):
            # Nothing is written; the next ingested pair's position comes from its own time, so the
            # positions keep the gap this pair leaves (edgekv/frameskip.py).
            self._pending = None
            self.counters.frames += 1
            self.counters.pairs_skipped += 1
            self._last_t = t
            return IngestResult(frame_index, None, 0, (time.perf_counter() - started) * 1e3, skipped=True)
        result = self._ingest_pair(first, frame, t_first, frame_index, started)
        self._pending = None
        self.counters.frames += 1
        self._last_t = t
        return result

    def _check_time(self, t: float | None) -> float:
        if t is None:
            t = self.counters.frames / float(self.config.video.fps)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(float(t)):
            raise ValueError(f"t must be a finite number of seconds, got {t!r}")
        if abs(float(t)) > MAX_ABS_SECONDS:
            raise ValueError(f"t={t!r}: timestamps must lie within +-{MAX_ABS_SECONDS:.4g} s (beyond, float64 "
                             f"seconds step by more than a millisecond)")
        if self._last_t is not None and float(t) < self._last_t:
            raise ValueError(f"timestamps must not go back in time: got t={t} after t={self._last_t}")
        self._check_position(float(t))
        return float(t)

    @property
    def temporal_position_limit(self) -> int:
        """Largest temporal offset a frame pair may get: the cache keeps positions as int32 (``tpos``),
        and the video start plus a question after the video must still fit below int32's maximum."""
        return int(torch.iinfo(self.cache.tpos.dtype).max) - self.video_start - self.capacity

    def _check_position(self, t: float) -> None:
        """Refuse a timestamp whose temporal position would not fit int32, before any state changes."""
        first = self._t0 if self._t0 is not None else (self._pending[1] if self._pending is not None else t)
        t_pos = math.floor((t - first) * self.tokens_per_second + 1e-9) - self.t_offset
        limit = self.temporal_position_limit
        if t_pos > limit:
            latest = first + (limit + self.t_offset) / self.tokens_per_second
            raise ValueError(
                f"t={t!r} is {t - first:.6g} s after the stream's first frame (t={first!r}): its temporal position "
                f"{t_pos} would pass the limit {limit} of the cache's int32 positions; timestamps must stay "
                f"at or below t={latest:.6g} (seconds since the first frame x {self.tokens_per_second:g} tokens "
                f"per second)"
            )

    def _ingest_pair(self, first: np.ndarray, second: np.ndarray, t_first: float, frame_index: int,
                     started: float) -> IngestResult:
        if self._t0 is None:
            self._t0 = t_first
        if self.recall is not None:
            self.recall.attach()
        pair_index = self.counters.frame_pairs
        with torch.inference_mode():
            pixel_values, grid_thw = self.preprocessor.pair(first, second)
            vision_start = time.perf_counter()
            tokens = self.vision.encode(pixel_values.to(self.device, self.dtype), grid_thw.to(self.device))
            vision_ms = (time.perf_counter() - vision_start) * 1e3
            self.policy.observe_pair(pair_index, tokens)
            grid_h, grid_w = int(grid_thw[0, 1]) // self.merge, int(grid_thw[0, 2]) // self.merge
            self.grid = (grid_h, grid_w)
            compression_ms = self._make_room(tokens.shape[0])  # may re-base positions: compute them after
            t_pos = int(math.floor((t_first - self._t0) * self.tokens_per_second + 1e-9)) - self.t_offset
            positions = vision_block_position_ids(self.video_start, t_pos, grid_h, grid_w).to(self.device)
            prefill_start = time.perf_counter()
            index = torch.arange(tokens.shape[0], device=self.device)
            meta = ChunkMeta(SlotKind.VISION, frame=pair_index, rows=index // grid_w, cols=index % grid_w,
                             tpos=positions[0])
            start = self.cache.length
            if self.sinks is None:
                self._prefill(tokens, positions, meta)
            else:
                self._prefill(tokens, positions, meta, visible=self.sinks.visibility(), mass_out=self.sinks.mass)
                self.sinks.update(start, tokens.shape[0])
            prefill_ms = (time.perf_counter() - prefill_start) * 1e3
            if self.recall is not None:  # before any compaction can move these slots
                self.recall.archive_pair(start, tokens.shape[0], pair_index, t_first, int(positions[0, 0]))
        self.next_position = max(self.next_position, int(positions.max()) + 1)
        self.counters.frame_pairs += 1
        ms = (time.perf_counter() - started) * 1e3
        self.counters.ingest_ms_last = ms
        self.counters.ingest_ms_total += ms
        return IngestResult(frame_index, pair_index, tokens.shape[0], ms, vision_ms, prefill_ms, compression_ms)

    def _make_room(self, num_tokens: int) -> float:
        """Ask the policy to free room for ``num_tokens`` more video tokens; returns the ms it took."""
        if self.cache.length + num_tokens <= self.video_limit:
            return 0.0
        started = time.perf_counter()
        before = self.cache.length
        if not self.policy.evicts:
            raise CacheFullError(
                f"the cache is full: cache.max_tokens={self.capacity} holds the prefix ({self.prefix_tokens} tokens), "
                f"{self.frames_that_fit()} frames ({num_tokens} tokens per frame pair) and the text reserve "
                f"({self.text_reserve}); policy '{self.policy.name}' never evicts. Raise cache.max_tokens (or "
                f"cache.max_mib), lower video.resolution, or choose an evicting policy such as infinipot_v"
            )
        self.policy.compress(self, num_tokens)
        if self.cache.length + num_tokens > self.video_limit:
            raise RuntimeError(f"policy '{self.policy.name}' left {self.cache.length} slots; {num_tokens} do not fit")
        ms = (time.perf_counter() - started) * 1e3
        self.counters.compressions += 1
        self.counters.compression_ms_total += ms
        self.counters.tokens_evicted += before - self.cache.length
        return ms

    # ------------------------------------------------------------------ compaction and positions
    def view(self, recent_pairs: int) -> CacheView:
        """The valid part of the cache, as policies see it."""
        n, cache = self.cache.length, self.cache
        return CacheView(
            k=cache.policy_keys(n), v=cache.policy_values(n), kind=cache.kind[:, :, :n], sink=cache.sink[:, :, :n],
            frame=cache.frame[:, :, :n], row=cache.row[:, :, :n], col=cache.col[:, :, :n],
            tpos=cache.tpos[:, :, :n], grid=self.grid, latest_pair=self.counters.frame_pairs - 1,
            recent_pairs=recent_pairs, tokens_per_pair=self.tokens_per_pair, inv_freq=self.inv_freq,
            temporal_section=self.temporal_section,
        )

    def compact(self, keep: torch.Tensor) -> None:
        """Compact the cache to ``keep`` (policies call this), then re-base positions if they ran high."""
        self.cache.compact(keep)
        if self.next_position > self.rebase_at:
            self.rebase_positions()

    def rebase_positions(self) -> None:
        """Squeeze the temporal positions of kept video tokens; rotate their keys to match.

        Rule (order-preserving, per layer and KV head, since each keeps its own tokens): going back in
        time from the newest kept frame pair, every gap between consecutive distinct temporal positions
        wider than one nominal pair spacing ``G`` is shortened to ``G``; tokens of one pair keep one
        position, and the recent pairs (kept whole, at most ``G`` apart) keep their exact spacing. Then
        every video position shifts down by one common amount so the oldest lands at the video's start,
        and new frames continue right after the newest (``t_offset``). A (layer, head) holding ``k``
        distinct times spans at most ``(k - 1) G`` < ``C G`` positions, whatever the stream length.
        Each key moves by rotating only its temporal M-RoPE pairs by (new - old) — exact, because RoPE
        rotations compose (DESIGN invariant 5). Text after the video starts after the largest position
        in use, as in Qwen's ``get_rope_index``.
        """
        n, cache = self.cache.length, self.cache
        vision = cache.kind[:, :, :n] == int(SlotKind.VISION)  # [L, H, n]
        if not bool(vision.any()):
            return
        old = cache.tpos[:, :, :n].long()
        layers, heads = vision.shape[:2]
        new = squeeze_gaps(old.reshape(layers * heads, n), vision.reshape(layers * heads, n), self.pair_spacing)
        new = new.view(layers, heads, n)
        shift = int(new[vision].min()) - self.video_start
        new = torch.where(vision, new - shift, old)
        cache.retime_(new, self.inv_freq, self.temporal_section)
        self.t_offset += shift
        newest = int(new[vision].max())
        rows, cols = self.grid
        self.next_position = max(newest, self.video_start + max(rows, cols) - 1) + 1
        self.rebases += 1

    # ------------------------------------------------------------------ model plumbing
    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.llm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))

    def _prefill(self, embeds: torch.Tensor, positions: torch.Tensor, meta: ChunkMeta,
                 visible=None, mass_out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the LM over a chunk, writing its K/V at the end of the cache; returns final hidden states."""
        start, num = self.cache.length, embeds.shape[0]
        if start + num > self.capacity:
            raise CacheFullError(f"{num} tokens do not fit: the cache holds {start} of {self.capacity} slots")
        # Metadata first: an 8-bit cache stores keys time-neutral and reads the chunk's tpos as it writes.
        self.cache.write_meta(start, num, meta)
        try:
            hidden = self.llm.prefill(embeds, positions, self.cache, visible=visible, mass_out=mass_out)
        except BaseException:
            self.cache.clear_meta(start, start + num)
            raise
        self.cache.commit(num)
        return hidden

    # ------------------------------------------------------------------ questions
    @_exclusive
    def ask(self, question: str, max_new_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, seed: int | None = None, on_token=None, recall: bool | None = None) -> Answer:
        """Answer a question about everything the cache holds; the cache is unchanged afterwards.

        ``recall`` (default ``archive.recall`` when an archive is configured, else off): first bring back the
        archived frame pairs the question points at into the retrieval reserve (edgekv/archive/recall.py).
        """
        gen = self.config.generation
        max_new_tokens = gen.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = gen.temperature if temperature is None else temperature
        top_p = gen.top_p if top_p is None else top_p
        if recall is None:
            recall = self.recall is not None and self.config.archive.recall
        if recall and self.recall is None:
            raise ValueError("recall=True needs an archive: set archive.dir in the config")
        ids = self._question_ids(question, max_new_tokens, temperature, top_p,
                                 reserved=self.recall_reserve if recall else 0)
        video_len = self.cache.length
        recalled = ()
        generator = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
        started = time.perf_counter()
        out: list[int] = []
        finish = "length"
        try:
            with torch.inference_mode():
                positions = text_position_ids(self.text_start(), len(ids)).to(self.device)
                embeds = self._embed(ids)
                if recall:
                    recalled = self.recall.recall(embeds, positions).unique_pairs
                hidden = self._prefill(embeds, positions, ChunkMeta(SlotKind.TEXT, tpos=positions[0]),
                                       visible=self._answer_visible(recall))
                position = self.text_start() + len(ids)
                logits = self.llm.logits(hidden[-1])
                ttft = None
                decode_start = time.perf_counter()
                for step in range(max_new_tokens):
                    token = _sample(logits, temperature, top_p, generator)
                    if ttft is None:
                        ttft = time.perf_counter() - started
                        decode_start = time.perf_counter()
                    if token in self.tokenizer.stop_ids:
                        finish = "stop"
                        break
                    out.append(token)
                    if on_token is not None:
                        on_token(token)
                    if step == max_new_tokens - 1:
                        break
                    pos = text_position_ids(position, 1).to(self.device)
                    hidden = self._prefill(self._embed([token]), pos, ChunkMeta(SlotKind.TEXT, tpos=pos[0]),
                                           visible=self._answer_visible(recall))
                    position += 1
                    logits = self.llm.logits(hidden[-1])
                decode_s = time.perf_counter() - decode_start
        finally:
            used = max(self.cache.length, video_len + len(ids) + (self.recall_reserve if recall else 0))
            self.cache.truncate(video_len)
            if recall:
                self.recall.clear(video_len, used)
        self.counters.questions += 1
        self.counters.answer_tokens += len(out)
        ttft = ttft if ttft is not None else time.perf_counter() - started
        rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0
        return Answer(self.tokenizer.decode(out), out, ttft, rate, len(ids), video_len, finish, recalled)

    def text_start(self) -> int:
        """Position of the first text token after the video (``model.text_after_video``).

        ``qwen``: the largest position used so far + 1 (Qwen2.5-VL's reference ``get_rope_index`` and
        transformers 4.x). ``transformers-5``: video start + max(grid h, grid w), ignoring time, which is
        what transformers 5.x computes — kept so that streaming can be checked against that oracle.
        """
        if self.config.model.text_after_video == "transformers-5" and self.grid is not None:
            return self.video_start + max(self.grid)
        return self.next_position

    @_exclusive
    def question_logits(self, question: str, recall: bool = False) -> torch.Tensor:
        """Logits [n, V] at every token of the question suffix, over the cache as it is; nothing kept.

        The parity surface for streaming exactness: equals transformers' one-shot logits at the same
        tokens for the same video and question when nothing was evicted. ``recall``: as in ``ask``.
        """
        if recall and self.recall is None:
            raise ValueError("recall=True needs an archive: set archive.dir in the config")
        ids = self._question_ids(question, 1, 0.0, 1.0, reserved=self.recall_reserve if recall else 0)
        video_len = self.cache.length
        try:
            with torch.inference_mode():
                positions = text_position_ids(self.text_start(), len(ids)).to(self.device)
                embeds = self._embed(ids)
                if recall:
                    self.recall.recall(embeds, positions)
                hidden = self._prefill(embeds, positions, ChunkMeta(SlotKind.TEXT, tpos=positions[0]),
                                       visible=self._answer_visible(recall))
                return self.llm.logits(hidden).float()
        finally:
            used = max(self.cache.length, video_len + len(ids) + (self.recall_reserve if recall else 0))
            self.cache.truncate(video_len)
            if recall:
                self.recall.clear(video_len, used)

    def _answer_visible(self, recall: bool) -> torch.Tensor | None:
        """With recall: hide the cache's kept copies of the pairs recalled whole (edgekv/archive/recall.py)."""
        return self.recall.visible(self.cache.length) if recall else None

    def _question_ids(self, question: str, max_new_tokens: int, temperature: float, top_p: float,
                      reserved: int = 0) -> list[int]:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question must be a non-empty string, got {question!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not 0.0 <= float(temperature) <= 10.0:
            raise ValueError(f"temperature must be in [0, 10], got {temperature}")
        if not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        ids = self.layout.question_suffix_ids(self.tokenizer, question)  # the question as plain text
        room = self.capacity - self.cache.length - reserved
        if len(ids) + max_new_tokens > room:
            raise ValueError(
                f"question ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the {room} free slots "
                f"(cache.text_reserve_tokens={self.text_reserve}); shorten the question, lower max_new_tokens, "
                f"or raise cache.text_reserve_tokens"
            )
        return ids

    # ------------------------------------------------------------------ persistence
    @_exclusive
    def save(self, path) -> "SnapshotInfo":  # noqa: F821 - edgekv.state imports this module's types lazily
        """Write everything this session's future depends on to ``path``, atomically (see edgekv/state.py);
        ``Runtime.restore(path)`` returns a session that continues exactly where this one is now."""
        from edgekv.state import save_session

        return save_session(self, path)

    # ------------------------------------------------------------------ reporting
    @_exclusive
    def stats(self) -> dict:
        c = self.counters
        cache = self.cache
        stats = {
            "frames": c.frames,
            "frame_pairs": c.frame_pairs,
            "pairs_skipped": c.pairs_skipped,
            "frames_rejected": c.frames_rejected,
            "cache_tokens": cache.length,
            "video_tokens": max(cache.length - self.prefix_tokens, 0),
            "prefix_tokens": self.prefix_tokens,
            "cache_capacity_tokens": cache.capacity,
            "cache_capacity_bytes": cache.capacity_bytes,
            "text_reserve_tokens": self.text_reserve,
            "policy": self.policy.name,
            "vision_backend": self.vision.name,
            "llm_backend": self.llm.name,
            "decode_route": self.runtime.decode_route,
            "host_memory": self.runtime.host_memory,
            "compressions": c.compressions,
            "compression_ms_total": c.compression_ms_total,
            "tokens_evicted": c.tokens_evicted,
            "ingest_ms_last": c.ingest_ms_last,
            "ingest_ms_total": c.ingest_ms_total,
            "sink_tokens": int(cache.sink[0, 0, : cache.length].sum()) if cache.length else 0,
            "position_max": self.next_position - 1,
            "position_limit": self.model.config.text.max_position_embeddings,
            "position_rebases": self.rebases,
            "questions": c.questions,
            "answer_tokens": c.answer_tokens,
        }
        stats.update(self.policy.stats(self))
        if self.recall is not None:
            stats.update(self.recall.stats())
        return stats


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
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
