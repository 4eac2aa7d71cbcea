"""Ingest: frames in, frame pairs prefilled into the capped cache, room made by the policy when it is full.

A frame waits for its partner (``pending``): Qwen2.5-VL's vision tower takes two frames at a time
(``temporal_patch_size = 2``). Each pair: vision tower → room made (the policy compresses, DESIGN invariant 1)
→ LM prefill of its tokens (through StateKV's sink set when ``cache.sinks`` > 0) → sink update → the archive
gets a copy before any compaction can move its slots.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from edgekv.cache.capped import CacheFullError, ChunkMeta, SlotKind
from edgekv.frameskip import StaticPairSkipper
from edgekv.model.rope import vision_block_position_ids
from edgekv.session.clock import Stamp
from edgekv.session.results import IngestResult


class PairIngest:
    """The ingest side of a ``StreamSession`` (which calls it under its lock)."""

    def __init__(self, session) -> None:
        self.session = session
        self.pending: tuple[np.ndarray, float] | None = None  # a frame waiting for its partner, and its time
        skip = session.config.video.skip_static
        self.skipper = StaticPairSkipper(skip.threshold, skip.max_gap_pairs) if skip.enabled else None

    def frame(self, frame: np.ndarray, stamp: Stamp, started: float) -> IngestResult:
        """``frame`` (already checked) at ``stamp`` (already checked by the clock; ``stamp.stream`` is its time)."""
        s = self.session
        frame_index = s.counters.frames
        if self.pending is None:
            self.pending = (np.array(frame, copy=True), stamp.stream)
            self._accepted(stamp)
            return IngestResult(frame_index, None, 0, (time.perf_counter() - started) * 1e3)
        first, t_first = self.pending
        if self.skipper is not None and self.skipper.should_skip(first, frame):
            # Nothing is written; the next ingested pair's position comes from its own time, so the
            # positions keep the gap this pair leaves (edgekv/frameskip.py).
            self.pending = None
            s.counters.pairs_skipped += 1
            self._accepted(stamp)
            return IngestResult(frame_index, None, 0, (time.perf_counter() - started) * 1e3, skipped=True)
        result = self._pair(first, frame, t_first, frame_index, started, stamp.stream)
        self.pending = None
        self._accepted(stamp)
        return result

    def finish(self, started: float) -> IngestResult | None:
        """The frame waiting for its partner prefilled as a pair with itself (``StreamSession.finish_pair``); None
        when none waits. Not subject to ``video.skip_static`` (two copies of a frame are static by definition)."""
        if self.pending is None:
            return None
        first, t_first = self.pending
        result = self._pair(first, first, t_first, self.session.counters.frames - 1, started, t_first)
        self.pending = None
        return result

    def _accepted(self, stamp: Stamp) -> None:
        self.session.counters.frames += 1
        self.session.clock.accept(stamp)

    def _pair(self, first: np.ndarray, second: np.ndarray, t_first: float, frame_index: int,
              started: float, t_second: float) -> IngestResult:
        s = self.session
        if s.recall is not None:
            s.recall.attach()
        pair_index = s.counters.frame_pairs
        with torch.inference_mode():
            pixel_values, grid_thw = s.preprocessor.pair(first, second)
            vision_start = self._mark()
            tokens = s.vision.encode(pixel_values.to(s.device, s.dtype), grid_thw.to(s.device))
            vision_ms = (self._mark() - vision_start) * 1e3
            s.policy.observe_pair(pair_index, tokens)
            grid_h, grid_w = int(grid_thw[0, 1]) // s.merge, int(grid_thw[0, 2]) // s.merge
            s.grid = (grid_h, grid_w)
            compression_ms = self.make_room(tokens.shape[0])  # may re-base positions: compute them after
            t_pos = s.clock.position(t_first, s.t_offset)
            host_positions = vision_block_position_ids(s.video_start, t_pos, grid_h, grid_w)  # read here, not on
            positions = host_positions.to(s.device)  # the device (a host sync a pair on CUDA)
            prefill_start = self._mark()
            index = torch.arange(tokens.shape[0], device=s.device)
            meta = ChunkMeta(SlotKind.VISION, frame=pair_index, rows=index // grid_w, cols=index % grid_w,
                             tpos=positions[0])
            start = s.cache.length
            if s.sinks is None:
                s.prefill(tokens, positions, meta, pair=True)
            else:
                s.prefill(tokens, positions, meta, visible=s.sinks.visibility(), mass_out=s.sinks.mass, pair=True)
                s.sinks.update(start, tokens.shape[0])
            prefill_ms = (self._mark() - prefill_start) * 1e3
            if s.recall is not None:  # before any compaction can move these slots
                s.recall.archive_pair(start, tokens.shape[0], pair_index, t_first, int(host_positions[0, 0]),
                                      frames=1 if second is first else 2)
        s.next_position = max(s.next_position, int(host_positions.max()) + 1)
        s.pair_times[pair_index] = t_first
        s.pair_ends[pair_index] = t_second
        s.counters.frame_pairs += 1
        ms = (time.perf_counter() - started) * 1e3
        s.counters.ingest_ms_last = ms
        s.counters.ingest_ms_total += ms
        return IngestResult(frame_index, pair_index, tokens.shape[0], ms, vision_ms, prefill_ms, compression_ms)

    def _mark(self) -> float:
        """The host clock at a phase boundary. On CUDA the phases' kernels run behind the host: with
        ``session.sync_phases`` (a bench's switch; off in service, where a sync would stall the stream) the device
        is synchronized first, so vision / prefill / compression times are each phase's own."""
        s = self.session
        if s.sync_phases and s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        return time.perf_counter()

    def make_room(self, num_tokens: int) -> float:
        """Ask the policy to free room for ``num_tokens`` more video tokens; returns the ms it took."""
        s = self.session
        if s.cache.length + num_tokens <= s.video_limit:
            return 0.0
        started = self._mark()
        before = s.cache.length
        if not s.policy.evicts:
            raise CacheFullError(
                f"the cache is full: cache.max_tokens={s.capacity} holds the prefix ({s.prefix_tokens} tokens), "
                f"{s.frames_that_fit()} frames ({num_tokens} tokens per frame pair) and the text reserve "
                f"({s.text_reserve}); policy '{s.policy.name}' never evicts. Raise cache.max_tokens (or "
                f"cache.max_mib), lower video.resolution, or choose an evicting policy such as infinipot_v"
            )
        s.policy.compress(s, num_tokens)
        if s.cache.length + num_tokens > s.video_limit:
            raise RuntimeError(f"policy '{s.policy.name}' left {s.cache.length} slots; {num_tokens} do not fit")
        ms = (self._mark() - started) * 1e3
        s.counters.compressions += 1
        s.counters.compression_ms_total += ms
        s.counters.tokens_evicted += before - s.cache.length
        return ms
