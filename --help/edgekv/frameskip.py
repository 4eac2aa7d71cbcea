"""Skip frame pairs that did not change, before the vision tower (``video.skip_static``).

A static camera sends the same scene again and again; every pair costs a vision-tower pass, a prefill
of its tokens and cache room that a compression later has to give back. The vLLM hybrid seed (003,
"Dimension 2": do less work for inputs that add nothing) and AdaReTaKe's frame distance (seed 002,
§4.3: neighbouring frames that look alike carry little new information) suggest the cheapest test
that works: compare the pair's frames with the last *ingested* pair on a small grey thumbnail.

    d(pair) = max over the pair's two frames f, the cells (x, y) and the colour channels c of
              | g(f)[x, y, c] - g(ref)[x, y, c] |

where ``g`` averages the frame over ``cell`` x ``cell`` pixel blocks (per colour channel) and ``ref`` is
the second frame of the last ingested pair. Averaging a 4x4 block divides sensor noise of std ``s`` by
4, while an object covering a block moves its mean by its full contrast; the maximum (not the mean)
over cells keeps a small object from being diluted by a large static background, and the colour
channels keep an object whose grey level matches the background visible. Measured on
``synthetic:events`` streams (112x112, 4x4 cells): static pairs give d of about 4 at noise std 3 and
about 8 at std 6; the onset of an event gives d of 85 or more. The default threshold of 16 grey levels
sits between. A pair is skipped when ``d < threshold`` and fewer than ``max_gap_pairs`` pairs in a row
were skipped before it; the maximum gap makes sure the cache keeps hearing from a long static stretch
(time keeps moving).

Positions stay true to time: a skipped pair writes nothing, and the next ingested pair takes its
temporal position from its own timestamp (``StreamSession._ingest_pair``), so the gap is in the
positions exactly as it was in time. Cost: one resize-by-mean of two frames, O(H W), no allocation
beyond two thumbnails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

def thumbnail(frame: np.ndarray, cell: int) -> np.ndarray:
    """HxWx3 uint8 -> (H // cell)x(W // cell)x3 float32, each cell the mean of a cell x cell pixel block."""
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"expected an HxWx3 frame, got shape {frame.shape}")
    rows, cols = frame.shape[0] // cell, frame.shape[1] // cell
    if rows == 0 or cols == 0:
        raise ValueError(f"frame {frame.shape[:2]} is smaller than one {cell}x{cell} cell of the skip test")
    blocks = frame[: rows * cell, : cols * cell].astype(np.float32).reshape(rows, cell, cols, cell, 3)
    return blocks.mean(axis=(1, 3))


def pair_distance(first: np.ndarray, second: np.ndarray, reference: np.ndarray) -> float:
    """Largest absolute cell difference of either thumbnail to ``reference`` (grey levels, 0-255)."""
    return max(float(np.abs(first - reference).max()), float(np.abs(second - reference).max()))


@dataclass
class StaticPairSkipper:
    """Decides pair by pair whether to skip; holds the last ingested pair's thumbnail and the gap."""

    threshold: float = 16.0  # grey levels (0-255): largest cell difference of a near-duplicate
    max_gap_pairs: int = 8   # never skip more than this many pairs in a row
    cell: int = 4            # thumbnail block size in pixels

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"video.skip_static.threshold must be >= 0 grey levels, got {self.threshold}")
        if self.max_gap_pairs < 1:
            raise ValueError(f"video.skip_static.max_gap_pairs must be >= 1, got {self.max_gap_pairs}")
        if self.cell < 1:
            raise ValueError(f"video.skip_static.cell must be >= 1, got {self.cell}")
        self.reference: np.ndarray | None = None
        self.gap = 0              # pairs skipped since the last ingested one
        self.last_distance = float("nan")

    def should_skip(self, first: np.ndarray, second: np.ndarray) -> bool:
        """True if this pair is a near-duplicate of the last ingested one and the gap allows a skip.

        A pair that is not skipped becomes the new reference, so the caller must ingest it.
        """
        a, b = thumbnail(first, self.cell), thumbnail(second, self.cell)
        if self.reference is not None and self.reference.shape == b.shape:
            self.last_distance = pair_distance(a, b, self.reference)
            if self.last_distance < self.threshold and self.gap < self.max_gap_pairs:
                self.gap += 1
                return True
        else:
            self.last_distance = float("nan")
        self.reference = b
        self.gap = 0
        return False

    def reset(self) -> None:
        """Forget the reference (after a restore the next pair is always ingested)."""
        self.reference, self.gap = None, 0
