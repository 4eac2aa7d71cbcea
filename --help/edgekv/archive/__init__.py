"""The archive on flash and retrieval at question time (DESIGN invariant 10; ReKV, seed 001 §3).

``store``: frame pairs' KV appended to checksummed segment files by a background writer, with an
in-memory index (pair, time, temporal position, time-undone representative keys per layer and KV head).
``recall``: the question's queries pick the top-k archived pairs (by the share of attention they would draw,
or ReKV's cosine); their KV goes into the retrieval reserve inside the cap for one answer, then the reserve
is cleared.
"""

from edgekv.archive.store import ArchiveError, ArchiveMismatchError, FrameArchive, KVShape

__all__ = ["ArchiveError", "ArchiveMismatchError", "FrameArchive", "KVShape"]
