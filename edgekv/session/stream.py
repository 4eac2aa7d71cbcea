"""StreamSession: ingest a video frame pair by frame pair into the capped cache; answer at any time.

The session is a thin coordinator: it owns what every part shares (the model, the capped cache, the policy,
the sink set, positions, counters, the lock) and hands each capability to its room — the stream's time to
``clock``, its map to the wall clock to ``wallclock``, frames to ``ingest``, the cache's layout to ``memory``, questions to ``answer``, snapshots to
``edgekv.state``. Nothing in those rooms imports this module.

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
import logging
import math
import threading
import time
import weakref

import numpy as np
import torch

from edgekv.cache.capped import CacheFullError, CappedKVCache, CapTooSmallError, ChunkMeta, SlotKind
from edgekv.model.rope import text_position_ids
from edgekv.policies.base import CacheView
from edgekv.policies.statekv import SinkSelector
from edgekv.model.rope import rotary_inv_freq
from edgekv.session import memory
from edgekv.session.answer import Answerer
from edgekv.session.clock import StreamClock, real_seconds
from edgekv.session.ingest import PairIngest
from edgekv.session.results import Answer, Counters, IngestResult, YesNo
from edgekv.session.wallclock import WallClock, checked_unix
from edgekv.tokenizer import ChatLayout


def _exclusive(method):
    """Run a public session method under the session's lock (see StreamSession's docstring)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _between_answers(method):
    """``_exclusive``, and refused while this session is answering. The lock is re-entrant, so an ``on_token``
    callback got in with the question's tokens at the end of the cache: a pair it ingested was truncated away with
    them (counted, its time kept, its tokens gone), a snapshot it saved held the question as memory, a forget or
    reset broke the answer's own cleanup. Refused before anything changes: nothing ingested is lost."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            if self.answerer.video_length is not None:
                raise RuntimeError(f"{method.__name__}: called while this session is answering (from an on_token "
                                   f"callback?); call it after the answer returns")
            return method(self, *args, **kwargs)

    return locked


class StreamSession:
    """One live stream's state. Create it with ``Runtime.session()``.

    Threads: a session may be shared. ``ingest``, ``ask``, ``question_logits``, ``save`` and ``stats``
    each hold the session's lock from start to end, so they run one at a time in call order: a frame
    ingested while another thread is answering waits for the answer, then goes in; nothing is dropped
    and an answer never sees half a frame pair. The lock is re-entrant, so an ``on_token`` callback may
    call ``stats()``; it must not wait for another thread that uses this session (that would deadlock), and
    what changes or saves the cache (``ingest``, ``ask``, ``save``, ``forget``, ...) refuses it with a
    ``RuntimeError`` (the question's tokens are in the cache until the answer returns).
    """

    def __init__(self, runtime: "Runtime", archive: bool = True) -> None:  # noqa: F821 - Runtime imports this module
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
        self.clock = StreamClock(self.config.video.fps, self.tokens_per_second, self.config.video.max_gap_s)

        spec = runtime.cache_spec()
        self.capacity = runtime.cache_capacity_tokens(spec)
        self.text_reserve = int(self.config.cache.text_reserve_tokens)
        self.cache = CappedKVCache(spec, self.capacity, device=self.device, compute_dtype=self.dtype,
                                   rope=(self.inv_freq, self.temporal_section))
        if getattr(self.policy, "uses_sinks", False) and self.sink_budget <= 0:
            raise ValueError(f"cache.policy: '{self.policy.name}' needs cache.sinks > 0 (StateKV sink budget B)")
        self.sinks = SinkSelector(self.cache, self.sink_budget) if self.sink_budget > 0 else None
        self.counters = Counters()
        self.recall = None  # edgekv.archive.recall.Recall when archive.dir is set
        if archive and self.config.archive.dir is not None:
            from edgekv.archive.recall import Recall

            self.recall = Recall(self, self.config.archive)  # holds archive.dir until close()
            # A session dropped without close() kept the folder locked (and the archive's writer thread running) for
            # the life of the process: the writer thread holds the archive, so only the session's end can close it.
            weakref.finalize(self, self.recall.archive.close)
        try:
            self._start()
        except BaseException:  # a session that never started lets go of its archive folder
            self.close()
            raise

    def _start(self) -> None:
        self.ingestor = PairIngest(self)
        self.answerer = Answerer(self)
        self._decode_graph = None  # edgekv.session.decode_graph.DecodeGraph, captured at the first answer token
        self._pair_graphs = None  # edgekv.session.pair_graph.PairGraphs, made at the first pair (model.pair_route)
        self.sync_phases = False  # True: ingest synchronizes a CUDA device at its phase boundaries (benches' timings)
        self.pair_times: dict[int, float] = {}  # frame pair -> its time, for the pairs the cache still holds
        self.pair_ends: dict[int, float] = {}  # frame pair -> its second frame's time, for the same pairs
        self.wall = WallClock()  # stream time <-> wall clock (edgekv/session/wallclock.py)
        self.restored_from = None  # edgekv.state.SnapshotInfo when Runtime.restore built this session

        prefix_ids = self.tokenizer.encode(self.layout.stream_prefix())
        self.prefix_tokens = len(prefix_ids)
        self.grid: tuple[int, int] | None = None
        self._check_budget()
        self.video_start = self.prefix_tokens  # HF's st_idx for the video block
        self.next_position = self.video_start
        with torch.inference_mode():
            positions = text_position_ids(0, self.prefix_tokens).to(self.device)
            self.prefill(self.embed(prefix_ids), positions, ChunkMeta(SlotKind.PREFIX, tpos=positions[0]))

    def close(self) -> None:
        """Write the archive's queued pairs and let go of its folder (``archive.dir``: one open archive a folder,
        so another session, or ``Runtime.restore``, may open it). The session goes on from its cache alone: pairs
        ingested after this are not archived and questions recall nothing. Without an archive nothing happens.
        Idempotent; also done at exit."""
        if self.recall is not None:
            self.recall.close()

    @_between_answers
    def reset(self) -> None:
        """Forget the stream: the cache back to the system prefix (kept: it never changes), counters, clock,
        positions, the policy's and the sink set's state as at the start, and (``video.resolution`` null) the grid.
        No buffer is allocated or freed except the policy's and sinks' own small state (a session answering about a
        request's images reuses its cache this way)."""
        self.cache.truncate(self.prefix_tokens)
        self.policy = self.runtime.make_policy()
        if self.sinks is not None:
            self.sinks.mass.zero_()
            self.sinks.updates = 0
        self.counters = Counters()
        self.clock = StreamClock(self.config.video.fps, self.tokens_per_second, self.config.video.max_gap_s)
        self.ingestor = PairIngest(self)
        self.pair_times = {}
        self.pair_ends = {}
        self.wall = WallClock()
        self.t_offset = self.rebases = 0
        self.next_position = self.video_start
        self.grid = None
        if self.config.video.resolution is None:  # the grid is the stream's: the next stream's first frame fixes it
            self.preprocessor = None

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
        try:
            self._check_room()
        except ValueError as exc:  # the retrieval reserve in the way: the archive.top_k that fits, named
            if self.recall is None or self.preprocessor is None:
                raise
            raise type(exc)(f"{exc}{self.recall.top_k_advice(self._check_room)}") from None

    def _check_room(self) -> None:
        if self.preprocessor is None:
            return  # the grid is fixed by the first frame; checked then
        per_pair = self.tokens_per_pair
        needed = self.prefix_tokens + 2 * per_pair + self.text_reserve + self.recall_reserve
        if needed > self.capacity:
            recall = (f", the retrieval reserve (archive.top_k={self.recall.top_k} pairs = {self.recall_reserve} "
                      f"tokens)" if self.recall is not None else "")
            raise CapTooSmallError(
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
    @_between_answers
    def ingest(self, frame: np.ndarray, t: float | None = None, captured_unix: float | None = None) -> IngestResult:
        """Add one BGR uint8 frame (HxWx3) stamped ``t`` seconds. Every second frame completes a pair that is
        prefilled. A timestamp that jumps (back, or forward by more than ``video.max_gap_s``) is taken as a
        bounded, logged gap in stream time (``edgekv/session/clock.py``, DESIGN invariant 12).

        ``captured_unix``: the wall time the frame was captured (seconds since the epoch), kept in the session's
        wall-clock map so that questions and forgets can name a stretch by the clock (``wall_window``,
        ``edgekv/session/wallclock.py``); None: it was seen at no known wall time (after frames that had one, the
        map says so from here until a frame brings one again).

        Invalid input raises ``ValueError`` before any state changes, so nothing ingested is lost.
        """
        started = time.perf_counter()
        first = self.preprocessor is None  # video.resolution null: this frame fixes the grid, if it is accepted
        try:
            if first:
                self.preprocessor = self.runtime.make_preprocessor(frame)
                self._check_budget()
            self.preprocessor.check_frame(frame)
            if captured_unix is not None:
                captured_unix = checked_unix("captured_unix", captured_unix)
            pending = self.ingestor.pending
            stamp = self.clock.check(t, self.counters.frames, pending[1] if pending is not None else None,
                                     self.t_offset, self.temporal_position_limit)
        except BaseException as exc:
            if first:  # a refused first frame fixes no grid: the next frame chooses it, as if this one never came
                self.preprocessor = None
            if isinstance(exc, ValueError):
                self.counters.frames_rejected += 1
            raise
        result = self.ingestor.frame(frame, stamp, started)
        if captured_unix is not None:
            self.wall.observe(stamp.stream, float(captured_unix))
        else:
            self.wall.observe_none(stamp.stream)
        return result

    @_between_answers
    def finish_pair(self) -> IngestResult | None:
        """Prefill the frame waiting for its partner as a pair of itself twice — what Qwen2.5-VL's processor makes of
        a still image (the frame repeated to the temporal patch of 2). For the end of a finite source: an odd last
        frame, or a single image, was read and never seen (a lone frame waits for a second). None when no frame
        waits. A live stream should not call it: its next frame completes the pair."""
        return self.ingestor.finish(time.perf_counter())

    def wall_window(self, unix_from: float, unix_to: float) -> tuple[float, float]:
        """The window of stream time seen between two wall times (seconds since the epoch), for ``ask`` /
        ``probe`` / ``forget``; ``ValueError`` when the frames of that stretch have no wall time or it happened
        twice (the wall clock was set back): ``edgekv/session/wallclock.py``."""
        with self._lock:
            return self.wall.window(unix_from, unix_to, self.clock.last_t)

    def wall_stretches(self, unix_from: float, unix_to: float) -> list[tuple[float, float]]:
        """Every stretch of stream time seen between two wall times (several where the wall clock was set back in
        between, none where nothing was seen): what a forget by the clock removes."""
        with self._lock:
            return self.wall.stretches(unix_from, unix_to, self.clock.last_t)

    def wall_time(self, stream_t: float) -> float | None:
        """The wall time (seconds since the epoch) a stream time was seen at, or None when it has none."""
        with self._lock:
            return self.wall.unix_of(stream_t)

    @property
    def temporal_position_limit(self) -> int:
        """Largest temporal offset a frame pair may get: the cache keeps positions as int32 (``tpos``),
        and the video start plus a question after the video must still fit below int32's maximum."""
        return int(torch.iinfo(self.cache.tpos.dtype).max) - self.video_start - self.capacity

    # ------------------------------------------------------------------ what policies call (edgekv/session/memory.py)
    def view(self, recent_pairs: int) -> CacheView:
        """The valid part of the cache, as policies see it."""
        return memory.cache_view(self, recent_pairs)

    def compact(self, keep: torch.Tensor) -> None:
        """Compact the cache to ``keep``, then re-base positions if they ran high."""
        memory.compact(self, keep)

    def rebase_positions(self) -> None:
        """Squeeze the temporal positions of kept video tokens; rotate their keys to match."""
        memory.rebase_positions(self)

    @_between_answers
    def forget(self, t_from: float, t_to: float) -> dict:
        """Remove the frame pairs stamped in ``[t_from, t_to]`` (stream seconds) from the cache: their slots gone,
        their bytes zeroed (edgekv/session/memory.py). Returns what was removed: ``tokens`` the cache positions freed
        (what a cap is set in), ``slots`` those over every layer and KV head (a token counts once in each)."""
        low, high = real_seconds(t_from), real_seconds(t_to)
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) or low > high:
            raise ValueError(f"forget: expected a window from <= to, got from={t_from!r} to={t_to!r}")
        before = self.cache.length
        pairs, slots = memory.forget(self, low, high)
        self.counters.extra["pairs_forgotten"] = self.counters.extra.get("pairs_forgotten", 0) + len(pairs)
        return {"pairs": pairs, "tokens": before - self.cache.length, "slots": slots, "cache_tokens": self.cache.length}

    # ------------------------------------------------------------------ model plumbing
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.llm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, meta: ChunkMeta,
                 visible=None, mass_out: torch.Tensor | None = None, pair: bool = False) -> torch.Tensor:
        """Run the LM over a chunk, writing its K/V at the end of the cache; returns final hidden states.
        ``pair``: a frame pair's tokens, which go through the pair's CUDA graph where ``model.pair_route`` is
        "graph" (edgekv/session/pair_graph.py; the same bits as the eager path)."""
        start, num = self.cache.length, embeds.shape[0]
        if start + num > self.capacity:
            raise CacheFullError(f"{num} tokens do not fit: the cache holds {start} of {self.capacity} slots")
        # Metadata first: an 8-bit cache stores keys time-neutral and reads the chunk's tpos as it writes.
        self.cache.write_meta(start, num, meta)
        try:
            graphs = self.pair_graphs() if pair else None
            if graphs is not None:
                hidden = graphs.prefill(embeds, positions, visible=visible, mass_out=mass_out)
            else:
                hidden = self.llm.prefill(embeds, positions, self.cache, visible=visible, mass_out=mass_out)
        except BaseException:
            self.cache.clear_meta(start, start + num)
            raise
        self.cache.commit(num)
        return hidden

    def pair_graphs(self):
        """The frame pairs' CUDA graphs (edgekv.session.pair_graph.PairGraphs) where ``model.pair_route`` resolved
        to "graph" (the torch LLM on CUDA), made at the first pair; None where pairs prefill eagerly."""
        if getattr(self.runtime, "pair_route", "eager") != "graph" or self.llm.name != "torch":
            return None
        if self._pair_graphs is None:
            from edgekv.session.pair_graph import PairGraphs

            self._pair_graphs = PairGraphs(self.model.language, self.cache)
        return self._pair_graphs

    def decode_graph(self):
        """The CUDA graph of one decode step over this session's cache (``model.decode_route: graph``, the default on
        CUDA), captured at the first call and replayed for every answer token after it: the cache's buffers never
        move, so the graph stays valid for the session's life. None where answers decode eagerly (another
        route, an 8-bit cache, an engine's LLM)."""
        if self.runtime.decode_route != "graph" or self.cache.quantized or self.llm.name != "torch":
            return None
        if self._decode_graph is None:
            self._decode_graph = self._build_decode_graph()
        return self._decode_graph or None

    def _build_decode_graph(self):
        """The decode graph as fast as it builds here: the Triton kernels (split attention, fused layers), else the
        graph of the layers' own torch ops with SDPA (the configuration first run on an H200), else none — answers
        then decode eagerly for the rest of the session (False, remembered), with one warning that says why."""
        from edgekv.session.decode_graph import DecodeGraph

        reasons = []
        for options in ({}, {"split_attention": False, "fused": False}):
            try:
                return DecodeGraph(self.model.language, self.cache, **options)
            except Exception as exc:  # a kernel that does not build on this GPU must not cost the answer
                first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
                reasons.append(f"{options or 'default'}: {type(exc).__name__}: {first_line}")
        logging.getLogger("edgekv.session").warning("decode graph unavailable, answers decode eagerly (%s)",
                                                    "; ".join(reasons))
        return False

    # ------------------------------------------------------------------ questions (edgekv/session/answer.py)
    @_between_answers
    def ask(self, question: str, max_new_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, seed: int | None = None, on_token=None, recall: bool | None = None,
            evidence: int = 0, history=(), window: tuple[float, float] | None = None,
            answer_prefix: str = "") -> Answer:
        """Answer a question about everything the cache holds; the cache is unchanged afterwards.

        ``recall`` (default ``archive.recall`` when an archive is configured, else off): first bring back the
        archived frame pairs the question points at into the retrieval reserve (edgekv/archive/recall.py).
        ``evidence=K``: ``Answer.evidence`` names the K frame pairs the question attended most.
        ``history``: the conversation so far, ``[(role, text), ...]`` or OpenAI-style ``{"role", "content"}``
        messages, role ``user`` / ``assistant`` (a follow-up: "and where did it go?"); rendered after the video as
        the chat template renders earlier turns, its tokens in the text reserve with the question's and dropped
        with them (``edgekv.tokenizer.ChatLayout.question_suffix_ids``).
        ``window=(from, to)`` (stream seconds, as ``forget``'s): the question reads only the frame pairs stamped
        in that window — the others are hidden from its attention, not removed — and, with ``recall``, the
        archive's pairs of that window only ("what happened between 10:02 and 10:05?"); ``Answer.window_pairs``
        counts the pairs it saw. A window of which nothing is held (nor recalled) is a ``ValueError``.
        ``answer_prefix``: text the assistant's turn starts with, continued by the model; ``Answer.text`` is the
        continuation alone (``Answerer.ask``).
        """
        return self.answerer.ask(question, max_new_tokens, temperature, top_p, seed, on_token, recall, evidence,
                                 history, window, answer_prefix)

    def pairs_in(self, t_from: float, t_to: float) -> list[int]:
        """The held frame pairs with a frame in ``[t_from, t_to]``: stamped at most ``t_to``, their second frame at
        least ``t_from``. A pair is stamped with its first frame's time; chosen by that alone, a window beginning
        between a pair's two frames left out the pair whose second frame it holds — a forget kept that frame (and
        the evidence picture, which is that frame), and "the last half second" at 2 fps found nothing."""
        ends = self.pair_ends
        return sorted(pair for pair, t in self.pair_times.items() if t <= t_to and ends.get(pair, t) >= t_from)

    def last_seconds(self, seconds: float) -> tuple[float, float]:
        """The window of the last ``seconds`` of stream time, up to the newest frame (ending at 0 before any), for
        ``ask`` / ``probe``: what ``last_s`` means wherever a window is asked by its length."""
        newest = self.clock.last_t if self.clock.last_t is not None else 0.0
        return newest - seconds, newest

    @_between_answers
    def probe(self, question: str, window: tuple[float, float] | None = None) -> YesNo:
        """A yes/no question answered without decoding (standing questions, alerts): ``YesNo`` with P(yes) and
        the frame pairs the question attended; the cache is unchanged afterwards. ``window``: as ``ask``'s."""
        return self.answerer.probe(question, window)

    @_between_answers
    def question_logits(self, question: str, recall: bool = False) -> torch.Tensor:
        """Logits [n, V] at every token of the question suffix, over the cache as it is; nothing kept (the
        parity surface for streaming exactness against transformers' one-shot logits)."""
        return self.answerer.question_logits(question, recall)

    def text_start(self) -> int:
        """Position of the first text token after the video (``model.text_after_video``)."""
        return self.answerer.text_start()

    # ------------------------------------------------------------------ persistence
    @_between_answers
    def save(self, path, progress=None) -> "SnapshotInfo":  # noqa: F821 - edgekv.state never imports the session
        """Write everything this session's future depends on to ``path``, atomically (see edgekv/state.py);
        ``Runtime.restore(path)`` returns a session that continues exactly where this one is now. ``progress``: called
        as the file reaches the disk, a step at a time (``edgekv.state.write_snapshot``)."""
        from edgekv.state import save_session

        return save_session(self, path, progress)

    @_exclusive
    def number_pairs_after(self, last: int | None, where: str) -> None:
        """Number the next frame pair after ``last``, a pair of this stream that ``where`` (the archive, the evidence
        frames) holds. A session restored from a snapshot numbers its pairs on from the snapshot's; after a ``kill
        -9`` or a power cut the pairs ingested since were already archived under those numbers, and the new pairs
        took them again: a recall of the old pair was read as the new one held in the cache (not recalled, or the
        new one's tokens hidden from the answer), and its evidence frame was the new one's. Pair numbers are only
        names (policies and recall read their order, never a count), so the gap costs nothing."""
        if last is None or last < self.counters.frame_pairs:
            return
        skipped = last + 1 - self.counters.frame_pairs
        logging.getLogger("edgekv.session").info(
            "restored stream: %s holds %d frame pair(s) seen after the snapshot (%d-%d); new pairs are numbered "
            "from %d", where, skipped, self.counters.frame_pairs, last, last + 1)
        self.counters.frame_pairs = last + 1

    # ------------------------------------------------------------------ reporting
    @_exclusive
    def stats(self) -> dict:
        c = self.counters
        cache = self.cache
        wall = self.wall.span(self.clock.last_t)
        stats = {
            "frames": c.frames,
            "frame_pairs": c.frame_pairs,
            "pairs_skipped": c.pairs_skipped,
            "frames_rejected": c.frames_rejected,
            "clock_jumps": self.clock.jumps,
            # what a question's window can reach: the newest frame's stream time and the span of the pairs held
            "stream_t_last": self.clock.last_t,
            "pairs_held": len(self.pair_times),
            "held_t_first": min(self.pair_times.values()) if self.pair_times else None,
            "held_t_last": max(self.pair_times.values()) if self.pair_times else None,
            # ... and the wall times (seconds since the epoch) the stream's wall-clock map knows: first and newest
            "wall_t_first": wall[0] if wall is not None else None,
            "wall_t_last": wall[1] if wall is not None else None,
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
            "vision_route": getattr(self.runtime, "vision_route", "eager"),
            "prefill_route": getattr(self.runtime, "prefill_route", "eager"),
            "pair_route": getattr(self.runtime, "pair_route", "eager"),
            "vision_mlp_width": getattr(self.runtime, "vision_mlp_width", None),
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
            "probes": c.probes,
        }
        stats.update(self.policy.stats(self))
        if self.recall is not None:
            stats.update(self.recall.stats())
        return stats
