"""Recall: the question picks archived frame pairs; they enter a retrieval reserve inside the cap.

ReKV's internal retrieval (seed 001, §3 "Internal Video KV-Cache Retrieval"): a frame's representative
vector is the mean of its keys, ``v = 1/N_f sum_j k_j``, the question's is the mean of its queries,
``q = 1/N_q sum_k q_k``, heads concatenated into one vector; frames are ranked by cosine similarity
(eq. "retrieval", tau = 1) and the ``r`` best (here ``top_k``) are loaded as context for the answer
(eq. "answer generation": the question attends to [retrieved KV ; question]). That score is
``archive.scoring: cosine``. The default, ``attention``, ranks a pair by the attention the question would
pay its tokens (``FrameArchive.attention_scores``): per layer, query head and question token, a softmax
over the candidate pairs of ``log sum_c w_c exp(q . c / sqrt(d))``, with ``c`` the pair's representative
keys (``archive.index_keys`` k-means centroids per KV head, weights = their share of its tokens), averaged
over heads and tokens. Why: averaging a question's queries mixes its template words with the one that
names the object, and averaging a frame's keys dilutes an object covering a few patches in its
background. With the trained toy (issue 11, round 4; ``edgekv bench archive --parts accuracy --streams 2
--ks 4``, 26 questions about events older than the cap) the asked event's pair was among the k = 4
recalled for 31 % (per layer) / 4 % (pooled) of questions by cosine, 85 % by attention. Two variants of
where the ranking applies, chosen by ``archive.retrieval`` and compared by ``edgekv bench archive``:

* ``layer``: every layer ranks with its own mean query and keys and recalls its own top-k (ReKV: "it
  operates independently within each self-attention layer, allowing different layers to retrieve
  different video blocks");
* ``pooled``: one ranking for all layers, the per-layer cosines averaged.

The question's per-layer queries come from a **probe pass**: the question prefilled over the capped cache
as it is (its K/V written past the valid slots and forgotten). ReKV retrieves inside the answering pass;
a probe gives both variants the same queries (pooled needs every layer's before any layer loads) at the
cost of one extra question-length prefill. Keys and queries are compared with their temporal rotation
undone (keys at their pair's position, queries at their own), so a score does not depend on when a pair
was seen.

Candidates are the archived pairs of this stream that are **not whole in the cache** (every token of the
pair in every KV head of that layer — or of every layer, pooled); a pair the policy kept in part may be
recalled whole. The recalled K/V are written at the slots after the valid cache, ``[length, length + n P)``
— the retrieval reserve: ``top_k * tokens_per_pair`` slots kept free by the session's video limit, so
inside ``cache.max_tokens`` and counted in ``cache_capacity_bytes``, never allocated. The question follows
them, so it attends to [capped cache ; recalled pairs ; question] (slot order is irrelevant to softmax;
order in time is in the rotated keys). Positions: a pair archived at temporal position ``p`` when the
session's re-basing offset was ``o`` is moved to ``p + o - o_now`` — where a frame seen at its time would
be placed now — by rotating its keys' temporal M-RoPE pairs by ``o - o_now`` (exact: edgekv/positions.py).
Without re-basing (``o = o_now``) every recalled pair sits at its own position, in true time order with
everything in the cache. After re-basing squeezed the gaps between kept frames, an old kept token may sit
higher than where its time would map now, so a recalled pair can land before an older kept token: the
rule keeps recalled pairs in order among themselves and before every newer kept pair, not against older
survivors (a known limit; what is exact is the rotation to the chosen position).
A recalled pair may still be in the cache in part (the policy kept some of its tokens in some heads): the
question then sees it once, whole — the kept copies of a pair a layer recalled are hidden from that layer
for this answer (``visible``), else the same patches would be there twice (with the toy, "How many times
did the cross appear?" was answered "two" for a cross seen once). After the answer the session truncates
the cache and :meth:`Recall.clear` resets the reserve and question slots, so every valid slot and every
metadata field is as before the question.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from edgekv.archive.store import ARCHIVE_KV_DTYPES, ArchivedPair, FrameArchive, KVShape, new_stream_id
from edgekv.attention import CacheAttention
from edgekv.cache.capped import SlotKind
from edgekv.config import ArchiveSection
from edgekv.positions import rotate_temporal, rotate_temporal_

STREAM_KEY = "archive_stream"  # in session.counters.extra: saved and restored with the persistent memory
_SPARE = 2  # candidates ranked beyond top_k per layer, in case a record fails its checksum


@dataclass(frozen=True)
class Recalled:
    """What one question brought back: frame-pair indices per layer (the same row in every layer when pooled)."""

    pairs: tuple[tuple[int, ...], ...]
    tokens: int
    probe_ms: float
    select_ms: float
    read_ms: float

    @property
    def unique_pairs(self) -> tuple[int, ...]:
        return tuple(sorted({p for row in self.pairs for p in row}))

    @property
    def ms(self) -> float:
        return self.probe_ms + self.select_ms + self.read_ms


class RetrievalReserve:
    """The slots kept free inside the cap for ``top_k`` recalled pairs of ``session``'s grid, and the largest
    ``archive.top_k`` a budget check passes with. Apart from ``Recall`` so that ``edgekv-camera --check`` runs the
    start's budget check, advice included, on the config alone (no archive opened, no weights loaded)."""

    def __init__(self, session, top_k: int) -> None:
        self.session = session
        self.top_k = int(top_k)

    # ------------------------------------------------------------------ budget
    @property
    def reserve_tokens(self) -> int:
        """Slots kept free inside the cap for recalled pairs (0 until the frame grid is known)."""
        preprocessor = self.session.preprocessor
        return self.top_k * preprocessor.tokens_per_pair if preprocessor is not None else 0

    def largest_top_k(self, check: Callable[[], None]) -> int:
        """The largest ``archive.top_k``, up to the configured one, for which ``check()`` — the session's budget check
        (the prefix, two pairs, the text reserve and this reserve under the cap; the policy's target) — passes; 0
        when not even one recalled pair fits. The reserve only takes room, so the search halves the range."""
        configured, low, high = self.top_k, 0, self.top_k
        try:
            while low < high:
                self.top_k = (low + high + 1) // 2
                try:
                    check()
                except ValueError:
                    high = self.top_k - 1
                else:
                    low = self.top_k
        finally:
            self.top_k = configured
        return low

    def top_k_advice(self, check: Callable[[], None]) -> str:
        """What to add to a budget error when the retrieval reserve is in the way: the ``archive.top_k`` that fits
        (``largest_top_k``), or that none does; empty when the configured one fits (another setting is at fault)."""
        fits = self.largest_top_k(check)
        if fits == self.top_k:
            return ""
        per_pair = self.reserve_tokens // max(1, self.top_k)
        if fits == 0:
            return (f"; no archive.top_k fits beside the rest (one recalled pair is {per_pair} tokens): raise "
                    f"cache.max_tokens, or set archive.dir: null (no recall)")
        return (f"; or set archive.top_k: {fits} (the most that fits this cap: {self.top_k} recalled pairs take "
                f"{self.reserve_tokens} tokens, {fits} take {fits * per_pair})")


