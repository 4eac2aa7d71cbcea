"""What a session hands back and counts: ``IngestResult`` per frame, ``Answer`` per question, ``Counters``."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    confidence: float | None = None  # geometric mean of the answer tokens' probabilities (None: no token)
    evidence: tuple[int, ...] = ()  # frame pairs the question attended most (ask(..., evidence=K))
    escalated: str | None = None  # the remote model that answered instead (apps/outputs/escalate.py)
    escalation_note: str | None = None  # why it was (not) escalated
    window_pairs: int | None = None  # with ask(..., window=...): the frame pairs of the window the question saw


@dataclass(frozen=True)
class YesNo:
    """A yes/no question's verdict over the cache as it is, with no answer token decoded (``session.probe``):
    the model's next-token distribution constrained to its "yes" and "no" tokens, and where it looked."""

    p_yes: float             # P(yes) / (P(yes) + P(no)) at the first answer token
    pair_mass: dict[int, float]  # frame pair -> share of the question's attention its kept tokens drew
    ms: float
    prompt_tokens: int = 0

    @property
    def yes(self) -> bool:
        return self.p_yes > 0.5

    def top_pairs(self, k: int = 1) -> list[int]:
        """The ``k`` frame pairs the question attended most (the evidence of the verdict)."""
        return [pair for pair, _ in sorted(self.pair_mass.items(), key=lambda item: -item[1])[:k]]


@dataclass
class Counters:
    """A session's running totals (saved in snapshots as they are)."""

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
    probes: int = 0          # yes/no probes (standing questions): prefilled, never decoded
    tokens_evicted: int = 0
    extra: dict = field(default_factory=dict)