class Recall(RetrievalReserve):
    """A session's archive writer hook and retrieval reserve (``archive:`` in the YAML)."""

    def __init__(self, session, section: ArchiveSection) -> None:
        if session.llm.name != "torch":
            raise ValueError(f"archive.dir: recall reads the question's queries from the torch LM; engines.llm is "
                             f"{session.llm.name!r}. Set engines.llm: torch or archive.dir: null")
        super().__init__(session, section.top_k)
        cache = session.cache
        self.section = section
        self.mode = section.retrieval
        self.scoring = section.scoring
        # what is stored on flash: archive.kv_dtype, else as the cache holds it (an 8-bit cache: 8-bit records,
        # re-quantized from its dequantized, rotated keys: the archive keeps keys rotated at their positions)
        stored = ARCHIVE_KV_DTYPES.get(section.kv_dtype, cache.dtype)
        self.archive = FrameArchive(
            section.dir, KVShape.of(cache.num_layers, cache.kv_heads, cache.head_dim, stored, section.index_keys),
            stage_dtype=cache.compute_dtype if cache.quantized else cache.dtype,
            max_bytes=int(section.max_gib * 2**30), segment_bytes=int(section.segment_mib * 2**20),
            queue_pairs=section.queue_pairs, max_age_s=section.max_age_s, inv_freq=session.inv_freq.cpu(),
            temporal_section=session.temporal_section, when_full=section.when_full,
            keys=getattr(getattr(session, "runtime", None), "keys", None),
            keep_free_bytes=int(section.keep_free_gib * 2**30),
            max_index_bytes=None if section.max_index_mib is None else int(section.max_index_mib * 2**20))
        self.attached = False
        self._stream_hex, self._stream = "", b""
        self.recalls = 0
        self.recalled_pairs = 0
        self.ms_total = 0.0
        self.ms_last = 0.0
        self.last: Recalled | None = None
        self.hidden: torch.Tensor | None = None  # [L, Hkv, start] bool: kept copies of recalled pairs
        self._visible: torch.Tensor | None = None  # [L, Hkv, capacity]: the answer's mask while hidden is set

    # ------------------------------------------------------------------ ingest side
    def attach(self) -> None:
        """Before the first pair of this process: the stream's id — restored with the persistent memory, or
        new for a new stream (whose positions must never meet an old stream's records)."""
        if self.attached:
            return
        extra = self.session.counters.extra
        if STREAM_KEY not in extra:
            extra[STREAM_KEY] = new_stream_id().hex()
        else:  # a restored stream: its pairs after the snapshot (a kill -9, a power cut) are archived
            self.session.number_pairs_after(self.archive.last_frame(self.stream), "the archive")
        self.attached = True

    def seen_after_snapshot(self) -> list[ArchivedPair]:
        """The pairs of this restored stream that the archive holds and the restored session never numbered (at or
        past its next pair number), oldest first: ingested after its snapshot by a process that was killed or lost
        power before the next one. Empty once the session numbers its pairs past them (``number_pairs_after``)."""
        stream = self.stream
        if stream is None:
            return []
        after = self.session.counters.frame_pairs
        return sorted((e for e in self.archive.entries(stream) if e.frame >= after), key=lambda e: e.frame)

    @property
    def stream(self) -> bytes | None:
        """This stream's 16-byte id; None before its first pair (nothing of it is archived yet)."""
        text = self.session.counters.extra.get(STREAM_KEY)
        if text is None:
            return None
        if self._stream_hex != text:  # parsed once per stream, not per pair
            self._stream_hex, self._stream = text, bytes.fromhex(text)
        return self._stream

    def archive_pair(self, start: int, tokens: int, pair: int, t: float, tpos: int, frames: int = 2) -> bool:
        """Queue the pair just prefilled at slots [start, start + tokens) (never blocks: see FrameArchive).
        ``frames`` 1: one frame prefilled as a pair of itself (``StreamSession.finish_pair``: an odd last frame),
        which its record says (``ArchivedPair.frames``), so that it ends where it starts: a restart after a
        ``kill -9`` goes on at the frame after it, and a window after that frame does not recall it."""
        if self.archive.closed:  # the session let go of its archive folder (session.close()): cache only from here
            return False
        cache, (rows, cols) = self.session.cache, self.session.grid
        k, v = cache.slots(start, start + tokens)
        return self.archive.submit(k, v, frame=pair, t=t, tpos=tpos, t_offset=self.session.t_offset, rows=rows,
                                   cols=cols, stream=self.stream, frames=frames)

    # ------------------------------------------------------------------ question side
    def probe(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 [layers, q_heads, T, head_dim] on the model's device: the question's queries per layer, their
        temporal rotation undone. The question's K/V land past the valid slots, uncommitted."""
        session, cache = self.session, self.session.cache
        queries: list[torch.Tensor] = []
        attend = CacheAttention(cache, cache.length, embeds.shape[0])
        text_pos = positions[0].to(torch.float32)

        def recording(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [Hq, Q, hd] rotated at the text positions; undo the temporal part
            queries.append(rotate_temporal(q, text_pos.expand(q.shape[0], -1).neg(), session.inv_freq,
                                           session.temporal_section).float())
            return attend(layer, q, k, v)

        cache.check_room(embeds.shape[0])
        session.model.language(embeds, positions, recording)
        return torch.stack(queries)

    @staticmethod
    def mean_query(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """ReKV's question vector from ``probe``'s queries: fp32 [layers, kv_heads * head_dim], the mean over
        the question's tokens and over the query heads of each KV head's group (CPU)."""
        layers, q_heads, _, dim = queries.shape
        return queries.mean(dim=2).view(layers, kv_heads, q_heads // kv_heads, dim).mean(dim=2).reshape(layers, -1).cpu()

    def _whole_in_cache(self, entries: list[ArchivedPair]) -> torch.Tensor:
        """[n, layers] bool: every token of the pair is in every KV head of that layer."""
        return whole_in_cache(self.session.cache, [e.frame for e in entries], entries[0].tokens if entries else 0)

    def select(self, queries: torch.Tensor, window: tuple[float, float] | None = None) -> list[list[ArchivedPair]]:
        """Per layer, the best ``top_k + _SPARE`` archived pairs of this stream (best first) among those not
        whole in the cache (``queries``: ``probe``'s); the spares stand in for a record that fails its checksum.
        ``window`` (stream seconds): only pairs with a frame inside it are candidates (a question about a time)."""
        layers = self.session.cache.num_layers
        if self.stream is None:  # before this stream's first pair: none of its pairs is archived
            return [[] for _ in range(layers)]
        pooled = self.mode == "pooled"
        if self.scoring == "attention":
            def exclude(entries: list[ArchivedPair]) -> torch.Tensor:
                whole = self._whole_in_cache(entries)
                return whole.all(dim=1, keepdim=True).expand_as(whole) if pooled else whole

            entries, scores = self.archive.attention_scores(queries, self.stream, exclude)  # [N, L]
            if not entries:
                return [[] for _ in range(layers)]
            if pooled:  # the mean share over layers; a non-candidate is -inf in every layer
                scores = scores.mean(dim=1, keepdim=True)
        else:
            entries, scores = self.archive.cosine_scores(self.mean_query(queries, self.session.cache.kv_heads),
                                                         self.stream)  # [N, L]
            if not entries:
                return [[] for _ in range(layers)]
            whole = self._whole_in_cache(entries)
            if pooled:
                scores = scores.mean(dim=1, keepdim=True).masked_fill(whole.all(dim=1, keepdim=True), float("-inf"))
            else:
                scores = scores.masked_fill(whole, float("-inf"))
        if window is not None:  # a pair with a frame in it (``StreamSession.pairs_in``): its first frame (its stamp)
            frame_s = 1.0 / self.session.config.video.fps  # at most the window's end, its last at least its start
            outside = torch.tensor([not (e.t <= window[1] and e.t_last(frame_s) >= window[0]) for e in entries],
                                   device=scores.device)
            scores = scores.masked_fill(outside[:, None], float("-inf"))
        best = torch.topk(scores, min(self.top_k + _SPARE, len(entries)), dim=0)  # [m, L or 1]
        ranked = [[entries[i] for i, value in zip(idx, val) if value != float("-inf")]
                  for idx, val in zip(best.indices.t().tolist(), best.values.t().tolist())]
        return ranked * layers if self.mode == "pooled" else ranked

    def load(self, ranked: list[list[ArchivedPair]]) -> tuple[tuple[int, ...], ...]:
        """Read up to ``top_k`` pairs per layer straight into slots [length, ...), commit the same count in
        every layer, then re-rotate each layer's recalled keys at once. Returns the pairs per layer."""
        session, cache = self.session, self.session.cache
        start = cache.length
        wanted = min([self.top_k, *(len(r) for r in ranked)])
        if wanted == 0:
            return tuple(() for _ in ranked)
        tokens = ranked[0][0].tokens
        if start + wanted * tokens > session.capacity:
            raise RuntimeError(f"the retrieval reserve does not fit: {cache.length} + {wanted} x {tokens} slots")
        chosen: list[list[ArchivedPair]] = [[] for _ in ranked]
        depth = [0] * len(ranked)
        while True:  # one open per pair per round; a layer whose record fails moves on to its next best
            need: dict[int, tuple[ArchivedPair, dict]] = {}
            for layer, row in enumerate(ranked):
                if len(chosen[layer]) < wanted and depth[layer] < len(row):
                    entry = row[depth[layer]]
                    depth[layer] += 1
                    at = start + len(chosen[layer]) * tokens
                    entry, targets, slots = need.setdefault(entry.pair, (entry, {}, {}))
                    targets[layer] = ((cache.k[layer, :, at:at + tokens], cache.v[layer, :, at:at + tokens])
                                      if not cache.quantized else self._scratch(tokens))
                    slots[layer] = at
            if not need:
                break
            for entry, targets, slots in need.values():
                for layer in sorted(self.archive.read_into(entry, targets)):
                    if cache.quantized:  # written as the cache writes: time-neutral codes, from the archived rotation
                        at, (k, v) = slots[layer], targets[layer]
                        cache.tpos[layer, :, at:at + tokens] = entry.tpos
                        cache.write_layer(layer, at, k.to(cache.device), v.to(cache.device))
                    chosen[layer].append(entry)
        count = min(len(row) for row in chosen)
        self._prepare(start, [row[:count] for row in chosen])
        cache.commit(count * tokens)
        return tuple(tuple(e.frame for e in row[:count]) for row in chosen)

    def _scratch(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K/V [kv_heads, P, head_dim] a recalled layer is read into before an 8-bit cache writes it."""
        cache = self.session.cache
        shape = (cache.kv_heads, tokens, cache.head_dim)
        return torch.empty(shape, dtype=self.archive.stage_dtype), torch.empty(shape, dtype=self.archive.stage_dtype)

    def _prepare(self, start: int, rows: list[list[ArchivedPair]]) -> None:
        """Metadata of the recalled slots (``rows``: each layer's pairs in slot order, equal counts), and the
        keys moved by the re-basing since each pair was archived — every layer in one pass."""
        session, cache = self.session, self.session.cache
        if not rows or not rows[0]:
            return
        tokens = rows[0][0].tokens
        end = start + len(rows[0]) * tokens
        device = cache.device

        def per_slot(value) -> torch.Tensor:  # [L, n] per pair -> [L, 1, n * P] per slot
            table = torch.tensor([[value(e) for e in row] for row in rows], device=device)
            return table.repeat_interleave(tokens, dim=1).unsqueeze(1)

        delta = per_slot(lambda e: e.t_offset - session.t_offset)
        cols = per_slot(lambda e: e.cols)
        index = torch.arange(tokens, device=device).repeat(len(rows[0]))
        heads = (len(rows), cache.kv_heads, end - start)
        if bool(delta.any()) and not cache.quantized:  # an 8-bit cache's keys are time-neutral: tpos moves them
            rotate_temporal_(cache.k[:, :, start:end], delta.expand(heads), session.inv_freq,
                             session.temporal_section)
        cache.kind[:, :, start:end] = int(SlotKind.VISION)
        cache.sink[:, :, start:end] = False
        cache.frame[:, :, start:end] = per_slot(lambda e: e.frame).expand(heads).to(cache.frame.dtype)
        cache.row[:, :, start:end] = (index // cols).expand(heads).to(cache.row.dtype)
        cache.col[:, :, start:end] = (index % cols).expand(heads).to(cache.col.dtype)
        cache.tpos[:, :, start:end] = (per_slot(lambda e: e.tpos) + delta).expand(heads).to(cache.tpos.dtype)

    def recall(self, embeds: torch.Tensor, positions: torch.Tensor,
               window: tuple[float, float] | None = None) -> Recalled:
        """Probe, select and load for one question (the session then prefills the question after them); after
        ``session.close()`` nothing (the archive's folder is another's to open). ``window``: as ``select``'s."""
        if self.archive.closed:
            self.hidden = None
            return Recalled(tuple(() for _ in range(self.session.cache.num_layers)), 0, 0.0, 0.0, 0.0)
        started = time.perf_counter()
        queries = self.probe(embeds, positions)
        probed = time.perf_counter()
        ranked = self.select(queries, window)
        selected = time.perf_counter()
        start = self.session.cache.length
        pairs = self.load(ranked)
        self.hidden = self._kept_copies(start, pairs)
        done = time.perf_counter()
        tokens = sum(len(row) for row in pairs[:1]) * (ranked[0][0].tokens if ranked and ranked[0] else 0)
        result = Recalled(pairs, tokens, (probed - started) * 1e3, (selected - probed) * 1e3, (done - selected) * 1e3)
        self.recalls += 1
        self.recalled_pairs += len(result.unique_pairs)
        self.ms_last = result.ms
        self.ms_total += result.ms
        self.last = result
        return result

    def _kept_copies(self, start: int, pairs: tuple[tuple[int, ...], ...]) -> torch.Tensor | None:
        """[L, Hkv, start] bool, True at the vision slots (before the reserve) of a pair that layer recalled;
        None when no recalled pair has a token left in the cache."""
        cache = self.session.cache
        if not any(pairs) or start == 0:
            return None
        hidden = torch.zeros(cache.num_layers, cache.kv_heads, start, dtype=torch.bool, device=cache.device)
        vision = cache.kind[:, :, :start] == int(SlotKind.VISION)
        for layer, row in enumerate(pairs):
            if row:
                wanted = torch.tensor(row, dtype=cache.frame.dtype, device=cache.device)
                hidden[layer] = torch.isin(cache.frame[layer, :, :start], wanted) & vision[layer]
        if not bool(hidden.any()):
            return None
        # visible over the whole capacity, built once per question: every decode step takes a slice of it
        self._visible = torch.ones(cache.num_layers, cache.kv_heads, cache.capacity, dtype=torch.bool,
                                   device=cache.device)
        self._visible[:, :, :start] = ~hidden
        return hidden

    def visible(self, length: int) -> torch.Tensor | None:
        """The ``visible`` mask [L, Hkv, length] for a chunk of the answer starting at slot ``length``:
        every committed slot but the kept copies of recalled pairs; None when nothing is hidden."""
        return None if self.hidden is None else self._visible[:, :, :length]

    def clear(self, start: int, end: int) -> None:
        """Reset slots [start, end) — the reserve and the question's — to an empty cache's values."""
        self.hidden = self._visible = None
        cache = self.session.cache
        end = min(end, cache.capacity)
        if end <= start:
            return
        cache.k[:, :, start:end].zero_()
        cache.v[:, :, start:end].zero_()
        cache.kind[:, :, start:end] = int(SlotKind.EMPTY)
        cache.sink[:, :, start:end] = False
        cache.frame[:, :, start:end] = -1
        cache.row[:, :, start:end] = -1
        cache.col[:, :, start:end] = -1
        cache.tpos[:, :, start:end] = 0

    def stats(self) -> dict:
        return {**self.archive.stats(), "recall_reserve_tokens": self.reserve_tokens, "recall_top_k": self.top_k,
                "recall_mode": self.mode, "recall_scoring": self.scoring, "recalls": self.recalls, "recalled_pairs": self.recalled_pairs,
                "recall_ms_last": round(self.ms_last, 3), "recall_ms_total": round(self.ms_total, 3)}

    def close(self) -> None:
        self.archive.close()


def whole_in_cache(cache, pairs: list[int], tokens: int) -> torch.Tensor:
    """[n, layers] bool: all ``tokens`` tokens of frame pair ``pairs[i]`` are vision slots of every KV head of
    that layer of ``cache`` (such a pair is not a recall candidate there)."""
    n = cache.length
    whole = torch.zeros(len(pairs), cache.num_layers, dtype=torch.bool)
    if not pairs or n == 0:
        return whole
    frames = cache.frame[:, :, :n].to(torch.int64).cpu()  # [L, H, n]
    kinds = cache.kind[:, :, :n].cpu() == int(SlotKind.VISION)
    lookup = {p: i for i, p in enumerate(pairs)}
    for layer in range(cache.num_layers):
        counts = torch.zeros(cache.kv_heads, len(pairs), dtype=torch.int64)
        for head in range(cache.kv_heads):
            values, count = torch.unique(frames[layer, head][kinds[layer, head]], return_counts=True)
            for value, c in zip(values.tolist(), count.tolist()):
                if value in lookup:
                    counts[head, lookup[value]] = c
        whole[:, layer] = (counts >= tokens).all(dim=0)
    return whole
